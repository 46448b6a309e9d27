"""Adapter ``worker-capture``: hooks on the decoder layers instead of a rewritten forward.

Upstream symbol: ``speculators.data_generation.custom_worker.
HiddenStatesWorkerExtension`` (its ``_patched_forward``), and on the vLLM
side the worker surface the capture relies on:
``GPUModelRunner.execute_model`` (the step), ``InputBatch.req_ids`` (the
batch layout) and ``ParallelConfig.worker_extension_cls``.

Why it breaks: 0.3.0's generic forward calls ``get_input_embeddings``
(renamed ``embed_input_ids`` in vLLM 0.12+), passes only ``positions,
hidden_states, residual`` to each layer (vLLM 0.16's DeepseekV2 layer also
takes ``llama_4_scaling``: dropped silently), skips model-specific forward
logic, captures during warm-up, keeps every step's states on the device
until the end of the call, and is used with ``collective_rpc`` whose reply
shape changed.

How it is fixed: the engine is started with our worker extension
(:class:`eagle3_compat.worker.CaptureWorkerExtension`), imported by vLLM
inside each worker, which registers forward hooks on the requested decoder
layers and records rows per request at every step.  Nothing is patched in
the user's process (this record's install step is empty; its probe checks
the worker-side symbols there, before any engine starts).  What changes in
the worker processes, per engine and only for the generator's own engine,
when ``e3c_setup`` runs: on the tensor-rank-0 worker (of each pipeline
stage), forward hooks on the requested decoder layers it runs (pre-hooks with ``capture="layer_input"``) and a
forward pre-hook on the model (its inputs); on every worker, that runner
instance's ``execute_model`` is wrapped (a ``wrapt.FunctionWrapper`` set as
an instance attribute; the ``GPUModelRunner`` class is not touched).
``e3c_teardown`` removes the hooks and the instance attribute; the engine's
shutdown ends the processes either way.

vLLM 0.22 to 0.32: the new model runner (``vllm/v1/worker/gpu/
model_runner.py``, "Model Runner V2") becomes the default (Qwen3 in 0.22,
Llama/Mistral/DeepseekV2 in 0.24, dense models in 0.25, all in 0.29; the
old runner deprecated, still in 0.32).  It has no ``runner.input_batch`` /
``runner.input_ids``, orders rows decodes first then by token count, and its
``execute_model`` takes more keyword arguments.  The worker reads the layout
of the runner the engine actually built (:mod:`eagle3_compat.runners`:
``v1`` or ``v2``, an unknown one refused naming this adapter and the vLLM
version).  On the CPU platform the V2 runner never runs ("Model Runner V2
requires Triton; using the V1 model runner instead", 0.25 to 0.32): its
layout is tested as pure logic only.  The probe accepts either runner module.

Remove when: speculators 0.3.0 is no longer supported.
"""

from __future__ import annotations

from .._journal import Journal
from . import Adapter, AdapterError

ID = "worker-capture"


def _v1_runner_ok() -> bool:
    try:
        from vllm.v1.worker.gpu_input_batch import InputBatch  # noqa: PLC0415
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: PLC0415
    except ImportError:
        return False
    if not callable(getattr(GPUModelRunner, "execute_model", None)):
        raise AdapterError(ID, "vllm GPUModelRunner.execute_model", "missing")
    if not hasattr(InputBatch, "req_ids"):
        raise AdapterError(ID, "vllm InputBatch.req_ids", "missing (batch layout unknown)")
    return True


def _v2_runner_ok() -> bool:
    try:
        from vllm.v1.worker.gpu import model_runner  # noqa: PLC0415
    except ImportError:
        return False
    return callable(getattr(getattr(model_runner, "GPUModelRunner", None), "execute_model", None))


def probe() -> None:
    from vllm.config import ParallelConfig  # noqa: PLC0415

    # Either runner may be what the engine builds; the worker reads which
    # (eagle3_compat.runners).  vLLM 0.11-0.21 have only the V1 runner.
    if not (_v1_runner_ok() or _v2_runner_ok()):
        raise AdapterError(
            ID, "vllm GPUModelRunner", "neither the V1 nor the V2 model runner module imports"
        )
    if "worker_extension_cls" not in getattr(ParallelConfig, "__dataclass_fields__", {}):
        raise AdapterError(ID, "vllm ParallelConfig.worker_extension_cls", "missing")


def install(journal: Journal) -> None:  # noqa: ARG001 - nothing to patch in this process
    return None


ADAPTER = Adapter(
    id=ID,
    targets=("eagle3_compat.worker.CaptureWorkerExtension (worker_extension_cls)",),
    vllm_min=(0, 11),
    vllm_max=(0, 32),
    probe=probe,
    install=install,
    upstream="vLLM 0.12 renamed get_input_embeddings; vLLM 0.16 DeepseekV2 layers take llama_4_scaling; "
    "vLLM 0.22-0.29 made the V2 model runner the default (other layout)",
    remove_when="speculators 0.3.0 is no longer supported",
)
