"""Pipeline parallel on the real CPU engine: TP 1 x PP 2 against TP 1 and HF float32.

vLLM's CPU backend runs ``pipeline_parallel_size=2`` as two worker processes
(one core each: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``).  The tiny models have
6 decoder layers: stage 0 runs layers 0-2, stage 1 runs 3-5 (and the final
norm).  The layer ids asked for are unsorted and cross the stage boundary,
so every result is a merge of both stages' replies.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import GEN_LAYERS, GEN_MAX_MODEL_LEN, VLLM_DIFFERS_FROM_HF
from prompts import mixed_prompts

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("applied_f32")]

# The shared TP 1 generator's layers (conftest: 5, 0, 2) plus 3, the first
# layer of stage 1: stage 0 captures 0 and 2, stage 1 captures 5 and 3.
LAYERS = [*GEN_LAYERS, 3]
PP_TOL = 1e-5  # PP 2 against TP 1, both float32
HF_TOL = 1e-4


@pytest.fixture(autouse=True)
def _verified_release(request, vllm_minor):
    """Pipeline parallelism is verified (and allowed) on vLLM 0.11-0.16 only;
    elsewhere only the refusal is tested."""
    from eagle3_compat.generator import PIPELINE_VERIFIED

    inside = PIPELINE_VERIFIED[0] <= vllm_minor <= PIPELINE_VERIFIED[1]
    if not inside and "refused" not in request.node.name:
        pytest.skip(f"pipeline parallelism is refused on vLLM {vllm_minor} (verified {PIPELINE_VERIFIED})")


def test_pipeline_parallel_refused_outside_the_verified_releases(tiny_models, vllm_minor, monkeypatch):
    """Outside 0.11-0.16 the generator refuses PP before the engine starts,
    naming the releases; inside, the override makes it refuse too."""
    from speculators.data_generation import VllmHiddenStatesGenerator

    from eagle3_compat.generator import _check_pipeline_release

    model = str(tiny_models("llama"))
    monkeypatch.setenv("EAGLE3_COMPAT_VLLM_VERSION", "0.32.0")
    with pytest.raises(ValueError, match=r"verified on vLLM 0.11-0.16 only, and this is vLLM 0.32.0"):
        _check_pipeline_release(2)
    _check_pipeline_release(1)
    monkeypatch.delenv("EAGLE3_COMPAT_VLLM_VERSION")
    if vllm_minor > (0, 16):
        with pytest.raises(ValueError, match="verified on vLLM 0.11-0.16 only"):
            VllmHiddenStatesGenerator(model, layer_ids=[1], pipeline_parallel_size=2)


@pytest.fixture(scope="module")
def two_cores():
    with pytest.MonkeyPatch.context() as m:
        m.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        yield


def _pp2(model, layers, **kw):
    from speculators.data_generation import VllmHiddenStatesGenerator

    return VllmHiddenStatesGenerator(str(model), layer_ids=layers, pipeline_parallel_size=2, **kw)


@pytest.fixture(scope="module")
def pp_llama(tiny_models, two_cores, vllm_minor):
    from eagle3_compat.generator import PIPELINE_VERIFIED
    from eagle3_compat.testing import ensure_applied

    # a module-scoped fixture is set up before the module's function-scoped
    # `applied_f32`: apply here, or a test run alone gets speculators' own
    # generator (no pipeline_parallel_size)
    ensure_applied("float32")

    if not PIPELINE_VERIFIED[0] <= vllm_minor <= PIPELINE_VERIFIED[1]:  # (module scope: before the autouse skip)
        pytest.skip(f"pipeline parallelism is refused on vLLM {vllm_minor}")
    with pytest.MonkeyPatch.context() as m:
        # conftest sets it for every engine of the tests; this one's comes
        # from the generator (eagle3_compat.heap.engine_environment)
        m.delenv("VLLM_SLEEP_WHEN_IDLE", raising=False)
        g = _pp2(tiny_models("llama"), LAYERS, max_model_len=GEN_MAX_MODEL_LEN)
    yield g
    g.close()


def _shm_names():
    from eagle3_compat.arena import PREFIX, SHM_DIR

    mine = f"{PREFIX}{os.getpid()}-"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(mine))


def _check(pp_results, tp1_results, model, prompts):
    """Every layer against HF float32; the TP 1 generator's layers (all but
    the last slot) against TP 1 at 1e-5."""
    from eagle3_compat.testing import compare, hf_layer_outputs

    compare(pp_results, hf_layer_outputs(model, prompts, LAYERS), prompts, LAYERS, HF_TOL)
    n = len(GEN_LAYERS)
    head = [{"input_ids": r["input_ids"], "hidden_states": r["hidden_states"][:n]} for r in pp_results]
    return compare(head, [r["hidden_states"] for r in tp1_results], prompts, GEN_LAYERS, PP_TOL)


def test_pipeline_parallel_2_matches_tensor_parallel_1(pp_llama, llama_gen, tiny_models, monkeypatch):
    """The core tier's PP reference test: a chunked call (45 prompts, ~20k
    tokens over the 8192-token step budget), a second call, a repeat (over
    the RPC path: each stage sends its own layers, as a stage on another
    host does), and stream(): each against TP 1 (1e-5) and HF float32 (1e-4)."""
    import torch

    model = tiny_models("llama")
    g = pp_llama
    assert g.pipeline_parallel_size == 2 and g.layer_ids == LAYERS
    infos = g.llm.collective_rpc("e3c_state")
    assert [i["active"] for i in infos] == [True, True]
    big = mixed_prompts(45, GEN_MAX_MODEL_LEN - 1, seed=1)
    assert sum(map(len, big)) > 8192
    small = mixed_prompts(12, 700, seed=3)
    r_big = g.generate(big)
    r_small = g.generate(small)
    with monkeypatch.context() as m:
        m.setenv("EAGLE3_COMPAT_TRANSPORT", "rpc")
        r_again = g.generate(small)
    for a, b in zip(r_again, r_small):  # two engine calls: equal up to the CPU kernels' noise
        for x, y in zip(a["hidden_states"], b["hidden_states"]):
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-5), float((x - y).abs().max())
    for r, p in zip(r_big, big):
        assert [tuple(h.shape) for h in r["hidden_states"]] == [(len(p), 256)] * len(LAYERS)
    worst = _check(r_big, llama_gen.generate(big), model, big)
    tp1_small = llama_gen.generate(small)
    worst = max(worst, _check(r_small, tp1_small, model, small), _check(r_again, tp1_small, model, small))
    stream_prompts = mixed_prompts(14, 600, seed=9)
    got = dict(g.stream(iter(stream_prompts), max_in_flight=4))
    assert sorted(got) == list(range(len(stream_prompts)))
    ordered = [got[i] for i in range(len(stream_prompts))]
    worst = max(worst, _check(ordered, llama_gen.generate(stream_prompts), model, stream_prompts))
    print(f"PP 2 vs TP 1: max relative error {worst:.2e}")
    assert _shm_names() == []
    assert not any(m["call_open"] for m in g.llm.collective_rpc("e3c_memory"))


def test_pipeline_parallel_stage_setup(pp_llama):
    """Each stage hooks only the requested layers it runs (the others are
    vLLM's placeholders there), and says so."""
    infos = pp_llama._e3c_setup_infos
    assert [(i["stage"], i["owned"], [LAYERS[s] for s in i["slots"]]) for i in infos] == [
        (0, [0, 3], [0, 2]),
        (1, [3, 6], [5, 3]),
    ]
    assert [s["hooks"] for s in pp_llama.llm.collective_rpc("e3c_state")] == [3, 3]  # 2 layers + inputs
    # Both workers started with VLLM_SLEEP_WHEN_IDLE=1 from the generator
    # (vLLM 0.11-0.17 spin them on their cores between calls otherwise), and
    # the user's process did not keep it.
    assert [m["vllm_sleep_when_idle"] for m in pp_llama.llm.collective_rpc("e3c_memory")] == ["1", "1"]


def test_pipeline_parallel_argument_is_checked(tiny_models):
    from speculators.data_generation import VllmHiddenStatesGenerator

    model = str(tiny_models("llama"))
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive int, got 0"):
        VllmHiddenStatesGenerator(model, layer_ids=[1], pipeline_parallel_size=0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=1 x pipeline_parallel_size=64 = 64 workers"):
        VllmHiddenStatesGenerator(model, layer_ids=[1], pipeline_parallel_size=64)
    with pytest.raises(TypeError):  # keyword-only
        VllmHiddenStatesGenerator(model, [1], 128, 0.8, 1, "layer_output", 2)
    with pytest.raises(ValueError, match=r"distributed_executor_backend must be None or one of \('mp', 'ray'\), got 'rya'"):
        VllmHiddenStatesGenerator(model, layer_ids=[1], pipeline_parallel_size=2, distributed_executor_backend="rya")


def test_ray_executor_skips_the_host_device_count():
    """With vLLM's Ray executor the workers are placed on the Ray cluster's
    nodes: 8 x 2 workers on this 2-core host are vLLM's and Ray's to refuse,
    not ours; with the default or "mp" executor they must fit this host."""
    from eagle3_compat.generator import _check_parallel

    _check_parallel(8, 2, "ray")
    for backend in (None, "mp"):
        with pytest.raises(ValueError, match=r"= 16 workers but only \d+ "):
            _check_parallel(8, 2, backend)


@pytest.mark.extended
@pytest.mark.parallel
def test_executor_backend_reaches_vllm(pp_llama, tiny_models, caplog):
    """``distributed_executor_backend="ray"`` is passed to vLLM: its CPU
    platform says it falls back to multiprocessing (the Ray executor does not
    run on the CPU platform), and the results are those of the same engine
    without it."""
    pytest.importorskip("ray")  # vLLM refuses "ray" without it (installed in vllm016's env)
    import logging

    prompts = mixed_prompts(6, 500, seed=12)
    with caplog.at_level(logging.WARNING), _pp2(
        tiny_models("llama"), LAYERS, max_model_len=GEN_MAX_MODEL_LEN, distributed_executor_backend="ray"
    ) as g:
        got = g.generate(prompts)
    assert "ray is not supported on CPU, fallback to mp" in caplog.text
    from eagle3_compat.testing import compare

    compare(got, [r["hidden_states"] for r in pp_llama.generate(prompts)], prompts, LAYERS, PP_TOL)


@pytest.mark.extended
@pytest.mark.parallel
def test_pipeline_parallel_2_moe_matches_tensor_parallel_1(tiny_models, two_cores, vllm_minor):
    """Qwen3-MoE (every layer MoE): PP 2 against TP 1 at 1e-5, several prompts
    per call, layers on both stages."""
    from speculators.data_generation import VllmHiddenStatesGenerator

    from eagle3_compat.testing import compare

    model = tiny_models("qwen3_moe")
    layers = [4, 1, 2, 5]
    prompts = mixed_prompts(8, 400, seed=5)
    try:
        tp1 = VllmHiddenStatesGenerator(str(model), layer_ids=layers, max_model_len=512)
    except RuntimeError as exc:
        if "initialization failed" not in str(exc) or vllm_minor != (0, 14):
            raise
        pytest.skip("vLLM 0.14's CPU build cannot run an MoE model (README)")
    # vLLM 0.12/0.13's own forward of this family depends on the batch (README):
    # there both sides run one prompt per call.
    one_by_one = vllm_minor in VLLM_DIFFERS_FROM_HF["qwen3_moe"]

    def run(g):
        return [g.generate([p])[0] for p in prompts] if one_by_one else g.generate(prompts)

    with tp1:
        ref = run(tp1)
    with _pp2(model, layers, max_model_len=512) as g:
        got = run(g)
        got2 = run(g)
    ref_states = [r["hidden_states"] for r in ref]
    worst = max(compare(got, ref_states, prompts, layers, PP_TOL), compare(got2, ref_states, prompts, layers, PP_TOL))
    print(f"Qwen3-MoE PP 2 vs TP 1: max relative error {worst:.2e}")


def _engine_children():
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE or "resource_tracker" in " ".join(p.cmdline()):
                continue
        except psutil.Error:
            continue
        out.append(p)
    return out


@pytest.mark.extended
@pytest.mark.parallel
@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.usefixtures("reap_semaphores")  # SIGKILLs processes: their semaphores stay
def test_killed_pipeline_stage_worker_is_a_clear_error(tiny_models, two_cores, stage):
    """PP 2: the worker of either stage dies (SIGKILL) after a correct call:
    the next calls raise EngineDiedError, no process and no arena is left.
    With stage 0 as the victim, only stage 1's layers are asked for: stage 0
    captures nothing (its worker replies None) and the results are still
    whole."""
    import psutil

    from eagle3_compat.generator import EngineDiedError
    from eagle3_compat.testing import compare, hf_layer_outputs

    model = tiny_models("llama")
    keep = {p.pid for p in _engine_children()}
    layers = [4, 5] if stage == 0 else [1, 4]
    g = _pp2(model, layers, max_model_len=512)
    assert [i["capturing"] for i in g._e3c_setup_infos] == [stage == 1, True]
    prompts = mixed_prompts(6, 200, seed=7)
    compare(g.generate(prompts), hf_layer_outputs(model, prompts, layers), prompts, layers, HF_TOL)
    (victim,) = [i["pid"] for i in g._e3c_setup_infos if i["stage"] == stage]
    assert victim in {p.pid for p in _engine_children()}
    target = psutil.Process(victim)
    target.send_signal(signal.SIGKILL)
    psutil.wait_procs([target], timeout=10)
    t0 = time.monotonic()
    with pytest.raises(EngineDiedError, match="died|dead"):
        for _ in range(3):  # the death may land between calls or inside one
            g.generate(mixed_prompts(3, 100, seed=23))
    # a clear error, not a hang: ~15 s alone; 114 s once under `tox -p 2`
    # (two suites' engines on 2 cores) on vLLM 0.11
    assert time.monotonic() - t0 < 240
    deadline = time.monotonic() + 60
    while [p for p in _engine_children() if p.pid not in keep] and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [(p.pid, p.cmdline()[-3:]) for p in _engine_children() if p.pid not in keep]
    assert not left, f"orphan engine processes {left}"
    assert _shm_names() == []
    with pytest.raises(RuntimeError, match="closed"):
        g.generate([[5]])
