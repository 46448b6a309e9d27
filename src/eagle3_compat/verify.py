"""``eagle3-compat verify DIR``: check a data folder, and finish a sharded one.

Shard jobs (``generate --num-shards N --shard-index I``) write only files of
their own (:mod:`eagle3_compat.dataset`): samples, ``manifest.shard-I-of-N.json``
and ``token_freq.shard-I-of-N.json``.  Once every job has finished,
:func:`verify_folder` checks the folder as a whole and, if nothing is wrong,
writes what speculators' pipeline reads besides the samples:

* ``manifest.json``: the shared settings, the total and each shard's counts;
* ``data_config.json``: speculators' own ``DataGenerationConfig`` as the
  shard jobs made it (the same for all but the time and command line);
* the merged token frequencies (``torch.save`` of ``{token id: count}``,
  as speculators' ``token_freq.pt``), where the jobs' ``--token-freq-path``
  (or ``verify --token-freq-path``) says.

What is checked: every shard's manifest present and complete, the same
settings and package versions in all; every sample index of the input
present exactly once and no other ``data_*.pt`` file; every file loadable
(``torch.load(weights_only=True)``) with the keys and shapes speculators'
trainer reads (``input_ids``/``loss_mask`` ``[T]``, ``hidden_states`` one
``[T, H]`` tensor per layer id, one ``H`` and one dtype in the folder).  An
unsharded folder (``manifest.json`` of one job) is checked the same way and
left as it is.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .dataset import (
    DATA_CONFIG,
    MANIFEST,
    in_shard,
    manifests,
    shard_manifest_name,
    write_json_atomic,
)
from .upstream import data_path

__all__ = ["VerifyResult", "verify_folder"]

# Keys of a job's manifest that differ from job to job by nature; every other
# key must be the same in all shard manifests.
_PER_JOB = {
    "shard_index", "samples", "written_this_run", "tokens_this_run", "seconds_this_run",
    "data_config", "token_freq_file", "complete", "replicas",
}
# data_config.json fields that name the run, not the data
_DATA_CONFIG_VOLATILE = ("generated_at",)
_SHARD_MANIFEST = re.compile(r"manifest\.shard-(\d+)-of-(\d+)\.json")
_LIST_AT_MOST = 20


@dataclass
class VerifyResult:
    """What :func:`verify_folder` found: ``problems`` (empty: the folder is
    sound), the samples checked, and the files it wrote."""

    problems: list[str] = field(default_factory=list)
    samples: int = 0
    written: list[Path] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"`` (at most a few dozen runs shown)."""
    runs: list[str] = []
    start = prev = None
    for i in sorted(indices):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            runs.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = i
    if start is not None:
        runs.append(f"{start}-{prev}" if prev != start else f"{start}")
    more = len(runs) - _LIST_AT_MOST
    return ", ".join(runs[:_LIST_AT_MOST]) + (f" and {more} more run(s)" if more > 0 else "")


def _settings(manifest: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in manifest.items() if k not in _PER_JOB}


def _config_key(cfg: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in cfg.items() if k not in _DATA_CONFIG_VOLATILE}
    repro = dict(out.get("reproducibility") or {})
    repro.pop("command", None)  # --shard-index differs
    out["reproducibility"] = repro
    return out


def _check_file(path: Path, n_layers: int, max_len: int, seen: dict[str, Any]) -> str | None:
    """A problem with one sample file, or None; ``seen`` keeps the folder's H and dtype."""
    import torch  # noqa: PLC0415

    try:
        data = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
    except Exception as exc:  # noqa: BLE001
        return f"{path.name}: does not load ({type(exc).__name__}: {exc})"
    if not isinstance(data, dict):
        return f"{path.name}: a {type(data).__name__}, not a dict"
    missing = {"input_ids", "hidden_states", "loss_mask"} - set(data)
    if missing:
        return f"{path.name}: no {sorted(missing)}"
    ids, mask, states = data["input_ids"], data["loss_mask"], data["hidden_states"]
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 1 and ids.dtype == torch.long):
        return f"{path.name}: input_ids is not a 1-D int64 tensor"
    t = ids.shape[0]
    if not 1 <= t <= max_len:
        return f"{path.name}: {t} tokens, expected 1..{max_len}"
    if not (isinstance(mask, torch.Tensor) and mask.shape == ids.shape):
        return f"{path.name}: loss_mask {getattr(mask, 'shape', type(mask).__name__)} for {t} tokens"
    if not isinstance(states, (list, tuple)) or len(states) != n_layers:
        return f"{path.name}: {len(states) if isinstance(states, (list, tuple)) else 'no list of'} " \
               f"hidden state tensors, expected {n_layers} (one per layer id)"
    for j, h in enumerate(states):
        if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[0] != t:
            return f"{path.name}: hidden_states[{j}] {tuple(getattr(h, 'shape', ()))}, expected [{t}, H]"
        for key, value in (("hidden size", h.shape[1]), ("dtype", str(h.dtype))):
            first = seen.setdefault(key, (value, path.name))
            if first[0] != value:
                return f"{path.name}: hidden_states[{j}] {key} {value}, {first[1]} has {first[0]}"
    return None


