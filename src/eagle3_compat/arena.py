"""The arena: where one call's hidden states go from the rank-0 worker to the user.

The driver (the user's process) leases one file per ``generate()`` call
(one per prompt for a stream) in ``/dev/shm``, sized for every prompt and
layer, and names it in the arm RPC.  The rank-0 worker maps it and writes
each captured run of rows to its final place (prompt ``i``, layer ``j``,
position ``p``) as the steps run; at the end of the call it replies with
metadata only.  The driver hands out tensors that *are* that memory: no
serialisation, no copy, whatever the size of the call.

Lifetime: the driver unlinks the file's name as soon as the worker has
mapped it (after the arm RPC), so ``/dev/shm`` holds a name only for the
duration of that RPC and nothing is left behind by a killed worker, a dead
engine or an interrupted driver; the memory itself is returned when the
last mapping goes.  Files are reused (:class:`ArenaPool`): once every
result tensor of a call is gone, its file, still mapped in the driver and
the worker, serves a later call of a similar size; the pool keeps a
bounded number of bytes and frees the rest (and everything at ``close()``),
and the worker unmaps what the driver freed at its next RPC.  Names left by
a driver that was killed inside the arm RPC carry its pid and are removed
by the next driver on the machine.

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
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import settings
from .capture import CaptureError

__all__ = [
    "ArenaLayout", "ArenaPool", "DriverArena", "LocalSink", "Probe", "ShmSink", "SHM_DIR", "PREFIX",
    "probe_seen", "shard_choice", "transport_choice",
]

SHM_DIR = "/dev/shm"
PREFIX = "eagle3_compat-"
PAGE = mmap.ALLOCATIONGRANULARITY
NONCE_BYTES = 16
TRANSPORTS = settings.TRANSPORTS


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


def direct_choice() -> bool:
    """``EAGLE3_COMPAT_DIRECT`` (1, the default: rows are copied into the
    arena during the step where the worker can; 0: through staging buffers
    after the step, the earlier path, for before/after figures), checked."""
    return settings.DIRECT.get()


def shard_choice() -> bool:
    """``EAGLE3_COMPAT_SHARD`` (1, the default: with tensor parallelism each
    rank copies its share of every step's rows into the arena, over its own
    device-to-host link, where every rank of the stage sees the driver's
    ``/dev/shm``; 0: tensor rank 0 copies every row, as before), checked."""
    return settings.SHARD.get()


class Probe:
    """A small file in ``/dev/shm`` with a random nonce: the workers that can
    read it share the driver's host and shared memory (:func:`probe_seen`).
    Named like an arena (the driver's pid), so a killed driver's probe is
    swept by the next one; removed on exit from the ``with`` block."""

    def __init__(self, directory: str = SHM_DIR) -> None:
        self.path = os.path.join(directory, f"{PREFIX}{os.getpid()}-probe-{secrets.token_hex(6)}")
        self.nonce = secrets.token_hex(NONCE_BYTES)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, self.nonce.encode())
        finally:
            os.close(fd)

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def probe_seen(path: str, nonce: str) -> bool:
    """Whether the driver's :class:`Probe` at ``path`` is readable here with its nonce."""
    try:
        with open(path, "rb") as f:
            return f.read(len(nonce) + 1) == nonce.encode()
    except OSError:
        return False


def transport_choice() -> str:
    """``EAGLE3_COMPAT_TRANSPORT`` (auto, shm or rpc), checked."""
    return settings.TRANSPORT.get()


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


POOL_ENV = settings.ARENA_POOL_BYTES.name


def pool_keep_bytes() -> int | None:
    """``EAGLE3_COMPAT_ARENA_POOL_BYTES``, checked: ``None`` for ``auto`` (the
    default), else how many bytes of released arenas a pool keeps for reuse."""
    return settings.ARENA_POOL_BYTES.get()


def _capacity(total: int) -> int:
    """The size of a new file for ``total`` bytes: rounded up to a size class
    (an eighth of its power of two, whole pages; at most 12.5 % more), so that
    files are reused by calls of similar sizes."""
    step = max(PAGE, 1 << max(0, total.bit_length() - 4))
    return -(-total // step) * step


class _File:
    """One shared-memory file: created with its pages allocated, mapped here once
    (page tables filled), its name removed once the worker has mapped it."""

    def __init__(self, capacity: int, directory: str) -> None:
        self.key = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self.path: str | None = os.path.join(directory, self.key)
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.capacity = capacity
        self.mm: mmap.mmap | None = None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, self.nonce)
            os.ftruncate(fd, capacity)
            # Allocate the pages now, in one call: the worker's first touch of
            # each page would otherwise fault it in (measured: 2.3 s for 1 GB
            # of writes on this machine's tmpfs, 0.3 s with the pages present).
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, capacity)
            self.mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)

    def unlink(self) -> None:
        path, self.path = self.path, None
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Drop the name and this process's mapping (the pages go with the last mapping)."""
        self.unlink()
        mm, self.mm = self.mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # tensors still use it: it goes with them
                pass


