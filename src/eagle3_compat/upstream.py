"""speculators 0.3.0's own pipeline: what its trainer expects of a data folder.

speculators' offline pipeline is ``scripts/data_generation_offline.py`` ->
``scripts/build_vocab_mapping.py`` -> ``scripts/train.py`` (v0.3.0 tag).
Its trainer reads every ``*.pt`` under the data folder
(``speculators.train.data.list_files``) and ``standardize_data_v1``
concatenates ``hidden_states[:-1]`` as the draft's input and takes
``hidden_states[-1]`` as the verifier's final state; the draft's ``fc`` is
``Linear(3 * H, H)``.  A folder made for it therefore needs, per sample,
exactly 4 tensors: three layers in ascending order, then the output of the
final decoder layer.  Anything else either fails late (a shape error at the
first training step) or, worse, trains on the wrong states without a word:

* fewer or more than 4 layers: ``mat1 and mat2 shapes cannot be multiplied``
  at training time (the default ids of a model with < 8 layers give 3);
* ``capture="layer_input"``: the last tensor is the input of layer L-1, not
  the final state (measured: the target's argmax agreed with the verifier's
  on 147 of 335 tokens instead of 335);
* unsorted ids: a middle layer ends up last (upstream's generator sorts them).

:func:`check_layer_plan` applies these rules before any model loads, from the
model's ``config.json``; ``trainer_checks=False`` is the explicit opt-out for
other consumers of the files (recorded in the manifest by the CLI).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .generator import default_layer_ids, validate_layer_ids

__all__ = [
    "TRAINER_LAYERS",
    "check_layer_plan",
    "data_path",
    "model_num_layers",
    "upstream_resume_index",
]

TRAINER_LAYERS = 4
OPT_OUT_FLAG = "--no-trainer-checks"


def data_path(out: Path, index: int) -> Path:
    """Sample ``index``'s file, named as speculators 0.3.0 names it (``data_{idx}.pt``)."""
    return out / f"data_{index}.pt"


def upstream_resume_index(out: Path) -> int:
    """Where speculators 0.3.0's script resumes in ``out``: the largest
    ``data_{i}.pt`` index plus one (0 for an empty or missing folder)."""
    best = -1
    if out.is_dir():
        for p in out.iterdir():
            if p.name.startswith("data_") and p.name.endswith(".pt"):
                try:
                    best = max(best, int(p.name[5:-3]))
                except ValueError:
                    continue
    return best + 1


def model_num_layers(model: str) -> int:
    """Decoder layers of ``model``, read from its ``config.json`` (no weights
    load); through transformers' ``AutoConfig`` for a model id in the HF cache."""
    cfg_file = Path(model) / "config.json"
    if cfg_file.is_file():
        cfg: Any = json.loads(cfg_file.read_text())
        for c in (cfg, cfg.get("text_config") or {}):
            n = c.get("num_hidden_layers")
            if isinstance(n, int):
                return n
        raise ValueError(f"{cfg_file}: no num_hidden_layers (nor text_config.num_hidden_layers)")
    from transformers import AutoConfig  # noqa: PLC0415

    from .generator import _num_layers  # noqa: PLC0415

    return _num_layers(AutoConfig.from_pretrained(model, trust_remote_code=True))


def check_layer_plan(
    layer_ids: Sequence[int] | None,
    num_layers: int,
    capture: str,
    *,
    trainer_checks: bool = True,
) -> list[int]:
    """The layer ids a job will capture, checked; raises ``ValueError`` naming
    the rule broken and the fix.

    Always: ids in range, none repeated (``layer_ids=None``: speculators
    0.3.0's default for ``num_layers``).  With ``trainer_checks`` (a folder
    for speculators 0.3.0's trainer): exactly 4 ids, ascending, the last one
    the final decoder layer ``num_layers - 1``, captured as layer outputs.
    """
    where = "the default layer ids" if layer_ids is None else "--layer-ids"
    ids = default_layer_ids(num_layers) if layer_ids is None else layer_ids
    ids = validate_layer_ids(ids, num_layers, name=where)
    if not trainer_checks:
        return ids
    last = num_layers - 1
    suggestion = _suggest(num_layers)
    fix = (f"pass e.g. --layer-ids {' '.join(map(str, suggestion))}, or {OPT_OUT_FLAG} if the "
           "files are not for speculators' trainer") if suggestion else (
           f"the model has {num_layers} layers, too few for speculators' trainer; {OPT_OUT_FLAG} "
           "if the files are for another consumer")
    rule = ("speculators 0.3.0's trainer needs exactly 4 layer ids per sample, ascending, the last "
            f"being the final decoder layer ({last}), captured as layer outputs (its draft fuses "
            "hidden_states[:-1] and reads hidden_states[-1] as the verifier's final state)")
    if len(ids) != TRAINER_LAYERS:
        raise ValueError(f"{where} {ids} for a {num_layers}-layer model give {len(ids)} layers: {rule}; {fix}")
    if ids != sorted(ids):
        raise ValueError(f"{where} {ids} are not ascending (a middle layer would be read as the final "
                         f"state): {rule}; pass them sorted: --layer-ids {' '.join(map(str, sorted(ids)))}")
    if ids[-1] != last:
        raise ValueError(f"{where} {ids} end at layer {ids[-1]}, not the final layer {last}: {rule}; {fix}")
    if capture != "layer_output":
        raise ValueError(
            f"--capture {capture}: the last tensor would be the input of layer {last}, not the final "
            f"state: {rule}; use --capture layer_output (the default), or {OPT_OUT_FLAG} if the files "
            "are for another consumer (vLLM's EAGLE-3 serving convention)"
        )
    return ids


def _suggest(num_layers: int) -> list[int] | None:
    """Four ascending ids ending at the final layer, near speculators' default."""
    if num_layers < TRAINER_LAYERS:
        return None
    ids = sorted(set(default_layer_ids(num_layers)))
    pool = [k for k in range(num_layers - 1) if k not in ids]
    while len(ids) < TRAINER_LAYERS:
        ids = sorted([*ids, pool.pop()])
    return ids
