"""The GPU suite: speculators 0.3.0's generator on vLLM's CUDA engine, one GPU.

Run with ``python -m pytest tests/gpu`` where vLLM (CUDA) and speculators
0.3.0 are installed (``tools/gpu_run.sh`` runs it with the benchmark);
skipped, with the reason, where there is no CUDA GPU.

Each case runs under both model runners, chosen with
``VLLM_USE_V2_MODEL_RUNNER`` (``1``: the new runner, vLLM's default for dense
models from 0.25; ``0``: the V1 runner, its default for MoE models there),
and checks which runner the engine built.  The engine keeps vLLM's default
chunked prefill (the prompts of a call exceed one step's 8192 tokens, so
long prompts are split across steps); prefix caching is off in the
generator (a cached prefix's rows would not be computed).

References, on the same GPU:

* Hugging Face transformers (``hf_layer_outputs``), one prompt per forward.
  float32: within 1e-4 relative.  bfloat16: within ``BF16_NOISE_FACTOR``
  times what Hugging Face's own bfloat16 forward differs from its float32
  forward on the same prompts (the noise of bfloat16 itself, measured per
  model), against the float32 reference.
* vLLM's own unpatched forward (``VllmReference``: the model's forward
  stopped after layer ``k``, one prompt per step) for the MoE and MLA
  families: float32 1e-4; bfloat16 ``MLA_BF16_TOL``.

Every check also shows it can fail: the same results against a reference
shifted by one row, and one of the neighbouring layer, must not pass.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eagle3_compat.testing import gpu_unavailable

pytestmark = [pytest.mark.gpu, pytest.mark.engine]

# ``tests/conftest.py`` sets variables for vLLM's CPU platform before any
# engine starts (MLA disabled, spawned workers, a CPU KV-cache size).  With a
# CUDA GPU they are removed again where they hold exactly those values, so
# the engines here run MLA (FlashMLA / FA3-MLA) and the start method the
# library chooses itself (``eagle3_compat.cuda_engine``).  Nothing changes
# without a GPU (the suite is skipped there).  This is not a conftest.py of
# its own: pytest would import it as ``conftest`` ahead of tests/conftest.py,
# which the CPU tests import names from.
CPU_PLATFORM_ENV = {"VLLM_MLA_DISABLE": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
                    "VLLM_CPU_KVCACHE_SPACE": "1"}
if gpu_unavailable() is None:
    for _name, _value in CPU_PLATFORM_ENV.items():
        if os.environ.get(_name) == _value:
            del os.environ[_name]
    # vLLM 0.25's sampler probes FlashInfer at load time; a `pip install vllm`
    # brings it, a vLLM without it needs the probe off.
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

MAX_MODEL_LEN = 4096
LAYERS = [0, 2, 3, 5]  # of 6: first and last layer included
RUNNERS = ("v2", "v1")
# Hugging Face bfloat16 vs its own float32, per model and prompt set, times this.
BF16_NOISE_FACTOR = 3.0
MLA_BF16_TOL = 5e-2
FP32_TOL = 1e-4
N_PROMPTS = 48
# The calls the prompts are given in: several calls, of different sizes,
# the second and third each more than one engine step (8192 tokens).
CALLS = ((0, 5), (5, 29), (29, N_PROMPTS))


def gpu_prompts(n: int = N_PROMPTS, vocab: int = 400, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of 1 to ``MAX_MODEL_LEN - 1`` tokens: short ones, long
    ones that chunked prefill splits across steps, a duplicate, and a group
    sharing a 700-token prefix."""
    rng = random.Random(seed)
    fixed = [1, 2, MAX_MODEL_LEN - 1, 3000, 17, 2500, 257, 4000, 64, 1800]
    prompts = []
    for i in range(n):
        length = fixed[i] if i < len(fixed) else rng.choice([rng.randint(3, 80), rng.randint(200, 1500)])
        prompts.append([rng.randrange(4, vocab) for _ in range(length)])
    prefix = prompts[3][:700]
    for i in range(12, 20):
        prompts[i] = prefix + [rng.randrange(4, vocab) for _ in range(5 + 40 * (i - 12))]
    prompts[30] = list(prompts[6])
    return prompts