class _Handed:
    """The prompts of a lease handed out as tensors; the file returns to its
    pool when the last prompt's tensors are gone."""

    def __init__(self, pool: ArenaPool, file: _File, layout: ArenaLayout) -> None:
        self.pool, self.file, self.layout = pool, file, layout
        self.alive = set(range(len(layout.lengths)))
        self.punched: set[int] = set()

    def release(self, i: int) -> None:
        with self.pool._lock:
            self.alive.discard(i)
            if not self.alive:
                self.pool._held.pop(id(self), None)
                self.pool._give_back(self.file)

    def punch_released(self) -> None:
        """Return the pages of released prompts while others are still held
        (a caller keeping some results of a call keeps only those)."""
        mm = self.file.mm
        if mm is None or not hasattr(mmap, "MADV_REMOVE"):
            return
        for i in range(len(self.layout.lengths)):
            if i not in self.alive and i not in self.punched:
                off, size = self.layout.block(i)
                try:
                    mm.madvise(mmap.MADV_REMOVE, off, size)
                except OSError:
                    return
                self.punched.add(i)
        tail = _align(self.layout.total)
        if -1 not in self.punched and tail < self.file.capacity:
            try:
                mm.madvise(mmap.MADV_REMOVE, tail, self.file.capacity - tail)
            except OSError:
                return
            self.punched.add(-1)  # the slack of the file's size class


class ArenaPool:
    """The driver's shared-memory files, kept for reuse.

    Making a file costs more than filling it: allocating its pages, and
    mapping them in two processes (each page's first touch is a page
    fault), take ~0.8 s per GB on this project's CPU machine against
    ~0.13 s for the copy of the rows (``benchmarks/datapath.py``).  A file
    whose results have all been released goes back to the pool, still
    mapped here and in the rank-0 worker, and the next call of a similar
    size writes into it.  Every row of a call is written in that call
    (the driver checks that the captured runs tile every prompt: see
    :func:`eagle3_compat.capture.check_segments`), so nothing of an earlier
    call can show through.

    ``keep_bytes``: how many bytes of released files to keep (``None``:
    as many as were ever leased at once, i.e. one call's worth for
    ``generate()``; ``0``: none, every file is freed when its results
    are).  :meth:`close` frees what is kept.
    """

    def __init__(self, keep_bytes: int | None = None, directory: str = SHM_DIR) -> None:
        sweep_stale(directory)
        self.directory = directory
        self.keep_bytes = keep_bytes
        self._lock = threading.RLock()
        self._free: list[_File] = []  # oldest first
        self._held: dict[int, _Handed] = {}  # partly released leases
        self._forget: list[str] = []  # files the worker may unmap
        self._leased = 0
        self._high_water = 0
        self._made = 0
        self._closed = False

    @staticmethod
    def available(directory: str = SHM_DIR) -> bool:
        return os.path.isdir(directory) and os.access(directory, os.W_OK)

    def lease(self, layout: ArenaLayout) -> DriverArena:
        """An arena for ``layout``: a kept file of the right size, or a new one."""
        return DriverArena(layout, pool=self)

    def stats(self) -> dict[str, int]:
        """Bytes leased now, bytes kept free, files kept, files made so far."""
        with self._lock:
            return {
                "leased_bytes": self._leased,
                "free_bytes": sum(f.capacity for f in self._free),
                "free_files": len(self._free),
                "files_made": self._made,
            }

    def pop_forget(self) -> list[str]:
        """Keys of files this pool freed since the last call (the worker unmaps them)."""
        with self._lock:
            out, self._forget = self._forget, []
        return out

    def close(self) -> None:
        """Free every kept file; files still leased are freed when released."""
        with self._lock:
            self._closed = True
            for f in self._free:
                f.close()
            self._free.clear()

    def _take(self, total: int) -> _File:
        with self._lock:
            if self._closed:
                raise CaptureError("the arena pool is closed")
            for handed in list(self._held.values()):
                handed.punch_released()
            fits = [f for f in self._free if total <= f.capacity <= 2 * total]
            file = min(fits, key=lambda f: f.capacity) if fits else None
            if file is not None:
                self._free.remove(file)
            else:
                file = _File(_capacity(total), self.directory)
                self._made += 1
            self._leased += file.capacity
            self._high_water = max(self._high_water, self._leased)
            return file

    def _give_back(self, file: _File) -> None:
        with self._lock:
            self._leased -= file.capacity
            if self._closed or file.mm is None:
                self._drop(file)
                return
            self._free.append(file)
            keep = self._high_water if self.keep_bytes is None else self.keep_bytes
            while self._free and sum(f.capacity for f in self._free) > keep:
                self._drop(self._free.pop(0))

    def _retire(self, file: _File) -> None:
        """A file whose call failed: never reused (the worker may still hold rows for it)."""
        with self._lock:
            self._leased -= file.capacity
            self._drop(file)

    def _drop(self, file: _File) -> None:
        file.close()
        self._forget.append(file.key)


