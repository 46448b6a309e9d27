#!/usr/bin/env python
"""GPU throughput of hidden-state extraction on one NVIDIA H100/H200 (vLLM CUDA).

What it measures
----------------
A random-weight Llama at a real model's width (hidden 4096, intermediate
14336, 32 query / 8 KV heads of 128, bfloat16; ``--layers`` decoder layers,
default 8: ~2.0e9 parameters, ~4.0 GB), written once (on the GPU, in a child
process, so this process never touches CUDA); ``--prompts`` prompts (default
160) of random token ids with log-normal lengths (median ~1500, clipped to
[128, max_model_len - 1], max_model_len 4096, seed 0: ~280k tokens); four
captured layers (speculators' default ``[2, L // 2, L - 3, L - 1]``:
``[2, 4, 5, 7]`` for 8 layers).

Every mode runs in its own fresh process (``--child MODE``), on the same
prompts (``prompts.json`` / ``prompts.jsonl`` in the work dir):

``prefill``
    plain vLLM with its defaults (torch.compile, CUDA graphs):
    ``LLM(model, dtype="bfloat16", max_model_len=4096,
    gpu_memory_utilization=0.8, seed=0, enable_prefix_caching=False)``, all
    prompts in one ``generate`` call, ``SamplingParams(max_tokens=1)``.  The
    baseline (ratio 1.00).
``prefill-eager``
    the same with the generator's engine settings: ``enforce_eager=True,
    compilation_config=0, max_num_seqs=32, max_num_batched_tokens=8192``.
``generate``
    speculators 0.3.0's ``VllmHiddenStatesGenerator`` through
    ``eagle3_compat.apply(dtype="bfloat16")``: ``gen.generate`` on calls of
    ``--batch`` prompts (default 64); each call's results are counted
    (bytes of ``hidden_states``) and dropped.
``stream``
    the same generator, ``gen.stream(prompts)`` over every prompt, each
    sample counted and dropped as it comes.
``stream-10x``
    ``stream`` over the prompt list ten times over, in one ``stream()``
    call: its peak PSS against ``stream``'s shows whether host memory is
    bounded by what is in flight (it should be the same) or grows with the
    list.
``cli``
    ``python -m eagle3_compat generate --model M --input prompts.jsonl
    --output-dir DIR --layer-ids ... --seq-length 4096 --dtype bfloat16``
    as a subprocess, writing its files into the work dir (local disk).
``extract-hidden-states``
    vLLM's own path (best effort): speculative method
    ``extract_hidden_states`` with the ``ExampleHiddenStatesConnector`` KV
    connector (``vllm/config/speculative.py``,
    ``vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``),
    vLLM's default compilation, chunked prefill off (vLLM's documentation of
    the feature: "Chunked prefill is not compatible with this feature"),
    prefix caching off.  vLLM's aux-hidden-state id ``k`` is the state after
    ``k`` decoder layers, so the layer outputs ``[2, 4, 5, 7]`` are ids
    ``[3, 5, 6, 8]``.  The timed part includes reading every request's
    safetensors file back (``load_hidden_states``) and deleting it.
    ``extract-hidden-states-eager`` (not run by default): the same with
    ``enforce_eager=True``.

Each child starts its engine (``start s``: the engine's construction alone,
the imports before it not included), makes one untimed warm-up call on the
first ``--warmup`` prompts (default 4), then the timed run (``generate`` and ``stream``: then a second timed pass over the
same prompts, "2nd pass ratio", with the call arenas reused from the
driver's pool and already page-locked, as in a long job after its first
calls; the notes give the ``cudaHostRegister`` files, GB and seconds of each
pass); it reports JSON
(its result file, and the last ``RESULT`` line of its stdout).  tokens/s is
over the timed extraction only.  The CLI cannot be warmed up or timed from
inside: its time runs from the moment its ``manifest.json`` appears (written
once its engine is up, before the first step) to its final manifest
(``complete``), files written included; its ``start s`` is launch to that
moment (imports included) and its end-to-end wall is in the second table.
Where the manifest was not seen, its tokens/s is estimated from its wall
minus the ``generate`` mode's engine start, marked ``(est.)``.

"capture overhead s" = the mode's timed seconds minus ``prefill-eager``'s
(the same engine settings without capture; for ``extract-hidden-states``:
minus ``prefill``'s).  "GB to host": bytes of hidden states that reached the
driver process.  Memory: the peak proportional set size (PSS,
``/proc/<pid>/smaps_rollup``, shared memory counted once, in proportion) of
the child's process tree (driver, engine core, the CLI), sampled every 0.2 s
by a thread of this process; peak GPU memory: ``nvidia-smi``'s
``memory.used`` of the card, every second (vLLM reserves
``gpu_memory_utilization`` of it for the KV cache, so this is mostly that).

A mode that fails, times out (``--timeout`` per child, default 240 s) or is
skipped because the run's wall budget (``--budget``, default 510 s, model
creation included) is spent shows its error in the table; the script goes
on.  Between children the process group of the last one is killed and the
GPU's memory awaited back to its level at the start.

    python benchmarks/gpu_throughput.py                 # the full set (8 layers, 160 prompts)
    python benchmarks/gpu_throughput.py --quick         # smoke run: hidden 1024, 2 layers, 16 prompts
    python benchmarks/gpu_throughput.py --out results/ --modes prefill,prefill-eager,generate
    python benchmarks/gpu_throughput.py --model-dir /tmp/llama-w4096  # make it once, reuse it

Run with vLLM's CUDA build importable (e.g. ``PYTHONPATH=/tmp/site``; this
repository's ``src`` is put first on the children's ``PYTHONPATH``).
Children get ``VLLM_USE_FLASHINFER_SAMPLER=0``, ``TOKENIZERS_PARALLELISM=false``
and ``HF_HUB_OFFLINE=1`` unless set.  ``--out DIR`` writes ``table.md``,
``results.json`` and every child's logs (``logs/``).  Exit status 0 when every
mode gave a result, 1 when one or more report an error (the table is printed
either way).
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"

MODES = ("prefill", "prefill-eager", "generate", "stream", "cli", "stream-10x", "extract-hidden-states")
EXTRA_MODES = ("extract-hidden-states-eager",)
GENERATOR_MODES = ("generate", "stream")
# speculators 0.3.0's engine limits, which the generator keeps (eagle3_compat.generator)
GEN_MAX_NUM_SEQS = 32
GEN_MIN_BATCHED_TOKENS = 8192
MIN_PROMPT = 128
PSS_INTERVAL_S = 0.2
GPU_INTERVAL_S = 1.0
EXIT_GRACE_S = 45.0  # after a child's result: time left to shut its engine down
MIN_MODE_BUDGET_S = 60.0  # a mode is not started with less wall budget than this left


@dataclass
class Shape:
    """The benchmark model's architecture (Llama)."""

    hidden: int = 4096
    layers: int = 8
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 32000

    def params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate + 2 * h
        return self.layers * per_layer + 2 * self.vocab * h + h

    def describe(self) -> str:
        return (f"random-weight Llama, hidden {self.hidden}, {self.layers} layers, intermediate "
                f"{self.intermediate}, {self.heads} heads / {self.kv_heads} KV heads of {self.head_dim}, "
                f"vocab {self.vocab}, bfloat16 ({self.params() / 1e9:.2f}e9 parameters, "
                f"{self.params() * 2 / 1e9:.1f} GB)")