PROMPTS = gpu_prompts()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from eagle3_compat.testing import make_tiny_model

    root = tmp_path_factory.mktemp("gpu-models")
    made = {}

    def get(family: str, **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in made:
            name = family + "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
            made[key] = make_tiny_model(root / name, family, **kw)
        return made[key]

    return get


def _free_gpu() -> None:
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def hf_reference():
    """(model path, dtype) -> Hugging Face outputs of LAYERS for PROMPTS on the GPU (cached)."""
    from eagle3_compat.testing import hf_layer_outputs

    cache = {}

    def get(model, dtype="float32", layers=tuple(LAYERS), prompts=None):
        key = (str(model), dtype, tuple(layers), prompts is None)
        if key not in cache:
            cache[key] = hf_layer_outputs(model, PROMPTS if prompts is None else prompts, list(layers),
                                          device="cuda", dtype=dtype)
            _free_gpu()
        return cache[key]

    return get


@contextlib.contextmanager
def _env(**values):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def generator(model, dtype, runner, layers=LAYERS, **kw):
    """speculators' generator through eagle3_compat, on the runner asked for."""
    from eagle3_compat.testing import ensure_applied

    ensure_applied(dtype)
    from speculators.data_generation import VllmHiddenStatesGenerator

    _free_gpu()
    with _env(VLLM_USE_V2_MODEL_RUNNER="1" if runner == "v2" else "0"):
        gen = VllmHiddenStatesGenerator(str(model), layer_ids=list(layers), max_model_len=MAX_MODEL_LEN,
                                        gpu_memory_utilization=0.3, **kw)
    try:
        info = gen._e3c_worker_info
        assert info["runner"] == runner, f"asked for the {runner} runner, the engine built {info['runner']}"
        assert info["device"].startswith("cuda"), info
        yield gen
    finally:
        gen.close()


def _in_calls(gen, prompts):
    out = []
    for lo, hi in CALLS:
        out.extend(gen.generate(prompts[lo:hi]))
    return out


def _must_fail(compare, results, ref, prompts, layers, tol):
    """The check can fail: a reference one row off, and one of swapped layers, do not pass."""
    import torch

    shifted = [[torch.roll(t, 1, dims=0) for t in per] for per in ref]
    with pytest.raises(AssertionError):
        compare(results, shifted, prompts, layers, tol)
    swapped = [list(reversed(per)) for per in ref]
    with pytest.raises(AssertionError):
        compare(results, swapped, prompts, layers, tol)


def _bf16_bound(hf_reference, model, record):
    from eagle3_compat.testing import compare

    noise = compare([{"input_ids": _ids(p), "hidden_states": h}
                     for p, h in zip(PROMPTS, hf_reference(model, "bfloat16"))],
                    hf_reference(model, "float32"), PROMPTS, LAYERS, float("inf"))
    record("hf_bf16_vs_fp32", noise)
    return BF16_NOISE_FACTOR * noise


def _ids(p):
    import torch

    return torch.tensor(p, dtype=torch.long)


def _bad_inputs_refused(gen, ref):
    """Bad prompts refused with the prompt and the problem named; the engine right after."""
    from eagle3_compat.testing import compare

    first = gen.generate(PROMPTS[:3])
    for bad, said in (([[5, 6], []], "prompt 1 is empty"), ([[5, 600]], "prompt 0: token id 600"),
                      ([[5, -2]], "prompt 0: negative token id")):
        with pytest.raises(ValueError, match=said):
            gen.generate(bad)
    after = gen.generate(PROMPTS[:8])
    compare(first, ref[:3], PROMPTS[:3], LAYERS, FP32_TOL)
    compare(after, ref[:8], PROMPTS[:8], LAYERS, FP32_TOL)


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_WORKER_MULTIPROC_METHOD", "EAGLE3_COMPAT_APPLIED", "VLLM_USE_V2_MODEL_RUNNER",
                        "TRITON_F32_DEFAULT")}
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


SCRIPT = textwrap.dedent('''
    import json, logging, sys
    import torch
    logging.basicConfig(level=logging.INFO)
    if sys.argv[2] == "touch":
        # what a user's script does first: ask for the GPU (transformers,
        # accelerate and speculators' scripts do), load the model on the CPU
        assert torch.cuda.is_available()
        from transformers import AutoModelForCausalLM
        AutoModelForCausalLM.from_pretrained(sys.argv[1])
    import eagle3_compat
    eagle3_compat.apply(dtype="float32")
    from speculators.data_generation import VllmHiddenStatesGenerator
    from eagle3_compat.testing import hf_layer_outputs, max_rel_error

    if __name__ == "__main__":
        prompts = [[5, 6, 7, 8], list(range(4, 300)), [9] * 40]
        with VllmHiddenStatesGenerator(sys.argv[1], layer_ids=[1, 4], max_model_len=512,
                                       gpu_memory_utilization=0.4) as gen:
            runner = gen._e3c_worker_info["runner"]
            got = gen.generate(prompts)
        ref = hf_layer_outputs(sys.argv[1], prompts, [1, 4])
        err = max(max_rel_error(h, r) for g, rr in zip(got, ref) for h, r in zip(g["hidden_states"], rr))
        print("RESULT " + json.dumps({"runner": runner, "err": err}))
''')


