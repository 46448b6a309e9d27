"""Device to host: captured rows leave the accelerator without stalling the step.

This module needs torch only (no vLLM), so the very code the worker runs can
be measured on a GPU machine where vLLM is not installed
(``benchmarks/offload_gpu.py``).

On CUDA, a synchronous ``tensor.to("cpu")`` inside the step copies into
pageable memory at a fraction of the link's speed and blocks the host
until the copy is done: measured on an H200 with the shapes of one
8192-token step (4 x [8192, 7168] bf16), 1.3 GB/s, and a 9 ms stand-in
step became 371 ms.  Here each captured tensor is copied with
``non_blocking=True`` into a pinned staging buffer on a side stream that
first waits for the compute stream (so the copy starts after the rows are
written and overlaps the layers that follow); an event marks its end.
The rows are used (written to the call's arena) by a writer thread that
waits on that event, then hands the staging buffer back to its pool.  A
pool holds ``depth`` buffers per capture slot: when the writer falls
behind, :meth:`HostOffload.submit` waits for a free buffer, so host memory
stays bounded instead of growing with the call.

That staging costs a second copy on the host, which at real widths is
slower than the link (one thread, as in vLLM's GPU workers: ~5 GB/s
against the link's 55).  The worker's direct path avoids it: where each
run of rows goes is known before the step (:meth:`StepSlicer.plan_step
<eagle3_compat.capture.StepSlicer.plan_step>`), the arena file is
page-locked once (:meth:`HostOffload.register`), and
:meth:`HostOffload.submit_runs` copies each run from the device straight
to its place, one event for the lot.

On the CPU platform the rows already are in host memory: a tensor that the
capture made itself (``hidden + residual``) is used as is, anything else is
copied once (a later in-place op of the model could change it), and the
work runs inline, at the end of the step.
"""

from __future__ import annotations

import queue
import time
import threading
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["HostOffload", "Staged"]

Tensor = Any