QUICK_SHAPE = Shape(hidden=1024, layers=2, intermediate=3584, heads=8, kv_heads=2, head_dim=128, vocab=32000)


# ----------------------------------------------------------------- pure parts

def make_prompts(n: int, max_model_len: int, vocab: int, median: int = 1500, sigma: float = 0.6,
                 seed: int = 0) -> list[list[int]]:
    """``n`` prompts of random token ids (4..vocab-1), log-normal lengths
    (median ``median``) clipped to [128, max_model_len - 1]."""
    rng = random.Random(seed)
    lo, hi = min(MIN_PROMPT, max_model_len - 1), max_model_len - 1
    mu = math.log(median)
    lengths = [min(hi, max(lo, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]
    return [[rng.randrange(4, vocab) for _ in range(k)] for k in lengths]


def default_layer_ids(layers: int) -> list[int]:
    """speculators 0.3.0's default ``[2, L // 2, L - 3, L - 1]`` where it gives
    4 distinct ascending ids (8 layers: [2, 4, 5, 7]), else the last (up to)
    4 layers."""
    raw = [2, layers // 2, layers - 3, layers - 1]
    if raw == sorted(set(raw)) and raw[0] >= 0 and raw[-1] < layers:
        return raw
    return list(range(max(0, layers - 4), layers))


def trainer_conform(layer_ids: Sequence[int], layers: int) -> bool:
    """Whether the CLI's trainer checks accept these ids (4, ascending, ending
    at the final layer); else the CLI gets ``--no-trainer-checks``."""
    ids = list(layer_ids)
    return len(ids) == 4 and ids == sorted(set(ids)) and ids[-1] == layers - 1


def _f(x: float | None, fmt: str = ".2f", suffix: str = "") -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{fmt}}{suffix}"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _ok(r: dict[str, Any] | None) -> bool:
    return bool(r) and not r.get("error") and r.get("tok_s") is not None


def derived(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per mode: ratio to prefill, capture overhead (and what it is against),
    GB to host, peak PSS, PSS per GB captured, the CLI's estimate."""
    out: dict[str, dict[str, Any]] = {}
    base = results.get("prefill")
    eager = results.get("prefill-eager")
    gen_start = (results.get("generate") or {}).get("start_s")
    for mode, r in results.items():
        d: dict[str, Any] = {"tok_s": r.get("tok_s"), "seconds": r.get("seconds"), "estimated": False}
        if mode == "cli" and r.get("tok_s") is None and r.get("tokens") and r.get("wall_s") and gen_start:
            secs = r["wall_s"] - gen_start
            if secs > 0:
                d.update(tok_s=r["tokens"] / secs, seconds=secs, estimated=True)
        if d["tok_s"] is not None and _ok(base):
            d["ratio"] = d["tok_s"] / base["tok_s"]
            if r.get("tok_s_second"):
                d["ratio_second"] = r["tok_s_second"] / base["tok_s"]
        ref_mode = "prefill" if mode.startswith("extract-hidden-states") else "prefill-eager"
        ref = base if ref_mode == "prefill" else eager
        if mode in (*GENERATOR_MODES, "cli") or mode.startswith("extract-hidden-states"):
            if d["seconds"] is not None and _ok(ref):
                d["overhead_s"] = d["seconds"] - ref["seconds"]
                d["overhead_vs"] = ref_mode
        captured = r.get("bytes_captured") or 0
        d["gb_host"] = (r.get("bytes_to_host") or 0) / 1e9 if captured else None
        pss = r.get("peak_pss")
        d["pss_gb"] = pss / 1e9 if pss else None
        d["pss_per_gb"] = pss / captured if pss and captured else None
        gpu = r.get("peak_gpu_mib")
        d["gpu_gb"] = gpu * 2**20 / 1e9 if gpu else None
        out[mode] = d
    return out


TABLE_HEAD = ("mode", "start s", "timed s", "tokens/s", "ratio to prefill", "2nd pass ratio", "capture overhead s",
              "GB to host", "peak PSS GB", "peak PSS / GB captured", "peak GPU GB", "error")


def render_table(results: dict[str, dict[str, Any]], modes: Sequence[str]) -> str:
    """The markdown table of the modes (in ``modes`` order)."""
    der = derived(results)
    lines = ["| " + " | ".join(TABLE_HEAD) + " |", "|" + "---|" * len(TABLE_HEAD)]
    for mode in modes:
        r, d = results.get(mode, {"error": "not run"}), der.get(mode, {})
        tok_s = _f(d.get("tok_s"), ",.0f") + (" (est.)" if d.get("estimated") else "")
        over = _f(d.get("overhead_s"), "+.2f")
        if over and d.get("overhead_vs") == "prefill":
            over += " (vs prefill)"
        if over and d.get("estimated"):
            over += " (est.)"
        err = r.get("error") or ""
        cells = [mode, _f(r.get("start_s"), ".1f"), _f(d.get("seconds"), ".2f"), tok_s,
                 _f(d.get("ratio"), ".2f"), _f(d.get("ratio_second"), ".2f"), over, _f(d.get("gb_host"), ".2f"), _f(d.get("pss_gb"), ".1f"),
                 _f(d.get("pss_per_gb"), ".2f"), _f(d.get("gpu_gb"), ".1f"), err[:140]]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def render_walls(results: dict[str, dict[str, Any]], modes: Sequence[str]) -> str:
    """End to end per child: launch to exit (imports, engine start, warm-up,
    timed run, shutdown)."""
    lines = ["| mode | wall s (launch to exit) | imports s | start s | tokens / wall |", "|---|---|---|---|---|"]
    for mode in modes:
        r = results.get(mode, {})
        wall, tokens = r.get("wall_s"), r.get("tokens")
        per = tokens / wall if wall and tokens and not r.get("error") else None
        lines.append(f"| {mode} | {_f(wall, '.1f')} | {_f(r.get('import_s'), '.1f')} | "
                     f"{_f(r.get('start_s'), '.1f')} | {_f(per, ',.0f')} |")
    return "\n".join(lines)


def render_notes(results: dict[str, dict[str, Any]], modes: Sequence[str]) -> list[str]:
    notes = ["start s: the engine's construction in the child (LLM() / the generator), imports not included "
             "(cli: launch to its manifest.json, imports included); tokens/s over the timed run only, after one "
             "untimed warm-up call (none for cli)",
             "capture overhead s: timed seconds minus prefill-eager's (same engine settings, no capture); "
             "extract-hidden-states: minus prefill's (vLLM's default engine)"]
    for mode in modes:
        r = results.get(mode) or {}
        for n in r.get("notes", []):
            notes.append(f"{mode}: {n}")
        if r.get("order_errors"):
            notes.append(f"{mode}: {r['order_errors']} result(s) not for their prompt or with wrong row counts")
        if r.get("engine"):
            notes.append(f"{mode} engine: " + ", ".join(f"{k}={v}" for k, v in r["engine"].items()))
    return notes


# -------------------------------------------------------- process-tree memory

def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def process_tree(pid: int) -> list[int]:
    kids, out, todo = _children_map(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _pss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def tree_pss(pid: int) -> int:
    """PSS of ``pid`` and its descendants (smaps_rollup; where the kernel has
    none, cli_job.py's psutil reading of the full smaps)."""
    if _pss_bytes(pid) is None and Path(f"/proc/{pid}").exists():
        if str(HERE) not in sys.path:
            sys.path.insert(0, str(HERE))
        from cli_job import tree_pss as psutil_tree_pss  # noqa: PLC0415

        return psutil_tree_pss(pid)
    return sum(_pss_bytes(p) or 0 for p in process_tree(pid))


class PssSampler(threading.Thread):
    """Peak PSS of a process tree, every 0.2 s; also the first reading after
    ``ready_file`` appears (the engine is up)."""

    def __init__(self, pid: int, ready_file: Path) -> None:
        super().__init__(daemon=True, name="pss-sampler")
        self.pid, self.ready_file = pid, ready_file
        self.peak, self.at_ready = 0, None
        self._halt = threading.Event()  # not _stop: threading.Thread has a method of that name

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                m = tree_pss(self.pid)
            except Exception:  # noqa: BLE001 - a reading lost is not a failed mode
                m = 0
            self.peak = max(self.peak, m)
            if self.at_ready is None and self.ready_file.exists():
                self.at_ready = m
            self._halt.wait(PSS_INTERVAL_S)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


# ---------------------------------------------------------------- GPU queries

def _gpu_index() -> str | None:
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return first if first.isdigit() else None


def nvidia_smi(query: str) -> list[str] | None:
    cmd = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"]
    if _gpu_index() is not None:
        cmd += ["-i", _gpu_index()]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return [x.strip() for x in out.stdout.strip().splitlines()[0].split(",")]


def gpu_used_mib() -> int | None:
    got = nvidia_smi("memory.used")
    try:
        return int(float(got[0])) if got else None
    except ValueError:
        return None


def wait_gpu_free(baseline: int | None, limit_s: float = 30.0) -> float:
    """Wait until the card's used memory is back within 1 GiB of ``baseline``;
    the seconds waited."""
    if baseline is None:
        return 0.0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        used = gpu_used_mib()
        if used is None or used <= baseline + 1024:
            break
        time.sleep(1.0)
    return time.perf_counter() - t0


# ------------------------------------------------------------ running children

def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # the GPU bundle carries no FlashInfer
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    return env


def _kill_group(pgid: int, proc: subprocess.Popen) -> None:
    """End the child's process group (the child, vLLM's engine core and what
    else it started): SIGTERM while the child lives, then SIGKILL."""
    if proc.poll() is None:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(pgid, signal.SIGKILL)  # stragglers once the child is gone
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(kept[-lines:])


def _last_error_line(*paths: Path) -> str | None:
    """The most telling line of a dead child's logs: the last 'Error'-ish one."""
    for path in paths:
        tail = _tail(path, 60).splitlines()
        for ln in reversed(tail):
            if re.search(r"(Error|Exception|error:|Killed|CUDA out of memory)", ln):
                return ln.strip()[-300:]
    for path in paths:
        tail = _tail(path, 1)
        if tail:
            return tail[-300:]
    return None


def run_child(mode: str, spec_path: Path, logs: Path, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """Run ``--child mode`` in a fresh process group; its result dict (with
    ``wall_s``, ``peak_pss``, ``peak_gpu_mib``; ``error`` where it failed)."""
    logs.mkdir(parents=True, exist_ok=True)
    result_path = spec_path.parent / f"result-{mode}.json"
    ready = Path(str(result_path) + ".ready")
    for p in (result_path, ready):
        p.unlink(missing_ok=True)
    out_log, err_log = logs / f"{mode}.stdout.log", logs / f"{mode}.stderr.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--spec", str(spec_path),
           "--result", str(result_path), "--timeout", str(int(timeout))]
    t0 = time.perf_counter()
    with out_log.open("w") as fo, err_log.open("w") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=env, start_new_session=True,
                                cwd=str(spec_path.parent))
    sampler = PssSampler(proc.pid, ready)
    sampler.start()
    gpu_peak: int | None = None
    seen_result: float | None = None
    timed_out = False
    try:
        while proc.poll() is None:
            used = gpu_used_mib()
            if used is not None:
                gpu_peak = max(gpu_peak or 0, used)
            now = time.perf_counter()
            if seen_result is None and result_path.exists():
                seen_result = now
            if seen_result is not None and now - seen_result > EXIT_GRACE_S:
                break  # the result is in; the engine's shutdown hangs
            if seen_result is None and now - t0 > timeout:
                timed_out = True
                break
            time.sleep(GPU_INTERVAL_S)
    finally:
        wall = time.perf_counter() - t0
        sampler.stop()
        _kill_group(proc.pid, proc)
    res: dict[str, Any]
    try:
        res = json.loads(result_path.read_text())
    except (OSError, ValueError):
        if timed_out:
            why = f"timed out after {timeout:.0f} s"
        else:
            why = f"child exited {proc.returncode} without a result"
        last = _last_error_line(err_log, out_log)
        res = {"error": why + (f": {last}" if last else "")}
    res["wall_s"] = wall
    res["exit_code"] = proc.returncode
    res["peak_pss"] = sampler.peak or None
    res["pss_at_engine_start"] = sampler.at_ready
    res["peak_gpu_mib"] = gpu_peak
    res["logs"] = [str(out_log), str(err_log)]
    if seen_result is not None and proc.returncode is None:
        res.setdefault("notes", []).append("the child did not exit within "
                                           f"{EXIT_GRACE_S:.0f} s of its result (killed)")
    return res


# --------------------------------------------------------------- child side

class Child:
    """What a mode's process has: its spec, prompts, and what to close at the end."""

    def __init__(self, mode: str, spec: dict[str, Any], result_path: Path, timeout: float) -> None:
        self.mode, self.spec, self.result_path, self.timeout = mode, spec, result_path, timeout
        self.closers: list[Callable[[], None]] = []
        self.prompts: list[list[int]] = json.loads(Path(spec["prompts"]).read_text()) if spec.get("prompts") else []
        self.layer_ids: list[int] = list(spec.get("layer_ids") or [])

    def engine_ready(self) -> None:
        """Tell the parent the engine is up (its PSS reading at that moment)."""
        Path(str(self.result_path) + ".ready").touch()

    @property
    def warmup(self) -> list[list[int]]:
        return self.prompts[: max(1, int(self.spec.get("warmup", 4)))]


def _engine_info(vllm_config: Any) -> dict[str, Any]:
    """The resolved engine settings worth knowing (best effort)."""
    info: dict[str, Any] = {}
    probes: dict[str, Callable[[], Any]] = {
        "max_num_seqs": lambda: vllm_config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": lambda: vllm_config.scheduler_config.max_num_batched_tokens,
        "chunked_prefill": lambda: vllm_config.scheduler_config.enable_chunked_prefill,
        "async_scheduling": lambda: vllm_config.scheduler_config.async_scheduling,
        "compilation": lambda: str(vllm_config.compilation_config.mode),
        "cudagraph_mode": lambda: str(vllm_config.compilation_config.cudagraph_mode),
        "model_runner_v2": lambda: bool(vllm_config.use_v2_model_runner),
        "block_size": lambda: vllm_config.cache_config.block_size,
        "num_gpu_blocks": lambda: vllm_config.cache_config.num_gpu_blocks,
    }
    for name, probe in probes.items():
        try:
            value = probe()
        except Exception:  # noqa: BLE001 - absent on this release
            continue
        if value is not None:
            info[name] = value
    return info


def _shutdown_llm(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass


def _sample_bytes(sample: dict[str, Any]) -> int:
    return sum(h.numel() * h.element_size() for h in sample["hidden_states"])


def _order_errors(batch: list[list[int]], out: list[dict[str, Any]]) -> int:
    """extraction.py's check: results not for the prompt at their index, or
    with row counts other than the prompt's length (benchmarks/ is on
    sys.path in a child)."""
    from extraction import _order_errors as check  # noqa: PLC0415

    return check(batch, out)


def child_prefill(ctx: Child, eager: bool) -> dict[str, Any]:
    t_imp = time.perf_counter()
    from vllm import LLM, SamplingParams  # noqa: PLC0415

    import_s = time.perf_counter() - t_imp
    spec = ctx.spec
    kw: dict[str, Any] = dict(model=spec["model"], dtype="bfloat16", max_model_len=spec["max_model_len"],
                              gpu_memory_utilization=spec["gpu_memory_utilization"], seed=0,
                              enable_prefix_caching=False)
    if eager:  # the generator's engine settings (eagle3_compat.generator.generator_init)
        kw.update(enforce_eager=True, compilation_config=0, max_num_seqs=GEN_MAX_NUM_SEQS,
                  max_num_batched_tokens=max(GEN_MIN_BATCHED_TOKENS, spec["max_model_len"]))
    t0 = time.perf_counter()
    llm = LLM(**kw)
    start_s = time.perf_counter() - t0
    ctx.closers.append(lambda: _shutdown_llm(llm))
    ctx.engine_ready()
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def call(batch: list[list[int]]) -> list[Any]:
        return llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)

    call(ctx.warmup)
    t1 = time.perf_counter()
    outs = call(ctx.prompts)
    seconds = time.perf_counter() - t1
    bad = abs(len(outs) - len(ctx.prompts)) + sum(
        len(o.prompt_token_ids or []) != len(p) for o, p in zip(outs, ctx.prompts))
    tokens = sum(map(len, ctx.prompts))
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "start_s": start_s,
            "import_s": import_s, "bytes_captured": 0, "bytes_to_host": 0, "order_errors": bad,
            "engine": _engine_info(llm.llm_engine.vllm_config), "engine_kwargs": {k: v for k, v in kw.items()
                                                                                  if k != "model"}}


def _start_generator(ctx: Child) -> tuple[Any, float, float, list[str]]:
    t_imp = time.perf_counter()
    import eagle3_compat  # noqa: PLC0415

    report = eagle3_compat.apply(dtype="bfloat16")
    if not getattr(report, "applied", False):
        raise RuntimeError(f"eagle3_compat.apply() did not apply: {report}")
    from speculators.data_generation import VllmHiddenStatesGenerator  # noqa: PLC0415

    import_s = time.perf_counter() - t_imp
    t0 = time.perf_counter()
    gen = VllmHiddenStatesGenerator(ctx.spec["model"], layer_ids=ctx.layer_ids,
                                    max_model_len=ctx.spec["max_model_len"],
                                    gpu_memory_utilization=ctx.spec["gpu_memory_utilization"])
    start_s = time.perf_counter() - t0
    ctx.closers.append(gen.close)
    ctx.engine_ready()
    notes = [f"eagle3_compat {eagle3_compat.__version__}; capture: "
             + json.dumps(getattr(gen, "_e3c_worker_info", None), default=str)[:300]]
    return gen, start_s, import_s, notes


def _pinning(gen: Any) -> dict[str, Any]:
    """What the capturing worker has page-locked so far (CUDA; zeros elsewhere)."""
    try:
        replies = gen.llm.collective_rpc("e3c_memory", args=(False,))
    except Exception as exc:  # noqa: BLE001 - a figure, not a result
        return {"error": repr(exc)}
    for r in replies if isinstance(replies, list) else [replies]:
        if isinstance(r, dict) and "registrations" in r:
            return {k: r[k] for k in ("registrations", "registered_bytes", "register_seconds", "pinned_files")}
    return {}


def _second_pass(result: dict[str, Any], again: Callable[[], tuple[int, float]], gen: Any,
                 pins: dict[str, Any]) -> None:
    """A second timed pass over the same prompts, arenas now reused from the
    pool (what a long job runs at after its first calls), and the
    page-locking each pass paid for."""
    after_first = _pinning(gen)
    rows, seconds = again()
    after_second = _pinning(gen)
    result["tok_s_second"] = rows / seconds if seconds > 0 else None
    result["seconds_second"] = seconds

    def delta(a: dict[str, Any], b: dict[str, Any]) -> str:
        if not a or not b or "error" in a or "error" in b:
            return "unknown"
        gb = (b["registered_bytes"] - a["registered_bytes"]) / 1e9
        return f"{b['registrations'] - a['registrations']} file(s), {gb:.2f} GB in " \
               f"{b['register_seconds'] - a['register_seconds']:.2f} s"

    result["notes"].append(f"cudaHostRegister: first pass {delta(pins, after_first)}; "
                           f"second pass {delta(after_first, after_second)}")


def _generator_result(gen: Any, timed: Callable[[], tuple[int, int, int, float]], start_s: float,
                      import_s: float, notes: list[str], pins: dict[str, Any] | None) -> dict[str, Any]:
    """One timed pass (``timed()``: bytes, rows, order errors, seconds) and,
    where ``pins`` (the page-locking before it) is given, a second one."""
    nbytes, rows, bad, seconds = timed()
    result = {"tokens": rows, "seconds": seconds, "tok_s": rows / seconds, "start_s": start_s,
              "import_s": import_s, "bytes_captured": nbytes, "bytes_to_host": nbytes, "order_errors": bad,
              "engine": _engine_info(gen.vllm_config), "notes": notes}
    if pins is not None:
        def again() -> tuple[int, float]:
            _, r, b, sec = timed()
            result["order_errors"] += b
            return r, sec

        _second_pass(result, again, gen, pins)
    return result


def child_generate(ctx: Child) -> dict[str, Any]:
    gen, start_s, import_s, notes = _start_generator(ctx)
    gen.generate(ctx.warmup)
    pins = _pinning(gen)
    batch = int(ctx.spec["batch"])

    def timed() -> tuple[int, int, int, float]:
        nbytes = rows = bad = 0
        check_s = 0.0
        t1 = time.perf_counter()
        for i in range(0, len(ctx.prompts), batch):
            chunk = ctx.prompts[i : i + batch]
            out = gen.generate(chunk)
            c0 = time.perf_counter()
            bad += _order_errors(chunk, out)  # untimed: are the rows the prompts'?
            check_s += time.perf_counter() - c0
            nbytes += sum(_sample_bytes(r) for r in out)
            rows += sum(len(r["input_ids"]) for r in out)
            del out
        return nbytes, rows, bad, time.perf_counter() - t1 - check_s

    notes.append(f"{math.ceil(len(ctx.prompts) / batch)} calls of <= {batch} prompts")
    return _generator_result(gen, timed, start_s, import_s, notes, pins)


def child_stream(ctx: Child, repeat: int = 1) -> dict[str, Any]:
    """``stream()`` over the prompts (``repeat`` times over, in one stream:
    host memory must stay bounded by what is in flight, not by the list)."""
    gen, start_s, import_s, notes = _start_generator(ctx)
    prompts = ctx.prompts * repeat
    mif = ctx.spec.get("max_in_flight")
    kw = {} if not mif else {"max_in_flight": int(mif)}
    for _ in gen.stream(ctx.warmup, **kw):
        pass
    pins = _pinning(gen)

    def timed() -> tuple[int, int, int, float]:
        nbytes = rows = bad = n = 0
        check_s = 0.0
        t1 = time.perf_counter()
        for index, sample in gen.stream(prompts, **kw):
            c0 = time.perf_counter()
            bad += _order_errors([prompts[index]], [sample])
            check_s += time.perf_counter() - c0
            nbytes += _sample_bytes(sample)
            rows += len(sample["input_ids"])
            n += 1
            del sample
        return nbytes, rows, bad + abs(n - len(prompts)), time.perf_counter() - t1 - check_s

    notes.append(f"max_in_flight {mif or 'default (eagle3_compat.generator.DEFAULT_MAX_IN_FLIGHT)'}")
    if repeat > 1:
        notes.append(f"{len(prompts)} prompts ({repeat} x the prompt list) in one stream(): its peak PSS "
                     "against stream's shows whether host memory grows with the list")
    return _generator_result(gen, timed, start_s, import_s, notes, pins if repeat == 1 else None)


def child_extract_hidden_states(ctx: Child, eager: bool) -> dict[str, Any]:
    """vLLM's own extraction (vllm/config/speculative.py: method
    "extract_hidden_states", draft_model_config.hf_config's
    eagle_aux_hidden_state_layer_ids; vllm/distributed/kv_transfer/kv_connector/
    v1/example_hidden_states_connector.py: one safetensors file per request,
    its path in RequestOutput.kv_transfer_params["hidden_states_path"])."""
    t_imp = time.perf_counter()
    from vllm import LLM, SamplingParams  # noqa: PLC0415

    import_s = time.perf_counter() - t_imp
    spec = ctx.spec
    storage = Path(spec["work"]) / f"ehs-storage-{ctx.mode}"
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True)
    ctx.closers.append(lambda: shutil.rmtree(storage, ignore_errors=True))
    # vLLM's aux id k: the residual stream after k decoder layers (the output of
    # layer k - 1; num_hidden_layers = the last layer's output, before the norm).
    aux = [k + 1 for k in ctx.layer_ids]
    kw: dict[str, Any] = dict(
        model=spec["model"], dtype="bfloat16", max_model_len=spec["max_model_len"],
        gpu_memory_utilization=spec["gpu_memory_utilization"], seed=0, enable_prefix_caching=False,
        enable_chunked_prefill=False,  # vLLM's docs of the feature: not compatible with chunked prefill
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux}}},
        kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                            "kv_connector_extra_config": {"shared_storage_path": str(storage)}},
    )
    if eager:
        kw["enforce_eager"] = True
    t0 = time.perf_counter()
    llm = LLM(**kw)
    start_s = time.perf_counter() - t0
    ctx.closers.append(lambda: _shutdown_llm(llm))
    ctx.engine_ready()
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # noqa: PLC0415
        cleanup_hidden_states,
        load_hidden_states,
    )

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def run(batch: list[list[int]]) -> tuple[int, int, float, list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        engine_done = time.perf_counter()
        nbytes = bad = 0
        shape: list[int] = []
        for p, o in zip(batch, outs):
            path = (getattr(o, "kv_transfer_params", None) or {}).get("hidden_states_path")
            if path is None:
                raise RuntimeError("a request finished without kv_transfer_params['hidden_states_path']")
            data = load_hidden_states(path)  # blocks until the connector's writer is done
            hs = data["hidden_states"]  # [tokens, layers, hidden]
            shape = list(hs.shape)
            nbytes += hs.numel() * hs.element_size()
            if hs.shape[0] != len(p) or hs.shape[1] != len(aux) or data["token_ids"].tolist() != p:
                bad += 1
            del data, hs
            cleanup_hidden_states(path)
        return nbytes, bad + abs(len(outs) - len(batch)), engine_done, shape

    run(ctx.warmup)
    t1 = time.perf_counter()
    nbytes, bad, engine_done, shape = run(ctx.prompts)
    seconds = time.perf_counter() - t1
    tokens = sum(map(len, ctx.prompts))
    notes = [f"aux layer ids {aux} (= layer outputs {ctx.layer_ids}); files in {storage} "
             f"({_fs_type(storage)}); engine part (generate() until it returned) {engine_done - t1:.2f} s, "
             f"reading the files back {time.perf_counter() - engine_done:.2f} s; last file's hidden_states "
             f"shape {shape}"]
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "start_s": start_s,
            "import_s": import_s, "bytes_captured": nbytes, "bytes_to_host": nbytes, "order_errors": bad,
            "engine_s": engine_done - t1, "engine": _engine_info(llm.llm_engine.vllm_config), "notes": notes}


