"""Logging: a library's habits in your process, visible output in vLLM's.

In the application's process eagle3_compat configures nothing (Python's
logging HOWTO, "Configuring Logging for a Library"): the ``eagle3_compat``
logger has a :class:`logging.NullHandler` and propagates, so records reach
whatever handlers the application installed (``logging.basicConfig``,
pytest's ``caplog``, ...) at the levels it chose.  The only exception is
explicit: when ``EAGLE3_COMPAT_LOG_LEVEL`` (a level name) or
``EAGLE3_COMPAT_DEBUG=1`` (DEBUG) is set, that is the ``eagle3_compat``
logger's level; no handler is added.

vLLM's engine and worker processes are not the application's: vLLM
configures its own ``vllm`` logger there (a stream handler, ``propagate =
False``, level ``VLLM_LOGGING_LEVEL``) and nothing else, so any other
library's record reaches only Python's last-resort handler (WARNING and
above, no format).  The worker extension calls :func:`attach_to_vllm_logging`
inside those processes: our records then go through vLLM's own handler(s)
(its format, its stream) at our level, ``EAGLE3_COMPAT_LOG_LEVEL`` (default
INFO; ``EAGLE3_COMPAT_DEBUG=1`` means DEBUG).  Spawned processes inherit both
variables, so the user's choice holds everywhere.  Where that process's root
logger has handlers (a user script re-imported by a spawned process that
configured logging at import, a forked worker), records propagate there
instead.
"""

from __future__ import annotations

import logging

from . import settings

__all__ = ["attach_to_vllm_logging", "get_logger", "level_from_env"]

ROOT = "eagle3_compat"
ENV_LEVEL = settings.LOG_LEVEL.name
ENV_DEBUG = settings.DEBUG.name


def level_from_env(default: int | None = None) -> int | None:
    """The level the user asked for through the environment, else ``default``.

    ``EAGLE3_COMPAT_DEBUG`` (anything but empty or ``0``) means DEBUG;
    otherwise ``EAGLE3_COMPAT_LOG_LEVEL``, a level name or number.
    An unknown name gives ``default``.
    """
    if settings.DEBUG.get():
        return logging.DEBUG
    level = settings.LOG_LEVEL.get()
    return default if level is None else level


def _library_setup() -> None:
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, logging.NullHandler) for h in root.handlers):
        root.addHandler(logging.NullHandler())
    level = level_from_env(None)
    if level is not None:
        root.setLevel(level)


_library_setup()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)``; ``name`` is under ``eagle3_compat``."""
    return logging.getLogger(name)


class _ToVllmHandlers(logging.Handler):
    """Hands our records to the ``vllm`` logger's handlers (this process is vLLM's).

    Decided per record: where the root logger has handlers, the record
    propagates there and this does nothing; where the ``vllm`` logger has no
    handler (``VLLM_CONFIGURE_LOGGING=0``), Python's last resort is used as it
    would have been without us.
    """

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        targets = logging.getLogger("vllm").handlers
        if not targets:
            last = logging.lastResort
            targets = [last] if last is not None and record.levelno >= last.level else []
        for handler in targets:
            # handle(), not callHandlers(): vLLM's handler level is
            # VLLM_LOGGING_LEVEL; ours is EAGLE3_COMPAT_LOG_LEVEL.
            handler.handle(record)


def attach_to_vllm_logging() -> None:
    """In a vLLM-owned process (engine core, worker): make our records visible.

    Sets the ``eagle3_compat`` logger's level from the environment (default
    INFO) and gives its records to vLLM's own handler(s) unless the root
    logger has handlers.  Idempotent.  Never call it in the application's
    process: there the application decides.
    """
    root = logging.getLogger(ROOT)
    level = level_from_env(logging.INFO)
    root.setLevel(logging.INFO if level is None else level)
    if not any(isinstance(h, _ToVllmHandlers) for h in root.handlers):
        root.addHandler(_ToVllmHandlers())
