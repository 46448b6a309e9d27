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
calls ``malloc_trim(0)`` only when that has grown by the threshold.  A trim
also returns the free pages of the model's per-step buffers, which the next
step faults in again (at hidden 2048, ~100-450 MiB a step here): the level
growth is counted from is therefore taken at the step after each trim, and
that re-growth does not count.  Without it a threshold below the working
set trimmed at nearly every step and cost the CLI job ~4 % of its speed;
now there is at least one step between two trims.  The memory held stays
within the level after the last trim, plus the working set faulted in
again, plus the threshold, plus one step's growth.
``EAGLE3_COMPAT_CPU_TRIM_MIB`` sets the threshold in MiB (default 64;
``0``: after every captured step; ``off``: never),
``EAGLE3_COMPAT_CPU_TRIM_INTERVAL_S`` an optional least time between two
trims (default 0).  Not used on CUDA workers, whose model buffers are
device memory.

What a trim cannot return is what the worker still holds.  One part of
it grows with the steps run: oneDNN's primitive cache.  vLLM's CPU linear
layers (``ops.onednn_mm``) make a oneDNN primitive for each distinct number
of tokens in a step, and oneDNN keeps up to 1024 of them (its default); a
prefill job's steps rarely repeat a token count, so the cache gains an
entry per distinct layer shape (4 for a Llama) a step until it is full,
some 250 steps in.  Capped at 64 entries the level after the trims at the
end of a 2000-sample job (hidden 2048, 64 steps) was ~35 MiB lower
(2469-2474 MiB against 2503-2506, three runs each;
``benchmarks/cli_job.py``), and it stops growing after ~16 steps.  The
generator therefore starts a CPU engine with
``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` at :data:`PRIMITIVE_CACHE_DEFAULT`
unless the user set it (:func:`engine_environment`); vLLM's own cache in
each layer (32 entries) is left as it is.

What a trim costs is the next step faulting the returned pages in again,
4 KiB at a time: at hidden 2048 ~98,000 faults a trim, ~2.85 M over a
2000-sample job, and ~5-7 s of the engine's CPU in the kernel's fault path
(a ``perf`` profile of the whole tree put it in the fault's entry, page
table locks and memory-cgroup charging, not in zeroing the pages).  With
PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` its CPU allocator gives every buffer of
2 MiB or more a 2 MiB alignment and asks for transparent huge pages
(``madvise(MADV_HUGEPAGE)``; PyTorch's CPU tuning guide recommends it for
inference), so those pages come back 2 MiB a fault.  Measured with the
CLI job at hidden 2048 (2000 samples, against plain prefill without it):
0.89x -> 0.94x of plain prefill's speed after the start, the engine's CPU
136 -> 128 s, and the whole tree's peak 3680 -> 3330 MiB (+10.2 % -> +5.4 %
from 200 to 2000 samples; ``benchmarks/cli_job.py``, mode ``cli-no-thp``
for the job without it).  The generator therefore starts a CPU engine with
``THP_MEM_ALLOC_ENABLE=1`` unless the user set it (``0`` keeps PyTorch's
default); where the system's THP setting is ``never`` it changes only the
alignment.  On a virtual machine that hands free 2 MiB blocks back to its
hypervisor (:func:`huge_pages_reported`, which ``eagle3-compat doctor``
reports) a fresh huge page costs ~20x a 4 KiB one, and there the setting
made a 16-layer model's engine start twice as long (loading the weights
takes fresh memory); there the engine starts with huge pages refused and
its workers take them back once the model is loaded
(:func:`engine_environment`, :func:`allow_huge_pages_after_start`).  After
the start the setting made the 4-layer CLI job faster and the 16-layer one
slower on such a machine (issue #16): kept for the steps.

The model's own per-step buffers above glibc's mmap threshold (at most
32 MiB by glibc's own rule) were mapped anew and zeroed by the kernel at
every op; each capturing CPU worker now fixes the threshold at 1 GiB once
its model is loaded (:func:`reuse_step_buffers`, :data:`MMAP_ENV`), so the
heap keeps them for the next step, and the trim above bounds what it keeps.

A CPU engine of several workers (tensor or pipeline parallel) on vLLM
0.11-0.17 also starts with ``VLLM_SLEEP_WHEN_IDLE=1`` unless the user set
it (:data:`IDLE_SLEEP_ENV`).  Each worker of such an engine waits for the
next step on vLLM's shared-memory queue by spinning on ``sched_yield()``,
pinned to its core, for as long as the engine lives; between calls (a
notebook, a trainer between extraction rounds) that is every one of the
engine's cores at 100 %, taken from the user's own work.  With the variable
a worker sleeps 0.1 s at a time once it has waited 3 s (vLLM's
``SpinSleepTimer``); while steps come it spins as before.  Seen here: two
such idle engines on a 2-core machine starved the kernel's per-CPU work
until a third engine's workers hung at start (issue #16's CI run).  vLLM
0.19 and later wait on a socket instead and do not know the variable
(they warn about unknown ``VLLM_`` variables), so it is set only where
vLLM defines it.  Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Callable, Iterator, MutableMapping

from . import settings
from .logs import get_logger

log = get_logger(__name__)

ENV = settings.CPU_TRIM_MIB.name
DEFAULT_MIB = settings.CPU_TRIM_MIB_DEFAULT
INTERVAL_ENV = settings.CPU_TRIM_INTERVAL_S.name
DEFAULT_INTERVAL_S = 0.0
PRIMITIVE_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
PRIMITIVE_CACHE_DEFAULT = 64
THP_ENV = "THP_MEM_ALLOC_ENABLE"  # PyTorch's c10 CPU allocator (c10/core/impl/alloc_cpu.cpp)
IDLE_SLEEP_ENV = "VLLM_SLEEP_WHEN_IDLE"  # vLLM 0.11-0.17 shm_broadcast: SpinSleepTimer, not SpinTimer
# set (internally) where the engine's processes start with huge pages refused
# (prctl PR_SET_THP_DISABLE, inherited) and take them back once the model is loaded
START_WITHOUT_HUGE_PAGES_ENV = settings.THP_AFTER_START.name
_PR_SET_THP_DISABLE, _PR_GET_THP_DISABLE = 41, 42  # linux/prctl.h
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
    return settings.CPU_TRIM_MIB.get(environ)


def interval_from_env(environ: dict[str, str] | None = None) -> float | None:
    """The least time in seconds between two trims, from :data:`INTERVAL_ENV`
    (``None``: not set, the caller's default).

    Raises:
        ValueError: the variable is set to something other than a number of
            seconds >= 0; the message names the variable and the value.
    """
    return settings.CPU_TRIM_INTERVAL_S.get(environ)


# VIRTIO_BALLOON_F_REPORTING: the guest hands free blocks of memory back to
# its hypervisor (virtio spec 1.2, 5.5.3; Linux mm/page_reporting.c).
_BALLOON_REPORTING_BIT = 5
_PAGEBLOCK_ORDER = 9  # what the kernel reports when page_reporting_order is left at its default (x86-64)


def _sysfs_text(*parts: str) -> str | None:
    """The stripped text of the file at ``os.path.join(*parts)``, or None."""
    try:
        with open(os.path.join(*parts), encoding="ascii") as fh:
            return fh.read().strip()
    except (OSError, ValueError):
        return None


def _sysfs_int(*parts: str) -> int | None:
    text = _sysfs_text(*parts)
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


def free_page_reporting_order(sysfs: str = "/sys") -> int | None:
    """The order of the free blocks this machine reports to its hypervisor,
    or ``None`` where it reports none.

    A virtual machine with a virtio balloon that negotiated free page
    reporting gives free blocks of at least ``2**order`` pages back to its
    host (Firecracker, Cloud Hypervisor, QEMU ``free-page-reporting=on``);
    the host drops their backing, and the next first touch of such a page
    faults in the host as well.  Read from ``sysfs`` (the balloon's
    negotiated ``features`` and ``page_reporting_order``); nothing is
    changed.
    """
    drivers = os.path.join(sysfs, "bus", "virtio", "drivers", "virtio_balloon")
    try:
        devices = [d for d in os.listdir(drivers) if d.startswith("virtio")]
    except OSError:
        return None
    features = [_sysfs_text(drivers, dev, "features") or "" for dev in devices]
    if not any(len(bits) > _BALLOON_REPORTING_BIT and bits[_BALLOON_REPORTING_BIT] == "1" for bits in features):
        return None
    order = _sysfs_int(sysfs, "module", "page_reporting", "parameters", "page_reporting_order")
    return order if order is not None and 0 <= order < 64 else _PAGEBLOCK_ORDER  # absent, -1: the default


def huge_page_order(sysfs: str = "/sys") -> int | None:
    """The order of a transparent huge page here (9 for 2 MiB of 4 KiB pages),
    or ``None`` where the kernel has no transparent huge pages."""
    size = _sysfs_int(sysfs, "kernel", "mm", "transparent_hugepage", "hpage_pmd_size")
    if size is None or size <= _PAGE or size % _PAGE:
        return None
    return (size // _PAGE).bit_length() - 1


def huge_pages_reported(sysfs: str = "/sys") -> bool:
    """Whether this machine reports free blocks as large as a transparent
    huge page to its hypervisor (:func:`free_page_reporting_order`).

    There a huge page is mostly carved from such a reported block, and its
    first touch faults in the host as well: measured on this project's
    2-core Firecracker machines, 0.1 GiB/s for memory free for 3 s faulted
    in as huge pages against 2.4 GiB/s as 4 KiB pages, and 4.6 GiB/s for
    huge pages just freed (``benchmarks/huge_page_faults.py``).  So there
    :data:`THP_ENV` pays where a CPU engine takes fresh memory (its start:
    +13 s for a 1.7 GB model) and gains where its steps reuse what they
    freed; on the CLI job it gained on a 4-layer model and lost on a
    16-layer one (issue #16, ``benchmarks/RESULTS.md``).  Where this is
    true :func:`engine_environment` starts the engine without huge pages,
    and ``eagle3-compat doctor`` reports the machine.
    """
    reported, huge = free_page_reporting_order(sysfs), huge_page_order(sysfs)
    return reported is not None and huge is not None and reported <= huge


def _prctl(option: int, arg: int = 0) -> int | None:
    """``prctl(option, arg, 0, 0, 0)``: its result, or ``None`` where it failed
    or there is no such call (not Linux)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    result = fn(option, arg, 0, 0, 0)
    return None if result < 0 else int(result)


def huge_pages_refused() -> bool | None:
    """Whether this process refuses transparent huge pages
    (``prctl(PR_GET_THP_DISABLE)``; inherited from the process that started
    it), or ``None`` where that cannot be read."""
    got = _prctl(_PR_GET_THP_DISABLE)
    return None if got is None else bool(got)


def allow_huge_pages_after_start(environ: MutableMapping[str, str] | None = None) -> bool:
    """In an engine's process once its model is loaded: take back the
    transparent huge pages :func:`engine_environment` refused the engine's
    start (only where it did so: :data:`START_WITHOUT_HUGE_PAGES_ENV`).
    Whether it did."""
    env = os.environ if environ is None else environ
    if not settings.THP_AFTER_START.get(env) or not huge_pages_refused():
        return False
    return _prctl(_PR_SET_THP_DISABLE, 0) is not None


MMAP_ENV = settings.CPU_MMAP_MIB.name
DEFAULT_MMAP_MIB = settings.CPU_MMAP_MIB_DEFAULT
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
_INT_MAX = 2**31 - 1  # mallopt takes an int


def mmap_threshold_from_env(environ: dict[str, str] | None = None) -> float | None:
    """The mmap threshold in MiB for a CPU worker's steps (``None``: glibc's
    own), from :data:`MMAP_ENV` (default :data:`DEFAULT_MMAP_MIB`).

    Raises:
        ValueError: the variable is set to something other than ``off`` or a
            number >= 0; the message names the variable and the value.
    """
    return settings.CPU_MMAP_MIB.get(environ)


def _user_set_malloc(environ: MutableMapping[str, str]) -> bool:
    """Whether the user chose glibc's thresholds (``MALLOC_MMAP_THRESHOLD_``,
    ``MALLOC_TRIM_THRESHOLD_`` or either in ``GLIBC_TUNABLES``)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    return (any(environ.get(name, "").strip() for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"))
            or "malloc.mmap_threshold" in tunables or "malloc.trim_threshold" in tunables)


def reuse_step_buffers(device: object, environ: MutableMapping[str, str] | None = None,
                       mallopt: Callable[[int, int], int] | None = None) -> int | None:
    """In a CPU worker once its model is loaded: let glibc keep the model's
    large per-step buffers in the heap for the next step, instead of
    mapping each anew; the threshold set in bytes, or ``None`` (not a CPU
    worker, :data:`MMAP_ENV` ``off``, the user's own glibc setting, no glibc).

    glibc serves a request of at least its mmap threshold with a fresh
    mapping and unmaps it on ``free``; the threshold starts at 128 KiB and
    follows the largest such block freed, up to 32 MiB.  A CPU model's
    activations above that (hidden 2048: the MLP's of a step of 8192 tokens
    are ~90 MiB) are therefore mapped, faulted in and zeroed by the kernel at
    every op of every step: a ``perf`` profile of plain vLLM prefill on a
    16-layer hidden-2048 model put ~29 % of its engine's CPU in zeroing fresh
    pages.  With the threshold fixed at :data:`MMAP_ENV` MiB (``mallopt``
    ``M_MMAP_THRESHOLD``; its trim threshold at twice that, as glibc's own
    rule has it, so that ``free`` does not hand the heap's top back either)
    those buffers come from the heap and the next step reuses their pages:
    the CLI job on that model 0.87x -> 1.02x of plain prefill's speed
    (``benchmarks/cli_job.py``, issue #16).  What the heap keeps is the
    largest step's buffers, which every step maps anyway; its growth beyond
    that is :class:`HeapTrimmer`'s.  Requests above the threshold are mapped
    as before.
    """
    env = os.environ if environ is None else environ
    if getattr(device, "type", str(device)) != "cpu" or _user_set_malloc(env):
        return None
    mib = mmap_threshold_from_env(env)  # type: ignore[arg-type]
    if mib is None:
        return None
    threshold = min(int(mib * 2**20), _INT_MAX)
    if mallopt is None:
        try:
            mallopt = ctypes.CDLL("libc.so.6").mallopt
        except (OSError, AttributeError):
            return None  # not glibc
    if not mallopt(_M_MMAP_THRESHOLD, threshold):
        log.warning("glibc refused an mmap threshold of %d MiB (%s): the steps' buffers are mapped anew each "
                    "time", threshold >> 20, MMAP_ENV)
        return None
    mallopt(_M_TRIM_THRESHOLD, min(2 * threshold, _INT_MAX))
    log.debug("glibc's mmap threshold at %d MiB: the steps' buffers stay in the heap", threshold >> 20)
    return threshold


@contextlib.contextmanager
def engine_environment(
    cpu: bool,
    environ: MutableMapping[str, str] | None = None,
    idle_sleep: bool = False,
    start_without_huge_pages: bool | None = None,
) -> Iterator[dict[str, str]]:
    """While the engine starts: :data:`PRIMITIVE_CACHE_ENV` at
    :data:`PRIMITIVE_CACHE_DEFAULT` and :data:`THP_ENV` at ``1`` in
    ``environ`` (``os.environ``) for an engine on vLLM's CPU platform, and
    :data:`IDLE_SLEEP_ENV` at ``1`` there too where ``idle_sleep`` (the
    caller's word that the engine has several workers and its vLLM defines
    the variable), each where the user has not set it (nothing for other
    platforms), which vLLM's engine and worker processes inherit when they
    are started from this one; restored afterwards, so the user's process
    keeps its own environment.  Yields what it set.

    Where this sets :data:`THP_ENV` on a machine that hands free huge-page
    blocks back to its hypervisor (:func:`huge_pages_reported`), the
    engine's start also runs without huge pages: this process refuses them
    (``prctl(PR_SET_THP_DISABLE)``, which the engine's processes inherit)
    until the engine is up, and each capturing worker takes them back once
    its model is loaded (:func:`allow_huge_pages_after_start`).  Loading the
    weights takes fresh memory, where a huge page costs ~20x a 4 KiB one
    there (the 16-layer hidden-2048 engine's start: 27 s against 13 s);
    the steps, which reuse what they free, keep the huge pages.
    ``start_without_huge_pages`` overrides that choice (``None``: by the
    machine)."""
    env = os.environ if environ is None else environ
    wanted = {PRIMITIVE_CACHE_ENV: str(PRIMITIVE_CACHE_DEFAULT), THP_ENV: "1"}
    if idle_sleep:
        wanted[IDLE_SLEEP_ENV] = "1"
    updates = {name: value for name, value in wanted.items() if cpu and not env.get(name, "").strip()}
    if start_without_huge_pages is None:
        start_without_huge_pages = THP_ENV in updates and huge_pages_reported()
    refused = False
    if cpu and start_without_huge_pages and huge_pages_refused() is False:
        refused = _prctl(_PR_SET_THP_DISABLE, 1) is not None
        if refused:
            log.info("starting the CPU engine without transparent huge pages: this machine hands free huge "
                     "pages back to its hypervisor, where a fresh one costs ~20x a 4 KiB page; the workers "
                     "take them back once the model is loaded (set %s=1 yourself to start with them)", THP_ENV)
    for name, value in updates.items():
        env[name] = value
        log.debug("starting the CPU engine with %s=%s (set it to choose otherwise)", name, value)
    if refused:  # the workers' word to take them back (eagle3_compat internal)
        updates[START_WITHOUT_HUGE_PAGES_ENV] = env[START_WITHOUT_HUGE_PAGES_ENV] = "1"
    try:
        yield updates
    finally:
        if refused:
            _prctl(_PR_SET_THP_DISABLE, 0)
        for name, value in updates.items():
            if env.get(name) == value:
                del env[name]


class HeapTrimmer:
    """Calls ``trim`` after a step when ``rss()`` has grown by
    ``threshold_bytes`` over its level, and ``min_interval_s`` have passed
    since the last trim (or the first step).

    The level is the resident size at the first step, then at the step after
    each trim, and it follows memory down.  A trim also returns the free pages
    of the model's per-step buffers, and the step after it faults them in
    again (the working set): that re-growth is a cost of every step, not
    growth, so the level is taken after it, and that step never trims.
    Without that, a threshold below the working set trimmed at every step
    (``threshold_bytes`` 0 does that on purpose).  What may build up between
    two trims is then the threshold plus one step's growth, whatever the sizes
    of the steps; an earlier version counted from the trim itself and allowed
    the largest re-growth seen so far on top of the threshold, which let the
    fragments of a long job's ordinary steps build up to that largest working
    set (the CLI job's whole tree +11-12 % from 200 to 2000 samples, issue
    #16).  :attr:`working_set_bytes` still reports the largest re-growth.

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
        self._level: int | None = None
        self._after_trim = False
        self._last = 0.0
        self.trims = 0
        self.released_bytes = 0
        self.working_set_bytes = 0
        # time inside the trim calls (the pages they return are faulted in
        # again during the next step, which this does not see)
        self.trim_seconds = 0.0

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
        trimmer = cls(int(mib * 2**20), DEFAULT_INTERVAL_S if interval is None else interval)
        if trimmer._trim is None:
            return None
        return trimmer

    def after_step(self) -> bool:
        """Trim if the process grew by the threshold since the level was set
        and the interval has passed; returns whether it trimmed."""
        now = self._rss()
        if self._level is None:
            self._level, self._last = now, self._clock()  # the first step
            if self.threshold_bytes:
                return False
        if self._after_trim:  # the working set faulted in again: the new level
            self._after_trim = False
            self.working_set_bytes = max(self.working_set_bytes, now - self._level)
            self._level = now
            if self.threshold_bytes:
                return False
        if now < self._level:
            self._level = now  # memory went back down by itself
            if self.threshold_bytes:
                return False
        grown = now - self._level
        if grown < self.threshold_bytes:
            return False
        if self.min_interval_s and self._clock() - self._last < self.min_interval_s:
            return False
        began = self._clock()
        self._trim()  # type: ignore[misc]
        self._last = self._clock()
        after = self._rss()
        took = self._last - began
        self.trim_seconds += took
        self.trims += 1
        self.released_bytes += max(0, now - after)
        self._level, self._after_trim = after, True
        log.debug("malloc_trim after %d MiB of growth (largest working set %d MiB): %d -> %d MiB resident "
                  "in %.1f ms", grown >> 20, self.working_set_bytes >> 20, now >> 20, after >> 20, took * 1e3)
        return True