def child_cli(ctx: Child) -> dict[str, Any]:
    """The CLI job as a user runs it; its engine-up moment is its manifest.json."""
    spec = ctx.spec
    out = Path(spec["work"]) / "cli-out"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "eagle3_compat", "generate", "--model", spec["model"],
           "--input", spec["prompts_jsonl"], "--output-dir", str(out),
           "--layer-ids", *map(str, ctx.layer_ids), "--seq-length", str(spec["max_model_len"]),
           "--dtype", "bfloat16"]
    if not trainer_conform(ctx.layer_ids, spec["shape"]["layers"]):
        cmd.append("--no-trainer-checks")
    if spec.get("max_in_flight"):
        cmd += ["--max-in-flight", str(spec["max_in_flight"])]
    if spec["gpu_memory_utilization"] != 0.8:
        cmd += ["--gpu-memory-utilization", str(spec["gpu_memory_utilization"])]
    manifest_path = out / "manifest.json"
    marks: dict[str, Any] = {"ready": None, "done": None, "manifest": None}
    stop = threading.Event()

    def watch() -> None:
        last: tuple[int, int, int] | None = None
        while not stop.is_set():
            try:
                st = manifest_path.stat()
            except OSError:
                st = None
            now = time.perf_counter()
            if st is not None:
                if marks["ready"] is None:
                    marks["ready"] = now
                    ctx.engine_ready()
                key = (st.st_mtime_ns, st.st_size, st.st_ino)
                if key != last and marks["done"] is None:
                    try:
                        m = json.loads(manifest_path.read_text())
                        last = key
                    except (OSError, ValueError):
                        m = None
                    if isinstance(m, dict) and m.get("complete"):
                        marks["done"], marks["manifest"] = now, m
            stop.wait(0.05)

    log = Path(spec["logs"]) / "cli-job.log"
    watcher = threading.Thread(target=watch, daemon=True, name="manifest-watch")
    watcher.start()
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ))
    ctx.closers.append(lambda: proc.kill() if proc.poll() is None else None)
    try:
        rc: int | None = proc.wait(timeout=max(10.0, ctx.timeout - 15))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = None
    wall = time.perf_counter() - t0
    stop.set()
    watcher.join(timeout=2)
    if rc != 0:
        raise RuntimeError(f"the CLI {'timed out' if rc is None else f'exited {rc}'}: "
                           + (_last_error_line(log) or "(no output)"))
    m = marks["manifest"] or {}
    if not m:
        try:
            m = json.loads(manifest_path.read_text())
        except (OSError, ValueError):
            m = {}
    tokens = int(m.get("tokens_this_run") or sum(map(len, ctx.prompts)))
    files = sorted(out.glob("data_*.pt"))
    disk = sum(f.stat().st_size for f in files)
    hidden = int(spec["shape"]["hidden"])
    captured = tokens * len(ctx.layer_ids) * hidden * 2  # bfloat16
    res: dict[str, Any] = {"tokens": tokens, "bytes_captured": captured, "bytes_to_host": captured,
                           "cli_wall_s": wall, "cli_seconds_this_run": m.get("seconds_this_run"),
                           "files": len(files), "bytes_on_disk": disk, "command": " ".join(cmd),
                           "notes": []}
    if marks["ready"] is not None:
        res["start_s"] = marks["ready"] - t0
        end = marks["done"] if marks["done"] is not None else t0 + wall
        res["seconds"] = end - marks["ready"]
        res["tok_s"] = tokens / res["seconds"]
        res["notes"].append(
            f"timed from manifest.json's first appearance (engine up) to the final manifest"
            f"{'' if marks['done'] is not None else ' (not seen: to the exit)'}; no warm-up; includes writing "
            f"{len(files)} files, {disk / 1e9:.2f} GB, to {out} ({_fs_type(out)}); the job's own "
            f"seconds_this_run (engine start included) {m.get('seconds_this_run')}; launch to exit {wall:.1f} s")
    else:
        res["notes"].append("manifest.json's appearance was not seen: tokens/s estimated (wall - generate's start)")
    if len(files) != len(ctx.prompts):
        res["order_errors"] = abs(len(files) - len(ctx.prompts))
    shutil.rmtree(out, ignore_errors=True)
    return res


