"""Property tests of the capture core and the arena (pure logic, no engine).

A toy scheduler (chunked prefill under a token budget, shuffled batch
order, padding rows, decode rows past the prompt, rows of another call's
requests) produces steps; the worker's own step code (``_Call`` and
``_Step`` of :mod:`eagle3_compat.worker`: the plan, the layer hook's
copies, the attribution and writes after the step, ``e3c_take``) handles
them on one or several tensor-parallel ranks, and the driver-side checks
and views give the results, which must equal the expected rows bit for
bit.  ``FAULTS`` then breaks one thing at a time in what the engine hands
over (a shifted position, a wrong token id, a repeated or unknown request,
a lost or replayed step, short tensors) and each must be refused with its
own error.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from eagle3_compat import arena as arena_mod
from eagle3_compat import capture
from eagle3_compat import worker as worker_mod
from eagle3_compat.capture import (
    CaptureError,
    StepLayout,
    StepSlicer,
    check_segments,
    make_request_id,
    parse_request_id,
)

torch = pytest.importorskip("torch")

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


def token(i: int, p: int) -> int:
    return 1000 * i + p


def schedule(lengths, budget, max_seqs, pad, decode_rows, foreign, seed, call):
    """Steps as the engine hands them over: (req_ids, counts, positions, token_ids, values)."""
    rng = random.Random(seed)
    done = [0] * len(lengths)
    steps = []
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
        pos, tok, val = [], [], []
        for _rid, i, start, k in sched:
            for p in range(start, start + k):
                pos.append(p)
                tok.append(token(i, p) if i >= 0 else -1)
                val.append(i)
        pos += [0] * pad
        tok += [0] * pad
        val += [-7] * pad
        steps.append(([s[0] for s in sched], [s[3] for s in sched], pos, tok, val))
        for _rid, i, start, k in sched:
            if i >= 0:
                done[i] = min(lengths[i], start + k)
    return steps


def rows_for(val, pos, layer_ids):
    vals = torch.tensor(val, dtype=torch.float32)
    pos = (list(pos) + [0] * len(val))[: len(val)]  # a fault may shorten one of them
    poss = torch.tensor(pos, dtype=torch.float32)
    return [torch.stack([vals, poss, torch.full_like(vals, L)], 1) for L in layer_ids]


def worker_for(core):
    """The worker module whose step code runs on top of ``core``: the real
    :mod:`eagle3_compat.worker` for the real core; for another core (a mutant,
    ``test_capture_mutants``) a copy of the worker's source that imports it,
    made once and kept on that module."""
    if core is capture:
        return worker_mod
    worker = getattr(core, "E3C_WORKER", None)
    if worker is None:
        worker = core.E3C_WORKER = load_worker(core)
    return worker


def load_worker(core, old=None, new=None):
    """A copy of :mod:`eagle3_compat.worker` importing ``core`` for its capture
    core, with ``old`` replaced by ``new`` in its source when given."""
    import inspect
    import sys
    import types

    src = inspect.getsource(worker_mod)
    assert src.count("from .capture import ") == 1
    src = src.replace("from .capture import ", f"from {core.__name__} import ")
    if old is not None:
        assert src.count(old) == 1, f"worker mutation {old!r} no longer matches"
        src = src.replace(old, new)
    mod = types.ModuleType(f"{core.__name__}_worker")
    mod.__package__ = "eagle3_compat"  # its other relative imports: the real modules
    sys.modules[mod.__name__] = mod
    exec(compile(src, mod.__name__, "exec"), mod.__dict__)  # noqa: S102
    return mod


def worker_rank(worker, call, rank, shards, layer_ids, direct):
    """A worker extension holding what ``e3c_setup`` would set on tensor-parallel
    rank ``rank`` of ``shards`` (CPU, float32, every layer slot on this stage),
    armed for ``call`` by its own ``e3c_arm``."""
    from eagle3_compat.offload import HostOffload

    ext = worker.CaptureWorkerExtension()
    ext.__dict__.update(
        _e3c_active=True, _e3c_capturing=rank == 0, _e3c_hooked=True, _e3c_tp_rank=rank, _e3c_tp_size=shards,
        _e3c_stage=0, _e3c_layer_ids=list(layer_ids), _e3c_slots=list(range(len(layer_ids))), _e3c_debug=False,
        _e3c_direct=direct, _e3c_offload=HostOffload("cpu"), _e3c_dtype="float32", _e3c_hidden=HIDDEN,
        _e3c_maps={}, _e3c_pinned={},
    )
    ext.e3c_arm(call, direct=direct, shards=[shards])
    return ext


def run_steps(steps, lengths, layer_ids, call, core=None, arena=None, direct=False, shards=1):
    """Every step through the worker's own code, then the driver's checks.

    Worker side, per tensor-parallel rank (``shards`` of them, each with its
    own ``_Call`` from ``e3c_arm``, sharing one arena as the ranks share the
    driver's file): a ``_Step`` per engine step, ``_Call.plan`` before the
    layers' rows arrive when ``direct`` (the model's forward pre-hook), each
    layer's rows through ``_Step.capture`` (the layer hook: straight to their
    planned places, or staged), the positions and token ids as the inputs hook
    stages them, then ``_Call.process`` (attribution, the plan's check, the
    staged rows' writes) and ``e3c_take`` for the replies.  Driver side:
    ``stage_replies`` (each share checked against rank 0's capture),
    ``merge_stage_captures``, ``check_segments`` and the payload's views.
    A capture error the worker reports is raised here as the driver raises it."""
    import copy

    from eagle3_compat.offload import HostOffload

    core = core or capture
    arena = arena or arena_mod
    worker = worker_for(core)
    layout = arena.layout_for(lengths, len(layer_ids), HIDDEN, "float32")
    sink = arena.LocalSink(layout, torch.float32, HIDDEN)
    ranks = [worker_rank(worker, call, r, shards, layer_ids, direct) for r in range(shards)]
    for r, ext in enumerate(ranks):
        # one arena for every rank (the driver's file, mapped by each)
        ext._e3c_call.add(0, [[i, n] for i, n in enumerate(lengths)], sink if r == 0 else copy.copy(sink),
                          "rpc", direct)
    slots = list(range(len(layer_ids)))
    stager = HostOffload("cpu")
    for req_ids, counts, pos, tok, val in steps:
        step_layout = core.StepLayout(tuple(req_ids), tuple(counts))
        layers = rows_for(val, pos, layer_ids)
        for r, ext in enumerate(ranks):
            state = ext._e3c_call
            step = worker._Step(step_layout.total, state)
            if direct:
                state.plan(step, step_layout)
            for slot, h in enumerate(layers):
                step.capture(ext._e3c_offload, slot, h, False, HIDDEN, torch.float32)
            step.positions = stager.submit("positions", torch.tensor(pos, dtype=torch.int64))
            if r == 0:
                step.token_ids = stager.submit("token_ids", torch.tensor(tok, dtype=torch.int64))
            state.process(step, step_layout, slots)
    replies = [ext.e3c_take(call, 0) for ext in ranks]
    merged = core.merge_stage_captures(core.stage_replies(replies), layer_ids)
    if merged["error"]:
        raise CaptureError(merged["error"])
    prompts = [[token(i, p) for p in range(n)] for i, n in enumerate(lengths)]
    core.check_segments(prompts, merged["segments"], layer_ids)
    return arena.tensors_from_payload(replies[0]["payload"], layout, "float32", HIDDEN)


def expected(i, n, layer_id):
    pos = torch.arange(n, dtype=torch.float32)
    return torch.stack([torch.full_like(pos, i), pos, torch.full_like(pos, layer_id)], 1)


def check_reassembly(sc, core=None, arena=None, direct=False, shards=1):
    lengths, layer_ids, budget, max_seqs, pad, decode_rows, foreign, seed, call = sc
    steps = schedule(lengths, budget, max_seqs, pad, decode_rows, foreign, seed, call)
    out = run_steps(steps, lengths, layer_ids, call, core=core, arena=arena, direct=direct, shards=shards)
    assert len(out) == len(lengths)
    for i, per_layer in enumerate(out):
        assert len(per_layer) == len(layer_ids)
        for j, t in enumerate(per_layer):
            assert torch.equal(t, expected(i, lengths[i], layer_ids[j])), (i, layer_ids[j])


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_reassembly_is_exact(sc):
    check_reassembly(sc)


# pure logic, the same on every release: in one env (the fixed cases below run in all)
@pytest.mark.once
@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_reassembly_is_exact_with_rows_copied_to_their_planned_places(sc):
    """The worker's direct path: runs planned before the step, rows copied there."""
    check_reassembly(sc, direct=True)


# -- one fault at a time ---------------------------------------------------------
# Each fault edits the steps of a valid schedule (of at least two prompts, so
# that a row can go to the wrong one) and names the error it must cause.


def _ours(step, call):
    """Indices of the step's runs that belong to the call's prompts."""
    return [k for k, r in enumerate(step[0]) if (parse_request_id(r) or (-1,))[0] == call]


def _run_bounds(step, k):
    start = sum(step[1][:k])
    return start, start + step[1][k]


def fault_shift_positions(steps, call, rng):
    step = rng.choice([s for s in steps if _ours(s, call)])
    lo, hi = _run_bounds(step, rng.choice(_ours(step, call)))
    for r in range(lo, hi):
        step[2][r] += 1


def fault_swap_positions(steps, call, rng):
    cands = [(s, k) for s in steps for k in _ours(s, call) if s[1][k] >= 2]
    step, k = rng.choice(cands)
    lo, _ = _run_bounds(step, k)
    step[2][lo], step[2][lo + 1] = step[2][lo + 1], step[2][lo]


def fault_wrong_token(steps, call, rng):
    step = rng.choice([s for s in steps if _ours(s, call)])
    lo, _ = _run_bounds(step, rng.choice(_ours(step, call)))
    step[3][lo] += 1


def fault_rows_to_other_prompt(steps, call, rng):
    step = rng.choice([s for s in steps if _ours(s, call)])
    k = rng.choice(_ours(step, call))
    _, index = parse_request_id(step[0][k])
    other = make_request_id(call, 1 - index if index < 2 else 0)
    if other in step[0]:
        j = step[0].index(other)
        step[0][k], step[0][j] = step[0][j], step[0][k]  # two runs' ids swapped
    else:
        step[0][k] = other


def fault_unknown_prompt(steps, call, rng):
    step = rng.choice([s for s in steps if _ours(s, call)])
    step[0][rng.choice(_ours(step, call))] = make_request_id(call, 99)


def fault_duplicate_request(steps, call, rng):
    step = rng.choice([s for s in steps if len(_ours(s, call)) >= 2])
    a, b = _ours(step, call)[:2]
    step[0][b] = step[0][a]


def fault_lost_step(steps, call, rng):
    steps.remove(rng.choice([s for s in steps if _ours(s, call)]))


def fault_replayed_step(steps, call, rng):
    step = rng.choice([s for s in steps if _ours(s, call)])
    steps.insert(steps.index(step) + 1, tuple(list(x) for x in step))


def fault_short_positions(steps, call, rng):
    step = rng.choice([s for s in steps if _ours(s, call)])
    total = sum(step[1])
    del step[2][total - 1:]


def fault_short_tokens(steps, call, rng):
    step = rng.choice([s for s in steps if _ours(s, call)])
    total = sum(step[1])
    del step[3][total - 1:]


def fault_short_layer(steps, call, rng):
    step = rng.choice([s for s in steps if _ours(s, call)])
    total = sum(step[1])
    del step[4][total - 1:]


FAULTS = {
    fault_shift_positions: r"where position \d+ was expected|not consecutive|captured \d+ of \d+ rows",
    fault_swap_positions: r"not consecutive",
    fault_wrong_token: r"token ids of captured rows .* differ from the prompt",
    fault_rows_to_other_prompt: r"differ from the prompt|where position \d+ was expected|"
                                r"captured \d+ of \d+ rows|do not fit a prompt",
    fault_unknown_prompt: r"names prompt 99",
    fault_duplicate_request: r"repeats a request id",
    fault_lost_step: r"where position \d+ was expected \(a missing|captured \d+ of \d+ rows",
    fault_replayed_step: r"where position \d+ was expected \(a repeated",
    fault_short_positions: r"positions for \d+ scheduled tokens",
    fault_short_tokens: r"token ids for \d+ scheduled tokens",
    fault_short_layer: r"captured \d+ rows but \d+ tokens were scheduled",
}


@st.composite
def faulty(draw):
    sc = draw(scenarios().filter(lambda s: len(s[0]) >= 2))
    return sc, draw(st.sampled_from(sorted(FAULTS, key=lambda f: f.__name__))), draw(st.integers(0, 2**16))


# On the direct path the rows are placed before the positions are read; a
# fault that moves rows is then refused by the plan's check, if not before.
PLAN_MISMATCH = r"|put them elsewhere"


def check_fault(case, core=None, arena=None, direct=False, shards=1):
    (lengths, layer_ids, budget, max_seqs, pad, decode_rows, foreign, seed, call), fault, fseed = case
    steps = schedule(lengths, budget, max_seqs, pad, decode_rows, foreign, seed, call)
    steps = [tuple(list(x) for x in s) for s in steps]
    try:
        fault(steps, call, random.Random(fseed))
    except (IndexError, ValueError):  # no step offers what the fault needs (rare)
        return False
    with pytest.raises(CaptureError, match=FAULTS[fault] + (PLAN_MISMATCH if direct else "")):
        run_steps(steps, lengths, layer_ids, call, core=core, arena=arena, direct=direct, shards=shards)
    return True


@settings(max_examples=300, deadline=None)
@given(faulty())
def test_every_single_fault_is_refused_by_name(case):
    check_fault(case)


# pure logic, the same on every release: in one env (the fixed cases below run in all)
@pytest.mark.once
@settings(max_examples=300, deadline=None)
@given(faulty())
def test_every_single_fault_is_refused_on_the_direct_path(case):
    check_fault(case, direct=True)


@pytest.mark.parametrize("direct", [False, True], ids=["staged", "direct"])
@pytest.mark.parametrize("fault", sorted(FAULTS, key=lambda f: f.__name__), ids=lambda f: f.__name__)
def test_each_fault_is_refused(fault, direct):
    """Every fault on one fixed schedule (two prompts, chunked, reordered)."""
    assert check_fault((([37, 20], [1, 4], 16, 2, 3, True, True, 7, 2), fault, 1), direct=direct)


def direct_examples(core=capture, arena=arena_mod):
    """The direct path on fixed cases; also run against every mutant."""
    # chunked, reordered, padded, decode rows and another call's rows: exact
    check_reassembly(([37, 20, 5], [1, 4], 16, 2, 3, True, True, 7, 2), core=core, arena=arena, direct=True)
    # Two chunks of one prompt handed over in the wrong order: by their
    # positions the staged path still puts every row in its place; the direct
    # path has already copied them where the plan said (each chunk after the
    # last), so only the plan's check stands between it and swapped rows.
    sc = ([40], [1, 4], 16, 1, 0, False, False, 3, 0)
    lengths, layer_ids, budget, max_seqs, pad, decode_rows, foreign, seed, call = sc
    steps = schedule(lengths, budget, max_seqs, pad, decode_rows, foreign, seed, call)
    steps[0], steps[1] = steps[1], steps[0]
    out = run_steps(steps, lengths, layer_ids, call, core=core, arena=arena)
    assert all(torch.equal(t, expected(0, 40, layer_ids[j])) for j, t in enumerate(out[0]))
    with pytest.raises(CaptureError, match="put them elsewhere"):
        run_steps(steps, lengths, layer_ids, call, core=core, arena=arena, direct=True)


# -- tensor-parallel ranks sharing the copies ------------------------------------


def _share_replies():
    primary = {"stage": 0, "slots": [0, 1], "transport": "shm", "steps": 2, "foreign_rows": 0,
               "segments": [[0, 0, 3, [1, 2, 3]], [1, 0, 2, [4, 5]]], "error": None, "dtype": "float32",
               "hidden_size": 8, "token_ids_checked": True, "shards": 2, "rows": 4}
    share = {"stage": 0, "shard": 1, "slots": [0, 1], "segments": [[0, 0, 3], [1, 0, 2]], "steps": 2,
             "rows": 6, "error": None}
    return primary, share


def shard_examples(core=capture, arena=arena_mod):
    """Shared copies on fixed cases, and every fault of a share refused; also
    run against every mutant."""
    for total in range(0, 23):
        for shards in range(1, 5):
            rows = [core.shard_rows(total, r, shards) for r in range(shards)]
            assert [i for lo, hi in rows for i in range(lo, hi)] == list(range(total)), (total, shards)
    with pytest.raises(ValueError, match="shard 2 of 2"):
        core.shard_rows(10, 2, 2)
    seg = capture.Segment(index=0, src=4, start=10, count=6, token_ids=None)
    assert core.clip_run(seg, 0, 4) is None and core.clip_run(seg, 10, 12) is None
    assert core.clip_run(seg, 6, 8) == (6, 12, 2) and core.clip_run(seg, 0, 100) == (4, 10, 6)
    # chunked, reordered, padded, decode rows, another call's rows: exact with 2 and 3 ranks
    sc = ([37, 20, 5], [1, 4], 16, 2, 3, True, True, 7, 2)
    check_reassembly(sc, core=core, arena=arena, shards=2)
    check_reassembly(sc, core=core, arena=arena, direct=True, shards=3)
    # the replies: a share is checked against rank 0's capture
    primary, share = _share_replies()
    (ok,) = core.stage_replies([dict(primary), dict(share)])
    assert ok["error"] is None and ok["segments"] == primary["segments"]

    def error(**change):
        p, h = _share_replies()
        h.update(change)
        (out,) = core.stage_replies([p, h])
        return out["error"]

    assert "wrote 9 rows x layers, the call's runs hold 10" in error(rows=5)
    assert "wrote 11 rows x layers" in error(rows=7)
    assert "rank 1 attributed the rows otherwise than rank 0" in error(segments=[[0, 0, 2], [0, 2, 1], [1, 0, 2]])
    assert "rank 1 attributed 3 steps, rank 0 2" in error(steps=3)
    assert error(error="boom") == "tensor-parallel rank 1: boom"
    p, _h = _share_replies()
    with pytest.raises(CaptureError, match=r"shared by 2 tensor-parallel ranks, but ranks \[\] sent"):
        core.stage_replies([p, None])
    with pytest.raises(CaptureError, match=r"shared by 2 tensor-parallel ranks, but ranks \[\] sent"):
        core.stage_replies(dict(p))  # a bare reply (unique_reply_rank) cannot hold the shares
    p, h = _share_replies()
    with pytest.raises(CaptureError, match="stage 1: tensor-parallel shares came without rank 0's capture"):
        core.stage_replies([p, dict(h, stage=1)])
    # rank 0 alone (shards 1): its rows must still be every run's rows
    p, _h = _share_replies()
    (out,) = core.stage_replies([dict(p, shards=1, rows=10), None])
    assert out["error"] is None
    (out,) = core.stage_replies([dict(p, shards=1, rows=4), None])
    assert "wrote 4 rows x layers, the call's runs hold 10" in out["error"]
    # a stream's exchange: each taken capture checked with its shares
    p, h = _share_replies()
    (out,) = core.stage_replies([{"taken": [p], "added": [], "stage": 0, "shards": 2},
                                 {"taken": [dict(h, rows=1)], "added": [], "stage": 0, "shard": 1}])
    assert "wrote 5 rows x layers" in out["taken"][0]["error"]


def test_tensor_parallel_shares_tile_each_step_and_are_checked():
    shard_examples()


# pure logic, the same on every release: in one env (the fixed cases above run in all)
@pytest.mark.once
@settings(max_examples=150, deadline=None)
@given(scenarios(), st.integers(1, 4), st.booleans())
def test_reassembly_is_exact_with_copies_shared_by_tensor_parallel_ranks(sc, shards, direct):
    check_reassembly(sc, direct=direct, shards=shards)


@pytest.mark.once
@settings(max_examples=150, deadline=None)
@given(faulty(), st.integers(2, 4), st.booleans())
def test_every_single_fault_is_refused_with_copies_shared(case, shards, direct):
    check_fault(case, direct=direct, shards=shards)


def test_a_plan_the_positions_contradict_is_refused_not_written_silently():
    direct_examples()


def test_plan_is_all_or_nothing_and_forgets_collected_prompts():
    mk = make_request_id
    s = StepSlicer(call=0, lengths={0: 5, 1: 3})
    plan = s.plan_step(StepLayout((mk(0, 1), "other", mk(0, 0)), (2, 4, 3)))
    assert [(g.index, g.src, g.start, g.count) for g in plan] == [(1, 0, 0, 2), (0, 6, 0, 3)]
    # the next chunk of each continues where its last ended; rows past the end are not attributed
    plan = s.plan_step(StepLayout((mk(0, 0), mk(0, 1)), (2, 3)))
    assert [(g.index, g.src, g.start, g.count) for g in plan] == [(0, 0, 3, 2), (1, 2, 2, 1)]
    with pytest.raises(CaptureError, match="names prompt 7"):
        s.plan_step(StepLayout((mk(0, 0), mk(0, 7)), (1, 1)))
    assert s.planned == {0: 5, 1: 3}  # unchanged by the refused plan
    s.forget(1)
    assert s.planned == {0: 5} and 1 not in s.lengths
    with pytest.raises(CaptureError, match="names prompt 1"):
        s.plan_step(StepLayout((mk(0, 1),), (1,)))


def stream_through_worker(ext, call, first, count, plen, per_step, layer_ids, direct):
    """Prompts ``first .. first+count-1`` of a stream through one worker's own
    code, as ``stream()`` drives it: each prompt its own group (``e3c_add``'s
    ``_Call.add``), steps of ``per_step`` whole prompts (planned when
    ``direct``, captured, attributed), then each group taken (``e3c_take``)
    and its rows checked."""
    import tracemalloc

    from eagle3_compat.offload import HostOffload

    stager = HostOffload("cpu")
    slots = list(range(len(layer_ids)))
    layout = arena_mod.layout_for([plen], len(layer_ids), HIDDEN, "float32")
    for k in range(first, first + count, per_step):
        batch = range(k, min(first + count, k + per_step))
        state = ext._e3c_call
        for i in batch:
            state.add(i, [[i, plen]], arena_mod.LocalSink(layout, torch.float32, HIDDEN), "rpc", direct)
        req_ids = [make_request_id(call, i) for i in batch]
        pos = [p for _ in batch for p in range(plen)]
        tok = [token(i, p) for i in batch for p in range(plen)]
        val = [i for i in batch for _ in range(plen)]
        step_layout = StepLayout(tuple(req_ids), tuple([plen] * len(batch)))
        step = worker_mod._Step(step_layout.total, state)
        if direct:
            state.plan(step, step_layout)
        for slot, h in enumerate(rows_for(val, pos, layer_ids)):
            step.capture(ext._e3c_offload, slot, h, False, HIDDEN, torch.float32)
        step.positions = stager.submit("positions", torch.tensor(pos, dtype=torch.int64))
        step.token_ids = stager.submit("token_ids", torch.tensor(tok, dtype=torch.int64))
        state.process(step, step_layout, slots)
        for i in batch:
            reply = ext.e3c_take(call, i)
            want = [[0, 0, plen, [token(i, p) for p in range(plen)]]]
            assert reply["error"] is None and reply["segments"] == want
            (rows,) = arena_mod.tensors_from_payload(reply["payload"], layout, "float32", HIDDEN)
            assert torch.equal(rows[-1], expected(i, plen, layer_ids[-1]))
    return tracemalloc.get_traced_memory()[0]


# pure logic, the same on every release: in one env
@pytest.mark.once
@pytest.mark.parametrize("direct", [False, True])
def test_a_stream_holds_only_its_prompts_in_flight(direct):
    """The worker keeps nothing of a prompt once it is taken: what a stream's
    state holds does not grow with the prompts done (issue #16: memory bounded
    by the requests in flight, independent of the dataset's length).  The
    slicer used to keep every run with its token ids for the whole stream:
    ~80 KB per 2048-token prompt on every rank; here ~3 KB per prompt."""
    import gc
    import os
    import tracemalloc

    import eagle3_compat

    ours = tracemalloc.Filter(True, os.path.join(os.path.dirname(eagle3_compat.__file__), "*"))

    def held() -> int:  # bytes allocated by the package's own code and not freed
        gc.collect()
        return sum(st.size for st in tracemalloc.take_snapshot().filter_traces([ours]).statistics("filename"))

    layer_ids, call, plen = [2, 5], 3, 64
    ext = worker_rank(worker_mod, call, 0, 1, layer_ids, direct)
    tracemalloc.start()
    try:
        stream_through_worker(ext, call, 0, 40, plen, 4, layer_ids, direct)  # warm: caches, free lists
        warm = held()
        stream_through_worker(ext, call, 40, 400, plen, 4, layer_ids, direct)
        grown = held() - warm
    finally:
        tracemalloc.stop()
    state = ext._e3c_call
    assert not state.groups and not state.owner and not state.slicer.lengths and not state.slicer.planned
    assert state.slicer.steps == 110 and state.error is None
    # 400 prompts of 64 tokens: a run kept per prompt would hold > 1 MB
    assert grown < 8 * 1024, f"the worker's stream state grew by {grown} bytes over 400 prompts"


def test_check_plan_names_the_misplaced_run():
    from eagle3_compat.capture import Segment, check_plan

    a = Segment(index=0, src=0, start=0, count=4, token_ids=None)
    check_plan(3, [a], [Segment(index=0, src=0, start=0, count=4, token_ids=(1, 2, 3, 4))])
    with pytest.raises(CaptureError, match=r"step 3: .*\(0, 0, 0, 4\), \(0, 0, 2, 4\)"):
        check_plan(3, [a], [Segment(index=0, src=0, start=2, count=4, token_ids=None)])
    with pytest.raises(CaptureError, match="put them elsewhere"):
        check_plan(0, [a], [])


# -- pieces ------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**6), st.sampled_from(["", "-0a1b2c3d", "-x"]))
def test_request_ids_round_trip(call, index, suffix):
    assert parse_request_id(make_request_id(call, index) + suffix) == (call, index)


def test_foreign_ids_are_not_ours():
    assert parse_request_id("0") is None
    assert parse_request_id("e3c:1:2") == (1, 2)
    assert parse_request_id("e3c:1:23") != (1, 2)


def core_examples(core=capture, arena=arena_mod):
    """Small cases, each for one check; also run against every mutant."""
    mk = core.make_request_id
    # rows of another call's request are counted, never attributed
    s = core.StepSlicer(call=1, lengths=[3])
    segs = s.slice_step(core.StepLayout((mk(0, 0) + "-ab",), (3,)), [0, 1, 2], [10, 11, 12], [3])
    assert segs == [] and s.foreign_rows == 3
    # a decode row past the prompt is not attributed
    s = core.StepSlicer(call=0, lengths=[3])
    (seg,) = s.slice_step(core.StepLayout((mk(0, 0),), (4,)), [0, 1, 2, 3], [5, 6, 7, 8], [4])
    assert (seg.index, seg.src, seg.start, seg.count, seg.token_ids) == (0, 0, 0, 3, (5, 6, 7))
    assert seg.to_wire() == [0, 0, 3, [5, 6, 7]]
    # inputs other than lists (a tuple, a range, ints of another type such as
    # numpy's) give the same run, with plain ints on the wire
    class Int(int):
        pass

    s = core.StepSlicer(call=0, lengths=[3])
    (seg,) = s.slice_step(core.StepLayout((mk(0, 0),), (4,)), range(4), tuple(map(Int, range(5, 9))), [4])
    assert seg.to_wire() == [0, 0, 3, [5, 6, 7]] and type(seg.token_ids[0]) is int
    # a run that starts mid-step, after another request's rows
    s = core.StepSlicer(call=0, lengths=[2, 4])
    segs = s.slice_step(core.StepLayout((mk(0, 1), mk(0, 0)), (2, 2)), [2, 3, 0, 1], [7, 8, 5, 6], [5])
    assert [(g.index, g.src, g.start, g.count) for g in segs] == [(1, 0, 2, 2), (0, 2, 0, 2)]
    # one request's rows out of order within a step are refused, not filed in
    # the order they came (the mutant that skipped this check was caught only
    # by the random faults, which missed it in one run of nine here)
    s = core.StepSlicer(call=0, lengths=[4])
    with pytest.raises(CaptureError, match=r"prompt 0: positions \[0, 2, 1, 3\] .* not consecutive"):
        s.slice_step(core.StepLayout((mk(0, 0),), (4,)), [0, 2, 1, 3], [5, 7, 6, 8], [4])
    # a step whose tensors or inputs hold fewer rows than it scheduled, and a
    # request naming a prompt the call does not have, are refused by name
    s = core.StepSlicer(call=0, lengths=[4])
    one = core.StepLayout((mk(0, 0),), (4,))
    with pytest.raises(CaptureError, match="layer slot 0 captured 3 rows but 4 tokens were scheduled"):
        s.slice_step(one, [0, 1, 2, 3], [5, 6, 7, 8], [3])
    with pytest.raises(CaptureError, match="3 positions for 4 scheduled tokens"):
        s.slice_step(one, [0, 1, 2], [5, 6, 7, 8], [4])
    with pytest.raises(CaptureError, match="3 token ids for 4 scheduled tokens"):
        s.slice_step(one, [0, 1, 2, 3], [5, 6, 7], [4])
    with pytest.raises(CaptureError, match="names prompt 1, which call 0 has not sent"):
        s.slice_step(core.StepLayout((mk(0, 1),), (2,)), [0, 1], [5, 6], [2])
    # without token ids the positions are still checked
    core.check_segments([[5, 6, 7]], [[0, 0, 3, None]], [1])
    with pytest.raises(CaptureError, match="captured 2 of 3"):
        core.check_segments([[5, 6, 7]], [[0, 0, 2, None]], [1])
    # errors name the prompt and the layers
    with pytest.raises(CaptureError, match=r"prompt 1, layers \[2, 9\]: token ids"):
        core.check_segments([[1], [2, 3]], [[0, 0, 1, [1]], [1, 0, 2, [2, 4]]], [2, 9])
    with pytest.raises(CaptureError, match="prompt index 5"):
        core.check_segments([[1]], [[5, 0, 1, [1]]], [0])
    with pytest.raises(CaptureError, match="a captured run of 0 rows"):
        core.check_segments([[1]], [[0, 0, 1, [1]], [0, 1, 0, []]], [0])
    with pytest.raises(CaptureError, match=r"start at position 1 where position 2 was expected \(a repeated"):
        core.check_segments([[1, 2]], [[0, 0, 2, [1, 2]], [0, 1, 1, [2]]], [0])
    with pytest.raises(CaptureError, match=r"where position 1 was expected \(a missing"):
        core.check_segments([[1, 2, 3]], [[0, 0, 1, [1]], [0, 2, 1, [3]]], [0])
    # the layout itself
    with pytest.raises(CaptureError, match="2 token counts"):
        core.StepLayout(("a",), (1, 2))
    with pytest.raises(CaptureError, match="negative"):
        core.StepLayout(("a",), (-1,))
    with pytest.raises(CaptureError, match="repeats a request id"):
        core.StepLayout(("a", "a"), (1, 1))
    pipeline_examples(core)


def test_core_examples():
    core_examples()


def test_both_reply_conventions_and_refusals():
    cap = {"segments": []}
    assert capture.rank0_reply(cap) is cap
    assert capture.rank0_reply([cap, None, None]) is cap
    with pytest.raises(CaptureError, match="expected its capture"):
        capture.rank0_reply([torch.zeros(3)])  # the 0.3.0 "[0] of a bare reply" mistake
    with pytest.raises(CaptureError, match="more than one"):
        capture.rank0_reply([{"segments": []}, {"segments": []}])
    with pytest.raises(CaptureError, match="unexpected"):
        capture.rank0_reply([])


def _stage_cap(stage, slots, segments, **kw):
    return {"stage": stage, "slots": slots, "segments": segments, "transport": "shm", "steps": 2,
            "foreign_rows": 0, "error": None, "token_ids_checked": True, "dtype": "float32",
            "hidden_size": 8, **kw}


def pipeline_examples(core=capture):
    """Pipeline-parallel replies: merged by layer, every fault refused with
    its own error (also run against every mutant)."""
    # TP 2 x PP 2: workers 0 and 2 (tensor rank 0 of stages 0 and 1) capture.
    layers = [5, 0, 2, 3]  # stage 0 runs 0..2, stage 1 runs 3..5
    segs = [[0, 0, 3, [4, 5, 6]], [1, 0, 1, [7]]]
    s0, s1 = _stage_cap(0, [1, 2], segs), _stage_cap(1, [0, 3], segs, steps=3)
    replies = core.stage_replies([s0, None, s1, None])
    assert replies == [s0, s1]
    assert core.stage_replies([None, None, s1, None]) == [s1]  # stage 0 holds no requested layer
    assert core.stage_replies([s1, None, s0, None]) == [s0, s1]  # keyed by the stage each names
    merged = core.merge_stage_captures(replies, layers)
    assert [(st["stage"], st["layers"]) for st in merged["stages"]] == [(0, [0, 2]), (1, [5, 3])]
    assert merged["steps"] == 3 and merged["error"] is None and merged["transport"] == "shm"
    assert core.merge_stage_captures([_stage_cap(1, [0], segs), _stage_cap(0, [1], segs, transport="rpc")],
                                     [0, 1])["transport"] == "mixed"
    # one stage, no "slots"/"stage" (a reply of the single-stage shape): every layer
    single = core.merge_stage_captures([{k: v for k, v in s0.items() if k not in ("stage", "slots")}], layers)
    assert single["stages"][0]["layers"] == layers

    segs = [[0, 0, 3, [4, 5, 6]]]
    s0 = _stage_cap(0, [1, 2], segs)
    merge = core.merge_stage_captures
    with pytest.raises(CaptureError, match=r"layer\(s\) \[3\] were captured by no pipeline stage"):
        merge([s0, _stage_cap(1, [0], segs)], layers)
    with pytest.raises(CaptureError, match="layer 2 was captured by pipeline stages 0 and 1"):
        merge([s0, _stage_cap(1, [0, 2, 3], segs)], layers)
    with pytest.raises(CaptureError, match="pipeline stage 1 sent layer slot 7"):
        merge([s0, _stage_cap(1, [0, 3, 7], segs)], layers)
    with pytest.raises(CaptureError, match="pipeline stage 1 sent layer slot -1"):
        merge([s0, _stage_cap(1, [-1, 0, 3], segs)], layers)
    with pytest.raises(CaptureError, match=r"prompt 0: pipeline stage 0 \(layers \[0, 2\]\) captured 3 rows, "
                                           r"pipeline stage 1 \(layers \[5, 3\]\) 2"):
        merge([s0, _stage_cap(1, [0, 3], [[0, 0, 2, [4, 5]]])], layers)
    with pytest.raises(CaptureError, match=r"prompt 1: .* captured 0 rows, .* 1"):
        merge([s0, _stage_cap(1, [0, 3], segs + [[1, 0, 1, [7]]])], layers)
    with pytest.raises(CaptureError, match="hidden_size 16"):
        merge([s0, _stage_cap(1, [0, 3], segs, hidden_size=16)], layers)
    with pytest.raises(CaptureError, match="dtype 'bfloat16'"):
        merge([s0, _stage_cap(1, [0, 3], segs, dtype="bfloat16")], layers)
    with pytest.raises(CaptureError, match="no pipeline stage sent a capture"):
        merge([], layers)
    err = merge([s0, _stage_cap(1, [0, 3], segs, error="step 4: boom")], layers)["error"]
    assert err == "pipeline stage 1 (layers [5, 3]): step 4: boom"
    assert merge([_stage_cap(0, [0], segs, error="boom")], [0])["error"] == "boom"  # one stage: as before
    with pytest.raises(CaptureError, match="more than one tensor-parallel rank of pipeline stage 1"):
        core.stage_replies([s0, s1, dict(s1)])
    with pytest.raises(CaptureError, match="worker 0 sent list, expected its capture"):
        core.stage_replies([[0.5]])  # the 0.3.0 "[0] of a bare reply" mistake
    with pytest.raises(CaptureError, match="no worker sent a capture"):
        core.stage_replies([None, None])
    with pytest.raises(CaptureError, match="unexpected collective_rpc reply of type list"):
        core.stage_replies([])


def test_pipeline_stage_replies_are_merged_by_layer_and_checked():
    pipeline_examples()


class SlicerMachine(RuleBasedStateMachine):
    """Sequences of calls on one worker: arm, steps (with stale requests of
    earlier calls mixed in), fetch.  Every step's rows are attributed exactly
    once, to the call that was armed, at the positions the step gave."""

    def __init__(self):
        super().__init__()
        self.call = -1
        self.slicer = None
        self.expected: dict[int, int] = {}
        self.runs: list = []  # what the steps returned (the worker files them by prompt)

    @rule()
    def arm(self):
        self.call += 1
        self.slicer = StepSlicer(call=self.call, lengths=[10**6] * 4)
        self.expected = {}
        self.runs = []

    @precondition(lambda self: self.slicer is not None)
    @rule(counts=st.lists(st.integers(0, 5), min_size=1, max_size=4), stale=st.integers(0, 3),
          pad=st.integers(0, 3))
    def step(self, counts, stale, pad):
        req_ids = [make_request_id(self.call, i) for i in range(len(counts))]
        nums = list(counts)
        if stale and self.call > 0:
            req_ids.append(make_request_id(self.call - 1, 0) + "-abcd1234")
            nums.append(stale)
        positions, tokens, starts = [], [], []
        for i, n in enumerate(nums):
            start = self.expected.get(i, 0) if i < len(counts) else 0
            starts.append(sum(nums[:i]))
            positions += list(range(start, start + n))
            tokens += [i] * n
        before = self.slicer.steps
        segs = self.slicer.slice_step(StepLayout(tuple(req_ids), tuple(nums)),
                                      positions + [0] * pad, tokens + [0] * pad, [sum(nums) + pad])
        assert self.slicer.steps == before + 1
        want = [(i, starts[i], self.expected.get(i, 0), n) for i, n in enumerate(counts) if n]
        assert [(s.index, s.src, s.start, s.count) for s in segs] == want
        assert all(s.token_ids == (s.index,) * s.count for s in segs)
        self.runs += segs
        for i, n in enumerate(counts):
            self.expected[i] = self.expected.get(i, 0) + n

    @precondition(lambda self: self.slicer is not None)
    @rule()
    def fetch(self):
        got: dict[int, int] = {}
        for s in self.runs:
            got[s.index] = got.get(s.index, 0) + s.count
        assert got == {i: n for i, n in self.expected.items() if n}
        self.slicer = None  # handed over: a later step cannot add to it

    @invariant()
    def no_foreign_rows_kept(self):
        if self.slicer is not None:
            assert {s.index for s in self.runs} <= set(self.expected)


TestSlicerMachine = SlicerMachine.TestCase
TestSlicerMachine.settings = settings(max_examples=60, stateful_step_count=20, deadline=None)
