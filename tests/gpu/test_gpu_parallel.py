"""The GPU suite on several GPUs of one host: tensor and pipeline parallel
extraction through NCCL (vLLM's multiprocessing executor).

Each case needs a number of CUDA GPUs and is skipped, saying how many it
needs and how many are visible, where there are fewer (one GPU: every case
here is skipped; no GPU: the whole suite is).  Run with the rest of the GPU
suite (``tools/gpu_run.sh suite``).

NVLink multicast stays off in every process (NCCL, PyTorch's symmetric
memory, NVSHMEM): a shared host's GPUs can be put out of service by a
program that uses it.  The variables are set here unless already set, before
any engine starts, and the engine's processes inherit them.

References, on the same host:

* the single-GPU result of the same generator and dtype (bfloat16): every
  row of every layer within ``BF16_NOISE_FACTOR`` times Hugging Face's own
  bfloat16-vs-float32 noise on the same prompts;
* Hugging Face float32 on one GPU, at the same bound;
* for DeepseekV3 with MLA: vLLM's own unpatched forward on one GPU
  (``MLA_BF16_TOL``).

Every result comes back once and in the order of the prompts (``compare``
checks each result's token ids against its prompt), over three calls.
"""

from __future__ import annotations

import os

import pytest

from eagle3_compat.testing import gpu_unavailable

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
if gpu_unavailable() is None:
    for _name, _value in MULTICAST_OFF.items():
        os.environ.setdefault(_name, _value)

# The single-GPU suite's prompts, references and helpers (its module also
# removes the CPU platform's variables where a GPU is present).
from test_gpu_engine import (  # noqa: E402
    BF16_NOISE_FACTOR,
    LAYERS,
    MLA_BF16_TOL,
    PROMPTS,
    RUNNERS,
    _ids,
    _in_calls,
    _must_fail,
    generator,
    hf_reference,  # noqa: F401 - a fixture
    models,  # noqa: F401 - a fixture
    vllm_reference,  # noqa: F401 - a fixture
)

pytestmark = [pytest.mark.gpu, pytest.mark.engine]


def _need(n: int) -> None:
    """Skip unless ``n`` CUDA GPUs are visible."""
    if gpu_unavailable() is not None:
        pytest.skip(gpu_unavailable())
    import torch

    have = torch.cuda.device_count()
    if have < n:
        pytest.skip(f"needs {n} CUDA GPUs, {have} visible")


@pytest.fixture(scope="module")
def single_gpu():
    """(model, runner) -> the generator's bfloat16 results for PROMPTS on one GPU (cached)."""
    cache = {}

    def get(model, runner):
        key = (str(model), runner)
        if key not in cache:
            with generator(model, "bfloat16", runner) as gen:
                cache[key] = _in_calls(gen, PROMPTS)
        return cache[key]

    return get


def _bound(hf_reference, model):
    from eagle3_compat.testing import compare

    noise = compare([{"input_ids": _ids(p), "hidden_states": h}
                     for p, h in zip(PROMPTS, hf_reference(model, "bfloat16"))],
                    hf_reference(model, "float32"), PROMPTS, LAYERS, float("inf"))
    return BF16_NOISE_FACTOR * noise


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (8, 1), (1, 2)])
def test_parallel_llama_bf16(tp, pp, runner, models, hf_reference, single_gpu, record_property):
    """Llama (16 heads, 8 KV heads, hidden 1024) in bfloat16 over ``tp`` x ``pp``
    GPUs: every row against the one-GPU result and Hugging Face float32."""
    from eagle3_compat.testing import compare

    _need(tp * pp)
    model = models("llama", hidden=1024)
    tol = _bound(hf_reference, model)
    one = single_gpu(model, runner)
    with generator(model, "bfloat16", runner, tensor_parallel_size=tp, pipeline_parallel_size=pp) as gen:
        results = _in_calls(gen, PROMPTS)
    vs_one = compare(results, one, PROMPTS, LAYERS, tol)
    vs_hf = compare(results, hf_reference(model, "float32"), PROMPTS, LAYERS, tol)
    record_property("max_rel_error_vs_one_gpu", vs_one)
    record_property("max_rel_error_vs_hf", vs_hf)
    print(f"llama bf16 tp{tp} pp{pp} {runner}: vs one GPU {vs_one:.3g}, vs HF float32 {vs_hf:.3g} "
          f"(bound {tol:.3g})")
    _must_fail(compare, results, one, PROMPTS, LAYERS, tol)


@pytest.mark.parametrize("tp,pp", [(2, 1), (8, 1), (1, 2)])
def test_parallel_deepseek_v3_mla(tp, pp, models, vllm_reference, record_property):
    """DeepseekV3 with MLA on (bfloat16, the real latent sizes, 16 heads) over
    ``tp`` x ``pp`` GPUs, on the runner vLLM chooses: against vLLM's own
    forward on one GPU."""
    from eagle3_compat.testing import compare, ensure_applied

    _need(tp * pp)
    model = models("deepseek_v3_mla", hidden=512)
    ref = vllm_reference(model, "bfloat16")
    ensure_applied("bfloat16")
    from speculators.data_generation import VllmHiddenStatesGenerator

    from test_gpu_engine import MAX_MODEL_LEN

    with VllmHiddenStatesGenerator(str(model), layer_ids=LAYERS, max_model_len=MAX_MODEL_LEN,
                                   gpu_memory_utilization=0.3, tensor_parallel_size=tp,
                                   pipeline_parallel_size=pp) as gen:
        results = _in_calls(gen, PROMPTS)
    worst = compare(results, ref, PROMPTS, LAYERS, MLA_BF16_TOL)
    record_property("max_rel_error", worst)
    print(f"deepseek_v3_mla bf16 tp{tp} pp{pp}: vs vLLM's own forward on one GPU {worst:.3g}")
    _must_fail(compare, results, ref, PROMPTS, LAYERS, MLA_BF16_TOL)
