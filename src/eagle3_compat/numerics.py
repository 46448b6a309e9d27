"""``eagle3-compat verify --numerics DIR``: a folder's hidden states checked against the model.

``verify`` checks a folder's shape (every sample once, loadable, one row per
token).  The worst silent bugs in this field keep that shape and get the
numbers wrong: states of the wrong layer, rows shifted by one, the states of
another prompt.  This module checks the numbers, on a sample of records:

* **logits** (the folder's last layer id is the model's final decoder layer
  and its states are layer outputs): the model's final norm and LM head,
  read from the checkpoint alone (two tensors; the rest of the model is
  never loaded), are applied to the last captured layer's rows, and the
  log-probabilities that gives are compared with the engine's own
  ``prompt_logprobs`` for the same token ids (vLLM's plain engine, nothing
  of this library in it).  Row ``t`` predicts token ``t + 1``: a sample
  agrees at a position when the engine's top-1 token is also ours (within
  ``tie`` nats of our best, for near ties), and the agreement is the
  fraction of positions that do.  The difference of the two log-probs of
  the actual next token is reported as well.
* **recompute** (any other layer set): Hugging Face transformers recomputes
  the sampled prompts' states at the folder's layers (for models whose
  checkpoint fits ``max_recompute_bytes``); a row agrees when its relative
  error is within ``tol``.

A sample fails below ``threshold`` agreement, or when its files do not fit
the check (a row count unlike its tokens, fewer states than layers); the
folder fails when any sampled record does.  Defaults are per dtype: float32
states agree at nearly every position; bfloat16 states leave near ties.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .dataset import CONVENTIONS
from .upstream import data_path

__all__ = [
    "CONVENTION_OUTPUT",
    "NumericsResult",
    "SampleNumerics",
    "check_numerics",
    "final_norm_and_head",
    "logits_agreement",
]

log = logging.getLogger(__name__)

CONVENTION_OUTPUT = CONVENTIONS["layer_output"]
_DATA_FILE = re.compile(r"data_(\d+)\.pt")
# per dtype of the stored states: agreement threshold, near-tie margin (nats),
# relative tolerance of a recomputed row
_DEFAULTS = {
    "float32": {"threshold": 0.95, "tie": 5e-3, "tol": 1e-3},
    "bfloat16": {"threshold": 0.90, "tie": 5e-2, "tol": 5e-2},
    "float16": {"threshold": 0.95, "tie": 1e-2, "tol": 1e-2},
}
_ROWS_PER_CHUNK = 256


@dataclass
class SampleNumerics:
    """One sampled record: its agreement (0 to 1) and what was compared."""

    index: int
    tokens: int
    agreement: float
    ok: bool
    detail: str


@dataclass
class NumericsResult:
    """What :func:`check_numerics` found, per sampled record."""

    method: str
    threshold: float
    layer_ids: list[int]
    convention: str
    samples: list[SampleNumerics] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.samples) and all(s.ok for s in self.samples)

    @property
    def failed(self) -> list[SampleNumerics]:
        return [s for s in self.samples if not s.ok]

    def table(self) -> str:
        """The per-sample report, as ``verify --numerics`` prints it."""
        head = (f"numerics ({self.method}; layers {self.layer_ids}, {self.convention}; "
                f"a sample fails below {self.threshold:.2f} agreement)")
        rows = [f"  sample {s.index:>6}: {s.tokens:>6} tokens, agreement {s.agreement:6.1%}  "
                f"{'ok  ' if s.ok else 'FAIL'}  {s.detail}" for s in self.samples]
        return "\n".join([head, *rows])


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def folder_settings(folder: Path) -> dict[str, Any]:
    """Model, layer ids, convention and dtype of a folder: from this library's
    ``manifest.json`` (or a shard manifest), else speculators' ``data_config.json``."""
    manifest = _read_json(folder / "manifest.json")
    if manifest is None:
        shards = sorted(folder.glob("manifest.shard-*-of-*.json"))
        manifest = _read_json(shards[0]) if shards else None
    if manifest is not None:
        capture = manifest.get("capture", "layer_output")
        return {"model": manifest.get("model"), "layer_ids": manifest.get("layer_ids"),
                "convention": manifest.get("layer_convention", CONVENTIONS.get(capture, capture)),
                "capture": capture, "dtype": manifest.get("dtype"),
                "max_model_len": manifest.get("max_model_len")}
    cfg = _read_json(folder / "data_config.json")
    if cfg is None:
        raise ValueError(f"{folder}: neither manifest.json nor data_config.json can be read; "
                         "is this a data folder?")
    hs = cfg.get("hidden_states", {})
    model = cfg.get("model", {})
    return {"model": model.get("target_model_path") if isinstance(model, dict) else None,
            "layer_ids": hs.get("layer_ids"),
            "convention": hs.get("layer_convention", CONVENTION_OUTPUT), "capture": "layer_output",
            "dtype": None, "max_model_len": cfg.get("data", {}).get("seq_length")}


