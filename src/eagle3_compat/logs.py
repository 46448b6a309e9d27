"""Logging that is visible in vLLM's worker processes.

vLLM configures only its own ``vllm`` logger.  In a spawned worker, any
other library's ``logger.info`` goes to the root logger, which has no
handler there, so Python's last-resort handler shows WARNING and above
only: the field report lost hours to worker-side log lines nobody saw.
Our logger therefore carries its own stderr handler (once per process),
tagged with the process id, at the level of ``EAGLE3_COMPAT_LOG_LEVEL``
(default INFO; ``EAGLE3_COMPAT_DEBUG=1`` means DEBUG).  Both variables are
inherited by spawned workers, so the user's choice holds everywhere.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["get_logger"]

_ROOT = "eagle3_compat"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (test captures, redirections)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _configure() -> None:
    root = logging.getLogger(_ROOT)
    if getattr(root, "_e3c_configured", False):
        return
    level_name = os.environ.get("EAGLE3_COMPAT_LOG_LEVEL", "INFO").upper()
    if os.environ.get("EAGLE3_COMPAT_DEBUG", "") not in ("", "0"):
        level_name = "DEBUG"
    level = logging.getLevelName(level_name)
    root.setLevel(level if isinstance(level, int) else logging.INFO)
    handler = _StderrHandler()
    handler.setFormatter(
        logging.Formatter(f"%(levelname)s eagle3_compat[{os.getpid()}] %(name)s: %(message)s")
    )
    root.addHandler(handler)
    root.propagate = False
    root._e3c_configured = True  # type: ignore[attr-defined]


def get_logger(name: str) -> logging.Logger:
    """A logger under ``eagle3_compat`` whose output reaches stderr in every process."""
    _configure()
    return logging.getLogger(name)
