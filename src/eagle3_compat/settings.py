"""Every ``EAGLE3_COMPAT_*`` environment variable, declared once.

Each :class:`Setting` below has its name, its type, its default, the
values it takes and a one-line meaning; ``SETTINGS`` holds them all by
name, in the order ``eagle3-compat status`` lists them.  The modules read
their variables through :meth:`Setting.get` (or :func:`get` by name), which
reads the environment at that moment: a worker's read happens when it
happens in the module that asks, and a test's ``monkeypatch.setenv`` is seen
by the next read.  A value a setting cannot take raises a ``ValueError``
naming the variable and the value.

Other projects' variables that eagle3_compat sets for vLLM's engine
(``THP_MEM_ALLOC_ENABLE``, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``,
``VLLM_SLEEP_WHEN_IDLE``) belong to :mod:`eagle3_compat.heap`, not here.
Nothing here imports more than the standard library.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["SETTINGS", "Setting", "describe", "get", "table"]

T = TypeVar("T")
Environ = Mapping[str, str]


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: ``parse(name, raw)`` turns the text found
    (stripped or not, as the variable has always been read) into the value;
    ``default`` is the value where the variable is not set."""

    name: str
    type: str
    default: T
    allowed: str
    meaning: str
    parse: Callable[[str, str], T]
    shown_default: str  # how `status` writes the default
    internal: bool = False  # set by eagle3_compat itself, for its child processes

    def raw(self, environ: Environ | None = None) -> str | None:
        """The variable's text as set, or ``None`` where it is not set."""
        return (os.environ if environ is None else environ).get(self.name)

    def get(self, environ: Environ | None = None) -> T:
        """The value now, from ``environ`` (``os.environ``).

        Raises:
            ValueError: a value the setting does not take, naming the
                variable and the value.
        """
        raw = self.raw(environ)
        return self.default if raw is None else self.parse(self.name, raw)


SETTINGS: dict[str, Setting[Any]] = {}


def _declare(setting: Setting[T]) -> Setting[T]:
    if setting.name in SETTINGS:
        raise ValueError(f"{setting.name} is declared twice")
    SETTINGS[setting.name] = setting
    return setting


def get(name: str, environ: Environ | None = None) -> Any:
    """The value of the setting called ``name`` (:meth:`Setting.get`)."""
    try:
        setting = SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name} is not an eagle3_compat setting") from None
    return setting.get(environ)


# The parsers.  Each variable has its own rules for what counts as unset,
# case and surrounding spaces, which users' scripts and the tests rely on.

def _flag(_name: str, raw: str) -> bool:
    # anything but empty or "0", unstripped
    return raw not in ("", "0")


def _exactly_one(_name: str, raw: str) -> bool:
    return raw == "1"


def _text(_name: str, raw: str) -> str | None:
    return raw or None


def _zero_or_one(name: str, raw: str) -> bool:
    value = raw.strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


TRANSPORTS = ("auto", "shm", "rpc")


def _transport(name: str, raw: str) -> str:
    value = raw.strip().lower() or "auto"
    if value not in TRANSPORTS:
        raise ValueError(f"{name} must be one of {TRANSPORTS}, got {value!r}")
    return value


def _pool_bytes(name: str, raw: str) -> int | None:
    value = raw.strip().lower() or "auto"
    if value == "auto":
        return None
    try:
        keep = int(value)
    except ValueError:
        keep = -1
    if keep < 0:
        raise ValueError(f"{name} must be 'auto' or a number of bytes >= 0, got {value!r}")
    return keep


def _positive_int(name: str, raw: str) -> int | None:
    value = raw.strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _log_level(_name: str, raw: str) -> int | None:
    # a level name or number; an unknown name counts as unset
    value = raw.strip().upper()
    if not value:
        return None
    if value.isdigit():
        return int(value)
    level = logging.getLevelName(value)
    return level if isinstance(level, int) else None


_OFF = ("off", "none", "no", "false")


def _number(unit: str, off: bool, blank: float | None) -> Callable[[str, str], float | None]:
    """A finite number >= 0 of ``unit``; ``blank`` where the variable is
    empty, ``None`` for ``off`` where ``off`` is allowed."""

    def parse(name: str, raw: str) -> float | None:
        value = raw.strip()
        if not value:
            return blank
        if off and value.lower() in _OFF:
            return None
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not (number >= 0 and math.isfinite(number)):  # also NaN
            raise ValueError(f"{name}={value!r}: expected a number of {unit} >= 0" + (", or 'off'" if off else ""))
        return number

    return parse


CPU_TRIM_MIB_DEFAULT = 64.0
CPU_MMAP_MIB_DEFAULT = 1024.0

# -- versions and adapters --------------------------------------------------

STRICT = _declare(Setting(
    "EAGLE3_COMPAT_STRICT", "flag", False, "0 or empty: off; anything else: on",
    '"unsupported version" warnings become errors (UnsupportedVersionError)',
    _flag, "0"))
VLLM_VERSION = _declare(Setting[str | None](
    "EAGLE3_COMPAT_VLLM_VERSION", "version", None, "a PEP 440 version, e.g. 0.16.0",
    "overrides the vLLM version read from the installed distribution",
    _text, "installed"))
