"""Adapter records: what eagle3_compat changes, for which vLLM, and why.

Each adapter is a declared record (style of OpenTelemetry's ``_instruments``
and vllm-ascend's ``patch/`` modules): an id, the symbols it touches, the
vLLM range it applies to, a probe of the exact upstream symbols it relies
on, an install function that makes every change through the journal, the
upstream story, and when it can be removed.  Coarse choice is by version
range; the probe is the fine check, and a failing probe is a loud
:class:`AdapterError`, never a silently skipped patch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._journal import Journal
from ..settings import ALLOW_UNVERIFIED

__all__ = ["ADAPTERS", "Adapter", "AdapterError", "VERIFIED_ARCHITECTURES", "refuse_unverified"]


class AdapterError(RuntimeError):
    """An adapter could not be applied; names the adapter and the symbol."""

    def __init__(self, adapter: str, symbol: str, problem: str) -> None:
        super().__init__(f"eagle3_compat adapter {adapter!r}: {symbol}: {problem}")
        self.adapter = adapter
        self.symbol = symbol


@dataclass(frozen=True)
class Adapter:
    id: str
    targets: tuple[str, ...]
    vllm_min: tuple[int, int]
    vllm_max: tuple[int, int]  # inclusive minor release
    probe: Callable[[], None]
    install: Callable[[Journal], None]
    upstream: str
    remove_when: str
    # Fine choice by what is installed besides vLLM (e.g. the transformers
    # major version), read from metadata (a versions.Found); None: always.
    needed: Callable[[Any], bool] | None = None

    def applies_to(self, vllm_minor: tuple[int, int]) -> bool:
        return self.vllm_min <= vllm_minor <= self.vllm_max

    def needed_for(self, found: Any) -> bool:
        """Whether this adapter is needed with the packages ``found`` (after :meth:`applies_to`)."""
        return self.needed is None or bool(self.needed(found))


# Architectures whose capture is checked against a reference in the test
# suite (see README, "Verified model families").
VERIFIED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    # vLLM's Llama classes (its MistralForCausalLM subclasses them)
    "MistralForCausalLM",
    # scaled embeddings, four norms per layer, soft-capping, sliding window
    "Gemma2ForCausalLM",
    # MoE with biased experts, attention sinks, sliding window; unquantized
    # checkpoints in bfloat16 on the CPU (MXFP4 not run)
    "GptOssForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Olmo2ForCausalLM",
    "LlavaForConditionalGeneration",
    "DeepseekV3ForCausalLM",
    # vision tower + DeepseekV3 text model; the capture hooks the text model's
    # decoder layers (get_language_model()), text prompts only
    "KimiK25ForConditionalGeneration",
)
ENV_ALLOW_UNVERIFIED = ALLOW_UNVERIFIED.name


def refuse_unverified(config: Any) -> None:
    """Refuse, before any weights load, an architecture no test has verified."""
    archs = list(getattr(config, "architectures", None) or [])
    if any(a in VERIFIED_ARCHITECTURES for a in archs):
        return
    if ALLOW_UNVERIFIED.get():
        return
    raise ValueError(
        f"eagle3_compat has not verified hidden-state capture for architecture(s) {archs}; "
        f"verified: {', '.join(VERIFIED_ARCHITECTURES)}. Set {ENV_ALLOW_UNVERIFIED}=1 to run "
        "anyway (check the result against a reference)."
    )


def _load() -> tuple[Adapter, ...]:
    from . import generator_engine, transformers5, worker_capture  # noqa: PLC0415

    # transformers5 first: the others' probes import speculators.
    return (transformers5.ADAPTER, generator_engine.ADAPTER, worker_capture.ADAPTER)


class _Lazy:
    """ADAPTERS without importing the adapter modules' targets at import time."""

    def __iter__(self):
        return iter(_load())

    def __len__(self) -> int:
        return len(_load())


ADAPTERS: Any = _Lazy()
