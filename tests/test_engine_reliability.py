"""Bad input, failures and cleanup, on the real engine."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import GEN_LAYERS
from prompts import mixed_prompts

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("applied_f32")]


LAYERS = GEN_LAYERS  # the session's shared generator (conftest)


def engine_children():
    """Live descendants of this process, except multiprocessing's resource
    tracker (one per driver process, started on first use, lives until exit)."""
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


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama")


@pytest.fixture(scope="module")
def gen(llama_gen):
    return llama_gen


def check_correct(gen, model, prompts):
    from eagle3_compat.testing import compare, hf_layer_outputs

    results = gen.generate(prompts)
    compare(results, hf_layer_outputs(model, prompts, LAYERS), prompts, LAYERS, 1e-4)


BAD_INPUTS = [
    ([], "cannot be empty"),
    ([[5, 6], []], "prompt 1 is empty"),
    ([[5, 6.0]], "prompt 0: token ids must be ints"),
    ([[5, -1]], "prompt 0: negative token id -1"),
    ([[5], [7, 512]], "prompt 1: token id 512 is not below the vocabulary size 512"),
    ([[[5, 6]]], "prompt 0: token ids must be ints"),
    ([5, 6], "prompt 0: expected a list of token ids"),
    ("5 6", "must be a list of token-id lists"),
    ([[True, 5]], "prompt 0: token ids must be ints"),
]


@pytest.mark.parametrize(("bad", "match"), BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_generate_input_is_a_clear_value_error(gen, bad, match):
    with pytest.raises(ValueError, match=match):
        gen.generate(bad)


def test_bad_tensor_input(gen):
    import torch

    with pytest.raises(ValueError, match="2-D"):
        gen.generate(torch.tensor([5, 6, 7]))
    with pytest.raises(ValueError, match="integers"):
        gen.generate(torch.tensor([[5.0, 6.0]]))
    with pytest.raises(ValueError, match="prompt 1: expected a 1-D integer tensor"):
        gen.generate([torch.tensor([5]), torch.tensor([[5]])])


def test_generator_still_correct_after_bad_inputs(gen, model):
    for bad, _ in BAD_INPUTS:
        with pytest.raises(ValueError):
            gen.generate(bad)
    check_correct(gen, model, mixed_prompts(5, 200, seed=21))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"layer_ids": [0, 6]}, "out of bounds"),
        ({"layer_ids": [-1]}, "out of bounds"),
        ({"layer_ids": [2, 2]}, "repeats"),
        ({"layer_ids": []}, "empty"),
        ({"layer_ids": [1], "tensor_parallel_size": 64}, "tensor_parallel_size=64"),
        ({"layer_ids": [1], "tensor_parallel_size": 0}, "positive int"),
    ],
)
def test_bad_constructor_input(model, kwargs, match):
    from speculators.data_generation import VllmHiddenStatesGenerator

    before = len(engine_children())
    with pytest.raises(ValueError, match=match):
        VllmHiddenStatesGenerator(str(model), **kwargs)
    assert len(engine_children()) == before


def test_missing_model_and_unverified_architecture(tmp_path, model):
    from speculators.data_generation import VllmHiddenStatesGenerator

    with pytest.raises(ValueError, match="does not exist"):
        VllmHiddenStatesGenerator(str(tmp_path / "nope"), layer_ids=[0])
    other = tmp_path / "bert"
    other.mkdir()
    for f in os.listdir(model):
        if f != "config.json":
            (other / f).write_bytes((model / f).read_bytes())
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["LlamaForSequenceClassification"]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="has not verified.*LlamaForSequenceClassification"):
        VllmHiddenStatesGenerator(str(other), layer_ids=[0])


def shm_names():
    """This process's (the driver's) arena names in /dev/shm: none may outlive a
    call.  Other drivers (tox envs run side by side) have names of their own."""
    from eagle3_compat.arena import PREFIX, SHM_DIR

    mine = f"{PREFIX}{os.getpid()}-"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(mine))


@pytest.mark.lifecycle
@pytest.mark.usefixtures("reap_semaphores")  # SIGKILLs processes: their semaphores stay
def test_killed_engine_is_a_clear_error_and_leaves_no_processes(model, gen):
    from speculators.data_generation import VllmHiddenStatesGenerator

    keep = {p.pid for p in engine_children()}
    g = VllmHiddenStatesGenerator(str(model), layer_ids=[0], max_model_len=128)
    mine = [p for p in engine_children() if p.pid not in keep]
    assert mine
    for p in mine:
        os.kill(p.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="died|dead|Dead"):  # noqa: PT011
        g.generate(mixed_prompts(3, 100, seed=22))
    assert time.monotonic() - t0 < 60
    deadline = time.monotonic() + 30
    while [p for p in engine_children() if p.pid not in keep] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in engine_children() if p.pid not in keep], "orphan engine processes"
    assert shm_names() == []  # the arena made for the failed call is gone
    with pytest.raises(RuntimeError, match="closed"):
        g.generate([[5]])
    g.close()  # harmless
    # the module's generator is untouched and still right
    check_correct(gen, model, [[5, 6, 7, 8]])


@pytest.mark.lifecycle
def test_keyboard_interrupt_then_close_twice_leaves_no_engine_processes(model, gen, monkeypatch):
    """Ctrl-C inside generate() (here while the worker maps the prompts' arena,
    the one moment its name exists in /dev/shm) removes the arena and shuts
    the engine down by itself; the context
    manager's exit, close() and __del__ after that are harmless, and the
    generator says it is closed."""
    from speculators.data_generation import VllmHiddenStatesGenerator

    keep = {p.pid for p in engine_children()}

    with VllmHiddenStatesGenerator(str(model), layer_ids=[0], max_model_len=128) as g:
        assert g.generate([[5, 6, 7]])[0]["hidden_states"][0].shape == (3, 256)
        assert [p for p in engine_children() if p.pid not in keep]
        import eagle3_compat.generator as driver

        rpc = driver._rpc

        def interrupted_in_arm(self, method, *args):
            if method == "e3c_add":  # the arena's name exists until the worker has mapped it
                assert shm_names(), "the arena should exist during the e3c_add RPC"
                raise KeyboardInterrupt
            return rpc(self, method, *args)

        with monkeypatch.context() as m:
            m.setattr(driver, "_rpc", interrupted_in_arm)
            with pytest.raises(KeyboardInterrupt):
                # longer than the first call: a new file (the first call's, released, is
                # kept mapped for reuse and has no name any more)
                g.generate([[5, 6, 7] * 33])
        assert shm_names() == []
        assert g._e3c_closed  # Ctrl-C closed the engine
        with pytest.raises(RuntimeError, match="closed"):
            g.generate([[5]])
        deadline = time.monotonic() + 30
        while [p for p in engine_children() if p.pid not in keep] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in engine_children() if p.pid not in keep]  # before the with block ends
    g.close()
    g.__del__()
    with pytest.raises(RuntimeError, match="closed"):
        g.generate([[5]])


def test_non_finite_states_are_reported(tmp_path, tiny_models):
    import torch
    from safetensors.torch import load_file, save_file
    from speculators.data_generation import VllmHiddenStatesGenerator

    from eagle3_compat.capture import CaptureError

    src = tiny_models("llama")
    bad = tmp_path / "nan-llama"
    bad.mkdir()
    for f in os.listdir(src):
        (bad / f).write_bytes((src / f).read_bytes())
    weights = load_file(bad / "model.safetensors")
    weights["model.layers.3.mlp.down_proj.weight"][:] = float("nan")
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    keep = {p.pid for p in engine_children()}
    with VllmHiddenStatesGenerator(str(bad), layer_ids=[2, 3], max_model_len=128) as g:
        with pytest.raises(CaptureError, match="prompt 0, layer 3: non-finite"):
            g.generate([[5, 6, 7], [8, 9]])
        assert [p for p in engine_children() if p.pid not in keep]  # still running
    # the context manager's exit shut the engine down
    deadline = time.monotonic() + 30
    while [p for p in engine_children() if p.pid not in keep] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in engine_children() if p.pid not in keep]
    del torch


prompt_st = st.lists(st.integers(4, 399), min_size=1, max_size=120)
bad_prompt_st = st.one_of(
    st.just([]),
    st.lists(st.integers(-5, -1), min_size=1, max_size=3),
    st.lists(st.integers(512, 10**6), min_size=1, max_size=3),
    st.lists(st.floats(allow_nan=False), min_size=1, max_size=3),
)


@settings(max_examples=12, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.one_of(prompt_st, bad_prompt_st), min_size=1, max_size=6))
def test_fuzz_generate_valid_or_value_error(gen, model, prompts):
    def is_valid(p):
        return bool(p) and all(isinstance(t, int) and 0 <= t < 512 for t in p)

    if all(is_valid(p) for p in prompts):
        check_correct(gen, model, prompts)
    else:
        first_bad = next(i for i, p in enumerate(prompts) if not is_valid(p))
        with pytest.raises(ValueError, match=f"prompt {first_bad}"):
            gen.generate(prompts)
    # and the engine is still right afterwards
    check_correct(gen, model, [[7, 8, 9]])


@pytest.mark.extended
@pytest.mark.parallel
@pytest.mark.parametrize("victim", ["worker rank 1", "worker rank 0"])
@pytest.mark.usefixtures("reap_semaphores")  # SIGKILLs processes: their semaphores stay
def test_killed_tensor_parallel_worker_is_a_clear_error(model, monkeypatch, victim):
    """TP 2: correct against HF float32 (35 prompts, several engine steps,
    rows split across both ranks' batches), then one worker process (a child
    of the engine core) dies mid-run."""
    import psutil
    from speculators.data_generation import VllmHiddenStatesGenerator

    from eagle3_compat.generator import EngineDiedError
    from eagle3_compat.testing import compare, hf_layer_outputs

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    keep = {p.pid for p in engine_children()}
    layers = [1, 5] if victim.endswith("1") else [0, 4]
    g = VllmHiddenStatesGenerator(str(model), layer_ids=layers, max_model_len=512, tensor_parallel_size=2)
    if victim.endswith("1"):
        prompts = mixed_prompts(35, 500, seed=7)
        compare(g.generate(prompts), hf_layer_outputs(model, prompts, layers), prompts, layers, 1e-4)
    else:
        assert g.generate([[5, 6, 7]])[0]["hidden_states"][1].shape == (3, 256)
    mine = [p for p in engine_children() if p.pid not in keep]
    workers = sorted((p for p in mine if p.ppid() != os.getpid()), key=lambda p: p.pid)
    assert len(workers) >= 2, [(p.pid, p.name(), p.ppid()) for p in mine]
    target = workers[-1] if victim.endswith("1") else workers[0]
    target.send_signal(signal.SIGKILL)
    psutil.wait_procs([target], timeout=10)
    t0 = time.monotonic()
    with pytest.raises(EngineDiedError, match="died|dead"):
        for _ in range(3):  # the death may land between calls or inside one
            g.generate(mixed_prompts(3, 100, seed=23))
    assert time.monotonic() - t0 < 90
    deadline = time.monotonic() + 60
    while [p for p in engine_children() if p.pid not in keep] and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [(p.pid, p.cmdline()[-3:]) for p in engine_children() if p.pid not in keep]
    assert not left, f"orphan engine processes {left}"
    assert shm_names() == []
    with pytest.raises(RuntimeError, match="closed"):
        g.generate([[5]])