class Staged:
    """Rows on their way to host memory; :meth:`wait` gives them on the host."""

    __slots__ = ("_tensor", "_event", "_release")

    def __init__(self, tensor: Tensor, event: Any = None, release: Callable[[], None] | None = None):
        self._tensor = tensor
        self._event = event
        self._release = release

    def wait(self) -> Tensor:
        """The rows in host memory (valid until :meth:`release`)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._tensor

    def release(self) -> None:
        """Give the staging buffer back (idempotent)."""
        self._tensor = None
        release, self._release = self._release, None
        if release is not None:
            release()


class _Pool:
    """``depth`` growable pinned buffers for one capture slot."""

    def __init__(self, depth: int) -> None:
        self.free: queue.Queue = queue.Queue()
        for _ in range(depth):
            self.free.put([None])  # a holder: [pinned uint8 tensor or None]


class HostOffload:
    """Moves captured rows from ``device`` to host memory.

    ``submit`` starts a copy and returns a :class:`Staged`; ``run`` runs the
    work that uses the rows (on the writer thread on CUDA, inline on the
    CPU); ``drain`` waits for that work and re-raises its first error.
    """

    def __init__(self, device: Any, depth: int = 2) -> None:
        import torch  # noqa: PLC0415

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.depth = depth
        # cudaHostRegister calls so far, the bytes they page-locked and the
        # seconds they took (each file is registered once: a new file per
        # call shows here as time spent at the link's first use).
        self.registrations = 0
        self.registered_bytes = 0
        self.register_seconds = 0.0
        self._pools: dict[Hashable, _Pool] = {}
        self._error: BaseException | None = None
        if self.cuda:
            self._stream = torch.cuda.Stream(self.device)
            self._work: queue.Queue = queue.Queue()
            self._thread = threading.Thread(target=self._writer, name="e3c-offload", daemon=True)
            self._thread.start()

    # -- copies -----------------------------------------------------------------
    def submit(self, key: Hashable, tensor: Tensor, owned: bool = False) -> Staged:
        """Start moving ``tensor`` (rows already trimmed to what is needed) to the host.

        ``owned``: the tensor was made by the capture itself and nothing else
        writes to it, so on the CPU it need not be copied.
        """
        if not self.cuda:
            if tensor.device.type != "cpu":  # an accelerator other than CUDA
                return Staged(tensor.to("cpu"))
            return Staged(tensor if owned else tensor.clone())
        return self._submit_cuda(key, tensor)

    def _submit_cuda(self, key: Hashable, tensor: Tensor) -> Staged:
        import torch  # noqa: PLC0415

        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(self.depth)
        holder = pool.free.get()  # waits while the writer still uses every buffer
        nbytes = tensor.numel() * tensor.element_size()
        buf = holder[0]
        if buf is None or buf.numel() < nbytes:
            # Grown to the largest step seen; steps are bounded by the engine's
            # max_num_batched_tokens, so this settles after the first steps.
            buf = holder[0] = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        dst = buf[:nbytes].view(tensor.dtype).view(tensor.shape)
        return Staged(dst, self._copy_on_side_stream([(dst, tensor)]), lambda: pool.free.put(holder))

    def _copy_on_side_stream(self, pairs: list[tuple[Tensor, Tensor]]) -> Any:
        """Start ``dst.copy_(src)`` for each pair after the compute stream's work; the end event."""
        import torch  # noqa: PLC0415

        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        # The caching allocator must not hand the sources' memory to another
        # tensor before the side stream has read it (once per block: the runs
        # of a step are views of one layer's rows).
        seen: set[int] = set()
        for _dst, src in pairs:
            base = src if src._base is None else src._base
            if id(base) not in seen:
                seen.add(id(base))
                base.record_stream(stream)
        return event

    # -- straight into registered host memory ------------------------------------
    def register(self, host: Tensor) -> Callable[[], None]:
        """Page-lock ``host`` (a CPU tensor over, e.g., a call's arena) for
        :meth:`submit_into`; returns the function that unregisters it.

        On CUDA this is ``cudaHostRegister``: copies into ``host`` then run at
        the link's speed without a staging buffer and without the second host
        copy (measured on an H200, 4 x [8192, 7168] bf16 per 8 ms stand-in
        step: +4.9 % against +194 % with staging and the writer's copy into
        the arena; the copy alone takes the step +4.5 %:
        ``benchmarks/offload_gpu.py``).  Elsewhere it does nothing.
        """
        if not self.cuda:
            return lambda: None
        import torch  # noqa: PLC0415

        cudart = torch.cuda.cudart()
        ptr, size = host.data_ptr(), host.numel() * host.element_size()
        t0 = time.perf_counter()
        err = cudart.cudaHostRegister(ptr, size, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {size} bytes failed: {err}")
        self.registrations += 1
        self.registered_bytes += size
        self.register_seconds += time.perf_counter() - t0
        done = [False]

        def unregister() -> None:
            if not done[0]:
                done[0] = True
                torch.cuda.synchronize(self.device)  # no copy may still target it
                cudart.cudaHostUnregister(ptr)

        return unregister

    def submit_into(self, dst: Tensor, tensor: Tensor) -> Staged:
        """Copy ``tensor`` into ``dst`` (host memory given to :meth:`register`,
        same shape and dtype); the returned :class:`Staged` waits for the copy
        and gives ``dst``."""
        return Staged(dst, self.submit_runs([(dst, tensor)])._event)

    def submit_runs(self, pairs: list[tuple[Tensor, Tensor]]) -> Staged:
        """Copy each ``(dst, rows)`` pair: ``rows`` (on the device) into ``dst``
        (host memory, on CUDA given to :meth:`register`, e.g. a run's place in
        the call's arena); one :class:`Staged` waits for them all (its tensor
        is ``None``: the rows are where they were sent).

        This is the worker's direct path: no staging buffer and no second
        host copy, so a step's rows cost the link's time only.  Shapes and
        dtypes are checked first (``copy_`` would broadcast a row or convert
        a dtype without a word); nothing is copied if one pair is wrong.

        Raises:
            ValueError: a destination's shape or dtype differs from its rows'.
        """
        for dst, tensor in pairs:
            if dst.shape != tensor.shape or dst.dtype != tensor.dtype:
                raise ValueError(
                    f"submit_runs: destination {dst.dtype} {tuple(dst.shape)} does not match "
                    f"the rows {tensor.dtype} {tuple(tensor.shape)}"
                )
        if not self.cuda:
            for dst, tensor in pairs:
                dst.copy_(tensor)
            return Staged(None)
        return Staged(None, self._copy_on_side_stream(pairs) if pairs else None)

    # -- the work that uses the rows ---------------------------------------------
    def run(self, fn: Callable[[], None], release: Callable[[], None] | None = None) -> None:
        """Run ``fn`` (which waits on its ``Staged`` rows) off the step's critical path.

        ``release``: gives back what ``fn`` would have given back (its staging
        buffers) when ``fn`` is skipped because earlier work failed; without
        it those buffers would never return to their pools and the next
        :meth:`submit` of their slot would wait for ever, hanging the step.
        """
        if not self.cuda:
            fn()
            return
        self._work.put((fn, release))

    def _writer(self) -> None:
        while True:
            item = self._work.get()
            try:
                if item is None:
                    return
                fn, release = item
                if self._error is None:
                    fn()
                elif release is not None:  # the call already failed: free its buffers only
                    release()
            except BaseException as exc:  # noqa: BLE001 - re-raised by drain()
                if self._error is None:
                    self._error = exc
            finally:
                self._work.task_done()

    def drain(self) -> None:
        """Wait until every submitted piece of work has run; re-raise its first error."""
        if self.cuda:
            self._work.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop the writer thread and drop the staging buffers."""
        if self.cuda and self._thread.is_alive():
            self._work.put(None)
            self._thread.join(timeout=30)
        self._pools.clear()