def sample_indices(folder: Path, n: int) -> list[int]:
    """``n`` record indices spread over the folder's ``data_{i}.pt`` files, first and last included."""
    found = sorted(int(m.group(1)) for p in folder.glob("data_*.pt") if (m := _DATA_FILE.fullmatch(p.name)))
    if not found:
        raise ValueError(f"{folder}: no data_*.pt files")
    if n >= len(found):
        return found
    if n <= 1:
        return [found[0]]
    return sorted({found[round(i * (len(found) - 1) / (n - 1))] for i in range(n)})


def _text_config(config: Any) -> Any:
    for name in ("text_config", "language_config"):
        sub = getattr(config, name, None)
        if sub is not None and getattr(sub, "num_hidden_layers", None):
            return sub
    return config


def _checkpoint_tensors(model_path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the checkpoint's index or its files."""
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        return {k: model_path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open  # noqa: PLC0415

    names: dict[str, Path] = {}
    for f in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            names.update(dict.fromkeys(st.keys(), f))
    return names


_FINAL_NORM = re.compile(r"(?:^|\.)norm\.weight$")
_SKIP = ("layers.", "vision", "visual", "mm_projector", "multi_modal", "vit", "audio")
# model types whose final norm is a plain RMSNorm (x * rsqrt(mean(x^2) + eps) * w)
# and whose logits are the LM head's product with it, unscaled
RMS_HEAD_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "olmo2", "deepseek_v3", "deepseek_v2", "kimi_k2",
})


def final_norm_and_head(model_path: str | Path) -> tuple[Any, Any, float]:
    """The final norm's weight, the LM head's weight and the norm's epsilon,
    read from the checkpoint's safetensors (nothing else is loaded).  Raises
    ``ValueError`` naming what is missing, or a model type whose final
    norm and head this check does not know."""
    from safetensors import safe_open  # noqa: PLC0415
    from transformers import AutoConfig  # noqa: PLC0415

    path = Path(model_path)
    config = _text_config(AutoConfig.from_pretrained(str(path), trust_remote_code=True))
    mtype = getattr(config, "model_type", None)
    if mtype not in RMS_HEAD_MODEL_TYPES:
        raise ValueError(f"numerics: the final norm and LM head of model type {mtype!r} are not known to "
                         f"this check (known: {sorted(RMS_HEAD_MODEL_TYPES)})")
    names = _checkpoint_tensors(path)
    plain = [k for k in names if not any(s in k for s in _SKIP)]
    norms = sorted((k for k in plain if _FINAL_NORM.search(k)), key=len)
    heads = sorted((k for k in plain if k.endswith("lm_head.weight")), key=len)
    if not heads and getattr(config, "tie_word_embeddings", False):
        heads = sorted((k for k in plain if k.endswith("embed_tokens.weight")), key=len)
    if not norms or not heads:
        raise ValueError(f"numerics: {path} has no {'final norm' if not norms else 'LM head'} tensor "
                         f"({len(names)} tensors looked at)")

    def load(name: str) -> Any:
        with safe_open(str(names[name]), framework="pt") as st:
            return st.get_tensor(name)

    eps = getattr(config, "rms_norm_eps", None)
    if eps is None:
        raise ValueError(f"numerics: {path}'s config has no rms_norm_eps")
    return load(norms[0]), load(heads[0]), float(eps)


def _log_probs(rows: Any, norm_w: Any, head_w: Any, eps: float) -> Any:
    import torch  # noqa: PLC0415

    x = rows.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_w.to(torch.float32)
    return torch.log_softmax(x @ head_w.to(torch.float32).T, dim=-1)