@pytest.mark.parametrize("first", ["touch", "untouched"])
def test_default_start_method(first, models, tmp_path):
    """A user's script as is (vLLM's default start method, no variable set),
    whether it asked CUDA for its devices before the engine started or not:
    the engine starts, on vLLM's default runner (the new one for Llama), and
    the rows are right; the log says the engine was spawned and why."""
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(models("llama")), first], env=_clean_env(),
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    assert result["runner"] == "v2", result
    assert result["err"] <= FP32_TOL, result
    assert "VLLM_WORKER_MULTIPROC_METHOD=spawn" in proc.stderr, proc.stderr[-3000:]


def test_forked_engine_after_a_cuda_query_fails_in_vllm(models, tmp_path):
    """Why the library spawns: with fork forced, a script that asked CUDA for its
    devices first gets an engine that cannot start (vLLM's own behaviour)."""
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(models("llama")), "touch"],
                          env=_clean_env(VLLM_WORKER_MULTIPROC_METHOD="fork"),
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode != 0
    assert "Cannot re-initialize CUDA in forked subprocess" in proc.stdout + proc.stderr, proc.stderr[-4000:]


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("family,dtype", [
    ("llama", "float32"), ("llama", "bfloat16"), ("qwen3", "float32"), ("qwen3", "bfloat16"),
])
def test_many_prompts_match_hugging_face(family, dtype, runner, models, hf_reference, record_property):
    """48 prompts over three calls, then the same prompts through stream():
    every row of every layer against Hugging Face on this GPU, in order."""
    from eagle3_compat.testing import compare

    model = models(family)
    ref = hf_reference(model, "float32")
    tol = FP32_TOL if dtype == "float32" else _bf16_bound(hf_reference, model, record_property)
    with generator(model, dtype, runner) as gen:
        if (family, dtype) == ("llama", "float32"):
            _bad_inputs_refused(gen, ref)
        results = _in_calls(gen, PROMPTS)
        streamed = {}
        for i, sample in gen.stream(PROMPTS[:20], max_in_flight=8):
            assert i not in streamed, f"stream() gave prompt {i} twice"
            streamed[i] = sample
    worst = compare(results, ref, PROMPTS, LAYERS, tol)
    record_property("max_rel_error", worst)
    record_property("tolerance", tol)
    print(f"{family} {dtype} {runner}: worst relative error {worst:.3g} (bound {tol:.3g})")
    assert sorted(streamed) == list(range(20))
    compare([streamed[i] for i in range(20)], ref[:20], PROMPTS[:20], LAYERS, tol)
    _must_fail(compare, results, ref, PROMPTS, LAYERS, tol)


@pytest.mark.parametrize("runner", RUNNERS)
def test_wide_model_bf16(runner, models, hf_reference, record_property):
    """Hidden 2048 (16 heads of 128, as the real models' head size) in bfloat16:
    FlashAttention 3 and the real GEMM shapes."""
    from eagle3_compat.testing import compare

    model = models("llama", hidden=2048, layers=6)
    prompts = PROMPTS[:24]
    ref32 = hf_reference(model, "float32", prompts=prompts)
    ref16 = hf_reference(model, "bfloat16", prompts=prompts)
    noise = compare([{"input_ids": _ids(p), "hidden_states": h} for p, h in zip(prompts, ref16)],
                    ref32, prompts, LAYERS, float("inf"))
    tol = BF16_NOISE_FACTOR * noise
    with generator(model, "bfloat16", runner) as gen:
        results = gen.generate(prompts[:10]) + gen.generate(prompts[10:])
    worst = compare(results, ref32, prompts, LAYERS, tol)
    record_property("max_rel_error", worst)
    print(f"llama h2048 bf16 {runner}: worst {worst:.3g}, HF bf16 noise {noise:.3g}, bound {tol:.3g}")
    _must_fail(compare, results, ref32, prompts, LAYERS, tol)