def child_make_model(ctx: Child) -> dict[str, Any]:
    """Write the benchmark checkpoint: safetensors in bfloat16 drawn on the GPU
    (N(0, 0.02), norms 1), a config.json and the local tokenizer of
    eagle3_compat.testing."""
    import torch  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    from eagle3_compat.testing import _tokenizer  # noqa: PLC0415

    shape = Shape(**ctx.spec["shape"])
    path = Path(ctx.spec["model"])
    path.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)

    def w(*size: int) -> Any:
        return torch.randn(*size, generator=g, device=dev, dtype=torch.bfloat16).mul_(0.02).cpu()

    def ones(n: int) -> Any:
        return torch.ones(n, dtype=torch.bfloat16)

    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    tensors: dict[str, Any] = {"model.embed_tokens.weight": w(shape.vocab, h), "model.norm.weight": ones(h),
                               "lm_head.weight": w(shape.vocab, h)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
            p + "mlp.gate_proj.weight": w(shape.intermediate, h), p + "mlp.up_proj.weight": w(shape.intermediate, h),
            p + "mlp.down_proj.weight": w(h, shape.intermediate),
        })
    drawn = time.perf_counter() - t0
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": shape.vocab,
        "hidden_size": h, "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "hidden_act": "silu", "max_position_embeddings": max(4096, int(ctx.spec["max_model_len"])),
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "initializer_range": 0.02, "torch_dtype": "bfloat16", "dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "use_cache": True,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    _tokenizer(path)
    import eagle3_compat  # noqa: PLC0415

    return {"seconds": time.perf_counter() - t0, "drawn_s": drawn, "device": dev, "bytes": nbytes,
            "card": torch.cuda.get_device_name(0) if dev == "cuda" else None, "torch": torch.__version__,
            "cuda": torch.version.cuda, "eagle3_compat": eagle3_compat.__version__}


