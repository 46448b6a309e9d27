"""Bounding the heap of a CPU worker: ``malloc_trim`` when its memory has grown.

On vLLM's CPU platform the model's per-step buffers live in the worker's
host memory, and their sizes change with the number of tokens in each step.
glibc keeps what the worker frees (only the top of its heap goes back to the
system on its own) and reuses it imperfectly, so the worker's resident
memory grows with the number of steps run, for plain ``LLM.generate`` as
much as for a capturing engine: measured with vLLM 0.16 at hidden 2048,
+2.2 GiB of heap over 4000 prompts, all but ~0.15 GiB of it free memory
that ``malloc_trim(0)`` returns (``benchmarks/engine_heap.py``, issue #16).
A streaming job's memory would then depend on the dataset's length.

:class:`HeapTrimmer` runs after each captured step of a CPU worker: it
reads the process's resident size (one read of ``/proc/self/statm``) and
calls ``malloc_trim(0)`` only when that has grown by the threshold since
its last trim, and at most once per interval.  A trim's cost is mostly
after it: it also returns the pages of the model's per-step buffers that
are free between steps, and the next steps fault them in again (at hidden
2048, ~350 MiB a step here: trimming whenever 256 MiB had grown trimmed at
nearly every step and cost the CLI job ~4 % of its speed).  The interval
bounds that cost; the memory held stays bounded by the threshold plus what
grows in one interval.  ``EAGLE3_COMPAT_CPU_TRIM_MIB`` sets the threshold
in MiB (default 256; ``0``: after every captured step; ``off``: never),
``EAGLE3_COMPAT_CPU_TRIM_INTERVAL_S`` the interval (default 30 s; 0 with a
threshold of 0).  Not used on CUDA workers, whose model buffers are device
memory.  Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import ctypes
import math
import os
import time
from collections.abc import Callable

from .logs import get_logger

log = get_logger(__name__)

ENV = "EAGLE3_COMPAT_CPU_TRIM_MIB"
DEFAULT_MIB = 256.0
INTERVAL_ENV = "EAGLE3_COMPAT_CPU_TRIM_INTERVAL_S"
DEFAULT_INTERVAL_S = 30.0
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's resident set size, from ``/proc/self/statm``."""
    with open("/proc/self/statm", "rb") as fh:
        return int(fh.read().split()[1]) * _PAGE


def _glibc_trim() -> Callable[[], object] | None:
    try:
        fn = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS): nothing to trim this way
    fn.argtypes = [ctypes.c_size_t]
    return lambda: fn(0)


def threshold_from_env(environ: dict[str, str] | None = None) -> float | None:
    """The threshold in MiB (``None``: off), from :data:`ENV`.

    Raises:
        ValueError: the variable is set to something other than ``off`` or a
            number >= 0; the message names the variable and the value.
    """
    raw = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not raw:
        return DEFAULT_MIB
    if raw.lower() in ("off", "none", "no", "false"):
        return None
    try:
        mib = float(raw)
    except ValueError:
        mib = -1.0
    if not mib >= 0:  # also NaN
        raise ValueError(f"{ENV}={raw!r}: expected a number of MiB >= 0, or 'off'")
    return mib


def interval_from_env(environ: dict[str, str] | None = None) -> float | None:
    """The least time in seconds between two trims, from :data:`INTERVAL_ENV`
    (``None``: not set, the caller's default).

    Raises:
        ValueError: the variable is set to something other than a number of
            seconds >= 0; the message names the variable and the value.
    """
    raw = (os.environ if environ is None else environ).get(INTERVAL_ENV, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise ValueError(f"{INTERVAL_ENV}={raw!r}: expected a number of seconds >= 0")
    return seconds


class HeapTrimmer:
    """Calls ``trim`` after a step when ``rss()`` has grown by ``threshold_bytes``
    since the last trim (or since the first step) and ``min_interval_s`` have
    passed since the last trim (or the first step).

    ``rss``, ``trim`` and ``clock`` are injectable for tests; the defaults
    read ``/proc/self/statm``, call glibc's ``malloc_trim(0)`` and read
    ``time.monotonic``.
    """

    def __init__(self, threshold_bytes: int, min_interval_s: float = 0.0,
                 rss: Callable[[], int] = resident_bytes, trim: Callable[[], object] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threshold_bytes < 0:
            raise ValueError(f"threshold_bytes must be >= 0, got {threshold_bytes}")
        if not min_interval_s >= 0:
            raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s}")
        self.threshold_bytes = threshold_bytes
        self.min_interval_s = min_interval_s
        self._rss = rss
        self._trim = trim if trim is not None else _glibc_trim()
        self._clock = clock
        self._base: int | None = None
        self._last = 0.0
        self.trims = 0
        self.released_bytes = 0

    @classmethod
    def for_device(cls, device: object, environ: dict[str, str] | None = None) -> HeapTrimmer | None:
        """The trimmer for a worker whose model is on ``device`` (a CPU one only),
        or ``None`` (CUDA and other devices, :data:`ENV` ``off``, no glibc)."""
        if getattr(device, "type", str(device)) != "cpu":
            return None
        mib = threshold_from_env(environ)
        if mib is None:
            return None
        interval = interval_from_env(environ)
        if interval is None:
            interval = 0.0 if mib == 0 else DEFAULT_INTERVAL_S
        trimmer = cls(int(mib * 2**20), interval)
        if trimmer._trim is None:
            return None
        return trimmer

    def after_step(self) -> bool:
        """Trim if the process grew by the threshold and the interval has passed;
        returns whether it trimmed."""
        now = self._rss()
        if self._base is None:
            self._last = self._clock()  # the first step: the interval counts from here
        if self._base is None or now < self._base:
            self._base = now  # the first step, or memory went back down by itself
            if self.threshold_bytes:
                return False
        if now - self._base < self.threshold_bytes:
            return False
        if self.min_interval_s and self._clock() - self._last < self.min_interval_s:
            return False
        grown = now - self._base
        self._trim()  # type: ignore[misc]
        after = self._rss()
        self._last = self._clock()
        self.trims += 1
        self.released_bytes += max(0, now - after)
        self._base = after
        log.debug("malloc_trim after %d MiB of growth: %d -> %d MiB resident", grown >> 20, now >> 20, after >> 20)
        return True
