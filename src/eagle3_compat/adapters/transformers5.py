"""Adapter ``transformers5``: let speculators 0.3.0 import under transformers 5.

Upstream symbol: ``transformers.configuration_utils`` (its module globals),
as read by pydantic when speculators 0.3.0 rebuilds
``speculators.SpeculatorModelConfig`` (a pydantic model that also derives
from transformers' ``PretrainedConfig``) at import time:
``speculators/__init__.py`` -> ``reload_and_populate_configs()`` ->
``SpeculatorModelConfig.auto_populate_registry()`` -> ``reload_schema()`` ->
``model_rebuild(force=True)``.

Why it breaks: transformers 5 turned ``PreTrainedConfig`` into an annotated
class (``from __future__ import annotations``) whose fields include
``dtype: str | torch.dtype | None``, with ``torch`` imported only under
``TYPE_CHECKING``.  pydantic resolves the string annotations of every base
class in that class's module namespace, finds no ``torch`` there, and
``import speculators`` fails: ``PydanticUndefinedAnnotation: name 'torch' is
not defined`` (seen with transformers 5.19 on vLLM 0.32, 5.24 on vLLM 0.19;
pydantic 2.11 and 2.14 alike).  speculators 0.3.0 sets no upper bound on
transformers; vLLM requires transformers 5 from 0.25 (>= 5.5.3; 0.32:
>= 5.16.1, < 5.20) and allows it from 0.19.

How it is fixed: before anything imports speculators, ``torch`` (the real
module) is set as a global of ``transformers.configuration_utils``, through
the journal (``revert()`` deletes it), so the annotation resolves.  Nothing
else changes; speculators' own classes are untouched.  What this cannot fix:
an ``import speculators`` that runs *before* ``apply()`` in a process where
nothing applied yet fails as above (call ``apply()`` first; a failed import
is recovered by the ``apply()`` that follows it).  Child processes of a
process that applied get the fix as soon as transformers' configuration
module is imported (``eagle3_compat._inherit``).  Under transformers 5 the
pydantic fields of speculators' configs also include transformers' config
fields (``dtype``, ``id2label``, ...); the generator and the preprocessing
do not read them.

Chosen by what is found: transformers >= 5 (any vLLM in the range), not by
the vLLM version alone.

Upstream change: huggingface/transformers 5.0 (``PreTrainedConfig`` as an
annotated dataclass-style class); speculators fixed its configs for
transformers 5 in later releases.
Remove when: speculators 0.3.0 is no longer supported, or transformers
resolves ``torch`` in ``configuration_utils`` at run time.
"""

from __future__ import annotations

from typing import Any

from .._journal import Journal
from . import Adapter, AdapterError

ID = "transformers5"
TARGET = "transformers.configuration_utils.torch (module global)"


def needed(found: Any) -> bool:
    """Whether the transformers found is 5 or newer (pure: metadata only)."""
    from ..versions import parse  # noqa: PLC0415

    if not found.transformers:
        return False
    try:
        return parse(found.transformers).release[0] >= 5
    except ValueError:
        return False


def _module() -> Any:
    import transformers.configuration_utils as cu  # noqa: PLC0415

    return cu


def probe() -> None:
    try:
        cu = _module()
    except ImportError as exc:
        raise AdapterError(ID, "transformers.configuration_utils", f"cannot import: {exc}") from exc
    cls = getattr(cu, "PreTrainedConfig", None) or getattr(cu, "PretrainedConfig", None)
    if cls is None:
        raise AdapterError(ID, "transformers.configuration_utils.PreTrainedConfig", "missing")
    ann = vars(cls).get("__annotations__", {}).get("dtype")
    if ann is not None and "torch" not in str(ann):
        raise AdapterError(
            ID, "transformers PreTrainedConfig.dtype",
            f"annotation {ann!r} does not name torch (not the transformers 5 this adapter knows)",
        )


def install(journal: Journal) -> None:
    import torch  # noqa: PLC0415

    cu = _module()
    if vars(cu).get("torch") is torch:
        return  # already there (transformers itself, or an inheriting child's early fix)
    journal.set(cu, "torch", torch)


def install_early(_module_obj: Any = None) -> None:
    """The same change, from the post-import hook of an inheriting child
    (:mod:`eagle3_compat._inherit`), before speculators is imported there."""
    from .. import _state  # noqa: PLC0415
    from ..versions import detect  # noqa: PLC0415

    if needed(detect()):
        install(_state.journal)


ADAPTER = Adapter(
    id=ID,
    targets=(TARGET,),
    vllm_min=(0, 17),
    vllm_max=(0, 32),
    probe=probe,
    install=install,
    upstream="transformers 5 PreTrainedConfig annotations name torch (TYPE_CHECKING import); "
    "speculators 0.3.0 rebuilds its pydantic configs at import",
    remove_when="speculators 0.3.0 is no longer supported",
    needed=needed,
)