ALLOW_UNVERIFIED = _declare(Setting(
    "EAGLE3_COMPAT_ALLOW_UNVERIFIED", "flag", False, "0 or empty: off; anything else: on",
    "capture from architectures no test has verified (check against a reference)",
    _flag, "0"))

# -- logging ----------------------------------------------------------------

LOG_LEVEL = _declare(Setting[int | None](
    "EAGLE3_COMPAT_LOG_LEVEL", "log level", None, "a level name (DEBUG, INFO, ...) or number",
    "the eagle3_compat logger's level (unset in your own process: your logging decides)",
    _log_level, "INFO"))
DEBUG = _declare(Setting(
    "EAGLE3_COMPAT_DEBUG", "flag", False, "0 or empty: off; anything else: on",
    "DEBUG logging, and a per-step capture summary from the workers",
    _flag, "0"))

# -- the data path ----------------------------------------------------------

TRANSPORT = _declare(Setting(
    "EAGLE3_COMPAT_TRANSPORT", "choice", "auto", " | ".join(TRANSPORTS),
    "how hidden states reach the driver: shared memory, vLLM's RPC channel, or auto",
    _transport, "auto"))
DIRECT = _declare(Setting(
    "EAGLE3_COMPAT_DIRECT", "0/1", True, "0 or 1",
    "1: rows are copied into place during the step; 0: staged and written after it (read per call)",
    _zero_or_one, "1"))
SHARD = _declare(Setting(
    "EAGLE3_COMPAT_SHARD", "0/1", True, "0 or 1",
    "1: each tensor-parallel rank copies its share of the rows; 0: rank 0 copies every row (read per call)",
    _zero_or_one, "1"))
ARENA_POOL_BYTES = _declare(Setting[int | None](
    "EAGLE3_COMPAT_ARENA_POOL_BYTES", "bytes", None, "auto or an integer >= 0",
    "how many bytes of released shared-memory arenas are kept for reuse between calls",
    _pool_bytes, "auto"))
DRIVER_THREADS = _declare(Setting[int | None](
    "EAGLE3_COMPAT_DRIVER_THREADS", "integer", None, "an integer >= 1",
    "torch's threads in the process of `eagle3-compat generate` (with CUDA: torch's default)",
    _positive_int, "1 without CUDA"))

# -- a CPU worker's memory --------------------------------------------------

CPU_TRIM_MIB = _declare(Setting[float | None](
    "EAGLE3_COMPAT_CPU_TRIM_MIB", "MiB", CPU_TRIM_MIB_DEFAULT, "a number >= 0, or off",
    "a CPU worker trims its heap (malloc_trim) once it has grown by this much (0: every step)",
    _number("MiB", off=True, blank=CPU_TRIM_MIB_DEFAULT), "64"))
CPU_TRIM_INTERVAL_S = _declare(Setting[float | None](
    "EAGLE3_COMPAT_CPU_TRIM_INTERVAL_S", "seconds", None, "a number >= 0",
    "the least time between two heap trims of a CPU worker",
    _number("seconds", off=False, blank=None), "0"))
CPU_MMAP_MIB = _declare(Setting[float | None](
    "EAGLE3_COMPAT_CPU_MMAP_MIB", "MiB", CPU_MMAP_MIB_DEFAULT, "a number >= 0, or off",
    "glibc's mmap threshold in a capturing CPU worker (off: glibc's own)",
    _number("MiB", off=True, blank=CPU_MMAP_MIB_DEFAULT), "1024"))

# -- set by eagle3_compat itself ----------------------------------------------

APPLIED = _declare(Setting[str | None](
    "EAGLE3_COMPAT_APPLIED", "JSON", None, "apply()'s options as a JSON object",
    "set by apply() and `eagle3-compat run`: child processes apply with these options",
    _text, "unset", internal=True))
THP_AFTER_START = _declare(Setting(
    "EAGLE3_COMPAT_THP_AFTER_START", "flag", False, "1 or unset",
    "set while a CPU engine starts without huge pages: its workers take them back after loading",
    _exactly_one, "unset", internal=True))


def describe(environ: Environ | None = None) -> list[tuple[str, str, str]]:
    """``(name, value, meaning)`` for every setting: the value as set, or
    ``(default: X)``; a value the setting does not take is marked so."""
    rows = []
    for setting in SETTINGS.values():
        raw = setting.raw(environ)
        if raw is None:
            shown = f"(default: {setting.shown_default})"
        else:
            shown = repr(raw) if raw != raw.strip() or not raw else raw
            try:
                setting.parse(setting.name, raw)
            except ValueError:
                shown += " (INVALID)"
        meaning = setting.meaning + (" [internal]" if setting.internal else "")
        rows.append((setting.name, shown, meaning))
    return rows


def table(environ: Environ | None = None) -> str:
    """:func:`describe` as aligned lines under a ``settings`` heading."""
    rows = describe(environ)
    name_w = max(len(n) for n, _v, _m in rows)
    value_w = max(len(v) for _n, v, _m in rows)
    lines = ["settings (environment variables)"]
    lines += [f"  {n.ljust(name_w)}  {v.ljust(value_w)}  {m}" for n, v, m in rows]
    return "\n".join(lines)
