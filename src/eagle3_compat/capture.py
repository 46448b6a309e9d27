"""The capture core: turn per-step captures into per-prompt hidden states.

This module is pure logic.  It needs only objects that behave like CPU
tensors (slicing, ``torch.cat``-like concatenation through the ``cat``
argument, ``tolist``); no vLLM and no device code.  The worker extension
calls :meth:`StepSlicer.slice_step` after every engine step and the driver
calls :func:`assemble` once per ``generate()`` call, so the code that the
property tests exercise is the code that runs.

Why rows are attributed this way
--------------------------------
speculators 0.3.0 concatenates every captured row of a call and cuts it
with a running offset over the prompt lengths.  That is only right when
every prompt is scheduled whole, in input order, with no padding and no
extra tokens.  Chunked prefill, batch reordering, padded steps and decode
steps all break it, silently.  Here each step's rows are attributed from
what the model runner actually laid out (request ids in batch order and
the number of tokens scheduled for each), every chunk carries the
positions and token ids the model saw, and assembly checks that the
positions of each prompt are exactly ``0..len-1`` and that the token ids
are the prompt's.  Any mismatch is a :class:`CaptureError` naming the
prompt and the layer, never a silently shifted row.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CaptureError",
    "Chunk",
    "StepLayout",
    "StepSlicer",
    "assemble",

    "make_request_id",
    "parse_request_id",
    "rank0_reply",
]

Tensor = Any  # a CPU torch.Tensor at run time; kept abstract so the core stays pure


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


@dataclass
class Chunk:
    """The rows of one request in one step."""

    positions: list[int]
    token_ids: list[int] | None
    layers: list[Tensor]  # one [n, hidden] tensor per captured layer, in layer-id order


@dataclass
class StepSlicer:
    """Worker-side: keeps the chunks of one ``generate()`` call.

    ``call`` is the call id the driver armed the capture with; requests of
    other calls (or not made by us) are dropped here and counted, so stale
    rows can never reach a result.
    """

    call: int
    chunks: dict[int, list[Chunk]] = field(default_factory=dict)
    foreign_rows: int = 0
    steps: int = 0

    def slice_step(
        self,
        layout: StepLayout,
        layers: Sequence[Tensor],
        positions: Sequence[int],
        token_ids: Sequence[int] | None,
    ) -> None:
        """Attribute one step's captured rows to their requests.

        ``layers`` are the step's captured tensors (one per layer id, each
        with at least ``layout.total`` rows); ``positions`` and
        ``token_ids`` are the model inputs of the step (at least
        ``layout.total`` entries; ``token_ids`` may be ``None`` when the model
        was fed embeddings).
        """
        total = layout.total
        for li, h in enumerate(layers):
            if h.shape[0] < total:
                raise CaptureError(
                    f"step {self.steps}: layer slot {li} captured {h.shape[0]} rows but "
                    f"{total} tokens were scheduled"
                )
        if len(positions) < total:
            raise CaptureError(
                f"step {self.steps}: {len(positions)} positions for {total} scheduled tokens"
            )
        start = 0
        for req_id, n in zip(layout.req_ids, layout.num_tokens):
            end = start + n
            parsed = parse_request_id(req_id)
            if parsed is None or parsed[0] != self.call:
                self.foreign_rows += n
            elif n:
                self.chunks.setdefault(parsed[1], []).append(
                    Chunk(
                        positions=list(positions[start:end]),
                        token_ids=None if token_ids is None else list(token_ids[start:end]),
                        layers=[h[start:end] for h in layers],
                    )
                )
            start = end
        self.steps += 1


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


def assemble(
    prompts: Sequence[Sequence[int]],
    chunks: Mapping[int, Sequence[Chunk]],
    layer_ids: Sequence[int],
    cat: Callable[[list[Tensor]], Tensor],
    check_finite: Callable[[Tensor], bool] | None = None,
) -> list[list[Tensor]]:
    """Per-prompt, per-layer tensors from the chunks of one call.

    Returns ``out[i][j]``: the ``[len(prompts[i]), hidden]`` states of layer
    ``layer_ids[j]`` for prompt ``i``, rows in prompt order.  Rows at
    positions past the prompt (a decode or extra scheduled token) are
    dropped; everything else must add up exactly or :class:`CaptureError`
    is raised naming the prompt (and layer).
    """
    unknown = sorted(set(chunks) - set(range(len(prompts))))
    if unknown:
        raise CaptureError(f"captured rows for prompt indices {unknown} that this call did not send")
    out: list[list[Tensor]] = []
    for i, prompt in enumerate(prompts):
        n = len(prompt)
        rows: list[tuple[int, Chunk, int, int]] = []  # (first position, chunk, lo, hi)
        for chunk in chunks.get(i, ()):
            pos = chunk.positions
            # Keep the prefix of the chunk that lies inside the prompt.
            hi = len(pos)
            while hi and pos[hi - 1] >= n:
                hi -= 1
            if any(p >= n for p in pos[:hi]):
                raise CaptureError(f"prompt {i}: positions out of order within a step: {pos}")
            if hi:
                rows.append((pos[0], chunk, 0, hi))
        rows.sort(key=lambda r: r[0])
        expected = 0
        for _first, chunk, lo, hi in rows:
            pos = chunk.positions[lo:hi]
            if pos != list(range(expected, expected + len(pos))):
                raise CaptureError(
                    f"prompt {i}: captured positions {pos[:3]}..{pos[-1:]} where position "
                    f"{expected} was expected (a missing, repeated or shifted row)"
                )
            if chunk.token_ids is not None and list(chunk.token_ids[lo:hi]) != list(
                prompt[expected : expected + len(pos)]
            ):
                raise CaptureError(
                    f"prompt {i}: token ids of captured rows {expected}..{expected + len(pos) - 1} "
                    "differ from the prompt (rows attributed to the wrong prompt)"
                )
            expected += len(pos)
        if expected != n:
            raise CaptureError(
                f"prompt {i}: captured {expected} of {n} rows (prompt incomplete)"
            )
        per_layer = []
        for j, layer_id in enumerate(layer_ids):
            # Always through cat: every result owns its memory (0.3.0 cloned too).
            t = cat([chunk.layers[j][lo:hi] for _, chunk, lo, hi in rows])
            if t.shape[0] != n:
                raise CaptureError(f"prompt {i}, layer {layer_id}: {t.shape[0]} rows for {n} tokens")
            if check_finite is not None and not check_finite(t):
                raise CaptureError(f"prompt {i}, layer {layer_id}: non-finite hidden states")
            per_layer.append(t)
        out.append(per_layer)
    return out
