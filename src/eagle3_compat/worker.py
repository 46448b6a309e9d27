"""Worker-side capture: forward hooks on the decoder layers.

vLLM imports this module inside every worker process (it is named as the
``worker_extension_cls`` of the engine), so nothing patched in the user's
process needs to reach the workers: the class below is the whole worker
side.  vLLM mixes it into its ``Worker`` class as an extra base; its
methods are called through ``collective_rpc``.

Why hooks, not a rewritten forward
----------------------------------
speculators 0.3.0 replaces the base model's ``forward`` with a generic
loop that calls ``layer(positions, hidden_states, residual)``.  That drops
every model-specific argument and step: DeepseekV2's ``llama_4_scaling``
(vLLM 0.16), Gemma's embedding normaliser, Qwen3-VL's deepstack, layers
that return one tensor, and ``get_input_embeddings`` renamed
``embed_input_ids``.  A forward hook on decoder layer ``k`` sees exactly
what the model's own forward produced there, whatever the model.

What is captured
----------------
The output of decoder layer ``k``: ``hidden + residual`` for layers that
return ``(hidden, residual)`` (vLLM's fused-residual layout), the tensor
itself for layers that return one.  That is speculators 0.3.0's contract
(the state before the final norm; Hugging Face ``hidden_states[k + 1]``
except for the last layer, where HF applies the final norm).
Rows leave the device at every step (only the scheduled rows; padding is
never copied), so device memory does not grow with the call.
"""

from __future__ import annotations

import os
from typing import Any

from .capture import StepLayout, StepSlicer
from .wire import pack
from .logs import get_logger

__all__ = ["CaptureWorkerExtension", "WORKER_EXTENSION"]

WORKER_EXTENSION = f"{__name__}.CaptureWorkerExtension"

log = get_logger("eagle3_compat.worker")


