"""Which model runner the engine built, and how to read one step's layout from it.

vLLM has two model runners, and an engine builds one of them:

``v1`` (``vllm/v1/worker/gpu_model_runner.py``, ``GPUModelRunner``, and the
CPU platform's ``CPUModelRunner`` built on it): the persistent batch
``runner.input_batch`` (``.req_ids``: the requests in row order, after the
runner's own reordering for the attention backend) and the token-id buffer
``runner.input_ids`` (a ``CpuGpuBuffer``: ``.gpu``).

``v2`` (``vllm/v1/worker/gpu/model_runner.py``, the "new model runner",
``VLLM_USE_V2_MODEL_RUNNER``): no persistent ``input_batch``; each step
builds an ``InputBatch`` kept in ``runner.execute_model_state.input_batch``
from the end of ``execute_model`` until ``sample_tokens`` (``.req_ids``,
``.input_ids``), the token ids are in ``runner.input_buffers.input_ids`` (a
plain tensor), and the rows are ordered by ``sort_batch_req_ids`` (decodes
and speculative verifications first, then by scheduled token count), not in
the scheduler's order.  Its ``execute_model`` takes more keyword arguments
(``dummy_run``, ``is_profile``, ...).  It became vLLM's default for Qwen3 in
0.22 (vllm-project/vllm#39337), for Llama/Mistral/DeepseekV2 in 0.24, for
every dense model in 0.25 (#44443) and every model in 0.29 (#53183).  On the
CPU platform it never runs (0.25 to 0.32 log "Model Runner V2 requires
Triton; using the V1 model runner instead"), so its layout is checked here as
pure logic (``tests/test_runner_layout.py``), not end to end.

The kind is read from the runner the engine actually built (its
attributes), never from the vLLM version: the same release builds either
runner depending on the model, the platform and ``VLLM_USE_V2_MODEL_RUNNER``.
A runner that looks like neither is refused with an error naming the
adapter, the runner class and the vLLM version (never guessed).

Pure: nothing here imports torch or vLLM (the runner objects are passed in).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .capture import StepLayout

__all__ = [
    "RUNNER_V1",
    "RUNNER_V2",
    "UnknownRunnerError",
    "runner_kind",
    "runner_layout",
    "runner_token_ids",
]

RUNNER_V1 = "v1"
RUNNER_V2 = "v2"
ADAPTER_ID = "worker-capture"


class UnknownRunnerError(RuntimeError):
    """The engine built a model runner whose per-step layout this version cannot read."""


def _vllm_version() -> str:
    import sys  # noqa: PLC0415

    mod = sys.modules.get("vllm")
    return str(getattr(mod, "__version__", "unknown")) if mod is not None else "not imported"


def runner_kind(runner: Any) -> str:
    """``"v1"`` or ``"v2"``: the layout of the runner the engine built.

    Raises:
        UnknownRunnerError: neither layout (names the adapter, the runner
            class and the vLLM version).
    """
    if hasattr(runner, "input_buffers") and hasattr(runner, "execute_model_state"):
        if hasattr(runner, "input_batch"):
            problem = "has both the old runner's input_batch and the new runner's input_buffers"
        else:
            return RUNNER_V2
    elif hasattr(getattr(runner, "input_batch", None), "req_ids"):
        return RUNNER_V1
    else:
        problem = (
            "has neither input_batch.req_ids (vLLM's V1 model runner) nor "
            "input_buffers + execute_model_state (the V2 model runner)"
        )
    raise UnknownRunnerError(
        f"eagle3_compat adapter {ADAPTER_ID!r} on vLLM {_vllm_version()}: the model runner "
        f"{type(runner).__module__}.{type(runner).__name__} {problem}; the rows of a step "
        "cannot be attributed to requests (unknown runner layout)"
    )


def runner_layout(runner: Any, kind: str, num_scheduled_tokens: Mapping[str, int]) -> StepLayout:
    """The step's row layout, read right after the runner's ``execute_model``.

    ``num_scheduled_tokens``: the scheduler's tokens per request this step
    (``SchedulerOutput.num_scheduled_tokens``).  The order of the rows is the
    runner's (``v1``: ``input_batch.req_ids``, ``None`` holes skipped;
    ``v2``: ``execute_model_state.input_batch.req_ids``).

    Raises:
        UnknownRunnerError: ``kind`` is unknown, or a ``v2`` runner holds no
            step state (``execute_model`` did not build a batch).
    """
    if kind == RUNNER_V1:
        order = runner.input_batch.req_ids
    elif kind == RUNNER_V2:
        state = getattr(runner, "execute_model_state", None)
        batch = getattr(state, "input_batch", None)
        if batch is None:
            raise UnknownRunnerError(
                f"eagle3_compat adapter {ADAPTER_ID!r} on vLLM {_vllm_version()}: the V2 model "
                f"runner {type(runner).__name__} holds no execute_model_state.input_batch after "
                "execute_model; the rows of the step cannot be attributed"
            )
        order = batch.req_ids
    else:
        raise UnknownRunnerError(f"eagle3_compat adapter {ADAPTER_ID!r}: unknown runner kind {kind!r}")
    req_ids = tuple(r for r in order if r is not None)
    return StepLayout(req_ids, tuple(int(num_scheduled_tokens.get(r, 0)) for r in req_ids))


def runner_token_ids(runner: Any, kind: str) -> Any:
    """The runner's device buffer of this step's token ids (rows in layout
    order, padding after), or ``None``; read when the model itself is fed
    embeddings (multimodal models).  ``v1``: ``input_ids.gpu``; ``v2``:
    ``input_buffers.input_ids``."""
    if kind == RUNNER_V2:
        return getattr(getattr(runner, "input_buffers", None), "input_ids", None)
    buf = getattr(runner, "input_ids", None)
    return getattr(buf, "gpu", buf)
