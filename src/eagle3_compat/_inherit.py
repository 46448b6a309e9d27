"""Child processes see the patches exactly when their parent applied them.

:func:`eagle3_compat.apply` records its options in the environment variable
``EAGLE3_COMPAT_APPLIED`` (JSON); :func:`eagle3_compat.revert` removes it.
Child processes inherit the environment.  At interpreter start the one-line
``eagle3_compat_inherit.pth`` that the wheel installs next to the package
calls :func:`install` when that variable is set (and does nothing else
otherwise): the child then applies with the parent's options as soon as it
imports speculators' generator module, so a ``multiprocessing`` spawn child
whose parent applied inside ``if __name__ == "__main__":`` is patched too,
and a child of a parent that never applied (or reverted) is not.

vLLM's own engine and worker processes need none of this: the capture runs
in them through the engine's ``worker_extension_cls``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
from typing import Any

ENV = "EAGLE3_COMPAT_APPLIED"
TARGET = "speculators.data_generation.vllm_hidden_states_generator"


def _apply(options: dict[str, Any]) -> None:
    import eagle3_compat  # noqa: PLC0415
    from eagle3_compat import _state  # noqa: PLC0415

    # An explicit apply() importing speculators (its probes do) fires this
    # hook from inside itself: that call is already doing the work.
    if _state.applying:
        return
    eagle3_compat.apply(**options)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs apply() right after speculators' generator module has executed."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from recursing
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, options = spec.loader, self.options
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _apply(options)

        loader.exec_module = exec_module  # this module's loader instance only
        return spec


def install() -> None:
    """Called from the ``.pth`` file when ``EAGLE3_COMPAT_APPLIED`` is set."""
    raw = os.environ.get(ENV)
    if not raw:
        return
    try:
        options = json.loads(raw)
        if not isinstance(options, dict):
            raise ValueError(raw)
    except ValueError:
        sys.stderr.write(f"eagle3_compat: ignoring malformed {ENV}={raw!r}\n")
        return
    if TARGET in sys.modules:
        _apply(options)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(options))