class DriverArena:
    """The driver's side of one call's (or one stream prompt's) arena: a file
    of an :class:`ArenaPool` leased for ``layout`` (see the module docstring).

    ``DriverArena(layout)`` without a pool: a file of its own, freed when its
    results are.
    """

    def __init__(
        self, layout: ArenaLayout, directory: str = SHM_DIR, pool: ArenaPool | None = None
    ) -> None:
        self.layout = layout
        self._pool = pool if pool is not None else ArenaPool(keep_bytes=0, directory=directory)
        self._file: _File | None = self._pool._take(layout.total)
        self._handed = False

    @staticmethod
    def available(directory: str = SHM_DIR) -> bool:
        return ArenaPool.available(directory)

    @property
    def path(self) -> str | None:
        return None if self._file is None else self._file.path

    def spec(self) -> dict[str, Any]:
        """What the worker needs to find and recognise the file (and which
        files of the pool it may forget)."""
        f = self._file
        if f is None:
            raise CaptureError("the arena of this call was already given back")
        return {
            "path": f.path,
            "key": f.key,
            "nonce": f.nonce.hex(),
            "total": self.layout.total,
            "capacity": f.capacity,
            "keep": self._pool.keep_bytes != 0,
            "forget": self._pool.pop_forget(),
        }

    def unlink(self) -> None:
        """Remove the name (idempotent); mapped memory stays until unmapped."""
        if self._file is not None:
            self._file.unlink()

    def discard(self) -> None:
        """Give everything back (the call failed or was interrupted); a no-op
        once the results were handed out (they give the file back)."""
        file, self._file = self._file, None
        if file is not None and not self._handed:
            self._pool._retire(file)

    def tensors(self, dtype_name: str, hidden: int) -> list[list[Any]]:
        """``out[i][j]``: prompt ``i``, layer slot ``j``, ``[len_i, hidden]``, on the arena.

        Each tensor's storage is exactly its own rows (so ``torch.save``
        writes that tensor only); the file goes back to the pool when every
        prompt's tensors are gone.
        """
        import numpy as np  # noqa: PLC0415
        import torch  # noqa: PLC0415

        dtype = _dtype(dtype_name)
        file = self._file
        if file is None or file.mm is None:
            raise CaptureError("the arena of this call was already given back")
        out, blocks = [], []
        try:
            for i, n in enumerate(self.layout.lengths):
                off, size = self.layout.block(i)
                block = np.frombuffer(file.mm, dtype=np.uint8, count=size, offset=off)
                per_layer = []
                for j in range(self.layout.num_layers):
                    r_off, _ = self.layout.region(i, j)
                    t = torch.frombuffer(block, dtype=dtype, count=n * hidden, offset=r_off - off)
                    per_layer.append(t.view(n, hidden))
                out.append(per_layer)
                blocks.append(block)
        except BaseException:
            del out, blocks
            self.discard()
            raise
        handed = _Handed(self._pool, file, self.layout)
        with self._pool._lock:
            self._pool._held[id(handed)] = handed
            self._handed = True
            self._file = None
            for i, block in enumerate(blocks):
                weakref.finalize(block, handed.release, i)
        return out


