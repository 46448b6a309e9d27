"""Reference (2), vLLM's own forward, is independent of the capture under test.

:class:`eagle3_compat.testing.VllmReference` stops the model's own forward
after layer ``k`` (``end_layer``) and reads the state its final norm would
have normalised; it shares no code with ``eagle3_compat.worker``.  Here:

* on toy modules shaped like vLLM's base models (torch only, no engine):
  the truncation returns layer ``k``'s output, restores the model, and fails
  loudly where a model does not follow that shape; the worker's record is
  read strictly; the worker functions travel by value (a worker importing
  another version of the module from disk cannot run instead);
* on the real engine (one reference engine start): the reference agrees with
  Hugging Face float32 (the other, independent reference) at 1e-4, the engine
  worker never imports ``eagle3_compat.worker`` (nor ``eagle3_compat.testing``:
  the reference's functions came by value), and breaking the capture's
  ``_layer_output`` (only ``hidden``, no residual) there and here leaves the
  reference's values unchanged, while the previous hook-based design, fed
  the same broken helper, moves.
"""

from __future__ import annotations

import pytest

from prompts import mixed_prompts

torch = pytest.importorskip("torch")


# --- toy models shaped like vLLM's base models (islice over end_layer, fused-add norm)


class _Norm(torch.nn.Module):
    """vLLM's RMSNorm contract: norm(x) -> normed; norm(x, r) -> (normed(x + r), x + r)."""

    def forward(self, x, residual=None):
        s = x if residual is None else x + residual
        normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
        return normed if residual is None else (normed, s)


class _PairLayer(torch.nn.Module):
    def __init__(self, i):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        torch.nn.init.normal_(self.lin.weight, 0.0, 0.5 + 0.1 * i)

    def forward(self, positions, hidden, residual):
        # like vLLM's decoder layers: the residual add fused into the next norm
        residual = hidden if residual is None else hidden + residual
        return torch.tanh(self.lin(residual)), residual


