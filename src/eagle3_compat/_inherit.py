"""Child processes see the patches exactly when their parent applied them.

:func:`eagle3_compat.apply` records its options in the environment variable
``EAGLE3_COMPAT_APPLIED`` (JSON); :func:`eagle3_compat.revert` removes it.
Child processes inherit the environment.  At interpreter start the one-line
``eagle3_compat_inherit.pth`` that the wheel installs next to the package
calls :func:`install` when that variable is set (and does nothing else
otherwise): the child then applies with the parent's options as soon as it
imports speculators' generator module (a ``wrapt`` post-import hook), so a
``multiprocessing`` spawn child whose parent applied inside ``if __name__ ==
"__main__":`` is patched too, and a child of a parent that never applied (or
reverted) is not.

vLLM's own engine and worker processes need none of this: the capture runs
in them through the engine's ``worker_extension_cls``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from .settings import APPLIED

ENV = APPLIED.name
TARGET = "speculators.data_generation.vllm_hidden_states_generator"

_registered = False  # one hook per process


def _apply(options: dict[str, Any]) -> None:
    import eagle3_compat  # noqa: PLC0415
    from eagle3_compat import _state  # noqa: PLC0415

    # An explicit apply() importing speculators (its probes do) fires this
    # hook from inside itself: that call is already doing the work.
    if _state.applying:
        return
    eagle3_compat.apply(**options)


def install() -> None:
    """Called from the ``.pth`` file when ``EAGLE3_COMPAT_APPLIED`` is set.

    ``wrapt``'s post-import hook runs :func:`_apply` right after speculators'
    generator module has executed (at once if it already has).
    """
    global _registered
    raw = APPLIED.get()
    if not raw or _registered:
        return
    try:
        options = json.loads(raw)
        if not isinstance(options, dict):
            raise ValueError(raw)
    except ValueError:
        sys.stderr.write(f"eagle3_compat: ignoring malformed {ENV}={raw!r}\n")
        return
    import wrapt  # noqa: PLC0415  (only in processes that inherit apply())

    _registered = True
    # transformers 5: speculators 0.3.0 fails in its own package import, before
    # the hook below could fire; the transformers5 adapter's change is made as
    # soon as transformers' configuration module exists (a no-op under 4).
    wrapt.register_post_import_hook(_transformers5_early, "transformers.configuration_utils")
    wrapt.register_post_import_hook(lambda _module: _apply(options), TARGET)


def _transformers5_early(_module: Any) -> None:
    from eagle3_compat.adapters import transformers5  # noqa: PLC0415

    transformers5.install_early()
