"""apply() on the real engine: speculators 0.3.0's generator against the references.

Each generator here starts the real vLLM engine (spawned processes) on a tiny
random-weight model the session created.  Results are compared, per prompt
and per layer, with Hugging Face transformers in float32.
"""

from __future__ import annotations

import random

import pytest

from eagle3_compat.testing import ensure_applied
from conftest import GEN_LAYERS, GEN_MAX_MODEL_LEN, VLLM_CANNOT_LOAD, VLLM_DIFFERS_FROM_HF, vllm_cannot_load
from prompts import mixed_prompts

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("applied_f32")]

# the session's shared generator (conftest): unsorted; first and last layer of a 6-layer model
MAX_MODEL_LEN = GEN_MAX_MODEL_LEN
LAYERS = GEN_LAYERS
F32_TOL = 1e-4
BF16_TOL = 5e-2


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models("llama")


@pytest.fixture(scope="module")
def gen(llama_gen):
    return llama_gen


def _check(results, model, prompts, layers, tol):
    from eagle3_compat.testing import compare, hf_layer_outputs

    ref = hf_layer_outputs(model, prompts, layers)
    return compare(results, ref, prompts, layers, tol)


def test_the_engine_runs_the_model_eagerly(gen):
    """The capture's hooks need an eager model: the generator's engine has
    torch.compile off (vLLM's compilation mode/level 0), on every release.
    (The core tier's TORCHDYNAMO_DISABLE, conftest, must not be what makes
    the hooks run.)"""
    cc = gen.vllm_config.compilation_config
    mode = getattr(cc, "mode", None)
    mode = getattr(cc, "level", None) if mode is None else mode
    assert int(mode) == 0, cc
    assert gen.vllm_config.model_config.enforce_eager is True


def test_many_prompts_chunked_and_reordered_match_reference(gen, llama):
    # 45 prompts (> max_num_seqs = 32), ~20k tokens (> the 8192-token step
    # budget, so prompts are chunked), duplicates and shared prefixes,
    # lengths 1 .. max_model_len - 1.
    prompts = mixed_prompts(45, MAX_MODEL_LEN - 1, seed=1)
    assert sum(map(len, prompts)) > 8192
    results = gen.generate(prompts)
    assert [r["input_ids"].tolist() for r in results] == prompts
    for r, p in zip(results, prompts):
        assert [tuple(h.shape) for h in r["hidden_states"]] == [(len(p), 256)] * len(LAYERS)
        assert r["loss_mask"] is None
    worst = _check(results, llama, prompts, LAYERS, F32_TOL)
    print(f"max relative error {worst:.2e}")


def test_several_calls_on_one_generator(gen, llama):
    a = mixed_prompts(5, 300, seed=2)
    b = mixed_prompts(12, 700, seed=3)
    ra = gen.generate(a)
    rb = gen.generate(b)
    ra2 = gen.generate(a)  # same prompts again: same states (no prefix-cache row loss)
    _check(ra, llama, a, LAYERS, F32_TOL)
    _check(rb, llama, b, LAYERS, F32_TOL)
    _check(ra2, llama, a, LAYERS, F32_TOL)


def test_released_files_are_reused_and_held_results_are_not_touched(gen, llama):
    """The arena pool on the real engine: a call whose results are partly held
    keeps its file (the held rows stay right while later calls run); a file
    whose results are all released takes the next call, rows all new."""
    import gc

    a = mixed_prompts(6, 300, seed=5)
    b = mixed_prompts(6, 300, seed=6)
    ra = gen.generate(a)
    kept = ra[2]
    del ra
    gc.collect()
    rb = gen.generate(b)  # not into a's file: prompt 2 of it is still held
    pool = gen._e3c_pool
    made = pool.stats()["files_made"]
    del rb
    gc.collect()
    assert pool.stats()["free_files"] >= 1
    c = b[::-1]  # other prompts at the same places of the file
    rc = gen.generate(c)
    assert pool.stats()["files_made"] == made  # the released file was reused
    _check([kept], llama, [a[2]], LAYERS, F32_TOL)
    _check(rc, llama, c, LAYERS, F32_TOL)


def test_tensor_input_and_single_token_prompt(gen, llama):
    import torch

    prompts = [[7], [9]]
    results = gen.generate(torch.tensor(prompts))
    _check(results, llama, prompts, LAYERS, F32_TOL)