def _decoder_layers(model: Any) -> tuple[Any, Any]:
    """(language model's base model, its decoder layers) of a vLLM model."""
    lm = model.get_language_model() if hasattr(model, "get_language_model") else model
    base = getattr(lm, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise RuntimeError(
            f"eagle3_compat: cannot find the decoder layers of {type(model).__name__} "
            "(expected <language model>.model.layers)"
        )
    return base, layers


CAPTURE_POINTS = ("layer_output", "layer_input")


def _input_reader(layer: Any) -> Any:
    """A function (args, kwargs) -> the state decoder ``layer`` receives.

    vLLM's EAGLE-3 serving reads, for aux layer ``k``, ``hidden_states +
    residual`` just before layer ``k`` runs (``LlamaModel.forward``,
    ``aux_hidden_state_layers``); the arguments are found by name in the
    layer's own ``forward`` signature, so positional and keyword calls both work.
    """
    import inspect  # noqa: PLC0415

    names = [n for n in inspect.signature(layer.forward).parameters]
    if "hidden_states" not in names:
        raise RuntimeError(
            f"eagle3_compat: capture='layer_input' needs a decoder layer whose forward takes "
            f"'hidden_states'; {type(layer).__name__}.forward takes {names}"
        )
    ih = names.index("hidden_states")
    ir = names.index("residual") if "residual" in names else None

    def read(args: tuple, kwargs: dict) -> Any:
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[ih]
        r = None
        if ir is not None:
            r = kwargs["residual"] if "residual" in kwargs else (args[ir] if len(args) > ir else None)
        return h if r is None else h + r

    return read


def _layer_output(out: Any) -> Any:
    if isinstance(out, tuple):
        hidden = out[0]
        residual = out[1] if len(out) > 1 else None
        # vLLM layers return (hidden, residual) with the residual add fused into
        # the next norm; the layer's output proper is their sum.
        return hidden if residual is None else hidden + residual
    return out


class _Step:
    """What the hooks collect during one ``execute_model`` call."""

    __slots__ = ("slicer", "total", "layers", "positions", "token_ids")

    def __init__(self, slicer: StepSlicer, total: int) -> None:
        self.slicer = slicer
        self.total = total
        self.layers: dict[int, Any] = {}
        self.positions: list[int] | None = None
        self.token_ids: list[int] | None = None


class CaptureWorkerExtension:
    """Mixed into vLLM's Worker; captures decoder-layer outputs per request."""

    # -- set-up ---------------------------------------------------------------
    def e3c_setup(self, layer_ids: list[int], capture: str = "layer_output") -> dict[str, Any]:
        """Register hooks on the decoder layers ``layer_ids``; wrap the step.

        ``capture``: ``"layer_output"`` (speculators 0.3.0: what layer ``k``
        returns) or ``"layer_input"`` (vLLM's EAGLE-3 serving: what layer ``k``
        receives).
        """
        import torch  # noqa: PLC0415
        from vllm.distributed import get_pp_group, get_tp_group  # noqa: PLC0415

        if getattr(self, "_e3c_handles", None):
            raise RuntimeError("eagle3_compat: capture is already set up in this worker")
        if get_pp_group().world_size != 1:
            raise RuntimeError("eagle3_compat: pipeline parallelism is not supported")
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        base, layers = _decoder_layers(model)
        n_layers = len(layers)
        if capture not in CAPTURE_POINTS:
            raise ValueError(f"capture must be one of {CAPTURE_POINTS}, got {capture!r}")
        bad = [k for k in layer_ids if not 0 <= k < n_layers]
        if bad:
            raise ValueError(f"layer ids {bad} out of range for {n_layers} decoder layers")

        self._e3c_layer_ids = list(layer_ids)
        self._e3c_rank0 = get_tp_group().rank_in_group == 0
        self._e3c_slicer: StepSlicer | None = None
        self._e3c_step: _Step | None = None
        self._e3c_debug = os.environ.get("EAGLE3_COMPAT_DEBUG", "") not in ("", "0")
        handles = []

        def keep(slot: int, h: Any) -> None:
            step = self._e3c_step
            if step is None:
                return  # warm-up, profiling, or not armed: never captured
            # Copy off the device now (scheduled rows only): memory stays flat.
            step.layers[slot] = h[: step.total].detach().to("cpu", copy=True)

        def layer_hook(slot: int):
            def hook(_module, _args, out):
                if self._e3c_step is not None:
                    keep(slot, _layer_output(out))

            return hook

        def layer_pre_hook(slot: int, read: Any):
            def hook(_module, args, kwargs):
                if self._e3c_step is not None:
                    keep(slot, read(args, kwargs))

            return hook

        def inputs_hook(_module, args, kwargs):
            step = self._e3c_step
            if step is None:
                return
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            if input_ids is None:
                # Multimodal models get inputs_embeds only ("always embeddings,
                # even for text", vLLM's GPU model runner); the token ids the
                # embeddings came from are still in the runner's buffer.
                buf = getattr(runner, "input_ids", None)
                buf = getattr(buf, "gpu", buf)
                input_ids = buf if isinstance(buf, torch.Tensor) else None
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            step.token_ids = None if input_ids is None else input_ids[: step.total].tolist()
            if positions is not None and positions.dim() == 2:  # M-RoPE: [3, tokens]
                positions = positions[0]
            step.positions = None if positions is None else positions[: step.total].tolist()

        if self._e3c_rank0:
            for slot, k in enumerate(self._e3c_layer_ids):
                if capture == "layer_input":
                    pre = layer_pre_hook(slot, _input_reader(layers[k]))
                    handles.append(layers[k].register_forward_pre_hook(pre, with_kwargs=True))
                else:
                    handles.append(layers[k].register_forward_hook(layer_hook(slot)))
            handles.append(model.register_forward_pre_hook(inputs_hook, with_kwargs=True))
        self._e3c_handles = handles

        original = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            slicer = self._e3c_slicer
            total = scheduler_output.total_num_scheduled_tokens
            if slicer is None or not total:
                return original(scheduler_output, *args, **kwargs)
            # Step-local state: a fetch() that races with an in-flight step
            # (async scheduling) detaches the slicer; this step's rows then go
            # to the detached slicer, never into the next call.
            step = _Step(slicer, total)
            self._e3c_step = step
            try:
                result = original(scheduler_output, *args, **kwargs)
            finally:
                self._e3c_step = None
            self._e3c_record(scheduler_output, step)
            return result

        runner.execute_model = execute_model  # instance attribute: this runner only
        self._e3c_original_execute = original
        info = {
            "model": type(model).__name__,
            "capture": capture,
            "num_layers": n_layers,
            "rank0": self._e3c_rank0,
            "dtype": str(next(model.parameters()).dtype),
            "torch": str(torch.__version__),
        }
        log.info("capture hooks on %s layers %s (rank0=%s)", info["model"], layer_ids, self._e3c_rank0)
        return info

    def _e3c_record(self, scheduler_output: Any, step: _Step) -> None:
        runner = self.model_runner  # type: ignore[attr-defined]
        # The runner lays tokens out in input_batch.req_ids order (after its own
        # reordering for the attention backend), each request's scheduled tokens
        # contiguous; read that order rather than assume the scheduler's.
        req_ids = [r for r in runner.input_batch.req_ids if r is not None]
        counts = scheduler_output.num_scheduled_tokens
        layout = StepLayout(tuple(req_ids), tuple(int(counts.get(r, 0)) for r in req_ids))
        if layout.total != step.total:
            raise RuntimeError(
                f"eagle3_compat: step layout covers {layout.total} tokens but {step.total} "
                "were scheduled; cannot attribute rows"
            )
        n = len(self._e3c_layer_ids)
        missing = [self._e3c_layer_ids[s] for s in range(n) if s not in step.layers]
        if missing or step.positions is None:
            raise RuntimeError(
                "eagle3_compat: the decoder-layer hooks did not fire during an engine step "
                f"(layer ids {missing}); is the model compiled or wrapped so that module "
                "hooks do not run?"
            )
        layers = [step.layers[s] for s in range(n)]
        step.slicer.slice_step(layout, layers, step.positions, step.token_ids)
        if self._e3c_debug:
            log.warning(
                "step %d: %d rows, requests %s, layers %s",
                step.slicer.steps,
                step.total,
                list(zip(layout.req_ids, layout.num_tokens)),
                [tuple(t.shape) for t in layers],
            )

    # -- per call ---------------------------------------------------------------
    def e3c_arm(self, call: int) -> None:
        """Start collecting rows for requests of ``generate()`` call ``call``."""
        self._e3c_slicer = StepSlicer(call=call) if self._e3c_rank0 else None

    def e3c_fetch(self, call: int) -> Any:
        """Hand over (and forget) the rows of call ``call``; ``None`` off rank 0."""
        slicer, self._e3c_slicer = self._e3c_slicer, None
        if not self._e3c_rank0:
            return None
        if slicer is None or slicer.call != call:
            raise RuntimeError(
                f"eagle3_compat: capture was not armed for call {call} in this worker"
            )
        wire = pack(slicer.chunks, len(self._e3c_layer_ids))
        wire.update(steps=slicer.steps, foreign_rows=slicer.foreign_rows)
        return wire

    def e3c_disarm(self) -> None:
        self._e3c_slicer = None

    def e3c_teardown(self) -> None:
        for h in getattr(self, "_e3c_handles", ()):
            h.remove()
        self._e3c_handles = []
        original = getattr(self, "_e3c_original_execute", None)
        if original is not None:
            del self.model_runner.execute_model  # type: ignore[attr-defined]
            self._e3c_original_execute = None

    def e3c_memory(self, trim: bool = True) -> dict[str, int]:
        """Resident memory of this worker process, for the bounded-memory tests.

        ``trim`` first asks glibc to return freed heap pages to the system, so
        that the number reflects what is held rather than allocator caching.
        """
        import ctypes  # noqa: PLC0415
        import gc  # noqa: PLC0415
        import resource  # noqa: PLC0415

        import psutil  # noqa: PLC0415

        if trim:
            gc.collect()
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except (OSError, AttributeError):
                pass

        rss = psutil.Process().memory_info().rss
        held = 0
        if self._e3c_slicer is not None:
            for chunks in self._e3c_slicer.chunks.values():
                for c in chunks:
                    held += sum(t.numel() * t.element_size() for t in c.layers)
        return {
            "rss": rss,
            "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "held_bytes": held,
        }