def verify_folder(output: Path, *, token_freq_path: str | None = None, write: bool = True) -> VerifyResult:
    """Check ``output`` (see the module docstring); with ``write`` and no
    problem, write the merged ``manifest.json``, ``data_config.json`` and token
    frequencies of a sharded folder.  Returns a :class:`VerifyResult`; never
    raises for a problem of the folder (each is a line in ``problems``)."""
    res = VerifyResult()
    output = Path(output)
    if not output.is_dir():
        res.problems.append(f"{output} is not a folder")
        return res
    try:
        found = manifests(output)
    except ValueError as exc:
        res.problems.append(str(exc))
        return res
    shards = {n: m for n, m in found.items() if _SHARD_MANIFEST.fullmatch(n)}
    if not shards:
        if MANIFEST not in found:
            res.problems.append(f"{output}: no manifest.json nor manifest.shard-I-of-N.json: not a folder "
                                "eagle3-compat generate wrote (or its jobs have not started)")
            return res
        jobs = {MANIFEST: found[MANIFEST]}
        num_shards = 1
    else:
        sizes = {int(_SHARD_MANIFEST.fullmatch(n).group(2)) for n in shards}  # type: ignore[union-attr]
        if len(sizes) > 1:
            res.problems.append(f"shard manifests of different --num-shards {sorted(sizes)}: "
                                f"{sorted(shards)}; one folder takes one sharding")
            return res
        (num_shards,) = sizes
        jobs = {}
        for i in range(num_shards):
            name = shard_manifest_name(i, num_shards)
            if name not in shards:
                res.problems.append(f"shard {i} of {num_shards}: no {name} (its job has not run): "
                                    f"run generate --num-shards {num_shards} --shard-index {i}")
            else:
                jobs[name] = shards[name]
    for name, m in jobs.items():
        if not m.get("complete"):
            res.problems.append(f"{name}: the job has not finished (still running, or killed): "
                                "run it again with the same arguments, it resumes")
        if m.get("num_shards", 1) != num_shards:
            res.problems.append(f"{name}: records num_shards {m.get('num_shards')}, its name says {num_shards}")
    if res.problems:
        return res
    first_name, first = next(iter(jobs.items()))
    for name, m in jobs.items():
        a, b = _settings(first), _settings(m)
        diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        if diff:
            res.problems.append("not the same settings everywhere: " + "; ".join(
                f"{k}: {a.get(k)!r} in {first_name}, {b.get(k)!r} in {name}" for k in diff))
        if num_shards > 1 and _config_key(m.get("data_config") or {}) != _config_key(first.get("data_config") or {}):
            res.problems.append(f"data_config differs between {first_name} and {name}")
    if res.problems:
        return res
    start = int(first.get("first_index", first.get("start_idx", 0)))
    total = int(first["input_samples"] if num_shards > 1 else first["samples"])
    layer_ids = list(first["layer_ids"])
    max_len = int(first["max_model_len"])
    for name, m in jobs.items():
        if num_shards > 1:
            own = sum(1 for i in range(total) if in_shard(i, num_shards, int(m["shard_index"])))
            if m["samples"] != own:
                res.problems.append(f"{name}: {m['samples']} samples, shard {m['shard_index']} of "
                                    f"{num_shards} owns {own} of {total}")
    expected = {data_path(output, start + i).name: start + i for i in range(total)}
    present = {p.name for p in output.glob("data_*.pt")}
    missing = [expected[n] for n in expected.keys() - present]
    extra = sorted(present - expected.keys())
    if missing:
        by_shard = Counter((i - start) % num_shards for i in missing)
        where = "" if num_shards == 1 else " (" + ", ".join(
            f"shard {s}: {c}" for s, c in sorted(by_shard.items())) + ")"
        res.problems.append(f"{len(missing)} of {total} samples missing: data_{{{_ranges(missing)}}}.pt{where}")
    if extra:
        shown = ", ".join(extra[:_LIST_AT_MOST]) + (" ..." if len(extra) > _LIST_AT_MOST else "")
        res.problems.append(f"{len(extra)} data file(s) not of this job's {total} samples "
                            f"(indices {start}..{start + total - 1}): {shown}")
    if next(output.glob("sample_*.pt"), None) is not None:
        res.problems.append("sample_*.pt files (eagle3_compat's layout before 0.1.0) in the folder")
    seen: dict[str, Any] = {}
    for name in sorted(expected.keys() & present, key=lambda n: expected[n]):
        problem = _check_file(output / name, len(layer_ids), max_len, seen)
        if problem:
            res.problems.append(problem)
        else:
            res.samples += 1
    # The hidden size speculators' data_config records (the jobs' copy for a
    # sharded folder, the folder's data_config.json otherwise) must be the files'.
    cfg, cfg_where = (first.get("data_config") or {}), f"{first_name}'s data_config"
    if num_shards == 1:
        cfg, cfg_where = {}, DATA_CONFIG
        if (output / DATA_CONFIG).exists():
            try:
                cfg = json.loads((output / DATA_CONFIG).read_text())
            except (OSError, ValueError) as exc:
                res.problems.append(f"{DATA_CONFIG} does not read ({exc})")
    cfg_h = ((cfg if isinstance(cfg, dict) else {}).get("model") or {}).get("hidden_size")
    if cfg_h is not None and "hidden size" in seen and seen["hidden size"][0] != cfg_h:
        res.problems.append(f"the files' hidden size {seen['hidden size'][0]} ({seen['hidden size'][1]}), "
                            f"{cfg_where} says {cfg_h}")
    token_freq: Counter | None = None
    tf_target = token_freq_path if token_freq_path is not None else first.get("token_freq_path")
    if num_shards > 1:
        token_freq = Counter()
        for name, m in jobs.items():
            tf_file = output / str(m.get("token_freq_file"))
            try:
                counts = json.loads(tf_file.read_text())
            except (OSError, ValueError) as exc:
                res.problems.append(f"{name}: its token counts {tf_file.name} do not read ({exc})")
                continue
            token_freq.update({int(t): int(c) for t, c in counts.items()})
        if tf_target is not None:
            tf = Path(tf_target).resolve()
            if tf.name.endswith("pt") and (tf.parent == output.resolve() or output.resolve() in tf.parents):
                res.problems.append(f"token frequencies to {tf}: inside the data folder speculators' "
                                    "trainer would read it as a sample; pass --token-freq-path elsewhere")
    if res.problems or not write or num_shards == 1:
        return res
    import torch  # noqa: PLC0415

    merged = {
        **{k: v for k, v in first.items() if k not in _PER_JOB and k != "input_samples"},
        "complete": True,
        "samples": total,
        "shards": {str(m["shard_index"]): {k: m.get(k) for k in (
            "samples", "written_this_run", "tokens_this_run", "seconds_this_run", "replicas")}
            for m in jobs.values()},
        "verified": {"samples": res.samples, "by": "eagle3-compat verify"},
    }
    config = dict(first["data_config"])
    (output / DATA_CONFIG).write_text(json.dumps(config, indent=2))
    res.written.append(output / DATA_CONFIG)
    if tf_target is not None and token_freq is not None:
        tf = Path(tf_target)
        tf.parent.mkdir(parents=True, exist_ok=True)
        torch.save({t: token_freq[t] for t in sorted(token_freq)}, tf)
        merged["token_freq_path"] = str(tf.resolve())
        res.written.append(tf)
    write_json_atomic(output / MANIFEST, merged)
    res.written.append(output / MANIFEST)
    return res
