"""Property tests of the capture core (pure logic, no engine)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from eagle3_compat import capture
from eagle3_compat.capture import (
    CaptureError,
    StepLayout,
    StepSlicer,
    assemble,
    make_request_id,
    parse_request_id,
)

torch = pytest.importorskip("torch")
from eagle3_compat.wire import pack, unpack  # noqa: E402

HIDDEN = 3


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.one_of(st.integers(1, 64), st.integers(1, 3000)), min_size=n, max_size=n))
    layer_ids = draw(st.lists(st.integers(0, 60), min_size=1, max_size=4, unique=True))
    budget = draw(st.one_of(st.integers(1, 400), st.integers(400, 8192)))
    max_seqs = draw(st.integers(1, 5))
    pad = draw(st.integers(0, 7))
    decode_rows = draw(st.booleans())
    foreign = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    call = draw(st.integers(0, 5))
    return lengths, layer_ids, budget, max_seqs, pad, decode_rows, foreign, seed, call


def simulate(lengths, layer_ids, budget, max_seqs, pad, decode_rows, foreign, seed, call, core=None):
    """A toy scheduler: chunked prefill under a token budget, shuffled batch order,
    padding rows, optional decode rows and rows of another call's requests."""
    core = core or capture
    rng = random.Random(seed)
    done = [0] * len(lengths)
    slicer = core.StepSlicer(call=call)
    while any(d < n for d, n in zip(done, lengths)):
        running = [i for i, (d, n) in enumerate(zip(done, lengths)) if d < n][:max_seqs]
        left = budget
        sched = []
        for i in running:
            if left == 0:
                break
            k = min(lengths[i] - done[i], left)
            sched.append((make_request_id(call, i), i, done[i], k))
            left -= k
        if decode_rows and sched:
            rid, i, start, k = sched[0]
            if start + k == lengths[i]:
                sched[0] = (rid, i, start, k + 1)  # an extra token past the prompt
        if foreign:
            sched.append((make_request_id(call + 1, 0) + "-deadbeef", -1, 0, 2))
        rng.shuffle(sched)
        rows_pos, rows_tok, rows_val = [], [], []
        for rid, i, start, k in sched:
            for p in range(start, start + k):
                rows_pos.append(p)
                rows_tok.append(1000 * i + p if i >= 0 else -1)
                rows_val.append(i)
        total = len(rows_pos)
        rows_pos += [0] * pad
        rows_tok += [0] * pad
        rows_val += [-7] * pad
        vals = torch.tensor(rows_val, dtype=torch.float32)
        poss = torch.tensor(rows_pos, dtype=torch.float32)
        layers = [torch.stack([vals, poss, torch.full_like(vals, L)], 1) for L in layer_ids]
        layout = core.StepLayout(tuple(s[0] for s in sched), tuple(s[3] for s in sched))
        assert layout.total == total
        slicer.slice_step(layout, layers, rows_pos, rows_tok)
        for rid, i, start, k in sched:
            if i >= 0:
                done[i] = min(lengths[i], start + k)
    prompts = [[1000 * i + p for p in range(n)] for i, n in enumerate(lengths)]
    return prompts, slicer


def check_reassembly(sc, core=None):
    core = core or capture
    lengths, layer_ids, *_ = sc
    prompts, slicer = simulate(*sc, core=core)
    chunks = unpack(pack(slicer.chunks, len(layer_ids)))  # as the RPC carries them
    out = core.assemble(prompts, chunks, layer_ids, cat=lambda x: torch.cat(x, 0),
                        check_finite=lambda t: bool(torch.isfinite(t).all()))
    assert len(out) == len(prompts)
    for i, per_layer in enumerate(out):
        assert len(per_layer) == len(layer_ids)
        for j, t in enumerate(per_layer):
            assert t.dtype == torch.float32
            pos = torch.arange(lengths[i], dtype=torch.float32)
            expect = torch.stack([torch.full_like(pos, i), pos, torch.full_like(pos, layer_ids[j])], 1)
            assert torch.equal(t, expect), (i, layer_ids[j])


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_reassembly_is_exact(sc):
    check_reassembly(sc)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**6), st.sampled_from(["", "-0a1b2c3d", "-x"]))
def test_request_ids_round_trip(call, index, suffix):
    assert parse_request_id(make_request_id(call, index) + suffix) == (call, index)


def test_foreign_ids_are_not_ours():
    assert parse_request_id("0") is None
    assert parse_request_id("e3c:1:2") == (1, 2)
    assert parse_request_id("e3c:1:23") != (1, 2)


def _one_prompt_slicer(rows, positions, token_ids, call=0):
    s = StepSlicer(call=call)
    layers = [torch.arange(len(positions), dtype=torch.float32)[:, None]]
    s.slice_step(StepLayout((make_request_id(call, 0),), (rows,)), layers, positions, token_ids)
    return s


def test_missing_row_is_an_error():
    s = _one_prompt_slicer(3, [0, 1, 3], [10, 11, 13])
    with pytest.raises(CaptureError, match="prompt 0"):
        assemble([[10, 11, 12, 13]], s.chunks, [0], cat=lambda x: torch.cat(x, 0))


