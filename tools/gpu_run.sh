#!/usr/bin/env bash
# The GPU suite and the GPU benchmark, on any machine with a CUDA GPU and
# vLLM (CUDA) + speculators 0.3.0 installed for python3:
#
#   tools/gpu_run.sh            # suite, then benchmark
#   tools/gpu_run.sh suite [pytest args...]   # test ids given run in that order
#   tools/gpu_run.sh bench [benchmark args...]
#
# Logs and the benchmark's table go to $OUT (default ./gpu-results).
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"; [ $# -gt 0 ] && shift
OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT"
PY="${PY:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
       HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# each failure's report as it happens (tests/conftest.py), not only at the end
export E3C_FAILURES_AT_ONCE=1
# NVLink multicast off in NCCL, PyTorch and NVSHMEM unless set (on a shared
# host a program that uses it can take the GPUs out of service); the
# engines' processes inherit these.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}" \
       NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
# The cases of tests/gpu/test_gpu_parallel.py run where this many GPUs are visible.
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  echo "GPUs visible: $GPUS (tensor/pipeline parallel cases need 2, 4 or 8)"
  "$PY" - <<'PY'
import importlib.metadata as md
for name in ("vllm", "torch", "transformers", "speculators", "triton"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
PY
  git rev-parse HEAD 2>/dev/null || true
} | tee "$OUT/machine.txt"
rc=0
if [ "$what" = all ] || [ "$what" = suite ]; then
  # test ids or paths among the arguments run in the order given, else all of tests/gpu
  targets=tests/gpu
  for a in "$@"; do case "$a" in tests/*) targets=;; esac; done
  "$PY" -m pytest $targets -p no:cacheprovider -rA --durations=0 --junitxml="$OUT/gpu-suite.xml" "$@" \
    2>&1 | tee "$OUT/gpu-suite.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  [ "$what" = bench ] && set -- "$@" || set --
  "$PY" benchmarks/gpu_throughput.py --out "$OUT/bench" "$@" 2>&1 | tee "$OUT/gpu-bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
exit "$rc"
