"""Adapter ``generator-engine``: drive speculators 0.3.0's generator through ``vllm.LLM``.

Upstream symbol: ``speculators.data_generation.vllm_hidden_states_generator.
VllmHiddenStatesGenerator`` (``__init__``, ``generate``, ``__del__``).

Why it breaks: 0.3.0 was written against vLLM 0.11's internals.  From 0.12
to 0.16, in failure order: ``SchedulerConfig`` needs ``is_encoder_decoder``;
``get_kv_cache_config_from_groups`` lost ``kv_cache_specs``; ``Scheduler``
needs ``block_size``; prefix caching and chunked prefill became defaults
(rows skipped, prompts truncated, later rows shifted: silent); the step
became two-phase (``execute_model`` then ``sample_tokens``);
``collective_rpc(unique_reply_rank=0)`` returns the bare reply, so ``[0]``
picks the first layer (silent: "771 tensors of shape [512]"); async
scheduling became the default (0.14); KV-cache sizing calls
``torch.cuda.mem_get_info`` (no CPU); 0.17 drops ``Request(eos_token_id)``.
On vLLM 0.11 itself, a call whose prompts need more than one engine step
comes back misaligned (each request is aborted after its first step).

How it is fixed: the methods are replaced (through the journal) by
:mod:`eagle3_compat.generator`, which keeps the signature and result format
but uses the offline engine's stable surface (``LLM``,
``llm_engine.add_request/step``, ``collective_rpc``), lets vLLM size the KV
cache and chunk prompts, turns prefix caching off, and attributes rows from
what each step actually scheduled.  ``close()``, ``__enter__`` and
``__exit__`` are added.

vLLM 0.17 to 0.32 (read from the CPU wheels and run in CI on 0.17, 0.19,
0.25, 0.29, 0.32): the offline-engine surface used here is unchanged.
``LLMEngine.add_request`` returns the engine's internal request id from
0.17 (the id we pass gets ``-<random>`` appended; ours are parsed with the
suffix ignored, and ``abort_request`` still takes the ids we passed);
passing a raw prompt dict logs a one-time deprecation warning from 0.17 (it
still works in 0.32: the replacement, ``Renderer.render_cmpl``, does not
exist before 0.17); ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` (0.17) is not
needed.

Upstream change: speculators 0.4.0 ported the hand-driven loop to vLLM
0.12-0.16 (and keeps some of the row bugs: see findings).
Remove when: speculators 0.3.0 is no longer used.
"""

from __future__ import annotations

import inspect

from .._journal import Journal
from . import Adapter, AdapterError

ID = "generator-engine"
TARGET = "speculators.data_generation.vllm_hidden_states_generator.VllmHiddenStatesGenerator"
EXPECTED_INIT = ["self", "model_path", "layer_ids", "max_model_len", "gpu_memory_utilization", "tensor_parallel_size"]


def _target():
    from speculators.data_generation import vllm_hidden_states_generator as mod  # noqa: PLC0415

    return mod.VllmHiddenStatesGenerator


def probe() -> None:
    try:
        cls = _target()
    except ImportError as exc:
        raise AdapterError(ID, TARGET, f"cannot import: {exc}") from exc
    for name in ("__init__", "generate", "_create_vllm_config", "_setup_capture"):
        if name not in vars(cls):
            raise AdapterError(ID, f"{TARGET}.{name}", "missing (not speculators 0.3.0?)")
    params = list(inspect.signature(vars(cls)["__init__"]).parameters)
    if params != EXPECTED_INIT:
        raise AdapterError(ID, f"{TARGET}.__init__", f"signature {params}, expected {EXPECTED_INIT}")
    from vllm import LLM  # noqa: PLC0415
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415
    from vllm.v1.engine.llm_engine import LLMEngine  # noqa: PLC0415

    for owner, name in ((LLM, "collective_rpc"), (LLMEngine, "add_request"), (LLMEngine, "step"),
                        (LLMEngine, "has_unfinished_requests"), (LLMEngine, "abort_request")):
        if not callable(getattr(owner, name, None)):
            raise AdapterError(ID, f"vllm {owner.__name__}.{name}", "missing")
    fields = getattr(EngineArgs, "__dataclass_fields__", {})
    for name in ("worker_extension_cls", "enable_prefix_caching", "compilation_config"):
        if name not in fields:
            raise AdapterError(ID, f"vllm EngineArgs.{name}", "missing")


def install(journal: Journal) -> None:
    from .. import generator as g  # noqa: PLC0415

    cls = _target()
    journal.set(cls, "__init__", g.generator_init)
    journal.set(cls, "generate", g.generator_generate)
    journal.set(cls, "__del__", g.generator_del)
    journal.set(cls, "close", g.generator_close)
    journal.set(cls, "__enter__", g.generator_enter)
    journal.set(cls, "__exit__", g.generator_exit)
    # An addition (not in 0.3.0): extraction as prompts finish, engine kept full.
    journal.set(cls, "stream", g.generator_stream)


ADAPTER = Adapter(
    id=ID,
    targets=tuple(
        f"{TARGET}.{n}"
        for n in ("__init__", "generate", "__del__", "close", "__enter__", "__exit__", "stream")
    ),
    vllm_min=(0, 11),
    vllm_max=(0, 32),
    probe=probe,
    install=install,
    upstream="speculators 0.3.0 targets vLLM 0.11 internals; vLLM 0.12-0.16 changed them (findings §2); "
    "0.17+: add_request returns the internal id, raw prompt dicts deprecated",
    remove_when="speculators 0.3.0 is no longer supported",
)