class _Sink:
    """Worker side: writes runs of rows to their (prompt, layer, position) place."""

    buf: Any  # a flat uint8 tensor over the whole arena

    def __init__(self, layout: ArenaLayout, dtype: Any, hidden: int) -> None:
        self.layout = layout
        self.dtype = dtype
        self.hidden = hidden
        self._rows: dict[int, Any] = {}  # prompt -> its block as [layers, length, hidden]

    def rows(self, i: int) -> Any:
        """Prompt ``i``'s block as one ``[num_layers, length, hidden]`` tensor.

        Made once per prompt: the worker's layer hook indexes it for every run
        of every step (``rows(i)[slot, start:start + count]``); building the
        view anew for each run cost more host time than the copy it feeds
        (on the H200's host: 25 us per run and layer with the copy, 11 us now).
        """
        t = self._rows.get(i)
        if t is None:
            off, size = self.layout.block(i)
            shape = (self.layout.num_layers, self.layout.lengths[i], self.hidden)
            t = self._rows[i] = self.buf[off : off + size].view(self.dtype).view(shape)
        return t

    def view(self, i: int, j: int) -> Any:
        """Layer slot ``j`` of prompt ``i``: ``[length, hidden]``."""
        return self.rows(i)[j]

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
        self._rows.clear()
        self.buf = None


class ShmSink(_Sink):
    """The driver's arena file, mapped in the rank-0 worker."""

    def __init__(
        self, layout: ArenaLayout, dtype: Any, hidden: int, mm: mmap.mmap, kept_key: str | None = None
    ) -> None:
        import torch  # noqa: PLC0415

        super().__init__(layout, dtype, hidden)
        self._mm: mmap.mmap | None = mm
        self.buf = torch.frombuffer(mm, dtype=torch.uint8)
        # The pool file's key when the worker's cache keeps the mapping (it
        # outlives this call, is not closed with the sink, and is worth
        # page-locking once for direct copies); None: this sink owns it.
        self.kept_key = kept_key

    @classmethod
    def open(
        cls,
        spec: dict[str, Any],
        layout: ArenaLayout,
        dtype: Any,
        hidden: int,
        cache: dict[str, mmap.mmap] | None = None,
    ) -> ShmSink | str:
        """The mapped arena, or why it cannot be used here (a string).

        ``cache``: the worker's mappings of the driver's pool files by key;
        a file the driver leases again is found there (its name is gone by
        then), a new one is mapped and kept there when the spec says
        ``keep``.
        """
        if spec.get("total") != layout.total:
            raise CaptureError(
                f"the driver sized the arena {spec.get('total')} bytes, the worker computes "
                f"{layout.total}: they disagree on the layout"
            )
        if cache is not None:
            for key in spec.get("forget", ()):
                mm = cache.pop(key, None)
                if mm is not None:
                    _close_mapping(mm)
        capacity = int(spec.get("capacity", layout.total))
        if capacity < layout.total:
            raise CaptureError(f"an arena file of {capacity} bytes for a layout of {layout.total}")
        key = spec.get("key")
        mm = None if cache is None or key is None else cache.get(key)
        if mm is not None:
            if mm[:NONCE_BYTES] != bytes.fromhex(spec["nonce"]) or len(mm) != capacity:
                return f"the mapping kept for arena {key} is not the driver's file (nonce differs)"
            return cls(layout, dtype, hidden, mm, kept_key=key)
        if spec.get("path") is None:
            return f"arena {key} has no name left and is not mapped in this worker"
        try:
            fd = os.open(spec["path"], os.O_RDWR)
        except OSError as exc:
            return f"cannot open {spec['path']} ({exc.strerror}): not the driver's host?"
        try:
            if os.pread(fd, NONCE_BYTES, 0) != bytes.fromhex(spec["nonce"]):
                return f"{spec['path']} is not the driver's file here (nonce differs)"
            if os.fstat(fd).st_size != capacity:
                return f"{spec['path']} has the wrong size"
            mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        keep = cache is not None and key is not None and bool(spec.get("keep"))
        if keep:
            cache[key] = mm  # type: ignore[index]
        return cls(layout, dtype, hidden, mm, kept_key=key if keep else None)

    def close(self) -> None:
        self._rows.clear()
        self.buf = None
        mm, self._mm = self._mm, None
        if mm is not None and self.kept_key is None:
            mm.close()


def _close_mapping(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # rows still in flight use it: it goes with them
        pass


def forget_all(cache: dict[str, mmap.mmap]) -> None:
    """The worker's teardown: unmap every kept pool file."""
    for mm in cache.values():
        _close_mapping(mm)
    cache.clear()


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