def test_truncation_keeps_0_3_0_behaviour_and_warns(gen, llama, caplog):
    long = [4 + (i % 390) for i in range(MAX_MODEL_LEN + 5)]
    short = [5, 6, 7]
    with caplog.at_level("WARNING", logger="eagle3_compat"):
        results = gen.generate([short, long])
    warned = [r.getMessage() for r in caplog.records if r.name == "eagle3_compat.generator"]
    assert any("truncating 1 prompt(s)" in m and "[1]" in m for m in warned), warned
    assert results[1]["input_ids"].tolist() == long[: MAX_MODEL_LEN - 1]
    _check(results, llama, [short, long[: MAX_MODEL_LEN - 1]], LAYERS, F32_TOL)


def _shm_names():
    """This process's arena names in /dev/shm (tox runs envs side by side:
    another env's driver may hold a name of its own at any moment)."""
    import os

    from eagle3_compat.arena import PREFIX, SHM_DIR

    mine = f"{PREFIX}{os.getpid()}-"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(mine))


def _system_thp() -> str | None:
    """The kernel's transparent huge page setting (the bracketed word), or None."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
            words = f.read().split()
    except OSError:
        return None
    return next((w.strip("[]") for w in words if w.startswith("[")), None)


def test_worker_memory_returns_to_level(gen):
    import psutil

    prompts = mixed_prompts(40, 900, seed=4)
    per_call = sum(map(len, prompts)) * len(LAYERS) * 256 * 4  # bytes of rows per call
    for _ in range(2):
        gen.generate(prompts)
    from eagle3_compat.worker import anon_rss

    before = gen.llm.collective_rpc("e3c_memory")[0]
    driver_before, pool_before = anon_rss(), gen._e3c_pool.stats()
    for _ in range(4):
        gen.generate(prompts)  # results dropped at once: their arena goes back to the pool
    after = gen.llm.collective_rpc("e3c_memory")[0]
    driver_after, pool_after = anon_rss(), gen._e3c_pool.stats()
    assert before["call_open"] is False and after["call_open"] is False
    # a CPU worker trims its heap when it has grown by 64 MiB beyond its
    # per-step working set (eagle3_compat.heap), with no interval by default
    assert after["trim_threshold_bytes"] == 64 * 2**20 and after["trim_interval_s"] == 0.0, after
    # and the engine's processes started with oneDNN's primitive cache capped
    # (eagle3_compat.heap.engine_environment), which this process did not keep
    import os

    from eagle3_compat.heap import PRIMITIVE_CACHE_ENV, THP_ENV

    assert after["onednn_primitive_cache_capacity"] == "64", after
    assert PRIMITIVE_CACHE_ENV not in os.environ
    # and with PyTorch's large CPU buffers on transparent huge pages, which
    # the worker's steps then use where the system allows them (its THP
    # setting "always" or "madvise"): each fault after a trim brings 2 MiB
    assert after["thp_mem_alloc_enable"] == "1" and THP_ENV not in os.environ, after
    # On a machine that hands free huge-page blocks to its hypervisor (this
    # project's Firecracker machines) the engine started without huge pages
    # (its model loaded on 4 KiB pages, where a fresh huge page costs ~20x:
    # none held at setup) and the worker took them back for its steps (it
    # refuses none now); elsewhere nothing of the kind happened, and the
    # long-lived buffers (weights, KV cache) are on huge pages.  (What the
    # steps hold on huge pages after the trim above depends on the step
    # sizes and trims of this small model: not asserted.)
    from eagle3_compat.heap import huge_pages_refused, huge_pages_reported

    reported = huge_pages_reported()
    assert after["huge_pages_refused"] is False and huge_pages_refused() is False, after
    assert after["huge_pages_after_start"] is reported, after
    if reported and _system_thp() == "madvise":
        assert after["anon_huge_at_setup"] == 0, after
    if not reported and _system_thp() in ("always", "madvise"):
        assert after["anon_huge"] >= 2 * 2**20, after
    # and glibc keeps the steps' large buffers in the heap for the next step
    # (eagle3_compat.heap.reuse_step_buffers; test_heap checks the effect)
    assert after["mmap_threshold"] == 2**30, after
    # The arena files: a file of the pool took every call, in the driver and
    # in the worker (nothing new made, mapped or kept).
    assert pool_after == pool_before and pool_after["free_files"] >= 1, (pool_before, pool_after)
    assert after["kept_maps"] == before["kept_maps"] != [], (before, after)
    assert after["kept_bytes"] == before["kept_bytes"] >= per_call, (per_call, before, after)
    # Everything else (heap, tensors): four more calls moved ~4 * per_call
    # bytes through the worker and the driver; a leak of an eighth of each
    # call's rows would add per_call / 2.  (vLLM 0.32's own worker heap moves
    # by a few MB between calls, ours or not: seen 2.4-3 MB steps every few
    # calls there, and tens of MB up and down in a plain vLLM 0.32 worker.)
    assert after["anon"] - before["anon"] < per_call / 2, (per_call, before, after)
    assert driver_after - driver_before < per_call / 2, (per_call, driver_before, driver_after)
    assert _shm_names() == []


def test_results_are_the_arena_and_rpc_path_is_identical(gen, monkeypatch):
    """Results map the call's shared memory (no name left in /dev/shm); the
    forced RPC path (a rank-0 worker on another host) gives the same bytes."""
    import io

    import torch

    prompts = mixed_prompts(9, 700, seed=5)
    shm = gen.generate(prompts)
    assert _shm_names() == []
    monkeypatch.setenv("EAGLE3_COMPAT_TRANSPORT", "rpc")
    rpc = gen.generate(prompts)
    # Two engine calls: equal up to float32 noise of the CPU kernels (the
    # transports themselves are bit-exact: test_arena.py); a shifted row or
    # swapped prompt differs by far more.
    for a, b in zip(shm, rpc):
        for x, y in zip(a["hidden_states"], b["hidden_states"]):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-5), float((x - y).abs().max())
    # Each tensor's storage is its own rows: torch.save writes one sample only.
    h = shm[3]["hidden_states"][1]
    assert h.untyped_storage().nbytes() == h.numel() * h.element_size()
    buf = io.BytesIO()
    torch.save(shm[3], buf)
    assert buf.tell() < 1.2 * sum(t.numel() * t.element_size() for t in shm[3]["hidden_states"]) + 4096
    monkeypatch.setenv("EAGLE3_COMPAT_TRANSPORT", "bogus")
    with pytest.raises(ValueError, match="EAGLE3_COMPAT_TRANSPORT"):
        gen.generate(prompts[:1])


def test_rows_go_straight_into_the_arena_and_the_staged_path_agrees(gen, llama, monkeypatch):
    """The worker copies each step's rows to their places in the arena while
    the step runs (runs planned before the model, checked against its
    positions after): every step of a chunked call and of a stream takes
    that path, the results match the reference, and the staged path
    (EAGLE3_COMPAT_DIRECT=0: copies after the step) gives the same rows."""
    import torch

    import eagle3_compat.generator as driver

    replies: list[dict] = []
    rpc = driver._rpc

    def spy(self, method, *args):
        out = rpc(self, method, *args)
        if method == "e3c_take":
            replies.append(out[0])
        elif method == "e3c_exchange":
            replies.extend(t for r in out if r for t in r["taken"])
        return out

    monkeypatch.setattr(driver, "_rpc", spy)
    # 30 prompts of up to 1000 tokens, ~10k: more than one 8192-token step,
    # so a prompt is chunked across steps
    prompts = mixed_prompts(30, 1000, seed=21)
    assert sum(map(len, prompts)) > 8192
    direct = gen.generate(prompts)
    (reply,) = replies
    assert reply["steps"] >= 2 and reply["direct_steps"] == reply["steps"], reply
    _check(direct, llama, prompts, LAYERS, F32_TOL)
    replies.clear()
    streamed = dict(gen.stream(iter(prompts[:5]), max_in_flight=2))
    assert replies and all(r["direct_steps"] == r["steps"] > 0 for r in replies), replies
    # another batching of the same prompts rounds differently (float32
    # matmuls over other row counts): equal within the reference tolerance,
    # where a shifted or swapped row differs by O(1)
    assert all(torch.allclose(a, b, rtol=F32_TOL, atol=F32_TOL)
               for i in streamed for a, b in zip(streamed[i]["hidden_states"], direct[i]["hidden_states"]))
    replies.clear()
    monkeypatch.setenv("EAGLE3_COMPAT_DIRECT", "0")
    staged = gen.generate(prompts)
    # (the engine may split the same prompts into other steps on another call)
    assert replies[0]["direct_steps"] == 0 and replies[0]["steps"] >= 2, replies[0]
    _check(staged, llama, prompts, LAYERS, F32_TOL)
    # (vLLM 0.17 batched them otherwise: 1.5e-5 apart in float32)
    for a, b in zip(direct, staged):
        for x, y in zip(a["hidden_states"], b["hidden_states"]):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.allclose(x, y, rtol=F32_TOL, atol=F32_TOL), float((x - y).abs().max())
    monkeypatch.setenv("EAGLE3_COMPAT_DIRECT", "yes")
    with pytest.raises(ValueError, match="EAGLE3_COMPAT_DIRECT"):
        gen.generate(prompts[:1])


def test_reference_checks_have_teeth(gen, llama):
    """compare() must fail on a shifted row, swapped results and a wrong layer."""
    from eagle3_compat.testing import compare, hf_layer_outputs

    prompts = [[11, 12, 13, 14, 15, 16], [21, 22, 23, 24]]
    results = gen.generate(prompts)
    ref = hf_layer_outputs(llama, prompts, LAYERS)
    compare(results, ref, prompts, LAYERS, F32_TOL)

    import torch

    shifted = [dict(r, hidden_states=[torch.roll(h, 1, 0) for h in r["hidden_states"]]) for r in results]
    with pytest.raises(AssertionError):
        compare(shifted, ref, prompts, LAYERS, F32_TOL)
    swapped = [
        dict(results[0], hidden_states=results[1]["hidden_states"]),
        dict(results[1], hidden_states=results[0]["hidden_states"]),
    ]
    with pytest.raises(AssertionError):
        compare(swapped, ref, prompts, LAYERS, F32_TOL)
    wrong_layer = hf_layer_outputs(llama, prompts, [4, 1, 3])  # each id off by one
    with pytest.raises(AssertionError):
        compare(results, wrong_layer, prompts, LAYERS, F32_TOL)


# Full suite only (vllm016): one more engine each in every env would lengthen
# the other envs' CI runs.  Their second call also holds more than one
# 8192-token step of tokens, so that a prompt is split across two steps.
EXTENDED_FAMILIES = ("qwen2", "mistral", "gemma2")


@pytest.mark.parametrize("family", [
    "qwen3", "qwen3_moe", "olmo2", "llava",
    *(pytest.param(f, marks=pytest.mark.extended) for f in EXTENDED_FAMILIES),
])
def test_other_family_matches_reference(tiny_models, family, vllm_minor, caplog):
    """Qwen3, Qwen3-MoE (every layer MoE), Olmo2 (decoder layers return one
    tensor, no fused residual), Llava (the language model behind
    get_language_model(), fed embeddings rather than token ids), Qwen2 (q/k/v
    biases), Mistral (vLLM's Llama classes, sliding window) and Gemma2
    (scaled embeddings, four norms per layer, soft-capping, alternating
    sliding window) against HF float32, several prompts per call, two calls."""
    from speculators.data_generation import VllmHiddenStatesGenerator

    from eagle3_compat.testing import compare, hf_layer_outputs, vllm_layer_outputs

    broken = vllm_cannot_load(family)
    if broken is not None:
        # vLLM's own module for this family does not import here: allowed only
        # on the releases the README names, and recorded as such.
        assert vllm_minor in VLLM_CANNOT_LOAD.get(family, ((), ""))[0], broken
        from importlib.metadata import version

        pytest.xfail(f"vLLM {vllm_minor[0]}.{vllm_minor[1]} itself cannot load {family} with "
                     f"transformers {version('transformers')}: {broken}")
    model = tiny_models(family)
    prompts = mixed_prompts(6, 400, seed=5)
    calls = [prompts[:3], prompts[3:]]
    if family in EXTENDED_FAMILIES:
        rng = random.Random(7)
        calls[1] += [[rng.randrange(4, 400) for _ in range(480)] for _ in range(17)]
        prompts = calls[0] + calls[1]
        assert sum(map(len, calls[1])) > 8192
    layers = [1, 4]
    try:
        g = VllmHiddenStatesGenerator(str(model), layer_ids=layers, max_model_len=512)
    except RuntimeError as exc:
        if "initialization failed" not in str(exc):
            raise
        # Only acceptable where vLLM's own engine cannot run the model either
        # (seen: MoE on the 0.14 CPU build).
        with pytest.raises(RuntimeError, match="initialization failed"):
            vllm_layer_outputs(model, prompts[:1], layers)
        pytest.skip(f"vLLM {vllm_minor[0]}.{vllm_minor[1]} itself cannot run {family} on this CPU build")
    with g:
        with caplog.at_level("WARNING", logger="eagle3_compat"):
            results = [r for call in calls for r in g.generate(call)]
        # Llava is fed embeddings: its token ids come from the runner's buffer
        # and must still be checked (a warning says when they cannot be).
        assert "without the token-id check" not in caplog.text
        hf = hf_layer_outputs(model, prompts, layers)
        try:
            worst = compare(results, hf, prompts, layers, F32_TOL)
            print(f"{family}: max relative error vs HF float32 {worst:.2e}")
            return
        except AssertionError as exc:
            hf_error = exc
        # Only on the releases the README names (VLLM_DIFFERS_FROM_HF) may an
        # HF mismatch be an expected failure; anywhere else it is a failure.
        if vllm_minor not in VLLM_DIFFERS_FROM_HF.get(family, ()):
            raise hf_error
        # There the capture must still equal what vLLM itself computes (seen:
        # Qwen3, Qwen3-MoE, Olmo2 on the vLLM 0.12 and 0.13 CPU paths, no
        # eagle3_compat involved, and batch-dependent there): one prompt per
        # call against vLLM's own one-prompt-per-step forward, 1e-5.
        singles = [g.generate([p])[0] for p in prompts]
    own = vllm_layer_outputs(model, prompts, layers)
    worst = compare(singles, own, prompts, layers, 1e-5)
    # ... and vLLM's own forward must be what differs from HF
    with pytest.raises(AssertionError):
        compare(own_as_results(own, prompts), hf, prompts, layers, F32_TOL)
    # reached only when the comparison with vLLM's forward above passed
    pytest.xfail(
        f"vLLM {vllm_minor[0]}.{vllm_minor[1]}'s own {family} forward differs from HF: {hf_error} "
        f"(capture vs vLLM's own forward, one prompt per call: {worst:.3g} <= 1e-5)"
    )


def own_as_results(own, prompts):
    import torch

    return [{"input_ids": torch.tensor(p), "hidden_states": states} for p, states in zip(prompts, own)]


def test_bfloat16_within_5e_2(tiny_models):
    import torch
    from speculators.data_generation import VllmHiddenStatesGenerator

    ensure_applied(None)  # dtype auto: the float32 checkpoint runs in bfloat16
    model = tiny_models("llama")
    prompts = mixed_prompts(4, 200, seed=6)
    with VllmHiddenStatesGenerator(str(model), layer_ids=[0, 3], max_model_len=256) as g:
        results = g.generate(prompts)
        # vLLM's block size, or 16 where this CPU build lacks the AMX kernels
        # vLLM would pick for bfloat16 (eagle3_compat.cpu_attention)
        block = g.vllm_config.cache_config.block_size
        assert g._e3c_block_size in (None, block), (g._e3c_block_size, block)
    assert results[0]["hidden_states"][0].dtype == torch.bfloat16
    _check(results, model, prompts, [0, 3], BF16_TOL)


# Tensor parallel 2 against HF float32: the first part of
# test_engine_reliability.py::test_killed_tensor_parallel_worker_is_a_clear_error
# ("worker rank 1"), which then kills a worker of the same engine (one TP 2
# engine start instead of two).


def test_matches_vllm_own_forward(gen, llama):
    """Reference (2): vLLM's unpatched forward, hooks via LLM.apply_model, one prompt per step."""
    from eagle3_compat.testing import compare, vllm_layer_outputs

    prompts = mixed_prompts(4, 300, seed=8)
    every = vllm_layer_outputs(llama, prompts, range(6))  # all six layers: one engine start

    def pick(ids):
        return [[states[k] for k in ids] for states in every]

    results = gen.generate(prompts)
    worst = compare(results, pick(LAYERS), prompts, LAYERS, 1e-5)
    print(f"max relative error vs vLLM's own forward {worst:.2e}")
    wrong = pick([4, 1, 3])
    with pytest.raises(AssertionError):
        compare(results, wrong, prompts, LAYERS, 1e-5)


def test_stream_keeps_the_engine_fed_and_matches_the_reference(gen, llama):
    """stream(): every prompt once, each as generate() gives it (HF float32
    reference), admission bounded by max_in_flight, the input read lazily."""
    prompts = mixed_prompts(23, 700, seed=9)
    pulled = [0]

    def source():
        for p in prompts:
            pulled[0] += 1
            yield p

    got = {}
    for k, sample in gen.stream(source(), max_in_flight=5):
        assert k not in got
        # at most 5 prompts in the engine, and at most 5 finished ones being
        # handed over (their successors were admitted in the same RPC)
        assert pulled[0] - len(got) <= 2 * 5
        got[k] = sample
        if len(got) in (8, 16):
            # the worker forgets each prompt it hands over: what it knows is
            # the prompts in flight, not the prompts done
            held = gen.llm.collective_rpc("e3c_memory", kwargs={"trim": False})[0]["call_prompts"]
            assert 1 <= held <= 2 * 5, held
    assert sorted(got) == list(range(len(prompts)))
    ordered = [got[i] for i in range(len(prompts))]
    assert [r["input_ids"].tolist() for r in ordered] == prompts
    _check(ordered, llama, prompts, LAYERS, F32_TOL)
    assert _shm_names() == []
    assert gen.llm.collective_rpc("e3c_memory")[0]["call_open"] is False


def test_stream_default_keeps_every_engine_step_full(gen, monkeypatch):
    """With stream()'s default max_in_flight the engine always has a full
    step queued behind the running one, so it runs as few steps as for the
    whole input at once.  With two steps' worth in flight (the earlier
    default, 64) the engine ran dry at step boundaries and its steps
    fragmented (2000 prompts: 150-330 steps instead of 64; issue #16)."""
    import random

    from eagle3_compat.generator import DEFAULT_MAX_IN_FLIGHT, MAX_NUM_SEQS

    assert DEFAULT_MAX_IN_FLIGHT >= 3 * MAX_NUM_SEQS
    rng = random.Random(16)
    # 200 tokens each: a full step (32 prompts, 6400 tokens) is long enough
    # for the driver to refill the queue even on a loaded machine
    prompts = [[rng.randrange(4, 200) for _ in range(200)] for _ in range(8 * MAX_NUM_SEQS)]
    engine = gen.llm.llm_engine
    steps: list[int] = []
    step = engine.step

    def counting_step():
        outs = step()
        done = sum(1 for o in outs if o.finished)
        if done:
            steps.append(done)
        return outs

    monkeypatch.setattr(engine, "step", counting_step)
    assert sorted(k for k, _ in gen.stream(iter(prompts))) == list(range(len(prompts)))
    # the first step may start before all first prompts have arrived
    assert sum(steps) == len(prompts)
    assert len(steps) <= len(prompts) // MAX_NUM_SEQS + 2, steps


def test_stream_stopped_early_or_fed_a_bad_prompt_leaves_the_generator_sound(gen, llama):
    prompts = mixed_prompts(12, 300, seed=10)
    it = gen.stream(iter(prompts), max_in_flight=4)
    first = [next(it), next(it)]
    it.close()  # the consumer stops: in-flight requests are aborted, arenas given back
    assert _shm_names() == []
    assert all(len(s["hidden_states"]) == len(LAYERS) for _k, s in first)
    bad = prompts[:3] + [[5, "x"]] + prompts[3:5]
    with pytest.raises(ValueError, match="prompt 3: token ids must be ints"):
        for _ in gen.stream(iter(bad), max_in_flight=2):
            pass
    assert _shm_names() == []
    _check(gen.generate(prompts[:4]), llama, prompts[:4], LAYERS, F32_TOL)


def test_idle_sleep_only_where_vllm_spins_idle_workers(vllm_minor):
    """The generator asks a multi-worker CPU engine's workers to sleep when
    idle only where vLLM defines VLLM_SLEEP_WHEN_IDLE: 0.11-0.17 spin them on
    sched_yield() otherwise; 0.19+ wait on a socket and warn about unknown
    VLLM_ variables (the PP 2 tests check the workers' environment)."""
    from eagle3_compat.generator import _knows_env

    assert _knows_env("VLLM_SLEEP_WHEN_IDLE") is (vllm_minor <= (0, 17))
    assert _knows_env("VLLM_NO_SUCH_VARIABLE") is False
