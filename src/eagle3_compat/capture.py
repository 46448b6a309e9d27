"""The capture core: attribute each engine step's rows to prompt positions.

This module is pure logic (no torch, no vLLM, no device code).  The worker
extension calls :meth:`StepSlicer.slice_step` after every engine step to
learn where each captured row belongs (which prompt, which position), and
the driver calls :func:`check_segments` once per ``generate()`` call before
it hands out any result, so the code that the property tests exercise is
the code that runs.

Why rows are attributed this way
--------------------------------
speculators 0.3.0 concatenates every captured row of a call and cuts it
with a running offset over the prompt lengths.  That is only right when
every prompt is scheduled whole, in input order, with no padding and no
extra tokens.  Chunked prefill, batch reordering, padded steps and decode
steps all break it, silently.  Here each step's rows are attributed from
what the model runner actually laid out (request ids in batch order and
the number of tokens scheduled for each), and every run of rows carries
the positions and token ids the model saw.  The worker writes a run's rows
straight to their place in the call's arena (prompt ``i``, position ``p``);
the driver then checks that the runs of each prompt tile its positions
``0..len-1`` exactly once and that their token ids are the prompt's.  Any
mismatch is a :class:`CaptureError` naming the prompt and the layers, never
a silently shifted row.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CaptureError",
    "Segment",
    "StepLayout",
    "StepSlicer",
    "check_plan",
    "check_segments",
    "check_stage_layers",
    "clip_run",
    "fold_shards",
    "make_request_id",
    "merge_stage_captures",
    "parse_request_id",
    "rank0_reply",
    "shard_rows",
    "stage_replies",
]


class CaptureError(RuntimeError):
    """Captured hidden states failed an invariant; the data would be wrong."""


_REQ_RE = re.compile(r"^e3c:(\d+):(\d+)(?:$|[^0-9])")


def make_request_id(call: int, index: int) -> str:
    """The request id given to prompt ``index`` of ``generate()`` call ``call``."""
    return f"e3c:{call}:{index}"


def parse_request_id(req_id: str) -> tuple[int, int] | None:
    """``(call, index)`` of a request id made by :func:`make_request_id`.

    vLLM 0.14+ appends ``-<random>`` to request ids inside the engine
    (vllm-project/vllm#27987 era, ``InputProcessor.assign_request_id``); the
    suffix is ignored.  Ids that are not ours give ``None``.
    """
    m = _REQ_RE.match(req_id)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class StepLayout:
    """What the model runner laid out for one step.

    ``req_ids[j]`` owns ``num_tokens[j]`` consecutive rows, in this order,
    starting at row 0.  Rows after ``sum(num_tokens)`` are padding.
    """

    req_ids: tuple[str, ...]
    num_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.req_ids) != len(self.num_tokens):
            raise CaptureError(
                f"step layout has {len(self.req_ids)} request ids but "
                f"{len(self.num_tokens)} token counts"
            )
        if len(set(self.req_ids)) != len(self.req_ids):
            raise CaptureError(f"step layout repeats a request id: {self.req_ids}")
        if any(n < 0 for n in self.num_tokens):
            raise CaptureError(f"negative token count in step layout: {self.num_tokens}")

    @property
    def total(self) -> int:
        return sum(self.num_tokens)


@dataclass(frozen=True)
class Segment:
    """A run of one prompt's rows in one step.

    Rows ``src .. src+count-1`` of the step's captured tensors are the
    states at positions ``start .. start+count-1`` of prompt ``index``;
    ``token_ids`` are the tokens the model saw there (``None`` when the
    model was fed embeddings and the ids could not be read).
    """

    index: int
    src: int
    start: int
    count: int
    token_ids: tuple[int, ...] | None

    def to_wire(self) -> list[Any]:
        """What the driver needs (the row in the step is the worker's business)."""
        return [self.index, self.start, self.count, None if self.token_ids is None else list(self.token_ids)]


@dataclass
class StepSlicer:
    """Worker-side: attributes the rows of one ``generate()`` call's steps.

    ``call`` is the call id the driver armed the capture with and
    ``lengths`` its prompts' token counts (a sequence indexed by prompt, or
    a mapping prompt index -> count that grows as a stream admits prompts);
    requests of other calls (or not made by us) are skipped and counted, so
    stale rows can never reach a result.

    The slicer keeps no run it has attributed (each step's runs are returned
    to the caller, who files them by prompt), and :meth:`forget` drops all it
    knows of a prompt, so a stream's slicer holds only the prompts in flight,
    however long the stream.  (It used to keep every run with its token ids:
    ~80 KB per 2048-token prompt on each rank, for the whole stream.)
    """

    call: int
    lengths: Sequence[int] | Mapping[int, int]
    foreign_rows: int = 0
    steps: int = 0
    # prompt index -> the position its next planned run starts at (plan_step)
    planned: dict[int, int] = field(default_factory=dict)

    def plan_step(self, layout: StepLayout) -> list[Segment]:
        """Where this step's rows will go, before the model runs them.

        The worker copies each run of rows to its place in the call's arena
        while the step runs (the rows go straight from the device into shared
        memory, with no staging copy), so it needs the places before the
        positions of the step can be read.  Each prompt's runs are expected
        in order from position 0: a request's ``n`` rows continue where the
        prompt's previous planned run ended, and rows past the prompt's end
        are not attributed (as in :meth:`slice_step`).  After the step,
        :meth:`slice_step` works the runs out from the positions the model
        saw and :func:`check_plan` must find the same runs, or the call
        fails: a wrong plan is an error, never shifted rows.

        Returns segments without token ids.  The plan is all or nothing: a
        :class:`CaptureError` (a request naming a prompt the call has not
        sent) leaves the tally as it was.
        """
        out: list[Segment] = []
        tally: dict[int, int] = {}
        src = 0
        for req_id, n in zip(layout.req_ids, layout.num_tokens):
            parsed = parse_request_id(req_id)
            if n and parsed is not None and parsed[0] == self.call:
                index = parsed[1]
                plen = self._known_length(index, req_id)
                first = tally.get(index, self.planned.get(index, 0))
                count = min(n, plen - first)
                if count > 0:
                    out.append(Segment(index=index, src=src, start=first, count=count, token_ids=None))
                    tally[index] = first + count
            src += n
        self.planned.update(tally)
        return out

    def forget(self, index: int) -> None:
        """Stop expecting prompt ``index`` (collected by the driver)."""
        if isinstance(self.lengths, dict):
            self.lengths.pop(index, None)
        self.planned.pop(index, None)

    def slice_step(
        self,
        layout: StepLayout,
        positions: Sequence[int],
        token_ids: Sequence[int] | None,
        captured_rows: Sequence[int],
    ) -> list[Segment]:
        """The runs of this step's rows that belong to the call's prompts.

        ``positions`` and ``token_ids`` are the model inputs of the step (at
        least ``layout.total`` entries; ``token_ids`` may be ``None`` when the
        model was fed embeddings; lists are taken to hold Python ints, as
        ``Tensor.tolist()`` gives, other sequences are converted once);
        ``captured_rows`` is the row count of each
        captured layer tensor (each must cover ``layout.total``).  Rows at
        positions past the prompt's end (a decode or extra scheduled token)
        are not attributed.
        """
        total = layout.total
        for slot, rows in enumerate(captured_rows):
            if rows < total:
                raise CaptureError(
                    f"step {self.steps}: layer slot {slot} captured {rows} rows but "
                    f"{total} tokens were scheduled"
                )
        if len(positions) < total:
            raise CaptureError(
                f"step {self.steps}: {len(positions)} positions for {total} scheduled tokens"
            )
        if token_ids is not None and len(token_ids) < total:
            raise CaptureError(
                f"step {self.steps}: {len(token_ids)} token ids for {total} scheduled tokens"
            )
        # Python ints, once for the step (the worker passes lists from
        # tolist(), which are); then each run is a C-level list slice.  An
        # 8192-token step's attribution took 2.3-2.7 ms of host time with
        # Python-level loops, 1.3-1.5 ms with a map(int) per run, 0.2-0.5 ms now.
        if type(positions) is not list:
            positions = list(map(int, positions))
        if token_ids is not None and type(token_ids) is not list:
            token_ids = list(map(int, token_ids))
        out: list[Segment] = []
        start = 0
        for req_id, n in zip(layout.req_ids, layout.num_tokens):
            end = start + n
            parsed = parse_request_id(req_id)
            if parsed is None or parsed[0] != self.call:
                self.foreign_rows += n
            elif n:
                index = parsed[1]
                plen = self._known_length(index, req_id)
                pos = positions[start:end]
                # Keep the prefix of the run that lies inside the prompt.
                hi = len(pos)
                while hi and pos[hi - 1] >= plen:
                    hi -= 1
                if hi:
                    first = pos[0]
                    if first < 0 or pos[:hi] != list(range(first, first + hi)):
                        shown = pos[:8] + (["..."] if hi > 8 else [])
                        raise CaptureError(
                            f"step {self.steps}: prompt {index}: positions {shown} of one request "
                            "are not consecutive (rows out of order within a step)"
                        )
                    out.append(
                        Segment(
                            index=index,
                            src=start,
                            start=first,
                            count=hi,
                            token_ids=None
                            if token_ids is None
                            else tuple(token_ids[start : start + hi]),
                        )
                    )
            start = end
        self.steps += 1
        return out


    def _known_length(self, index: int, req_id: str) -> int:
        plen = self._length(index)
        if plen is None:
            raise CaptureError(
                f"step {self.steps}: request {req_id!r} names prompt {index}, which call "
                f"{self.call} has not sent (or has already collected)"
            )
        return plen

    def _length(self, index: int) -> int | None:
        if isinstance(self.lengths, Mapping):
            return self.lengths.get(index)
        return self.lengths[index] if 0 <= index < len(self.lengths) else None


def check_plan(step: int, planned: Sequence[Segment], actual: Sequence[Segment]) -> None:
    """The runs the worker copied rows to during step ``step``
    (:meth:`StepSlicer.plan_step`) must be the runs the model's positions
    give (:meth:`StepSlicer.slice_step`): same prompts, same rows of the step,
    same positions.  Otherwise rows sit at the wrong place in the arena and
    :class:`CaptureError` says which."""
    want = [(s.index, s.src, s.start, s.count) for s in actual]
    got = [(s.index, s.src, s.start, s.count) for s in planned]
    if want != got:
        diff = [(g, w) for g, w in zip(got, want) if g != w] or [(got[len(want):], want[len(got):])]
        raise CaptureError(
            f"step {step}: rows were copied to the places planned before the step, but the positions "
            f"the model saw put them elsewhere (planned (prompt, row, position, count) vs actual: "
            f"{diff[:3]}); a request did not continue where its previous rows ended "
            "(prefix caching, preemption?)"
        )


def shard_rows(total: int, shard: int, shards: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of a step's ``total`` rows that tensor-parallel
    rank ``shard`` of ``shards`` copies to the host.

    After a decoder layer's all-reduce every tensor-parallel rank holds the
    same rows, so each can send a share of them over its own device-to-host
    link (at TP 8 each link carries 1/8 of the step's bytes).  The shares
    are contiguous, in rank order, and tile ``0..total-1`` exactly.
    """
    if not (isinstance(shards, int) and shards >= 1 and isinstance(shard, int) and 0 <= shard < shards):
        raise ValueError(f"shard {shard!r} of {shards!r}: need 0 <= shard < shards")
    return total * shard // shards, total * (shard + 1) // shards


def clip_run(seg: Segment, lo: int, hi: int) -> tuple[int, int, int] | None:
    """The part of run ``seg`` inside the step's rows ``[lo, hi)``:
    ``(src, start, count)`` (row in the step, position in the prompt, rows),
    or ``None`` when the run lies outside."""
    a, b = max(seg.src, lo), min(seg.src + seg.count, hi)
    if a >= b:
        return None
    return a, seg.start + (a - seg.src), b - a


def _fold_capture(stage: int, primary: dict[str, Any], helpers: Sequence[Mapping[str, Any]]) -> None:
    """Check one capture's shares (:func:`fold_shards`); a fault becomes the
    capture's ``error`` (the driver raises it before any result is used)."""
    if primary.get("error"):
        return
    where = f"pipeline stage {stage}: " if stage else ""

    def runs(reply: Mapping[str, Any]) -> list[tuple[int, int, int]]:
        return [(int(s[0]), int(s[1]), int(s[2])) for s in reply.get("segments", ())]

    mine = runs(primary)
    for h in helpers:
        rank = h.get("shard")
        if h.get("error"):
            primary["error"] = f"{where}tensor-parallel rank {rank}: {h['error']}"
            return
        if int(h.get("steps", -1)) != int(primary.get("steps", -2)):
            primary["error"] = (
                f"{where}tensor-parallel rank {rank} attributed {h.get('steps')} steps, rank 0 "
                f"{primary.get('steps')}: the ranks' shares of the rows cannot be trusted"
            )
            return
        theirs = runs(h)
        if theirs != mine:
            diff = [(a, b) for a, b in zip(mine, theirs) if a != b] or [(mine[len(theirs):], theirs[len(mine):])]
            primary["error"] = (
                f"{where}tensor-parallel rank {rank} attributed the rows otherwise than rank 0 "
                f"((prompt, position, count) rank 0 vs rank {rank}: {diff[:3]}): its share of "
                "the rows may sit elsewhere"
            )
            return
    if "rows" in primary:
        written = int(primary["rows"]) + sum(int(h.get("rows", 0)) for h in helpers)
        expected = sum(c for _i, _s, c in mine) * len(primary.get("slots", ()))
        if written != expected:
            primary["error"] = (
                f"{where}the tensor-parallel ranks wrote {written} rows x layers, the call's runs "
                f"hold {expected}: rows are missing or written twice"
            )


def fold_shards(stage: int, primary: dict[str, Any], helpers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One pipeline stage's reply with its tensor-parallel shares checked.

    With sharded copies (:func:`shard_rows`) the rank-0 worker of a stage
    replies with the call's metadata and every other tensor-parallel rank of
    the stage with its share: the runs it attributed, the steps it saw and
    the rows it wrote (``"shard"``: its rank).  Each rank attributes every
    step itself (from its own positions), so the runs must be rank 0's, the
    steps the same, and the rows written by all ranks together exactly the
    runs' rows times the stage's layers; any difference, or a rank's own
    error, becomes the reply's ``error`` (named by stage and rank), and a
    rank that did not reply at all is a :class:`CaptureError` here.  Works
    on the replies of ``e3c_take`` (a capture), ``e3c_exchange``
    (``"taken"``: a list of captures) and ``e3c_add``.
    """
    shards = int(primary.get("shards", 1))
    got = sorted(int(h.get("shard", -1)) for h in helpers)
    if got != list(range(1, shards)):
        raise CaptureError(
            f"pipeline stage {stage}: the call's rows were shared by {shards} tensor-parallel ranks, "
            f"but ranks {got} sent their share (expected {list(range(1, shards))})"
        )
    if "taken" in primary:
        for j, capture in enumerate(primary["taken"]):
            shares = [h["taken"][j] for h in helpers if j < len(h.get("taken", ()))]
            if len(shares) != len(helpers):
                raise CaptureError(f"pipeline stage {stage}: a tensor-parallel rank handed over fewer prompts")
            _fold_capture(stage, capture, shares)
    elif "segments" in primary:
        _fold_capture(stage, primary, helpers)
    return primary


def rank0_reply(reply: Any) -> Any:
    """The tensor-parallel rank-0 capture from a ``collective_rpc`` reply.

    vLLM's ``collective_rpc`` returns one reply per worker (a list), except
    ``MultiprocExecutor.collective_rpc(unique_reply_rank=...)``, which from
    vLLM 0.12 returns the bare reply: indexing that with ``[0]`` silently
    picked the first layer's tensor in speculators 0.3.0 ("771 tensors of
    shape [512]").  Both shapes are accepted here; a capture is a dict, so
    the two cannot be confused, and every other rank must have sent None.
    """
    if isinstance(reply, dict):
        return reply
    if not isinstance(reply, (list, tuple)) or not reply:
        raise CaptureError(f"unexpected collective_rpc reply of type {type(reply).__name__}")
    first, rest = reply[0], reply[1:]
    if not isinstance(first, dict):
        raise CaptureError(
            f"rank 0 sent {type(first).__name__}, expected its capture (a dict); "
            "is this a bare reply indexed twice?"
        )
    if any(r is not None for r in rest):
        raise CaptureError("captures came from more than one tensor-parallel rank")
    return first


def stage_replies(reply: Any) -> list[dict[str, Any]]:
    """The captures of a ``collective_rpc`` reply, one per pipeline stage, by stage.

    With pipeline parallelism the tensor-parallel rank-0 worker of each stage
    that owns a requested layer replies (a dict carrying its ``"stage"``);
    every other worker sends None.  Like :func:`rank0_reply`, a bare dict
    (``unique_reply_rank``) is accepted; a reply that is neither a dict nor
    None (the 0.3.0 "[0] of a bare reply" mistake), no capture at all, or two
    captures from one stage (two tensor-parallel ranks) are errors.  The
    shares of the other tensor-parallel ranks of a sharded call
    (``"shard"`` >= 1) are checked against their stage's capture and folded
    into it (:func:`fold_shards`).
    """
    if isinstance(reply, dict):
        return [fold_shards(int(reply.get("stage", 0)), reply, [])]
    if not isinstance(reply, (list, tuple)) or not reply:
        raise CaptureError(f"unexpected collective_rpc reply of type {type(reply).__name__}")
    out: dict[int, dict[str, Any]] = {}
    shares: dict[int, list[dict[str, Any]]] = {}
    for rank, r in enumerate(reply):
        if r is None:  # not a capturing worker (tensor rank > 0, or a stage without requested layers)
            continue
        if not isinstance(r, dict):
            raise CaptureError(
                f"worker {rank} sent {type(r).__name__}, expected its capture (a dict) or None; "
                "is this a bare reply indexed twice?"
            )
        stage = int(r.get("stage", 0))
        if r.get("shard"):  # another tensor-parallel rank's share of a sharded call
            shares.setdefault(stage, []).append(r)
            continue
        if stage in out:
            raise CaptureError(
                f"captures came from more than one tensor-parallel rank of pipeline stage {stage}"
            )
        out[stage] = r
    if not out:
        raise CaptureError("no worker sent a capture (every reply was None)")
    stray = sorted(set(shares) - set(out))
    if stray:
        raise CaptureError(f"pipeline stage {stray[0]}: tensor-parallel shares came without rank 0's capture")
    return [fold_shards(s, out[s], shares.get(s, ())) for s in sorted(out)]


def check_stage_layers(claims: Mapping[int, Sequence[int]], layer_ids: Sequence[int]) -> None:
    """Check that every requested layer is captured by exactly one pipeline stage.

    ``claims`` maps a stage to the layer slots (indices into ``layer_ids``)
    its capture holds.  A :class:`CaptureError` names the layer and the
    stages otherwise.
    """
    owner: dict[int, int] = {}
    for stage, slots in sorted(claims.items()):
        for slot in slots:
            if not 0 <= slot < len(layer_ids):
                raise CaptureError(
                    f"pipeline stage {stage} sent layer slot {slot}, but {len(layer_ids)} layers "
                    f"were requested ({list(layer_ids)})"
                )
            if slot in owner:
                raise CaptureError(
                    f"layer {layer_ids[slot]} was captured by pipeline stages {owner[slot]} and "
                    f"{stage}: each layer must come from the one stage that owns it"
                )
            owner[slot] = stage
    missing = [layer_ids[s] for s in range(len(layer_ids)) if s not in owner]
    if missing:
        held = {stage: [layer_ids[s] for s in slots] for stage, slots in sorted(claims.items())}
        raise CaptureError(
            f"layer(s) {missing} were captured by no pipeline stage (layers by stage: {held})"
        )


def merge_stage_captures(replies: Sequence[Mapping[str, Any]], layer_ids: Sequence[int]) -> dict[str, Any]:
    """One call's captures from its pipeline stages (:func:`stage_replies`), merged.

    Each stage's capture holds its own layer ``"slots"`` (indices into
    ``layer_ids``) and the runs of rows it wrote (``"segments"``).  Checked
    here: every requested layer comes from exactly one stage
    (:func:`check_stage_layers`); all stages agree on dtype and hidden size
    and captured the same number of rows for every prompt.  A stage's own
    error is kept, prefixed with the stage and its layers (with one stage,
    the message is the stage's own).  The result has the keys of a single
    capture (``segments`` are the first stage's) plus ``"stages"``: per
    stage ``stage``, ``slots``, ``layers``, ``segments``, ``transport`` and
    ``payload`` (RPC path only), which :func:`eagle3_compat.generator.collect_results`
    checks and assembles.
    """
    if not replies:
        raise CaptureError("no pipeline stage sent a capture")
    many = len(replies) > 1
    stages = []
    for r in replies:
        stage = int(r.get("stage", 0))
        slots = list(r.get("slots", range(len(layer_ids))))
        stages.append({
            "stage": stage,
            "slots": slots,
            "layers": [layer_ids[s] for s in slots if 0 <= s < len(layer_ids)],
            "segments": r["segments"],
            "transport": r["transport"],
            "payload": r.get("payload"),
        })
    check_stage_layers({s["stage"]: s["slots"] for s in stages}, layer_ids)

    def name(st: Mapping[str, Any]) -> str:
        return f"pipeline stage {st['stage']} (layers {st['layers']})"

    error = None
    for r, st in zip(replies, stages):
        if r.get("error"):
            error = f"{name(st)}: {r['error']}" if many else r["error"]
            break
    first = replies[0]
    for r, st in zip(replies[1:], stages[1:]):
        for key in ("dtype", "hidden_size"):
            if r[key] != first[key]:
                raise CaptureError(
                    f"{name(st)} captured {key} {r[key]!r}, {name(stages[0])} {first[key]!r}"
                )
    if error is None and many:
        rows = [_rows_by_prompt(st["segments"]) for st in stages]
        for st, counted in zip(stages[1:], rows[1:]):
            for index in sorted(set(counted) | set(rows[0])):
                a, b = rows[0].get(index, 0), counted.get(index, 0)
                if a != b:
                    raise CaptureError(
                        f"prompt {index}: {name(stages[0])} captured {a} rows, {name(st)} {b}: "
                        "the stages disagree on what ran"
                    )
    transports = {st["transport"] for st in stages}
    return {
        "transport": transports.pop() if len(transports) == 1 else "mixed",
        "segments": first["segments"],
        "stages": stages,
        "steps": max(int(r["steps"]) for r in replies),
        "foreign_rows": max(int(r["foreign_rows"]) for r in replies),
        "error": error,
        "token_ids_checked": all(r.get("token_ids_checked", True) for r in replies),
        "dtype": first["dtype"],
        "hidden_size": first["hidden_size"],
    }


def _rows_by_prompt(segments: Sequence[Sequence[Any]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for index, _start, count, _tokens in segments:
        out[int(index)] = out.get(int(index), 0) + int(count)
    return out


def check_segments(
    prompts: Sequence[Sequence[int]],
    segments: Sequence[Sequence[Any]],
    layer_ids: Sequence[int],
) -> None:
    """Check that the runs of a call tile every prompt exactly once.

    ``segments`` are :meth:`Segment.to_wire` lists ``[index, start, count,
    token_ids]`` as they arrive from the worker, in any order.  For every
    prompt the runs, sorted by start, must cover positions ``0..len-1``
    with no gap and no overlap, and carry the prompt's token ids; otherwise
    :class:`CaptureError` names the prompt and the layers whose rows would
    be wrong.
    """
    layers = list(layer_ids)
    by_prompt: dict[int, list[tuple[int, int, Any]]] = {}
    for index, start, count, tokens in segments:
        if not 0 <= index < len(prompts):
            raise CaptureError(
                f"captured rows for prompt index {index}, which this call did not send "
                f"({len(prompts)} prompts)"
            )
        if count <= 0:
            raise CaptureError(f"prompt {index}: a captured run of {count} rows")
        by_prompt.setdefault(index, []).append((start, count, tokens))
    for i, prompt in enumerate(prompts):
        n = len(prompt)
        expected = 0
        for start, count, tokens in sorted(by_prompt.get(i, ()), key=lambda r: r[0]):
            if start != expected:
                what = "repeated" if start < expected else "missing"
                raise CaptureError(
                    f"prompt {i}, layers {layers}: captured rows start at position {start} where "
                    f"position {expected} was expected (a {what} or shifted row)"
                )
            if tokens is not None and list(tokens) != list(prompt[start : start + count]):
                raise CaptureError(
                    f"prompt {i}, layers {layers}: token ids of captured rows "
                    f"{start}..{start + count - 1} differ from the prompt (rows attributed to the "
                    "wrong prompt)"
                )
            expected = start + count
        if expected != n:
            raise CaptureError(
                f"prompt {i}, layers {layers}: captured {expected} of {n} rows (prompt incomplete)"
            )