def test_wrong_tokens_are_an_error():
    s = _one_prompt_slicer(3, [0, 1, 2], [10, 99, 12])
    with pytest.raises(CaptureError, match="token ids"):
        assemble([[10, 11, 12]], s.chunks, [0], cat=lambda x: torch.cat(x, 0))


def test_incomplete_prompt_is_an_error():
    s = _one_prompt_slicer(2, [0, 1], [10, 11])
    with pytest.raises(CaptureError, match="2 of 3"):
        assemble([[10, 11, 12]], s.chunks, [0], cat=lambda x: torch.cat(x, 0))


def test_stale_call_rows_never_reach_results():
    s = _one_prompt_slicer(3, [0, 1, 2], [10, 11, 12], call=0)
    s2 = StepSlicer(call=1)
    s2.slice_step(StepLayout((make_request_id(0, 0),), (3,)), [torch.zeros(3, 1)], [0, 1, 2], [10, 11, 12])
    assert s2.chunks == {} and s2.foreign_rows == 3
    assert s.chunks


def test_non_finite_is_reported_with_prompt_and_layer():
    s = StepSlicer(call=0)
    layers = [torch.tensor([[0.0], [float("nan")]])]
    s.slice_step(StepLayout((make_request_id(0, 0),), (2,)), layers, [0, 1], [5, 6])
    with pytest.raises(CaptureError, match="prompt 0, layer 7: non-finite"):
        assemble([[5, 6]], s.chunks, [7], cat=lambda x: torch.cat(x, 0),
                 check_finite=lambda t: bool(torch.isfinite(t).all()))


def test_layout_must_cover_rows():
    s = StepSlicer(call=0)
    with pytest.raises(CaptureError):
        s.slice_step(StepLayout((make_request_id(0, 0),), (5,)), [torch.zeros(3, 1)], [0, 1, 2], None)


@settings(max_examples=60, deadline=None)
@given(scenarios(), st.booleans(), st.integers(0, 3))
def test_both_reply_conventions_give_the_same_result(sc, bare, other_ranks):
    """A list of per-rank replies and a bare rank-0 reply reassemble identically."""
    lengths, layer_ids, *_ = sc
    prompts, slicer = simulate(*sc)
    wire = pack(slicer.chunks, len(layer_ids))
    reply = wire if bare else [wire] + [None] * other_ranks
    out = capture.assemble(prompts, unpack(capture.rank0_reply(reply)), layer_ids,
                           cat=lambda x: torch.cat(x, 0))
    assert [len(p) for p in out] == [len(layer_ids)] * len(prompts)
    assert [t.shape[0] for per in out for t in per] == [n for n in lengths for _ in layer_ids]


def test_reply_that_is_not_a_capture_is_refused():
    with pytest.raises(CaptureError, match="expected its capture"):
        capture.rank0_reply([torch.zeros(3)])  # the 0.3.0 "[0] of a bare reply" mistake
    with pytest.raises(CaptureError, match="more than one"):
        capture.rank0_reply([{"meta": []}, {"meta": []}])


class SlicerMachine(RuleBasedStateMachine):
    """Sequences of calls on one worker: arm, steps (with stale requests of
    earlier calls mixed in), fetch.  Every step's rows are consumed exactly
    once, by the call that was armed, and nothing survives a fetch."""

    def __init__(self):
        super().__init__()
        self.call = -1
        self.slicer = None
        self.expected: dict[int, int] = {}

    @rule()
    def arm(self):
        self.call += 1
        self.slicer = StepSlicer(call=self.call)
        self.expected = {}

    @precondition(lambda self: self.slicer is not None)
    @rule(counts=st.lists(st.integers(0, 5), min_size=1, max_size=4), stale=st.integers(0, 3),
          pad=st.integers(0, 3))
    def step(self, counts, stale, pad):
        req_ids = [make_request_id(self.call, i) for i in range(len(counts))]
        nums = list(counts)
        if stale and self.call > 0:
            req_ids.append(make_request_id(self.call - 1, 0) + "-abcd1234")
            nums.append(stale)
        total = sum(nums)
        positions, tokens = [], []
        for i, n in enumerate(nums):
            start = self.expected.get(i, 0) if i < len(counts) else 0
            positions += list(range(start, start + n))
            tokens += [0] * n
        rows = torch.arange(total + pad, dtype=torch.float32)[:, None]
        before = self.slicer.steps
        self.slicer.slice_step(StepLayout(tuple(req_ids), tuple(nums)), [rows],
                               positions + [0] * pad, tokens + [0] * pad)
        assert self.slicer.steps == before + 1
        for i, n in enumerate(counts):
            self.expected[i] = self.expected.get(i, 0) + n

    @precondition(lambda self: self.slicer is not None)
    @rule()
    def fetch(self):
        got = {i: sum(len(c.positions) for c in cs) for i, cs in self.slicer.chunks.items()}
        assert got == {i: n for i, n in self.expected.items() if n}
        for cs in self.slicer.chunks.values():
            assert [c.positions for c in cs] == sorted((c.positions for c in cs), key=lambda p: p[0])
        self.slicer = None  # handed over: a later step cannot add to it

    @invariant()
    def no_foreign_rows_kept(self):
        if self.slicer is not None:
            assert set(self.slicer.chunks) <= set(self.expected)


TestSlicerMachine = SlicerMachine.TestCase
TestSlicerMachine.settings = settings(max_examples=60, stateful_step_count=20, deadline=None)