class _Base(torch.nn.Module):
    def __init__(self, n=4, respect_end_layer=True):
        super().__init__()
        self.layers = torch.nn.ModuleList(_PairLayer(i) for i in range(n))
        self.start_layer, self.end_layer = 0, n
        self.norm = _Norm()
        self.respect_end_layer = respect_end_layer

    def forward(self, x):
        from itertools import islice

        hidden, residual = x, None
        end = self.end_layer if self.respect_end_layer else len(self.layers)
        for layer in islice(self.layers, self.start_layer, end):
            hidden, residual = layer(None, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class _Top(torch.nn.Module):
    def __init__(self, base):
        super().__init__()
        self.model = base

    def forward(self, x):
        return self.model(x)


def _expected(base, x, k):
    hidden, residual = x, None
    for layer in list(base.layers)[: k + 1]:
        hidden, residual = layer(None, hidden, residual)
    return hidden + residual


def test_truncated_forward_is_layer_output_and_restored():
    from eagle3_compat.testing import _ref_load, _ref_restore, _ref_rows, _ref_truncate

    torch.manual_seed(0)
    top = _Top(_Base())
    x = torch.randn(5, 8)
    with torch.no_grad():
        full = top(x)
        for k in range(4):
            _ref_truncate(top, k)
            top(x)
            (rows,) = _ref_rows(_ref_load(_ref_restore(top)), [[0] * 5], k)
            assert torch.allclose(rows, _expected(top.model, x, k), atol=1e-6), k
        # restored: the same full forward as before, the original norm back
        assert torch.equal(top(x), full)
    assert isinstance(top.model.norm, _Norm) and top.model.end_layer == 4
    assert all(isinstance(m, _PairLayer) for m in top.model.layers)
    assert not top._forward_hooks


def test_fails_loudly_where_the_model_is_not_shaped_as_expected():
    from eagle3_compat.testing import _ref_load, _ref_restore, _ref_rows, _ref_truncate

    x = torch.randn(3, 8)
    # a forward that ignores end_layer would silently return the last layer
    top = _Top(_Base(respect_end_layer=False))
    _ref_truncate(top, 1)
    with pytest.raises(RuntimeError, match="does not stop at end_layer"):
        top(x)
    _ref_restore(top)

    # something after the final norm: the returned tensor is not the pre-norm state
    class After(_Top):
        def forward(self, x):
            return self.model(x) * 2

    top = After(_Base())
    _ref_truncate(top, 0)
    top(x)
    with pytest.raises(RuntimeError, match="not what its final norm returned"):
        _ref_rows(_ref_load(_ref_restore(top)), [[0] * 3], 0)

    # no end_layer / no base model at all
    base = _Base()
    del base.end_layer
    with pytest.raises(RuntimeError, match="expected exactly one module"):
        _ref_truncate(_Top(base), 0)
    with pytest.raises(ValueError, match="out of range"):
        _ref_truncate(_Top(_Base()), 4)


def test_worker_records_are_read_strictly():
    """What comes back from the worker is checked for what it is before it is
    counted: the raw bytes, another reply shape or another record format are
    errors naming it (once seen: the bytes counted as 618653 "forwards")."""
    import io

    from eagle3_compat.testing import _ref_load, _ref_reply, _ref_restore, _ref_rows, _ref_truncate

    top = _Top(_Base())
    _ref_truncate(top, 1)
    top(torch.randn(3, 8))
    blob = _ref_restore(top)
    assert len(_ref_rows(_ref_load(_ref_reply([blob])), [[0] * 3], 1)) == 1
    with pytest.raises(RuntimeError, match="not the list _ref_load returns"):
        _ref_rows(blob, [[0] * 3], 1)
    with pytest.raises(RuntimeError, match="not the bytes"):
        _ref_load([[True, torch.zeros(3, 8), "Tensor"]])
    for other in ([torch.zeros(3, 8)], {"outputs": []}, [[1, None, "Tensor"]]):
        buf = io.BytesIO()
        torch.save(other, buf)
        with pytest.raises(RuntimeError, match="not a list of"):
            _ref_load(buf.getvalue())
    for reply in (blob, [], [blob, blob]):
        with pytest.raises(RuntimeError, match="apply_model replied"):
            _ref_reply(reply)


# vLLM 0.25+'s engine core pickles apply_model/collective_rpc functions again
# for its workers with plain pickle (by reference): this module's functions
# travel by reference there (0.25, 0.32) (eagle3_compat.testing._shipped_by_value), and a
# local function cannot travel at all.  The reference itself (vLLM's own
# forward, truncated) is still used there by test_matches_vllm_own_forward
# and the DeepseekV3 tests.
def _by_value_releases_only():
    from eagle3_compat.testing import _by_reference

    if _by_reference():
        pytest.skip("vLLM 0.25+ re-pickles functions by reference in its engine core")


def test_worker_functions_travel_by_value(monkeypatch):
    """The engine worker unpickles what apply_model sends long after the
    driver imported eagle3_compat.testing.  Shipped by reference, it would
    run whatever version of the module it imports then; shipped by value
    (as VllmReference does), it runs the driver's.  Here the "worker's"
    module is swapped for a stale one between encoding and decoding, which
    go through vLLM's own message encoder (cloudpickle for plain functions,
    plain pickle, i.e. by reference, for any other callable)."""
    _by_value_releases_only()
    import contextlib
    import functools

    import cloudpickle
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    import eagle3_compat.testing as t

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

    def stale(*_a, **_kw):
        raise AssertionError("ran the worker's own (stale) copy of eagle3_compat.testing")

    def ship(arm, by_value=True):
        with t._shipped_by_value() if by_value else contextlib.nullcontext():
            payload = [MsgpackEncoder().encode(f) for f in (arm, t._ref_restore)]
        with monkeypatch.context() as m:
            for name in ("_ref_truncate", "_ref_restore", "_ref_base_model"):
                m.setattr(t, name, stale)
            return [MsgpackDecoder().decode(p) for p in payload]

    torch.manual_seed(0)
    top, x = _Top(_Base()), torch.randn(5, 8)
    before = set(cloudpickle.list_registry_pickle_by_value())
    arm, collect = ship(t._truncate_at(2))
    assert set(cloudpickle.list_registry_pickle_by_value()) == before
    with torch.no_grad():
        arm(top)
        top(x)
        (rows,) = t._ref_rows(t._ref_load(collect(top)), [[0] * 5], 2)
        assert torch.allclose(rows, _expected(top.model, x, 2), atol=1e-6)
    # the controls: without the by-value registration, and a functools.partial
    # (plain pickle in vLLM's encoder), the stale copy is what runs
    for arm, by_value in ((t._truncate_at(2), False), (functools.partial(t._ref_truncate, k=2), True)):
        arm, _ = ship(arm, by_value)
        with pytest.raises(AssertionError, match="stale"):
            arm(top)


# --- the real engine


@pytest.mark.engine
def test_reference_matches_hf_and_ignores_the_capture_code(tiny_models, monkeypatch):
    _by_value_releases_only()
    import io

    import eagle3_compat.worker as capture_worker
    from eagle3_compat.testing import VllmReference, compare, hf_layer_outputs, max_rel_error

    model = tiny_models("llama")
    prompts = mixed_prompts(3, 120, seed=31)
    layers = [0, 2, 5]  # first, middle, last (pre-norm) of the 6-layer model
    hf = hf_layer_outputs(model, prompts, [0, 1, 2, 5])

    def as_results(states):
        return [{"input_ids": torch.tensor(p), "hidden_states": s} for p, s in zip(prompts, states)]

    def capture_module_loaded(_m):
        import sys

        return "eagle3_compat.worker" in sys.modules

    def testing_module_loaded(_m):  # the reference's functions came by value
        import sys

        return "eagle3_compat.testing" in sys.modules

    def break_layer_output(_m):  # in the engine worker: the brief's deliberate bug
        import eagle3_compat.worker as w

        w._layer_output = lambda out: ((out[0] if isinstance(out, tuple) else out), False)
        a, b = torch.ones(2), torch.full((2,), 2.0)
        return float(w._layer_output((a, b))[0].sum())  # 2.0 broken, 6.0 intact

    def old_design_arm(m):  # the previous reference: a hook on layer 2 through the helpers
        import eagle3_compat.worker as w

        _, decoder_layers = w._decoder_layers(m)
        got = []
        handle = decoder_layers[2].register_forward_hook(
            lambda _mod, _a, out: got.append(w._layer_output(out)[0].detach().to("cpu", copy=True))
        )
        m._t_old_design = (handle, got)

    def old_design_collect(m):
        import io

        handle, got = m._t_old_design
        handle.remove()
        del m._t_old_design
        buf = io.BytesIO()
        torch.save(got, buf)
        return buf.getvalue()

    from vllm import SamplingParams

    with VllmReference(model, max(map(len, prompts))) as ref:
        before = ref.layer_outputs(prompts, layers)
        # the independent references agree; and the check has teeth (layer off by one)
        worst = compare(as_results(before), [[s[0], s[2], s[3]] for s in hf], prompts, layers, 1e-4)
        print(f"vLLM reference vs HF float32: max relative error {worst:.2e}")
        with pytest.raises(AssertionError):
            compare(as_results(before), [[s[1], s[2], s[3]] for s in hf], prompts, layers, 1e-4)
        # no code of the capture ran in the engine worker
        assert ref.llm.apply_model(capture_module_loaded) == [False]
        assert ref.llm.apply_model(testing_module_loaded) == [False]

        # break the capture's helper where the reference runs, and here
        monkeypatch.setattr(capture_worker, "_layer_output",
                            lambda out: ((out[0] if isinstance(out, tuple) else out), False))
        assert ref.llm.apply_model(break_layer_output) == [2.0]
        after = ref.layer_outputs(prompts, layers)
        for b, a in zip(before, after):
            for x, y in zip(b, a):
                assert max_rel_error(y, x) <= 1e-6

        # the hook-based design would have followed the broken helper
        ref.llm.apply_model(old_design_arm)
        ref.llm.generate([{"prompt_token_ids": prompts[2]}], SamplingParams(max_tokens=1, temperature=0.0),
                         use_tqdm=False)
        (old,) = torch.load(io.BytesIO(ref.llm.apply_model(old_design_collect)[0]), weights_only=True)
        assert max_rel_error(old[: len(prompts[2])], before[2][1]) > 1e-2
