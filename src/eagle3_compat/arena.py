"""The arena: where one call's hidden states go from the rank-0 worker to the user.

The driver (the user's process) creates one file per ``generate()`` call in
``/dev/shm``, sized for every prompt and layer, and names it in the arm
RPC.  The rank-0 worker maps it and writes each captured run of rows to
its final place (prompt ``i``, layer ``j``, position ``p``) as the steps
run; at the end of the call it replies with metadata only.  The driver maps
prompt ``i``'s block and hands out tensors that *are* that memory: no
serialisation, no copy, whatever the size of the call.

Lifetime: the driver unlinks the file's name as soon as the worker has
mapped it (after the arm RPC), so ``/dev/shm`` holds a name only for the
duration of that RPC and nothing is left behind by a killed worker, a dead
engine or an interrupted driver; the memory itself is returned when the
last mapping goes (the worker drops its mapping at fetch; the driver's
mappings live exactly as long as the result tensors that use them, one
mapping per prompt).  Names left by a driver that was killed inside the arm
RPC carry its pid and are removed by the next driver on the machine.

Each result tensor's storage is exactly its own rows (``torch.frombuffer``
with ``count``), so ``torch.save`` of a sample writes that sample only.

Where the worker cannot open the file (it is on another host, e.g. vLLM's
Ray executor across nodes, or in another ``/dev/shm`` namespace), it
says so in its arm reply and keeps the rows in its own memory; they then
travel in the fetch reply as a safetensors payload, which checks every
tensor's dtype, shape and length on load.  ``EAGLE3_COMPAT_TRANSPORT=rpc``
forces that path, ``=shm`` makes its use an error.

With pipeline parallelism the tensor-rank-0 worker of each stage maps the
same file and writes only the layer slots of the decoder layers its stage
owns: the regions are disjoint, so the stages never write the same bytes,
and the driver checks each stage's metadata and that every slot came from
exactly one stage (:func:`eagle3_compat.capture.merge_stage_captures`).  A
stage on another host sends its slots in its own payload.

The layout is pure arithmetic (:class:`ArenaLayout`) shared by both sides.
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .capture import CaptureError

__all__ = ["ArenaLayout", "DriverArena", "LocalSink", "ShmSink", "SHM_DIR", "PREFIX", "transport_choice"]

SHM_DIR = "/dev/shm"
PREFIX = "eagle3_compat-"
PAGE = mmap.ALLOCATIONGRANULARITY
NONCE_BYTES = 16
TRANSPORTS = ("auto", "shm", "rpc")


def _align(n: int) -> int:
    return -(-n // PAGE) * PAGE


@dataclass(frozen=True)
class ArenaLayout:
    """Byte offsets of every (prompt, layer) region of a call's arena.

    A header page (the driver's nonce), then one page-aligned block per
    prompt, holding its ``num_layers`` regions of ``length x row_bytes``
    back to back.
    """

    lengths: tuple[int, ...]
    num_layers: int
    row_bytes: int

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.row_bytes < 1 or any(n < 1 for n in self.lengths):
            raise ValueError(f"bad arena layout: {self}")

    def block(self, i: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of prompt ``i``'s block (offset page-aligned)."""
        return self._blocks()[i]

    def region(self, i: int, j: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of layer slot ``j`` of prompt ``i``."""
        off, _ = self.block(i)
        size = self.lengths[i] * self.row_bytes
        return off + j * size, size

    @property
    def total(self) -> int:
        blocks = self._blocks()
        off, size = blocks[-1]
        return off + size

    def _blocks(self) -> list[tuple[int, int]]:
        cached = self.__dict__.get("_cache")
        if cached is None:
            cached, off = [], PAGE
            for n in self.lengths:
                size = self.num_layers * n * self.row_bytes
                cached.append((off, size))
                off = _align(off + size)
            object.__setattr__(self, "_cache", cached)
        return cached


def transport_choice() -> str:
    """``EAGLE3_COMPAT_TRANSPORT`` (auto, shm or rpc), checked."""
    value = os.environ.get("EAGLE3_COMPAT_TRANSPORT", "auto").strip().lower() or "auto"
    if value not in TRANSPORTS:
        raise ValueError(f"EAGLE3_COMPAT_TRANSPORT must be one of {TRANSPORTS}, got {value!r}")
    return value


def _dtype(name: str) -> Any:
    import torch  # noqa: PLC0415

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CaptureError(f"unknown dtype {name!r} in the capture metadata")
    return dtype


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove arena names whose driver process no longer exists."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid_text = name[len(PREFIX) :].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except OSError:
                pass
    return removed


class DriverArena:
    """The driver's side of one call's arena (see the module docstring)."""

    def __init__(self, layout: ArenaLayout, directory: str = SHM_DIR) -> None:
        sweep_stale(directory)
        self.layout = layout
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.path: str | None = os.path.join(
            directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        )
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(self._fd, self.nonce)
            os.ftruncate(self._fd, layout.total)
            # Allocate the pages now, in one call: the worker's first touch of
            # each page would otherwise fault it in (measured: 2.3 s for 1 GB
            # of writes on this machine's tmpfs, 0.3 s with the pages present).
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self._fd, 0, layout.total)
        except BaseException:
            self.discard()
            raise

    @staticmethod
    def available(directory: str = SHM_DIR) -> bool:
        return os.path.isdir(directory) and os.access(directory, os.W_OK)

    def spec(self) -> dict[str, Any]:
        """What the worker needs to find and recognise the file."""
        return {"path": self.path, "nonce": self.nonce.hex(), "total": self.layout.total}

    def unlink(self) -> None:
        """Remove the name (idempotent); mapped memory stays until unmapped."""
        path, self.path = self.path, None
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def discard(self) -> None:
        """Give everything back (the call failed or was interrupted)."""
        self.unlink()
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def tensors(self, dtype_name: str, hidden: int) -> list[list[Any]]:
        """``out[i][j]``: prompt ``i``, layer slot ``j``, ``[len_i, hidden]``, on the arena.

        One mapping per prompt: a prompt's memory returns to the system when
        its tensors are gone, whatever happens to the other prompts'.
        """
        import torch  # noqa: PLC0415

        dtype = _dtype(dtype_name)
        if self._fd is None:
            raise CaptureError("the arena of this call was already given back")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        out = []
        try:
            for i, n in enumerate(self.layout.lengths):
                off, size = self.layout.block(i)
                mm = mmap.mmap(self._fd, size, flags=flags, offset=off)
                per_layer = []
                for j in range(self.layout.num_layers):
                    r_off, _ = self.layout.region(i, j)
                    t = torch.frombuffer(mm, dtype=dtype, count=n * hidden, offset=r_off - off)
                    per_layer.append(t.view(n, hidden))
                out.append(per_layer)
        finally:
            self.discard()
        return out


class _Sink:
    """Worker side: writes runs of rows to their (prompt, layer, position) place."""

    buf: Any  # a flat uint8 tensor over the whole arena

    def __init__(self, layout: ArenaLayout, dtype: Any, hidden: int) -> None:
        self.layout = layout
        self.dtype = dtype
        self.hidden = hidden

    def view(self, i: int, j: int) -> Any:
        off, size = self.layout.region(i, j)
        return self.buf[off : off + size].view(self.dtype).view(self.layout.lengths[i], self.hidden)

    def write(self, index: int, slot: int, start: int, count: int, rows: Any) -> None:
        """Put ``rows`` (``count`` of them) at positions ``start..`` of prompt ``index``, layer slot ``slot``."""
        n = self.layout.lengths[index]
        # Explicit checks: copy_ would broadcast a single row or convert a dtype silently.
        if rows.dim() != 2 or rows.shape[0] != count or rows.shape[1] != self.hidden:
            raise CaptureError(
                f"prompt {index}, layer slot {slot}: captured rows of shape {tuple(rows.shape)}, "
                f"expected [{count}, {self.hidden}] (rows scheduled, the model's hidden size)"
            )
        if rows.dtype != self.dtype:
            raise CaptureError(
                f"prompt {index}, layer slot {slot}: captured {rows.dtype}, expected {self.dtype}"
            )
        if start < 0 or start + count > n:
            raise CaptureError(
                f"prompt {index}, layer slot {slot}: rows for positions {start}..{start + count - 1} "
                f"do not fit a prompt of {n} tokens"
            )
        self.view(index, slot)[start : start + count].copy_(rows)

    def close(self) -> None:
        self.buf = None


class ShmSink(_Sink):
    """The driver's arena file, mapped in the rank-0 worker."""

    def __init__(self, layout: ArenaLayout, dtype: Any, hidden: int, mm: mmap.mmap) -> None:
        import torch  # noqa: PLC0415

        super().__init__(layout, dtype, hidden)
        self._mm = mm
        self.buf = torch.frombuffer(mm, dtype=torch.uint8)

    @classmethod
    def open(cls, spec: dict[str, Any], layout: ArenaLayout, dtype: Any, hidden: int) -> ShmSink | str:
        """The mapped arena, or why it cannot be used here (a string)."""
        if spec.get("total") != layout.total:
            raise CaptureError(
                f"the driver sized the arena {spec.get('total')} bytes, the worker computes "
                f"{layout.total}: they disagree on the layout"
            )
        try:
            fd = os.open(spec["path"], os.O_RDWR)
        except OSError as exc:
            return f"cannot open {spec['path']} ({exc.strerror}): not the driver's host?"
        try:
            if os.pread(fd, NONCE_BYTES, 0) != bytes.fromhex(spec["nonce"]):
                return f"{spec['path']} is not the driver's file here (nonce differs)"
            if os.fstat(fd).st_size != layout.total:
                return f"{spec['path']} has the wrong size"
            mm = mmap.mmap(fd, layout.total, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return cls(layout, dtype, hidden, mm)

    def close(self) -> None:
        self.buf = None
        mm, self._mm = self._mm, None
        if mm is not None:
            mm.close()


class LocalSink(_Sink):
    """Rows kept in the worker's own memory, sent back as a safetensors payload."""

    def __init__(self, layout: ArenaLayout, dtype: Any, hidden: int) -> None:
        import torch  # noqa: PLC0415

        super().__init__(layout, dtype, hidden)
        self.buf = torch.empty(layout.total, dtype=torch.uint8)

    def payload(self, slots: Sequence[int] | None = None) -> bytes:
        """The rows of layer ``slots`` (default: all) as safetensors (``"{prompt}.{slot}"``);
        a pipeline stage sends the slots of the layers it owns."""
        from safetensors.torch import save  # noqa: PLC0415

        slots = range(self.layout.num_layers) if slots is None else slots
        tensors = {f"{i}.{j}": self.view(i, j) for i in range(len(self.layout.lengths)) for j in slots}
        return save(tensors)


def tensors_from_payload(
    payload: bytes, layout: ArenaLayout, dtype_name: str, hidden: int, slots: Sequence[int] | None = None
) -> list[list[Any]]:
    """Driver side of the RPC path: the payload's tensors, every one checked.

    ``slots``: the layer slots the payload must hold (default: all);
    ``out[i][j]`` is None for the other slots (another pipeline stage's).
    """
    from safetensors.torch import load  # noqa: PLC0415

    dtype = _dtype(dtype_name)
    got = load(bytes(payload))
    slots = list(range(layout.num_layers)) if slots is None else list(slots)
    expected = {f"{i}.{j}" for i in range(len(layout.lengths)) for j in slots}
    if set(got) != expected:
        raise CaptureError(
            f"the capture payload holds tensors {sorted(set(got) ^ expected)[:5]} that do not "
            "match this call's prompts and layers"
        )
    out = []
    for i, n in enumerate(layout.lengths):
        per_layer: list[Any] = [None] * layout.num_layers
        for j in slots:
            t = got[f"{i}.{j}"]
            if t.dtype != dtype or tuple(t.shape) != (n, hidden):
                raise CaptureError(
                    f"prompt {i}, layer slot {j}: payload tensor {t.dtype} {tuple(t.shape)}, "
                    f"expected {dtype} {(n, hidden)}"
                )
            per_layer[j] = t
        out.append(per_layer)
    return out


def layout_for(lengths: Sequence[int], num_layers: int, hidden: int, dtype_name: str) -> ArenaLayout:
    """The layout of a call, from what both sides know."""
    itemsize = _dtype(dtype_name).itemsize
    return ArenaLayout(tuple(int(n) for n in lengths), int(num_layers), int(hidden) * itemsize)