def logits_agreement(rows: Any, token_ids: Sequence[int], engine: Sequence[tuple[int, float] | None],
                     norm_w: Any, head_w: Any, eps: float, tie: float) -> tuple[float, float, int]:
    """Agreement of our next-token predictions with the engine's.

    ``engine[t]`` is the engine's (top-1 token, log-prob of ``token_ids[t]``)
    for position ``t`` (``None`` at 0).  Returns (fraction of positions
    ``1..T-1`` where the engine's top-1 is within ``tie`` of our best, the
    largest log-prob difference of the actual tokens, positions compared)."""
    import torch  # noqa: PLC0415

    n = len(token_ids)
    agree = 0
    worst = 0.0
    for lo in range(0, n - 1, _ROWS_PER_CHUNK):
        hi = min(n - 1, lo + _ROWS_PER_CHUNK)
        lp = _log_probs(rows[lo:hi], norm_w, head_w, eps)
        best = lp.max(dim=-1).values
        for j in range(hi - lo):
            t = lo + j + 1
            top1, actual_lp = engine[t]  # type: ignore[misc]
            if float(lp[j, top1]) >= float(best[j]) - tie:
                agree += 1
            worst = max(worst, abs(float(lp[j, token_ids[t]]) - actual_lp))
        del lp
    compared = n - 1
    return (agree / compared if compared else 1.0), worst, compared


def engine_prompt_logprobs(model: str, prompts: Sequence[Sequence[int]], *, dtype: str,
                           max_model_len: int, llm: Any = None) -> list[list[tuple[int, float] | None]]:
    """vLLM's own (top-1 token, log-prob of the prompt's token) per position, per prompt.

    ``llm``: an engine to use (``vllm.LLM``); otherwise one is started (plain
    vLLM, nothing of this library's capture in it) and shut down after."""
    from vllm import SamplingParams  # noqa: PLC0415

    own = llm is None
    if own:
        llm = _start_engine(model, dtype, max_model_len)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    finally:
        if own:
            llm.llm_engine.engine_core.shutdown()
    result = []
    for i, (o, p) in enumerate(zip(outs, prompts)):
        per: list[tuple[int, float] | None] = [None]
        for t, d in enumerate(o.prompt_logprobs[1:], start=1):
            top = [tok for tok, lp in d.items() if getattr(lp, "rank", None) == 1]
            if not top or p[t] not in d:
                raise RuntimeError(f"numerics: the engine's prompt_logprobs for prompt {i} position {t} lack "
                                   "the top-1 token or the prompt's token")
            per.append((int(top[0]), float(d[p[t]].logprob)))
        result.append(per)
    return result


def _start_engine(model: str, dtype: str, max_model_len: int) -> Any:
    import contextlib  # noqa: PLC0415

    from vllm import LLM  # noqa: PLC0415
    from vllm.platforms import current_platform  # noqa: PLC0415

    from .cpu_attention import engine_kwargs  # noqa: PLC0415
    from .cuda_engine import cuda_engine_environment  # noqa: PLC0415

    env = cuda_engine_environment(dtype) if current_platform.is_cuda() else contextlib.nullcontext()
    with env:
        return LLM(model=model, dtype=dtype, max_model_len=max_model_len, enable_prefix_caching=False,
                   enforce_eager=True, seed=0, **engine_kwargs(dtype, model))


def _load(folder: Path, index: int) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    return torch.load(data_path(folder, index), weights_only=True, map_location="cpu")


def _shape_problem(data: dict[str, Any], n_layers: int) -> str | None:
    ids = data.get("input_ids")
    hs = data.get("hidden_states")
    if ids is None or not isinstance(hs, (list, tuple)):
        return "no input_ids or hidden_states"
    if len(hs) != n_layers:
        return f"{len(hs)} hidden-state tensors for {n_layers} layer ids"
    for j, h in enumerate(hs):
        if h.dim() != 2 or h.shape[0] != len(ids):
            return f"hidden state {j} has shape {tuple(h.shape)} for {len(ids)} tokens"
    return None


