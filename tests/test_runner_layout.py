"""The model-runner layouts (eagle3_compat.runners), as pure logic.

vLLM's V2 model runner ("Model Runner V2", vllm/v1/worker/gpu/model_runner.py)
never runs on the CPU platform (0.25 to 0.32 fall back to the V1 runner:
"Model Runner V2 requires Triton"), so its capture cannot be tested end to
end here.  What differs for the capture is where a step's row layout is read
and in which order the rows come: these tests model that runner with plain
objects (the attribute paths of the 0.32 wheel) and a toy scheduler whose
steps the runner lays out decodes first, then by scheduled token count
(ties in the scheduler's order), and check that the rows are attributed to
the right prompt and position, bit for bit, through the same slicer and
segment check the worker and the driver use.
"""

from __future__ import annotations

import random
import sys
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3_compat.capture import StepSlicer, check_segments, make_request_id
from eagle3_compat.runners import (
    RUNNER_V1,
    RUNNER_V2,
    UnknownRunnerError,
    runner_kind,
    runner_layout,
    runner_token_ids,
)


def v1_runner(req_ids, input_ids="v1-buffer"):
    """The attributes the V1 runner (GPUModelRunner / CPUModelRunner) has."""
    return SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=list(req_ids)),
        input_ids=SimpleNamespace(gpu=input_ids, cpu="host copy"),
        execute_model_state=None,  # the V1 runner has one too (a tuple), without input_batch
    )


def v2_runner(req_ids, input_ids="v2-buffer"):
    """The attributes the V2 runner has after its execute_model."""
    return SimpleNamespace(
        input_buffers=SimpleNamespace(input_ids=input_ids, positions="p"),
        execute_model_state=SimpleNamespace(
            input_batch=SimpleNamespace(req_ids=list(req_ids), input_ids=input_ids)
        ),
    )


# -- which runner -----------------------------------------------------------------


def test_kind_is_read_from_the_runner_attributes():
    assert runner_kind(v1_runner([])) == RUNNER_V1
    assert runner_kind(v2_runner([])) == RUNNER_V2
    # the V2 runner before its first step: execute_model_state is None, still V2
    fresh = v2_runner([])
    fresh.execute_model_state = None
    assert runner_kind(fresh) == RUNNER_V2


class StrangeRunner:
    pass


@pytest.mark.parametrize(
    "runner, problem",
    [
        (StrangeRunner(), "has neither input_batch.req_ids"),
        # an input_batch without req_ids is not the V1 layout either
        (SimpleNamespace(input_batch=SimpleNamespace()), "has neither input_batch.req_ids"),
        # both layouts at once: refused, not guessed
        (SimpleNamespace(**vars(v1_runner([])), input_buffers=SimpleNamespace()), "has both"),
    ],
)
def test_unknown_runner_is_refused_naming_adapter_runner_and_version(monkeypatch, runner, problem):
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="0.99.0+cpu"))
    with pytest.raises(UnknownRunnerError) as err:
        runner_kind(runner)
    msg = str(err.value)
    assert "'worker-capture'" in msg and "vLLM 0.99.0+cpu" in msg and problem in msg
    assert type(runner).__name__ in msg


def test_v2_without_step_state_is_an_error():
    runner = v2_runner([])
    runner.execute_model_state = None
    with pytest.raises(UnknownRunnerError, match="execute_model_state.input_batch"):
        runner_layout(runner, RUNNER_V2, {})
    with pytest.raises(UnknownRunnerError, match="unknown runner kind"):
        runner_layout(runner, "v3", {})


def test_token_id_buffer_of_each_runner():
    assert runner_token_ids(v1_runner([]), RUNNER_V1) == "v1-buffer"
    assert runner_token_ids(v2_runner([]), RUNNER_V2) == "v2-buffer"
    assert runner_token_ids(SimpleNamespace(), RUNNER_V2) is None


