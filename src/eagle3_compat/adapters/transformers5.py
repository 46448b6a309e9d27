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

Newer transformers 5 (5.24 here; 5.19 still has it) also removed
``transformers.modeling_attn_mask_utils``, which speculators 0.3.0's EAGLE-1
model module (``speculators.models.eagle``, imported with the package)
imports ``_prepare_4d_causal_attention_mask`` from: ``import speculators``
fails with ``ModuleNotFoundError`` even with the fix above.

How it is fixed: where that module is missing, a stand-in module is put in
``sys.modules`` (journaled) whose ``_prepare_4d_causal_attention_mask``
raises ``NotImplementedError`` naming this adapter: the EAGLE-1 model cannot
run with such a transformers, loudly; the EAGLE-3 generator and trainer
never call it.  And before anything imports speculators, ``torch`` (the real
module) is set as a global of ``transformers.configuration_utils``, through
the journal (``revert()`` deletes it), so the annotation resolves.  Nothing
else changes; speculators' own classes are untouched.  What this cannot fix:
an ``import speculators`` that runs *before* ``apply()`` in a process where
nothing applied yet fails as above (call ``apply()`` first; after such a failed
import, ``apply()`` drops the half-imported ``speculators.*`` modules it left
in ``sys.modules``, so the next import runs afresh).  Child processes of a
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


MASK_UTILS = "transformers.modeling_attn_mask_utils"


def _removed_mask_helper(*_args: Any, **_kwargs: Any) -> Any:
    raise NotImplementedError(
        f"eagle3_compat adapter {ID!r}: {MASK_UTILS}._prepare_4d_causal_attention_mask was "
        "removed from transformers (gone in 5.24, present in 5.19); speculators 0.3.0's EAGLE-1 "
        "model (speculators.models.eagle) needs it and cannot run with this transformers. "
        "The EAGLE-3 generator and trainer do not use it."
    )


def _mask_utils_stand_in() -> Any:
    import types  # noqa: PLC0415

    mod = types.ModuleType(MASK_UTILS, f"stand-in made by eagle3_compat (adapter {ID}); see its record")
    mod._prepare_4d_causal_attention_mask = _removed_mask_helper  # type: ignore[attr-defined]
    mod.__eagle3_compat_stand_in__ = True  # type: ignore[attr-defined]
    return mod


def install(journal: Journal) -> None:
    import importlib.util  # noqa: PLC0415
    import sys  # noqa: PLC0415

    import torch  # noqa: PLC0415

    if "speculators" not in sys.modules:
        # An ``import speculators`` that failed before apply() (the error this
        # adapter prevents) leaves its half-run submodules in sys.modules, whose
        # classes keep the unresolved annotation: drop them, so that the next
        # import runs speculators afresh (with torch resolvable).
        for name in [m for m in sys.modules if m.startswith("speculators.")]:
            del sys.modules[name]
    cu = _module()
    if vars(cu).get("torch") is not torch:  # else: transformers itself, or an inheriting child's early fix
        journal.set(cu, "torch", torch)
    if MASK_UTILS not in sys.modules and importlib.util.find_spec(MASK_UTILS) is None:
        # speculators 0.3.0 imports speculators.models.eagle (EAGLE-1) when its
        # package loads; that module imports a helper newer transformers removed.
        import transformers  # noqa: PLC0415

        stand_in = _mask_utils_stand_in()
        journal.set_item(sys.modules, MASK_UTILS, stand_in)
        journal.set(transformers, "modeling_attn_mask_utils", stand_in)


def install_early(_module_obj: Any = None) -> None:
    """The same change, from the post-import hook of an inheriting child
    (:mod:`eagle3_compat._inherit`), before speculators is imported there."""
    from .. import _state  # noqa: PLC0415
    from ..versions import detect  # noqa: PLC0415

    if needed(detect()):
        install(_state.journal)


ADAPTER = Adapter(
    id=ID,
    targets=(TARGET, f"sys.modules[{MASK_UTILS!r}] (stand-in, where transformers removed it)"),
    vllm_min=(0, 17),
    vllm_max=(0, 32),
    probe=probe,
    install=install,
    upstream="transformers 5 PreTrainedConfig annotations name torch (TYPE_CHECKING import); "
    "speculators 0.3.0 rebuilds its pydantic configs at import",
    remove_when="speculators 0.3.0 is no longer supported",
    needed=needed,
)