def check_numerics(
    folder: str | Path,
    *,
    model: str | None = None,
    samples: int = 8,
    threshold: float | None = None,
    method: str = "auto",
    llm: Any = None,
    max_recompute_bytes: int = 8 << 30,
) -> NumericsResult:
    """Check ``samples`` records of ``folder`` against the model (module docstring).

    ``model`` overrides the folder's model path; ``threshold`` the per-dtype
    default; ``method`` is ``auto`` (logits where the last layer id is the
    final layer and the states are layer outputs, else recompute),
    ``logits`` or ``recompute``; ``llm`` an engine to use for ``logits``."""
    from transformers import AutoConfig  # noqa: PLC0415

    if samples < 1:
        raise ValueError(f"numerics: samples must be at least 1, not {samples}")
    if threshold is not None and not 0.0 <= threshold <= 1.0:
        raise ValueError(f"numerics: threshold must be in [0, 1], not {threshold}")
    folder = Path(folder)
    settings = folder_settings(folder)
    model_path = model or settings["model"]
    layer_ids = settings["layer_ids"]
    if not model_path or not layer_ids:
        raise ValueError(f"{folder}: the folder names no model or layer ids; pass --model")
    layer_ids = [int(k) for k in layer_ids]
    num_layers = _text_config(AutoConfig.from_pretrained(str(model_path), trust_remote_code=True)).num_hidden_layers
    last_is_final = layer_ids[-1] == num_layers - 1 and settings["capture"] == "layer_output"
    if method == "auto":
        method = "logits" if last_is_final else "recompute"
    if method == "logits" and not last_is_final:
        raise ValueError(f"numerics: the logits check needs the final layer's output last ({num_layers - 1}, "
                         f"layer_output); the folder has {layer_ids} as {settings['capture']}")
    if method not in ("logits", "recompute"):
        raise ValueError(f"numerics: method must be auto, logits or recompute, not {method!r}")

    indices = sample_indices(folder, samples)
    records = {i: _load(folder, i) for i in indices}
    dtypes = {str(h.dtype).removeprefix("torch.") for d in records.values()
              for h in (d.get("hidden_states") or [])}
    dtype = settings["dtype"] if settings["dtype"] in _DEFAULTS else (
        "bfloat16" if "bfloat16" in dtypes else "float16" if "float16" in dtypes else "float32")
    limits = _DEFAULTS[dtype if dtype in _DEFAULTS else "float32"]
    threshold = limits["threshold"] if threshold is None else threshold
    result = NumericsResult(method=method, threshold=threshold, layer_ids=layer_ids,
                            convention=settings["convention"])
    sound = {}
    for i, d in records.items():
        problem = _shape_problem(d, len(layer_ids))
        if problem:
            n = len(d.get("input_ids", []))
            result.samples.append(SampleNumerics(i, n, 0.0, False, problem))
        else:
            sound[i] = d
    prompts = [sound[i]["input_ids"].tolist() for i in sound]
    longest = max((len(p) for p in prompts), default=1)
    max_len = max(int(settings["max_model_len"] or 0), longest + 1)
    log.info("numerics: %d of %d sampled records by %s against %s", len(sound), len(records), method, model_path)
    if method == "logits" and sound:
        norm_w, head_w, eps = final_norm_and_head(model_path)
        ref = engine_prompt_logprobs(str(model_path), prompts, dtype=dtype, max_model_len=max_len, llm=llm)
        for (i, d), p, r in zip(sound.items(), prompts, ref):
            agree, worst, n = logits_agreement(d["hidden_states"][-1], p, r, norm_w, head_w, eps, limits["tie"])
            result.samples.append(SampleNumerics(
                i, len(p), agree, agree >= threshold,
                f"top-1 as the engine's at {round(agree * n)} of {n} positions; "
                f"log-prob of the next token off by <= {worst:.3g}"))
    elif sound:
        _recompute(result, sound, prompts, str(model_path), layer_ids, settings["capture"], limits["tol"],
                   threshold, max_recompute_bytes)
    result.samples.sort(key=lambda s: s.index)
    return result


def _recompute(result: NumericsResult, sound: dict[int, Any], prompts: list[list[int]], model_path: str,
               layer_ids: list[int], capture: str, tol: float, threshold: float, max_bytes: int) -> None:
    import torch  # noqa: PLC0415

    from .testing import hf_layer_outputs  # noqa: PLC0415

    size = sum(p.stat().st_size for p in Path(model_path).glob("*.safetensors"))
    if size > max_bytes:
        raise ValueError(f"numerics: recomputing with Hugging Face needs the model in host memory "
                         f"({size / 2**30:.1f} GiB > {max_bytes / 2**30:.1f} GiB); capture the final layer "
                         "last for the logits check, or raise the limit")
    if capture != "layer_output":
        raise ValueError(f"numerics: recomputing {capture} states is not supported (layer_output only)")
    ref = hf_layer_outputs(model_path, prompts, layer_ids)
    for (i, d), p, r in zip(sound.items(), prompts, ref):
        good = 0
        worst = 0.0
        for t in range(len(p)):
            errs = []
            for got, want in zip(d["hidden_states"], r):
                g, w = got[t].to(torch.float64), want[t].to(torch.float64)
                errs.append(float((g - w).abs().max() / w.abs().max().clamp_min(1e-30)))
            row = max(errs)
            worst = max(worst, row if math.isfinite(row) else math.inf)
            good += row <= tol
        agree = good / len(p)
        result.samples.append(SampleNumerics(
            i, len(p), agree, agree >= threshold,
            f"{good} of {len(p)} rows within {tol:g} of Hugging Face (worst {worst:.3g})"))