CHILDREN: dict[str, Callable[[Child], dict[str, Any]]] = {
    "prefill": lambda c: child_prefill(c, eager=False),
    "prefill-eager": lambda c: child_prefill(c, eager=True),
    "generate": child_generate,
    "stream": child_stream,
    "stream-10x": lambda c: child_stream(c, repeat=10),
    "cli": child_cli,
    "extract-hidden-states": lambda c: child_extract_hidden_states(c, eager=False),
    "extract-hidden-states-eager": lambda c: child_extract_hidden_states(c, eager=True),
    "make-model": child_make_model,
}


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, default=str))
    os.replace(tmp, path)


def child_main(mode: str, spec_path: Path, result_path: Path, timeout: float) -> int:
    """One mode in this process: result JSON to ``result_path`` and as the
    last ``RESULT`` line of stdout, then the engine shut down."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    spec = json.loads(spec_path.read_text())
    ctx = Child(mode, spec, result_path, timeout)
    try:
        result = CHILDREN[mode](ctx)
    except BaseException as exc:  # noqa: BLE001 - the failure is the result
        result = {"error": f"{type(exc).__name__}: {exc}"[:600], "traceback": traceback.format_exc()[-6000:]}
        traceback.print_exc()
    result["mode"] = mode
    _write_json_atomic(result_path, result)
    print("RESULT " + json.dumps(result, default=str), flush=True)
    # The engine's shutdown, untimed; a hang there is the parent's to end.
    threading.Timer(EXIT_GRACE_S - 5, lambda: os._exit(3)).start()
    for close in reversed(ctx.closers):
        try:
            close()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if not result.get("error") else 1)


# --------------------------------------------------------------- parent side

def _fs_type(path: Path) -> str:
    """The file system ``path`` is on (longest mount point of /proc/mounts)."""
    try:
        target = str(Path(path).resolve())
        best, kind = "", "?"
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 3 and (target == parts[1] or target.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) >= len(best):
                    best, kind = parts[1], parts[2]
        return f"{kind} at {best}" if best else kind
    except OSError:
        return "?"


def _dist_version(name: str) -> str | None:
    import importlib.metadata as md  # noqa: PLC0415

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _read_shape(model: Path) -> Shape:
    cfg = json.loads((model / "config.json").read_text())
    cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
    heads = int(cfg["num_attention_heads"])
    return Shape(hidden=int(cfg["hidden_size"]), layers=int(cfg["num_hidden_layers"]),
                 intermediate=int(cfg.get("intermediate_size", 0)), heads=heads,
                 kv_heads=int(cfg.get("num_key_value_heads", heads)),
                 head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads), vocab=int(cfg["vocab_size"]))


def header_info(work: Path) -> dict[str, Any]:
    """Card, versions, host: gathered without touching CUDA here."""
    info: dict[str, Any] = {}
    got = nvidia_smi("name,memory.total,driver_version")
    if got:
        info["card"] = f"{got[0]}, {got[1]} MiB" + (f", driver {got[2]}" if len(got) > 2 else "")
    info["versions"] = {n: _dist_version(n) for n in ("vllm", "torch", "transformers", "speculators", "safetensors")}
    try:
        text = (SRC / "eagle3_compat" / "__init__.py").read_text()
        found = re.search(r'__version__ = "([^"]+)"', text)
        info["versions"]["eagle3_compat"] = found.group(1) if found else None
    except OSError:
        pass
    try:
        rev = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(HERE.parent), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10)
        if rev.returncode == 0:
            info["commit"] = rev.stdout.strip() + (" (+ uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        st = os.statvfs("/dev/shm")
        info["dev_shm_gib"] = round(st.f_blocks * st.f_frsize / 2**30, 1)
    except OSError:
        info["dev_shm_gib"] = None
    try:
        info["ram_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    info["cpus"] = os.cpu_count()
    info["python"] = sys.version.split()[0]
    info["work_dir"] = f"{work} ({_fs_type(work)})"
    return info


def render_header(h: dict[str, Any]) -> str:
    v = h.get("versions", {})
    lines = [
        "# GPU throughput of hidden-state extraction (benchmarks/gpu_throughput.py)",
        "",
        f"* card: {h.get('card') or h.get('card_torch') or 'unknown (no nvidia-smi)'}",
        "* versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val)
        + (f"; CUDA {h['cuda']}" if h.get("cuda") else "") + (f"; commit {h['commit']}" if h.get("commit") else ""),
        f"* host: {h.get('cpus')} CPUs, {h.get('ram_gib')} GiB RAM, /dev/shm {h.get('dev_shm_gib')} GiB, "
        f"Python {h.get('python')}; work dir {h.get('work_dir')}",
        f"* model: {h.get('model')}" + (f"; {h['model_made']}" if h.get("model_made") else ""),
        f"* prompts: {h.get('prompts')}",
        f"* layers captured: {h.get('layer_ids')}; max_model_len {h.get('max_model_len')}; "
        f"gpu_memory_utilization {h.get('gpu_memory_utilization')}",
    ]
    return "\n".join(lines)


def prompt_summary(prompts: list[list[int]], seed: int) -> str:
    lengths = [len(p) for p in prompts]
    return (f"{len(prompts)}, {sum(lengths):,} tokens; lengths median {statistics.median(lengths):.0f}, "
            f"mean {statistics.mean(lengths):.0f}, min {min(lengths)}, max {max(lengths)} "
            f"(log-normal, seed {seed}, random token ids)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="modes: " + ", ".join((*MODES, *EXTRA_MODES)))
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: hidden 1024, 2 layers (ids [0, 1]), 16 prompts (flags given win)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; --quick 2)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default 4096; --quick 1024)")
    ap.add_argument("--intermediate", type=int, default=None, help="MLP size (default 14336; --quick 3584)")
    ap.add_argument("--prompts", type=int, default=None, help="number of prompts (default 160; --quick 16)")
    ap.add_argument("--median-len", type=int, default=1500, help="median prompt length (default %(default)s)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--layer-ids", default=None, help="comma list (default: speculators' [2, L//2, L-3, L-1])")
    ap.add_argument("--batch", type=int, default=64, help="prompts per generate() call (default %(default)s)")
    ap.add_argument("--max-in-flight", type=int, default=None, help="stream()/CLI max_in_flight (default: the library's)")
    ap.add_argument("--warmup", type=int, default=4, help="prompts of the untimed warm-up call (default %(default)s)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="reuse the checkpoint there (its config.json gives the shape), or make it there and keep it")
    ap.add_argument("--out", type=Path, default=None, help="write table.md, results.json and logs/ here")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per child (default %(default)s)")
    ap.add_argument("--budget", type=float, default=510.0,
                    help="wall seconds for the whole run, model creation included; modes that would start "
                         "with less than 60 s left are skipped (default %(default)s)")
    ap.add_argument("--work-dir", type=Path, default=None, help="parent of the temporary work dir (default: system temp)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (model, prompts, results)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child, args.spec, args.result, args.timeout)
    t_run = time.perf_counter()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in (*MODES, *EXTRA_MODES)]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; known: {', '.join((*MODES, *EXTRA_MODES))}")
    base = QUICK_SHAPE if args.quick else Shape()
    shape = Shape(**{**asdict(base), **{k: v for k, v in (("layers", args.layers), ("hidden", args.hidden),
                                                          ("intermediate", args.intermediate)) if v is not None}})
    if args.hidden is not None and args.hidden != base.hidden:  # keep head_dim 128 and GQA 4:1
        shape.heads, shape.kv_heads = max(1, args.hidden // 128), max(1, args.hidden // 512)
    n_prompts = args.prompts if args.prompts is not None else (16 if args.quick else 160)

    work = Path(tempfile.mkdtemp(prefix="e3c-gpu-bench-", dir=args.work_dir))
    if not args.keep:
        atexit.register(shutil.rmtree, work, True)
    logs = (args.out / "logs") if args.out else work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = child_env()
    header = header_info(work)
    baseline = gpu_used_mib()

    model = args.model_dir if args.model_dir is not None else work / "model"
    model_error: str | None = None
    if (model / "config.json").exists() and (args.model_dir is not None):
        shape = _read_shape(model)
        header["model_made"] = f"reused {model}"
    layer_ids = [int(x) for x in args.layer_ids.split(",")] if args.layer_ids else default_layer_ids(shape.layers)
    prompts = make_prompts(n_prompts, args.max_model_len, shape.vocab, args.median_len, seed=args.seed)
    (work / "prompts.json").write_text(json.dumps(prompts))
    (work / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    spec = {"model": str(model), "prompts": str(work / "prompts.json"), "prompts_jsonl": str(work / "prompts.jsonl"),
            "layer_ids": layer_ids, "shape": asdict(shape), "max_model_len": args.max_model_len,
            "gpu_memory_utilization": args.gpu_memory_utilization, "batch": args.batch,
            "max_in_flight": args.max_in_flight, "warmup": args.warmup, "work": str(work), "logs": str(logs)}
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    header.update(model=shape.describe(), prompts=prompt_summary(prompts, args.seed), layer_ids=layer_ids,
                  max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization)

    if not (model / "config.json").exists():
        made = run_child("make-model", spec_path, logs, min(300.0, args.budget), env)
        if made.get("error"):
            model_error = f"no model: {made['error']}"
        else:
            header["model_made"] = (f"made in {made['seconds']:.1f} s on {made['device']} "
                                    f"({made['bytes'] / 1e9:.2f} GB)")
            header["card_torch"] = made.get("card")
            header["cuda"] = made.get("cuda")
        header["make_model"] = made
        wait_gpu_free(baseline)
    print(render_header(header), file=sys.stderr, flush=True)

    results: dict[str, dict[str, Any]] = {}
    for mode in modes:
        left = args.budget - (time.perf_counter() - t_run)
        if model_error:
            results[mode] = {"error": model_error}
            continue
        if left < MIN_MODE_BUDGET_S:
            results[mode] = {"error": f"skipped: {left:.0f} s of the run's --budget {args.budget:.0f} s left"}
            continue
        r = run_child(mode, spec_path, logs, min(args.timeout, left - 5), env)
        r["gpu_wait_s"] = wait_gpu_free(baseline)
        results[mode] = r
        brief = r.get("error") or (f"{_f(r.get('tok_s'), ',.0f') or '?'} tok/s, start "
                                   f"{_f(r.get('start_s'), '.1f') or '?'} s, timed {_f(r.get('seconds'), '.2f') or '?'} s")
        print(f"# {mode}: {brief} (wall {r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
        if r.get("error"):
            for path in r.get("logs", []):
                tail = _tail(Path(path), 15)
                if tail:
                    print(f"# --- last lines of {path}:\n{tail}", file=sys.stderr, flush=True)

    text = "\n".join([
        render_header(header), "", render_table(results, modes), "",
        *(f"* {n}" for n in render_notes(results, modes)), "",
        "End to end per child process:", "", render_walls(results, modes), "",
        f"total wall {time.perf_counter() - t_run:.0f} s",
    ])
    print(text, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(text + "\n")
        (args.out / "results.json").write_text(json.dumps({"header": header, "modes": modes, "results": results,
                                                           "derived": derived(results)}, indent=1, default=str))
    return 0 if all(not results.get(m, {}).get("error") for m in modes) else 1


if __name__ == "__main__":
    sys.exit(main())