def test_layout_order_is_the_runners_not_the_schedulers():
    counts = {"a": 5, "b": 1, "c": 3}  # the scheduler's order: a, b, c
    assert runner_layout(v2_runner(["b", "c", "a"]), RUNNER_V2, counts).req_ids == ("b", "c", "a")
    layout = runner_layout(v1_runner(["c", None, "a", "b"]), RUNNER_V1, counts)
    assert layout.req_ids == ("c", "a", "b")  # V1's holes (None) skipped
    assert layout.num_tokens == (3, 5, 1)
    assert layout.total == 9


# -- a toy engine whose steps the V2 runner lays out ---------------------------------


def v2_order(num_tokens: dict[str, int], decode_query_len: int = 1) -> list[str]:
    """The V2 runner's row order, as documented upstream: decode-like requests
    (exactly ``decode_query_len`` tokens) first, then by token count; Python's
    stable sort keeps the scheduler's order among equals."""
    return sorted(num_tokens, key=lambda r: (num_tokens[r] != decode_query_len, num_tokens[r]))


def toy_steps(lengths, budget, max_seqs, seed, call, foreign):
    """Steps of chunked prefill under a token budget, one decode row for each
    request whose prompt is done (a position past its end), and optionally
    requests of another call; yields (scheduler's counts, positions and token
    ids by request)."""
    rng = random.Random(seed)
    done = [0] * len(lengths)
    decoded = [False] * len(lengths)
    other = {make_request_id(call + 1, j): 0 for j in range(2)} if foreign else {}
    while not all(decoded):
        live = [i for i in range(len(lengths)) if not decoded[i]]
        rng.shuffle(live)
        counts: dict[str, int] = {}
        rows: dict[str, list[tuple[int, int]]] = {}
        left = budget
        for i in live[:max_seqs]:
            rid = make_request_id(call, i)
            if done[i] == lengths[i]:  # prompt finished: one decode token
                if left < 1:
                    continue
                counts[rid], rows[rid] = 1, [(lengths[i], 7)]
                decoded[i] = True
                left -= 1
                continue
            n = min(lengths[i] - done[i], left, rng.randint(1, lengths[i]))
            if n <= 0:
                continue
            counts[rid] = n
            rows[rid] = [(p, 1000 * i + p) for p in range(done[i], done[i] + n)]
            done[i] += n
            left -= n
        for rid in other:
            n = rng.randint(1, 4)
            counts[rid], rows[rid] = n, [(other[rid] + k, 99999) for k in range(n)]
            other[rid] += n
        if counts:
            yield counts, rows


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=7),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    call=st.integers(0, 4),
    foreign=st.booleans(),
)
def test_v2_rows_are_attributed_to_the_right_prompt_and_position(
    lengths, budget, max_seqs, seed, call, foreign
):
    slicer = StepSlicer(call=call, lengths=lengths)
    got: dict[int, dict[int, int]] = {i: {} for i in range(len(lengths))}
    wire = []
    for counts, rows in toy_steps(lengths, budget, max_seqs, seed, call, foreign):
        order = v2_order(counts)
        runner = v2_runner(order)
        # the rows as that runner lays them out: its order, then padding
        flat = [r for rid in order for r in rows[rid]] + [(-1, -1)] * 3
        positions = [p for p, _ in flat]
        token_ids = [t for _, t in flat]
        values = [float(t) for t in token_ids]  # the "hidden state" of each row
        layout = runner_layout(runner, runner_kind(runner), counts)
        assert layout.total == sum(counts.values())
        for seg in slicer.slice_step(layout, positions, token_ids, [len(values)]):
            wire.append(seg.to_wire())
            for k in range(seg.count):
                pos = seg.start + k
                assert pos not in got[seg.index], (seg.index, pos)
                got[seg.index][pos] = values[seg.src + k]
    prompts = [[1000 * i + p for p in range(n)] for i, n in enumerate(lengths)]
    check_segments(prompts, wire, [0])
    for i, n in enumerate(lengths):
        assert [got[i][p] for p in range(n)] == [float(1000 * i + p) for p in range(n)]
