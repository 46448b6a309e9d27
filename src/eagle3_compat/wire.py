"""The capture's journey from a worker to the user's process.

``collective_rpc`` replies travel through vLLM's msgpack encoder.  Unless
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (which we must not require), a
reply is sent without type information, and tensors inside it arrive as
plain lists (vLLM 0.16, ``UtilityResult``).  So the worker sends each
layer's rows of a whole call as one ``bytes`` object (dtype name, shape,
raw buffer) plus, per chunk, the prompt index, positions, token ids and the
chunk's first row; the driver rebuilds tensors from the buffers without
any per-row work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .capture import Chunk

__all__ = ["pack", "unpack"]


def _tensor_to_wire(t: Any) -> list[Any]:
    import torch  # noqa: PLC0415

    t = t.contiguous()
    raw = t.view(torch.uint8) if t.numel() else t.to(torch.uint8)
    return [str(t.dtype).removeprefix("torch."), list(t.shape), raw.numpy().tobytes()]


def _tensor_from_wire(item: Sequence[Any]) -> Any:
    import torch  # noqa: PLC0415

    dtype_name, shape, raw = item
    dtype = getattr(torch, dtype_name)
    if not raw:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def pack(chunks: Mapping[int, Sequence[Chunk]], num_layers: int) -> dict[str, Any]:
    """Worker side: one buffer per layer for the whole call."""
    import torch  # noqa: PLC0415

    meta: list[list[Any]] = []
    parts: list[list[Any]] = [[] for _ in range(num_layers)]
    row = 0
    for index, cs in chunks.items():
        for c in cs:
            n = len(c.positions)
            meta.append([int(index), c.positions, c.token_ids, row])
            for j in range(num_layers):
                parts[j].append(c.layers[j])
            row += n
    layers = [
        _tensor_to_wire(torch.cat(p, dim=0)) if p else None for p in parts
    ]
    return {"meta": meta, "layers": layers, "rows": row}


def unpack(wire: Mapping[str, Any]) -> dict[int, list[Chunk]]:
    """Driver side: chunks whose layer tensors are views on the per-layer buffers."""
    layers = [None if item is None else _tensor_from_wire(item) for item in wire["layers"]]
    out: dict[int, list[Chunk]] = {}
    for index, positions, token_ids, row in wire["meta"]:
        n = len(positions)
        out.setdefault(int(index), []).append(
            Chunk(
                positions=list(positions),
                token_ids=None if token_ids is None else list(token_ids),
                layers=[t[row : row + n] for t in layers],  # type: ignore[index]
            )
        )
    return out
