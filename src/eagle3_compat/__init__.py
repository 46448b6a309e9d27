"""eagle3_compat: speculators 0.3.0's EAGLE-3 hidden-state generator, correct on vLLM 0.11-0.32.

Usage::

    import eagle3_compat
    eagle3_compat.apply()
    from speculators.data_generation import VllmHiddenStatesGenerator

Importing this package imports neither torch, vLLM nor speculators;
:func:`apply` does, once.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from . import _state, settings
from . import logs as _logs  # noqa: F401  (only a NullHandler on the "eagle3_compat" logger)
from .versions import SUPPORTED_SPECULATORS, SUPPORTED_VLLM, Found, detect, minor, vllm_supported

__all__ = ["Status", "UnsupportedVersionError", "apply", "revert", "status", "__version__"]
__version__ = "0.1.0.dev0"

ENV_STRICT = settings.STRICT.name
ENV_APPLIED = settings.APPLIED.name  # set while applied; child processes apply too
_DTYPES = (None, "auto", "float32", "bfloat16", "float16")


class UnsupportedVersionError(RuntimeError):
    """vLLM or speculators outside the supported range, in strict mode."""


@dataclass
class Status:
    """What apply() found and did; ``str()`` gives a table for bug reports."""

    found: Found
    applied: bool = False
    active: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    note: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    # before apply(): the adapters apply() would install on this vLLM
    pending: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lo, hi = SUPPORTED_VLLM
        rows = [
            ("eagle3_compat", __version__),
            ("vllm", f"{self.found.vllm} ({self.found.vllm_dist})" if self.found.vllm else "not installed"),
            ("speculators", self.found.speculators or "not installed"),
            ("torch", self.found.torch or "not installed"),
            ("transformers", self.found.transformers or "not installed"),
            ("supported", f"vllm {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}, speculators {SUPPORTED_SPECULATORS}"),
            ("applied", "yes" if self.applied else "no"),
            ("options", ", ".join(f"{k}={v}" for k, v in self.options.items()) or "-"),
        ]
        rows += [(f"adapter {a}", "active") for a in self.active]
        rows += [(f"adapter {a}", "not applied yet (needed on this vLLM)") for a in self.pending]
        rows += [(f"adapter {a}", f"skipped: {why}") for a, why in self.skipped.items()]
        if self.note:
            rows.append(("note", self.note))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def status() -> Status:
    """The current state: versions found, adapters active or skipped, and why."""
    if _state.report is not None:
        return _state.report
    report = Status(found=detect(), note="apply() has not been called")
    try:
        vv = report.found.vllm_version
    except ValueError:  # an unreadable EAGLE3_COMPAT_VLLM_VERSION: apply() says so
        vv = None
    if vv is not None:
        from .adapters import ADAPTERS  # noqa: PLC0415

        vminor = minor(vv)
        for adapter in ADAPTERS:
            if not adapter.applies_to(vminor):
                report.skipped[adapter.id] = f"not needed on vLLM {vminor[0]}.{vminor[1]}"
            elif not adapter.needed_for(report.found):
                report.skipped[adapter.id] = f"not needed with transformers {report.found.transformers}"
            else:
                report.pending.append(adapter.id)
    return report


def _unsupported(msg: str) -> None:
    if settings.STRICT.get():
        raise UnsupportedVersionError(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def apply(*, dtype: str | None = None) -> Status:
    """Make speculators 0.3.0's ``VllmHiddenStatesGenerator`` work on the installed vLLM.

    Idempotent: a second call is a no-op (a call with different options
    warns and keeps the first).  Returns the :class:`Status`.

    Args:
        dtype: model dtype for the engine (``"float32"`` for exact reference
            comparisons); ``None`` keeps speculators' ``"auto"``.

    Raises:
        eagle3_compat.adapters.AdapterError: an adapter's probe or install
            failed; everything this call applied has been rolled back.
        UnsupportedVersionError: versions out of range and
            ``EAGLE3_COMPAT_STRICT=1``.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    options = {"dtype": dtype}
    if _state.applied:
        if options != _state.options:
            warnings.warn(
                f"eagle3_compat.apply() already ran with {_state.options}; "
                f"ignoring {options} (call revert() first to change options)",
                RuntimeWarning,
                stacklevel=2,
            )
        return _state.report
    found = detect()
    report = Status(found=found, options=options)
    if found.vllm is None or found.speculators is None:
        missing = [n for n, v in (("vllm", found.vllm), ("speculators", found.speculators)) if v is None]
        report.note = f"not installed: {', '.join(missing)}; nothing to patch"
        _state.report = report
        return report
    vv = found.vllm_version
    assert vv is not None
    problems = []
    if not vllm_supported(vv):
        lo, hi = SUPPORTED_VLLM
        problems.append(f"vLLM {found.vllm} (supported: {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]})")
    if found.speculators != SUPPORTED_SPECULATORS:
        problems.append(f"speculators {found.speculators} (supported: {SUPPORTED_SPECULATORS})")
    if problems:
        _unsupported("eagle3_compat: unsupported " + " and ".join(problems) + "; applying nothing")
        report.note = "unsupported: " + "; ".join(problems)
        _state.report = report
        return report

    from .adapters import ADAPTERS, AdapterError  # noqa: PLC0415

    journal = _state.journal
    mark = journal.mark()
    _state.applying = True
    vminor = minor(vv)
    current = None
    try:
        for adapter in ADAPTERS:
            current = adapter
            if not adapter.applies_to(vminor):
                report.skipped[adapter.id] = f"not needed on vLLM {vminor[0]}.{vminor[1]}"
                continue
            if not adapter.needed_for(found):
                report.skipped[adapter.id] = f"not needed with transformers {found.transformers}"
                continue
            adapter.probe()
            adapter.install(journal)
            report.active.append(adapter.id)
    except AdapterError:
        journal.undo(mark)
        raise
    except Exception as exc:
        journal.undo(mark)
        name = current.id if current is not None else "?"
        raise AdapterError(name, ", ".join(current.targets) if current else "?", repr(exc)) from exc
    finally:
        _state.applying = False
    report.applied = True
    # Inherited by child processes: they apply too (see _inherit.py).
    os.environ[ENV_APPLIED] = json.dumps(options)
    _state.options = options
    _state.applied = True
    _state.report = report
    return report


def revert() -> None:
    """Undo everything apply() did in this process (identity restored); idempotent."""
    _state.journal.undo()
    os.environ.pop(ENV_APPLIED, None)
    _state.applied = False
    _state.options = {}
    _state.report = None