@pytest.fixture(scope="module")
def vllm_reference():
    """(model, dtype) -> vLLM's own unpatched forward's outputs of LAYERS for PROMPTS (cached)."""
    from eagle3_compat.testing import VllmReference

    cache = {}

    def get(model, dtype):
        key = (str(model), dtype)
        if key not in cache:
            with VllmReference(model, MAX_MODEL_LEN - 1, dtype, gpu_memory_utilization=0.3) as ref:
                cache[key] = [[t.clone() for t in per] for per in ref.layer_outputs(PROMPTS, LAYERS)]
            _free_gpu()
        return cache[key]

    return get


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("family,dtype,tol", [
    ("qwen3_moe", "float32", FP32_TOL),
    ("deepseek_v3_mla", "bfloat16", MLA_BF16_TOL),
])
def test_moe_and_mla_match_vllm_forward(family, dtype, tol, runner, models, vllm_reference, hf_reference,
                                        record_property):
    """Fused MoE kernels (Qwen3-MoE) and MLA attention with MoE and llama_4_scaling
    (DeepseekV3 with the real latent sizes): against vLLM's own forward."""
    from eagle3_compat.testing import compare

    model = models(family, hidden=512) if family == "deepseek_v3_mla" else models(family)
    ref = vllm_reference(model, dtype)
    with generator(model, dtype, runner) as gen:
        results = _in_calls(gen, PROMPTS)
    worst = compare(results, ref, PROMPTS, LAYERS, tol)
    record_property("max_rel_error", worst)
    print(f"{family} {dtype} {runner}: worst relative error vs vLLM's own forward {worst:.3g}")
    _must_fail(compare, results, ref, PROMPTS, LAYERS, tol)
    if dtype == "float32":  # and against Hugging Face on this GPU
        worst_hf = compare(results, hf_reference(model, "float32"), PROMPTS, LAYERS, tol)
        print(f"{family} {dtype} {runner}: worst relative error vs Hugging Face {worst_hf:.3g}")


def test_kimi_k25_mla_matches_vllm_forward(models, vllm_reference, record_property):
    """Kimi-K2.5 (vision tower + DeepseekV3 text model) with MLA on, bfloat16,
    the real latent sizes (so vLLM picks its CUDA MLA backend as for the real
    model), text prompts over several calls, on the runner vLLM chooses for
    it: every row of the text model's layers against vLLM's own forward."""
    from eagle3_compat.testing import compare

    model = models("kimi_k25", hidden=512, mla=True)
    ref = vllm_reference(model, "bfloat16")
    from eagle3_compat.testing import ensure_applied

    ensure_applied("bfloat16")
    from speculators.data_generation import VllmHiddenStatesGenerator

    _free_gpu()
    with VllmHiddenStatesGenerator(str(model), layer_ids=LAYERS, max_model_len=MAX_MODEL_LEN,
                                   gpu_memory_utilization=0.3) as gen:
        info = gen._e3c_worker_info
        results = _in_calls(gen, PROMPTS)
    assert (info["model"], info["hidden_size"]) == ("KimiK25ForConditionalGeneration", 512), info
    worst = compare(results, ref, PROMPTS, LAYERS, MLA_BF16_TOL)
    record_property("max_rel_error", worst)
    record_property("runner", info["runner"])
    print(f"kimi_k25 mla bfloat16 {info['runner']}: worst relative error vs vLLM's own forward {worst:.3g}")
    _must_fail(compare, results, ref, PROMPTS, LAYERS, MLA_BF16_TOL)


def test_bad_layer_ids_refused_before_the_engine(models):
    from eagle3_compat.testing import ensure_applied

    ensure_applied("float32")
    from speculators.data_generation import VllmHiddenStatesGenerator

    for bad, said in (([6], "out of bounds"), ([-1], "out of bounds"), ([2, 5, 2], "repeats")):
        with pytest.raises(ValueError, match=said):
            VllmHiddenStatesGenerator(str(models("llama")), layer_ids=bad, max_model_len=MAX_MODEL_LEN)


def test_cli_generate_then_verify(models, hf_reference, tmp_path):
    """The CLI job on the GPU: files written, ``verify`` clean, every file's rows
    against Hugging Face float32 on this GPU."""
    import torch

    from eagle3_compat.testing import max_rel_error

    model = models("llama")
    prompts = PROMPTS[:24]
    ref = hf_reference(model, "float32")
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = tmp_path / "out"
    env = _clean_env()
    gen = subprocess.run([sys.executable, "-m", "eagle3_compat", "generate", "--model", str(model),
                          "--input", str(src), "--output-dir", str(out), "--layer-ids", *map(str, LAYERS),
                          "--seq-length", str(MAX_MODEL_LEN), "--dtype", "float32", "--batch-size", "10"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert gen.returncode == 0, gen.stderr[-6000:]
    ver = subprocess.run([sys.executable, "-m", "eagle3_compat", "verify", str(out), "--check-only"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert ver.returncode == 0, ver.stdout[-3000:] + ver.stderr[-3000:]
    for i, p in enumerate(prompts):
        data = torch.load(out / f"data_{i}.pt", weights_only=True)
        assert data["input_ids"].tolist() == p, i
        for h, r in zip(data["hidden_states"], ref[i]):
            assert max_rel_error(h, r) <= FP32_TOL, i
