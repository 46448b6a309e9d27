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
never copied) through :mod:`eagle3_compat.offload` and go to their place
in the call's arena (:mod:`eagle3_compat.arena`: shared memory with the
driver), so neither device nor worker memory grows with the call and
nothing is serialised.  Two paths:

direct (V1 runner)
    the model's forward pre-hook reads the step's layout (the runner has
    laid its batch out by then) and plans the runs (:meth:`_Call.plan`);
    each layer hook copies its rows run by run to their places
    (:meth:`_Step.capture`; on CUDA a side stream into the page-locked
    pool file); after the step the writer attributes the rows from the
    positions the model saw and checks them against the plan.
staged (V2 runner, files not kept, ``EAGLE3_COMPAT_DIRECT=0``)
    each layer's rows go to a staging buffer (pinned on CUDA) and the
    writer copies each run into the arena after attributing it.

Pipeline parallelism
--------------------
Each stage's model holds only its own decoder layers (the others are
placeholders); hooks go on the requested layers the stage runs
(:func:`_owned_layers`), and the tensor-rank-0 worker of each stage that
owns one of them attributes its rows exactly as without pipeline
parallelism (every stage sees the same scheduled batch, positions and
token ids) and writes its layers' slots of the call's arena.  Its replies
carry its ``stage`` and ``slots``; the driver merges them by layer.
"""

from __future__ import annotations

import os
from typing import Any

from . import settings
from .arena import LocalSink, ShmSink, forget_all, layout_for, probe_seen
from .capture import CaptureError, Segment, StepLayout, StepSlicer, check_plan, clip_run, shard_rows
from .cpu_attention import grant_amx
from .heap import (
    IDLE_SLEEP_ENV,
    PRIMITIVE_CACHE_ENV,
    THP_ENV,
    HeapTrimmer,
    allow_huge_pages_after_start,
    huge_pages_refused,
    reuse_step_buffers,
)
from .logs import attach_to_vllm_logging, get_logger
from .offload import HostOffload, Staged
from .runners import RUNNER_V1, UnknownRunnerError, runner_kind, runner_layout, runner_token_ids

__all__ = ["CaptureWorkerExtension", "WORKER_EXTENSION"]

WORKER_EXTENSION = f"{__name__}.CaptureWorkerExtension"

log = get_logger("eagle3_compat.worker")


def _proc_kib_field(path: str, field: str) -> int:
    """The ``<field>: <n> kB`` line of a /proc file, in bytes; -1 where there is none."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def anon_rss() -> int:
    """This process's resident anonymous memory in bytes (``RssAnon``): its
    heap and tensors, not the shared arena files it maps (those are counted
    by the arena pool).  -1 where /proc does not say."""
    return _proc_kib_field("/proc/self/status", "RssAnon")


def anon_huge_bytes() -> int:
    """This process's anonymous memory on transparent huge pages
    (``AnonHugePages`` of ``/proc/self/smaps_rollup``); -1 where /proc does
    not say."""
    return _proc_kib_field("/proc/self/smaps_rollup", "AnonHugePages")


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


def _owned_layers(base: Any, layers: Any, stage: int, stages: int) -> range:
    """The decoder layers pipeline stage ``stage`` of ``stages`` runs (global ids).

    vLLM builds every stage's model with the full ``layers`` list, the layers
    of other stages being ``PPMissingLayer`` placeholders, and records its own
    range as ``start_layer``/``end_layer`` on the base model (``make_layers``,
    ``vllm/model_executor/models/utils.py``, the same in 0.11-0.16); the base
    model's forward runs ``layers[start_layer:end_layer]``.  Where a model has
    no such attributes, vLLM's own split (``vllm.distributed.utils.
    get_pp_indices``, which honours ``VLLM_PP_LAYER_PARTITION``) is used.
    Either way the range is checked against the placeholders, so a hook is
    never put on a layer this stage does not run.
    """
    n = len(layers)
    if stages == 1:
        return range(n)
    start, end = getattr(base, "start_layer", None), getattr(base, "end_layer", None)
    how = "start_layer/end_layer"
    if not (isinstance(start, int) and isinstance(end, int)):
        from vllm.distributed.utils import get_pp_indices  # noqa: PLC0415

        start, end = get_pp_indices(n, stage, stages)
        how = "get_pp_indices"
    owned = range(int(start), int(end))
    try:
        from vllm.model_executor.models.utils import PPMissingLayer  # noqa: PLC0415
    except ImportError:  # pragma: no cover - present in every supported release
        PPMissingLayer = None  # noqa: N806
    if PPMissingLayer is not None:
        wrong = [k for k in range(n) if isinstance(layers[k], PPMissingLayer) == (k in owned)]
        if wrong:
            raise RuntimeError(
                f"eagle3_compat: pipeline stage {stage} of {stages} runs decoder layers "
                f"{owned.start}..{owned.stop - 1} ({how}) of {type(base).__name__}, but layers "
                f"{wrong} are {'placeholders' if wrong[0] in owned else 'real'} there: cannot tell "
                "which layers this stage owns"
            )
    return owned


def _input_reader(layer: Any) -> Any:
    """A function (args, kwargs) -> (the state decoder ``layer`` receives, owned).

    vLLM's EAGLE-3 serving reads, for aux layer ``k``, ``hidden_states +
    residual`` just before layer ``k`` runs (``LlamaModel.forward``,
    ``aux_hidden_state_layers``); the arguments are found by name in the
    layer's own ``forward`` signature, so positional and keyword calls both
    work.  ``owned``: the tensor was made here (a sum), not the model's own.
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

    def read(args: tuple, kwargs: dict) -> tuple[Any, bool]:
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[ih]
        r = None
        if ir is not None:
            r = kwargs["residual"] if "residual" in kwargs else (args[ir] if len(args) > ir else None)
        return (h, False) if r is None else (h + r, True)

    return read


def _layer_output(out: Any) -> tuple[Any, bool]:
    """(the output of a decoder layer, whether that tensor was made here)."""
    if isinstance(out, tuple):
        hidden = out[0]
        residual = out[1] if len(out) > 1 else None
        # vLLM layers return (hidden, residual) with the residual add fused into
        # the next norm; the layer's output proper is their sum.
        return (hidden, False) if residual is None else (hidden + residual, True)
    return out, False


class _Step:
    """What the hooks collect during one ``execute_model`` call.

    ``planned``: the runs of rows the call expects from this step, worked
    out before the model ran (:meth:`_Call.plan`); ``targets``: where each
    run of this worker's rows goes when the layers' rows are copied there
    directly during the step, as ``(place, src, count)``: rows
    ``src..src+count-1`` of each layer's tensor go to ``place[slot]``, a
    view of the prompt's block in its group's arena; ``direct``: the layer
    slots whose rows were.
    """

    __slots__ = ("total", "call", "scheduled", "layout", "planned", "targets", "direct",
                 "layers", "seen", "positions", "token_ids", "lo", "hi")

    def __init__(self, total: int, call: _Call | None = None, scheduled: Any = None) -> None:
        self.total = total
        self.call = call
        # The rows this worker copies: all of them, or its tensor-parallel
        # rank's share in a sharded call (capture.shard_rows).
        self.lo, self.hi = (0, total) if call is None else shard_rows(total, call.shard, call.shards)
        self.seen: dict[int, int] = {}  # layer slot -> rows its tensor had
        self.scheduled = scheduled  # SchedulerOutput.num_scheduled_tokens
        self.layout: StepLayout | None = None
        self.planned: list[Segment] | None = None
        self.targets: list[tuple[Any, int, int]] | None = None
        self.direct: set[int] = set()
        self.layers: dict[int, Staged] = {}
        self.positions: Staged | None = None
        self.token_ids: Staged | None = None

    def capture(self, offload: HostOffload, slot: int, h: Any, owned: bool, hidden: int, dtype: Any) -> None:
        """Send layer slot ``slot``'s rows ``h`` of this step on their way: each
        planned run straight to its place (``targets``), or else the scheduled
        rows (padding never leaves the device) to staging, for
        :meth:`_Call.process` to attribute and write."""
        targets = self.targets
        self.seen[slot] = int(h.shape[0]) if h.dim() else 0
        lo, hi = self.lo, self.hi
        if (targets is not None and h.dim() == 2 and h.shape[0] >= self.total
                and h.shape[1] == hidden and h.dtype == dtype):
            # the places were worked out once for the step (_Call.plan), not per layer
            pairs = [(place[slot], h[src : src + count]) for place, src, count in targets]
            try:
                self.layers[slot] = offload.submit_runs(pairs)
                self.direct.add(slot)
                return
            except ValueError:  # a run that does not fit: the staged path reports it
                pass
        self.layers[slot] = offload.submit(slot, h[lo:hi], owned)

    def release(self) -> None:
        for staged in (*self.layers.values(), self.positions, self.token_ids):
            if staged is not None:
                staged.release()


class _Group:
    """Prompts of a call that share one arena (all of a ``generate()`` call, or
    one prompt of a stream); collected together by ``e3c_take``."""

    def __init__(self, prompts: list[list[int]], sink: Any, transport: str, direct: bool = False) -> None:
        self.local = {int(index): i for i, (index, _n) in enumerate(prompts)}
        self.sink = sink
        self.transport = transport
        self.direct = direct  # rows may be copied into the sink during the step
        self.segments: list[Any] = []
        self.rows = 0  # rows x layer slots this worker wrote (its share in a sharded call)

    def close(self) -> None:
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.close()


class _Call:
    """A capturing worker's state for one ``generate()`` call or stream.

    ``shard`` of ``shards``: this worker's tensor-parallel rank when the
    ranks share the copies (each writes its rows of every step,
    :func:`~eagle3_compat.capture.shard_rows`); ``0`` of ``1`` otherwise.
    Every rank attributes every step itself; rank 0 replies with the
    call's metadata, the others with their share (checked by the driver,
    :func:`~eagle3_compat.capture.fold_shards`).
    """

    def __init__(self, call: int, debug: bool, shard: int = 0, shards: int = 1) -> None:
        shard_rows(0, shard, shards)  # checked
        self.shard, self.shards = shard, shards
        self.slicer = StepSlicer(call=call, lengths={})
        self.groups: dict[int, _Group] = {}
        self.owner: dict[int, _Group] = {}  # prompt index -> its group
        self.error: str | None = None
        self.debug = debug
        self.direct_steps = 0  # steps whose rows went straight into the arena

    def add(
        self, group_id: int, prompts: list[list[int]], sink: Any, transport: str, direct: bool = False
    ) -> None:
        if group_id in self.groups:
            raise CaptureError(f"group {group_id} of call {self.slicer.call} was already added")
        group = _Group(prompts, sink, transport, direct)
        for index, n in prompts:
            if index in self.owner:
                raise CaptureError(f"prompt {index} of call {self.slicer.call} was already added")
            self.owner[index] = group
            self.slicer.lengths[index] = int(n)  # type: ignore[index]
        self.groups[group_id] = group

    def take(self, group_id: int) -> _Group:
        group = self.groups.pop(group_id)
        for index in group.local:
            # Rows of a collected prompt that still arrived would be an error.
            del self.owner[index]
            self.slicer.forget(index)
        return group

    def plan(self, step: _Step, layout: StepLayout) -> None:
        """Before the model runs the step: the runs its rows will form
        (``step.planned``, checked against the model's positions after the
        step) and, when every run's group takes direct copies, where each
        goes (``step.targets``).  A request the call does not know leaves the
        step unplanned: it takes the staged path, whose attribution reports
        the error."""
        if self.error is not None:
            return
        try:
            planned = self.slicer.plan_step(layout)
        except CaptureError:
            return
        step.layout = layout
        step.planned = planned
        groups = [self.owner[seg.index] for seg in planned]
        if all(g.direct for g in groups):
            targets = []
            for g, seg in zip(groups, planned):
                part = clip_run(seg, step.lo, step.hi)  # this worker's rows of the run
                if part is not None:
                    src, start, count = part
                    # every layer slot's rows of the run: [slots, count, hidden]
                    targets.append((g.sink.rows(g.local[seg.index])[:, start : start + count], src, count))
            step.targets = targets

    def process(self, step: _Step, layout: StepLayout, slots: list[int]) -> None:
        """Attribute one step's rows and write them to their arenas (after their copy ended).

        A :class:`CaptureError` is kept and reported by ``e3c_take`` (the
        driver raises it); the engine goes on serving other requests.
        """
        try:
            if self.error is not None:
                return
            positions = step.positions.wait()  # type: ignore[union-attr]
            if positions.dim() == 2:  # M-RoPE: [3, tokens]
                positions = positions[0]
            token_ids = None if step.token_ids is None else step.token_ids.wait().tolist()
            # Direct slots: their rows are in the arena once the copies ended (wait()).
            rows = {s: step.layers[s].wait() for s in slots}
            counts = [step.seen.get(s, 0) for s in slots]
            segments = self.slicer.slice_step(layout, positions.tolist(), token_ids, counts)
            if step.planned is not None:
                check_plan(self.slicer.steps - 1, step.planned, segments)
            self.direct_steps += bool(step.direct)
            lo, hi = step.lo, step.hi
            for seg in segments:
                group = self.owner[seg.index]
                group.segments.append(seg)
                part = clip_run(seg, lo, hi)  # this worker's rows of the run
                if part is None:
                    continue
                src, start, count = part
                local = group.local[seg.index]
                for slot in slots:
                    if slot not in step.direct:  # staged: rows[slot] holds the step's rows lo..hi-1
                        group.sink.write(local, slot, start, count, rows[slot][src - lo : src - lo + count])
                group.rows += count * len(slots)
            if self.debug:
                log.warning(
                    "step %d: %d rows, requests %s, rows per layer slot %s, copied directly %s",
                    self.slicer.steps,
                    step.total,
                    list(zip(layout.req_ids, layout.num_tokens)),
                    counts,
                    sorted(step.direct),
                )
        except CaptureError as exc:
            self.error = str(exc)
        finally:
            step.release()

    def prompts_known(self) -> int:
        """Prompts this call remembers in any of its tables (added, not taken)."""
        return len(set(self.owner) | set(self.slicer.lengths) | set(self.slicer.planned))

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups.clear()
        self.owner.clear()


class CaptureWorkerExtension:
    """Mixed into vLLM's Worker; captures decoder-layer outputs per request."""

    # -- set-up ---------------------------------------------------------------
    def e3c_setup(self, layer_ids: list[int], capture: str = "layer_output") -> dict[str, Any]:
        """Register hooks on the decoder layers ``layer_ids``; wrap the step.

        ``capture``: ``"layer_output"`` (speculators 0.3.0: what layer ``k``
        returns) or ``"layer_input"`` (vLLM's EAGLE-3 serving: what layer ``k``
        receives).
        """
        attach_to_vllm_logging()  # one of vLLM's processes: our records through its handlers
        import torch  # noqa: PLC0415
        from vllm.distributed import get_pp_group, get_tp_group  # noqa: PLC0415

        if getattr(self, "_e3c_active", False):
            raise RuntimeError("eagle3_compat: capture is already set up in this worker")
        runner = self.model_runner  # type: ignore[attr-defined]
        # The runner the engine actually built (V1 or V2 layout; an unknown one is refused).
        self._e3c_runner_kind = runner_kind(runner)
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        base, layers = _decoder_layers(model)
        n_layers = len(layers)
        if capture not in CAPTURE_POINTS:
            raise ValueError(f"capture must be one of {CAPTURE_POINTS}, got {capture!r}")
        bad = [k for k in layer_ids if not 0 <= k < n_layers]
        if bad:
            raise ValueError(f"layer ids {bad} out of range for {n_layers} decoder layers")

        param = next(model.parameters())
        # vLLM's CPU attention runs AMX kernels without asking for the AMX
        # permission (eagle3_compat.cpu_attention): asked here, before any step.
        grant_amx(param.device)
        # The start ran without huge pages where the machine hands free ones
        # to its hypervisor (eagle3_compat.heap.engine_environment): the
        # model is loaded now, the steps take them back.
        self._e3c_anon_huge_at_setup = anon_huge_bytes()
        self._e3c_huge_after_start = allow_huge_pages_after_start()
        # A CPU worker's heap keeps what the model's steps free and grows with
        # the steps run (eagle3_compat.heap): trimmed when it has grown.
        self._e3c_trimmer = HeapTrimmer.for_device(param.device)
        # ... and glibc keeps its large per-step buffers for the next step
        # rather than mapping and zeroing them at every op (eagle3_compat.heap).
        self._e3c_mmap_threshold = reuse_step_buffers(param.device)
        pp = get_pp_group()
        stage, stages = int(pp.rank_in_group), int(pp.world_size)
        owned = _owned_layers(base, layers, stage, stages)
        self._e3c_layer_ids = list(layer_ids)
        tp = get_tp_group()
        self._e3c_tp_rank, self._e3c_tp_size = int(tp.rank_in_group), int(tp.world_size)
        self._e3c_rank0 = self._e3c_tp_rank == 0
        self._e3c_stage = stage
        # Pipeline parallel: this stage captures the requested layers it runs
        # (their slots in layer_ids order); the tensor-rank-0 worker of each
        # stage with such a layer replies, the others send None.
        self._e3c_slots = [s for s, k in enumerate(self._e3c_layer_ids) if k in owned]
        self._e3c_capturing = self._e3c_rank0 and bool(self._e3c_slots)
        # Every tensor-parallel rank of such a stage hooks the layers: in a
        # sharded call (e3c_arm) each copies its share of the rows; otherwise
        # the hooks of ranks > 0 return at once (no call is armed there).
        self._e3c_hooked = bool(self._e3c_slots)
        self._e3c_call: _Call | None = None
        self._e3c_step: _Step | None = None
        self._e3c_maps: dict[str, Any] = {}  # the driver's pool files mapped here, by key
        self._e3c_debug = settings.DEBUG.get()
        self._e3c_offload = HostOffload(param.device) if self._e3c_hooked else None
        self._e3c_dtype = str(param.dtype).removeprefix("torch.")
        self._e3c_hidden = int(runner.model_config.get_hidden_size())
        # Direct copies (rows straight into the arena during the step) need
        # the step's layout before the model runs: the V1 runner has its
        # batch in place by then; the V2 runner builds its step state at the
        # end of execute_model, so it takes the staged path.
        # (The driver can turn it off per call: EAGLE3_COMPAT_DIRECT=0.)
        self._e3c_direct = self._e3c_runner_kind == RUNNER_V1
        self._e3c_pinned: dict[str, Any] = {}  # kept pool file key -> its unregister()
        handles = []
        offload = self._e3c_offload
        dtype = param.dtype

        def keep(slot: int, h: Any, owned: bool) -> None:
            step = self._e3c_step
            if step is None:
                return  # warm-up, profiling, or not armed: never captured
            if h.dim() == 3 and h.shape[0] == 1:
                # vLLM's Transformers backend (Olmo2 from vLLM 0.29) runs Hugging
                # Face's decoder layers on a batch of one: [1, tokens, hidden].
                h = h[0]
            step.capture(offload, slot, h.detach(), owned, self._e3c_hidden, dtype)

        def layer_hook(slot: int):
            def hook(_module, _args, out):
                if self._e3c_step is not None:
                    keep(slot, *_layer_output(out))

            return hook

        def layer_pre_hook(slot: int, read: Any):
            def hook(_module, args, kwargs):
                if self._e3c_step is not None:
                    keep(slot, *read(args, kwargs))

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
                buf = runner_token_ids(runner, self._e3c_runner_kind)
                input_ids = buf if isinstance(buf, torch.Tensor) else None
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            if positions is not None:
                step.positions = offload.submit("positions", positions[..., : step.total])
            if input_ids is not None and (step.call is None or step.call.shard == 0):
                # (rank 0's token ids are checked against the prompts; a share's runs against rank 0's)
                step.token_ids = offload.submit("token_ids", input_ids[: step.total])
            if self._e3c_direct and step.layout is None and step.call is not None:
                # The batch is laid out by now (the runner prepared its inputs).
                try:
                    layout = runner_layout(runner, self._e3c_runner_kind, step.scheduled)
                except UnknownRunnerError:
                    return  # the staged path; _e3c_record reports it
                if layout.total == step.total:
                    step.call.plan(step, layout)

        if self._e3c_hooked:
            for slot in self._e3c_slots:
                k = self._e3c_layer_ids[slot]
                if capture == "layer_input":
                    pre = layer_pre_hook(slot, _input_reader(layers[k]))
                    handles.append(layers[k].register_forward_pre_hook(pre, with_kwargs=True))
                else:
                    handles.append(layers[k].register_forward_hook(layer_hook(slot)))
            handles.append(model.register_forward_pre_hook(inputs_hook, with_kwargs=True))
        self._e3c_handles = handles

        import wrapt  # noqa: PLC0415

        original = runner.execute_model  # the bound method (the class's, for this runner)

        def execute_model(wrapped, _instance, args, kwargs):
            call = self._e3c_call
            scheduler_output = args[0] if args else kwargs["scheduler_output"]
            total = scheduler_output.total_num_scheduled_tokens
            # The V2 runner's own warm-up/profile steps (dummy_run=True) are never captured.
            if call is None or not total or kwargs.get("dummy_run"):
                return wrapped(*args, **kwargs)
            # Step-local state: a fetch() that races with an in-flight step
            # (async scheduling) detaches the call; this step's rows then go
            # to the detached call, never into the next one.
            step = _Step(total, call, scheduler_output.num_scheduled_tokens)
            self._e3c_step = step
            try:
                result = wrapped(*args, **kwargs)
            finally:
                self._e3c_step = None
            self._e3c_record(scheduler_output, step, call)
            if self._e3c_trimmer is not None:
                self._e3c_trimmer.after_step()
            return result

        # An instance attribute (this runner only, never the class: other
        # engines in the process are untouched); wrapt keeps ``__wrapped__``
        # and the signature, and e3c_teardown removes exactly this object.
        wrapper = wrapt.FunctionWrapper(original, execute_model)
        runner.execute_model = wrapper
        self._e3c_wrapper = wrapper
        self._e3c_active = True
        info = {
            "model": type(model).__name__,
            "capture": capture,
            "num_layers": n_layers,
            "rank0": self._e3c_rank0,
            "tp_rank": self._e3c_tp_rank,
            "tp_size": self._e3c_tp_size,
            "stage": stage,
            "stages": stages,
            "owned": [owned.start, owned.stop],
            "slots": list(self._e3c_slots),
            "capturing": self._e3c_capturing,
            "pid": os.getpid(),
            "dtype": str(param.dtype),
            "hidden_size": self._e3c_hidden,
            "device": str(param.device),
            "torch": str(torch.__version__),
            "runner": self._e3c_runner_kind,
        }
        log.info(
            "capture hooks on %s layers %s (pipeline stage %d of %d, owning layers %d..%d; rank0=%s)",
            info["model"], [self._e3c_layer_ids[s] for s in self._e3c_slots] if self._e3c_capturing else [],
            stage, stages, owned.start, owned.stop - 1, self._e3c_rank0,
        )
        return info

    def _e3c_record(self, scheduler_output: Any, step: _Step, call: _Call) -> None:
        runner = self.model_runner  # type: ignore[attr-defined]
        slots = self._e3c_slots
        missing = [self._e3c_layer_ids[s] for s in slots if s not in step.layers]
        if missing or step.positions is None:
            step.release()
            raise RuntimeError(
                "eagle3_compat: the decoder-layer hooks did not fire during an engine step "
                f"(layer ids {missing}); is the model compiled or wrapped so that module "
                "hooks do not run?"
            )
        # The runner lays tokens out in its own request order (V1: input_batch
        # after its reordering for the attention backend; V2: sorted, decodes
        # first), each request's scheduled tokens contiguous; read that order
        # now (the batch changes at the next step) rather than assume the
        # scheduler's (eagle3_compat.runners).
        try:
            layout = runner_layout(
                runner, self._e3c_runner_kind, scheduler_output.num_scheduled_tokens
            )
            if layout.total != step.total:
                raise CaptureError(
                    f"step layout covers {layout.total} tokens but {step.total} were scheduled; "
                    "cannot attribute rows"
                )
            if step.layout is not None and step.layout != layout:
                raise CaptureError(
                    "the runner's batch changed during the step (before the model ran: "
                    f"{list(zip(step.layout.req_ids, step.layout.num_tokens))}, after: "
                    f"{list(zip(layout.req_ids, layout.num_tokens))}); rows copied during the step "
                    "would be misplaced"
                )
        except (CaptureError, UnknownRunnerError) as exc:
            step.release()
            call.error = call.error or str(exc)
            return
        self._e3c_offload.run(lambda: call.process(step, layout, slots), step.release)  # type: ignore[union-attr]

    # -- per call ---------------------------------------------------------------
    # A call: e3c_arm, then e3c_add for each group of prompts (with the
    # driver's arena for it), the engine steps, e3c_take for each group once
    # its requests have finished.  generate() adds all its prompts as one
    # group; a stream adds and takes one prompt at a time.
    def e3c_arm(self, call: int, direct: bool = True, shards: list[int] | None = None) -> None:
        """Start call ``call`` (forgetting any earlier one).

        ``direct``: copy rows into the call's arena during the step where this
        worker can (:meth:`_e3c_pin`); ``False``: the staged path only.
        ``shards``: per pipeline stage, how many tensor-parallel ranks share
        the copies (1: rank 0 copies every row; the stage's tensor-parallel
        size: each rank copies its share, into the same arena)."""
        if not getattr(self, "_e3c_active", False):
            raise RuntimeError(
                "eagle3_compat: capture is not set up in this worker (e3c_teardown was called, "
                "or e3c_setup never ran); no hidden states would be captured"
            )
        self.e3c_disarm()
        n = int(shards[self._e3c_stage]) if shards and self._e3c_stage < len(shards) else 1
        if n not in (1, self._e3c_tp_size):
            raise RuntimeError(
                f"eagle3_compat: call {call} shares the copies among {n} ranks, but pipeline stage "
                f"{self._e3c_stage} has {self._e3c_tp_size} tensor-parallel ranks"
            )
        if self._e3c_capturing or (self._e3c_hooked and n > 1):
            self._e3c_call = _Call(call, self._e3c_debug, self._e3c_tp_rank if n > 1 else 0, n)
            self._e3c_call_direct = bool(direct) and self._e3c_direct

    def _e3c_share(self) -> _Call | None:
        """The armed call when this worker (tensor rank > 0) copies a share of it."""
        state = getattr(self, "_e3c_call", None)
        return state if state is not None and state.shard > 0 else None

    def e3c_probe(self, path: str, nonce: str) -> bool:
        """Whether this worker sees the driver's probe file (same host and
        ``/dev/shm``): the driver shares the copies only among ranks that do."""
        return probe_seen(path, nonce)

    def e3c_add(
        self, call: int, group: int, prompts: list[list[int]], arena: dict[str, Any] | None
    ) -> Any:
        """Expect prompts ``[[index, length], ...]`` of call ``call`` as group ``group``.

        ``arena``: the driver's shared-memory file for them
        (:meth:`~eagle3_compat.arena.DriverArena.spec`), or ``None`` for the
        RPC path.  Returns, on a capturing worker (the tensor-rank-0 worker of
        a pipeline stage that owns a requested layer), the transport in use
        and why; ``None`` on other workers.
        """
        if not getattr(self, "_e3c_hooked", self._e3c_capturing):
            return None
        if arena is not None:
            for key in arena.get("forget", ()):
                self._e3c_unpin(key)  # before the mapping goes
                mm = self._e3c_maps.pop(key, None)
                if mm is not None:
                    forget_all({key: mm})
        state = self._e3c_call
        if not self._e3c_capturing and self._e3c_share() is None:
            return None  # tensor rank > 0 of a call that rank 0 copies alone
        if state is None or state.slicer.call != call:
            raise RuntimeError(f"eagle3_compat: capture was not armed for call {call} in this worker")
        import torch  # noqa: PLC0415

        dtype = getattr(torch, self._e3c_dtype)
        layout = layout_for(
            [n for _i, n in prompts], len(self._e3c_layer_ids), self._e3c_hidden, self._e3c_dtype
        )
        why = "forced by EAGLE3_COMPAT_TRANSPORT=rpc" if arena is None else ""
        sink: Any = None
        if arena is not None:
            opened = ShmSink.open(arena, layout, dtype, self._e3c_hidden, self._e3c_maps)
            if isinstance(opened, str):
                why = opened
                if state.shards > 1:
                    raise RuntimeError(
                        f"eagle3_compat: tensor-parallel rank {state.shard} of pipeline stage "
                        f"{self._e3c_stage} {why}; the ranks share the copies of this call "
                        "(EAGLE3_COMPAT_SHARD=0: rank 0 copies every row)"
                    )
                if arena.get("required"):
                    raise RuntimeError(
                        f"eagle3_compat: EAGLE3_COMPAT_TRANSPORT=shm but the rank-0 worker {why}"
                    )
            else:
                sink = opened
        elif state.shards > 1:
            raise RuntimeError(
                f"eagle3_compat: call {call} shares the copies among {state.shards} tensor-parallel "
                "ranks, which needs the driver's arena; none was sent"
            )
        transport = "shm" if sink is not None else "rpc"
        if sink is None:
            sink = LocalSink(layout, dtype, self._e3c_hidden)
        direct = getattr(self, "_e3c_call_direct", False) and self._e3c_pin(sink)
        try:
            state.add(group, prompts, sink, transport, direct)
        except CaptureError:
            sink.close()
            raise
        reply = {"transport": transport, "why": why, "stage": self._e3c_stage, "direct": direct,
                 "shards": state.shards}
        if state.shard:
            reply["shard"] = state.shard
        return reply

    def _e3c_pin(self, sink: Any) -> bool:
        """Whether rows may be copied into ``sink`` during the step.

        On the CPU platform always (plain copies).  On CUDA a device-to-host
        copy runs at the link's speed, asynchronously, only into page-locked
        memory: a pool file the worker keeps mapped is registered with CUDA
        once (``cudaHostRegister``, ~0.1-0.25 s/GB, paid once per file, not per
        call) and stays registered until the driver forgets the file or the
        worker tears down.  Any other sink takes the staged path.
        """
        offload = self._e3c_offload
        if offload is None or not offload.cuda:
            return True
        key = getattr(sink, "kept_key", None)
        if key is None:
            return False
        if key not in self._e3c_pinned:
            try:
                self._e3c_pinned[key] = offload.register(sink.buf)
            except RuntimeError as exc:
                log.warning("direct copies off for arena %s (staged instead): %s", key, exc)
                return False
        return True

    def _e3c_unpin(self, key: str) -> None:
        unregister = self._e3c_pinned.pop(key, None)
        if unregister is not None:
            unregister()

    def e3c_exchange(self, call: int, take: list[int], add: list[list[Any]]) -> Any:
        """A stream's round in one RPC: :meth:`e3c_take` for each group in
        ``take``, then :meth:`e3c_add` for each ``[group, prompts, arena]`` in
        ``add``.  A capturing worker: ``{"taken": [...], "added": [...],
        "stage": ...}``; others None."""
        taken = [self.e3c_take(call, group) for group in take]
        added = [self.e3c_add(call, group, prompts, arena) for group, prompts, arena in add]
        share = self._e3c_share()
        if not self._e3c_capturing and share is None:
            return None
        reply = {"taken": taken, "added": added, "stage": self._e3c_stage,
                 "shards": self._e3c_call.shards if self._e3c_call is not None else 1}
        if share is not None:
            reply["shard"] = share.shard
        return reply

    def e3c_take(self, call: int, group: int) -> Any:
        """Hand over group ``group`` of call ``call``: metadata (and the rows on the
        RPC path) of this stage's layer slots; ``None`` on a worker that does
        not capture."""
        share = self._e3c_share()
        if not self._e3c_capturing and share is None:
            return None
        state = self._e3c_call
        if state is None or state.slicer.call != call or group not in state.groups:
            raise RuntimeError(
                f"eagle3_compat: group {group} of call {call} is not armed in this worker"
            )
        # The group's last rows may still be on their way (the CUDA writer thread).
        self._e3c_offload.drain()  # type: ignore[union-attr]
        g = state.take(group)
        if share is not None:  # this rank's share: checked against rank 0's capture by the driver
            g.close()
            return {
                "stage": self._e3c_stage,
                "shard": share.shard,
                "slots": list(self._e3c_slots),
                "segments": [[g.local[s.index], s.start, s.count] for s in g.segments],
                "steps": state.slicer.steps,
                "direct_steps": state.direct_steps,
                "rows": g.rows,
                "error": state.error,
            }
        try:
            reply = {
                "stage": self._e3c_stage,
                "slots": list(self._e3c_slots),
                "transport": g.transport,
                "segments": [[g.local[s.index], s.start, s.count,
                              None if s.token_ids is None else list(s.token_ids)] for s in g.segments],
                "steps": state.slicer.steps,
                "direct_steps": state.direct_steps,
                "shards": state.shards,
                "rows": g.rows,
                "foreign_rows": state.slicer.foreign_rows,
                "error": state.error,
                # False: some rows' token ids could not be read (a model fed
                # embeddings, no runner buffer); they were attributed by
                # position only.
                "token_ids_checked": all(s.token_ids is not None for s in g.segments),
                "dtype": self._e3c_dtype,
                "hidden_size": self._e3c_hidden,
            }
            if g.transport == "rpc" and state.error is None:
                reply["payload"] = g.sink.payload(self._e3c_slots)
            return reply
        finally:
            g.close()

    def e3c_disarm(self) -> None:
        state, self._e3c_call = getattr(self, "_e3c_call", None), None
        if state is not None:
            try:
                self._e3c_offload.drain()  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - the call is abandoned anyway
                log.debug("offload error while disarming", exc_info=True)
            state.close()

    def e3c_teardown(self) -> None:
        """Undo :meth:`e3c_setup`: remove the hooks, give the runner its own
        ``execute_model`` back (the instance attribute is deleted, so the
        class's method is found again), close the offload.  Later calls to
        :meth:`e3c_arm` raise.  Idempotent."""
        self._e3c_active = False
        self.e3c_disarm()
        for key in list(getattr(self, "_e3c_pinned", {})):
            self._e3c_unpin(key)
        forget_all(getattr(self, "_e3c_maps", {}))
        for h in getattr(self, "_e3c_handles", ()):
            h.remove()
        self._e3c_handles = []
        offload = getattr(self, "_e3c_offload", None)
        if offload is not None:
            offload.close()
            self._e3c_offload = None
        wrapper = getattr(self, "_e3c_wrapper", None)
        if wrapper is not None:
            runner = self.model_runner  # type: ignore[attr-defined]
            if runner.__dict__.get("execute_model") is wrapper:
                del runner.execute_model
            else:  # someone replaced our wrapper: leave theirs, say so
                log.warning("runner.execute_model was replaced after e3c_setup; not restored")
            self._e3c_wrapper = None

    def e3c_state(self) -> dict[str, Any]:
        """What :meth:`e3c_setup` changed in this worker and is still in place."""
        import inspect  # noqa: PLC0415
        import types  # noqa: PLC0415

        import wrapt  # noqa: PLC0415

        runner = self.model_runner  # type: ignore[attr-defined]
        current = runner.execute_model
        own = getattr(type(runner), "execute_model", None)
        return {
            "signature": str(inspect.signature(current)),
            "active": bool(getattr(self, "_e3c_active", False)),
            "hooks": len(getattr(self, "_e3c_handles", ()) or ()),
            "execute_model_wrapped": "execute_model" in runner.__dict__,
            # Not hasattr(__wrapped__): vLLM's own method has one already
            # (torch.inference_mode's decorator).
            "execute_model_is_wrapt_wrapper": isinstance(current, wrapt.FunctionWrapper),
            # type(), not isinstance(): a wrapt proxy passes isinstance checks.
            "execute_model_is_original": type(current) is types.MethodType
            and current.__func__ is own,
            "rank0": bool(getattr(self, "_e3c_rank0", False)),
        }

    def e3c_memory(self, trim: bool = True) -> dict[str, Any]:
        """Resident memory of this worker process, for the bounded-memory tests.

        ``trim`` first asks glibc to return freed heap pages to the system, so
        that the number reflects what is held rather than allocator caching.
        ``call_open`` says whether this worker still holds an arena of a call;
        ``call_prompts`` how many prompts the armed call or stream still knows
        (those added and not yet taken: a stream's are the prompts in flight).
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

        maps = getattr(self, "_e3c_maps", {})
        offload = getattr(self, "_e3c_offload", None)
        trimmer = getattr(self, "_e3c_trimmer", None)
        state = getattr(self, "_e3c_call", None)
        return {
            "heap_trims": None if trimmer is None else trimmer.trims,
            "trim_threshold_bytes": None if trimmer is None else trimmer.threshold_bytes,
            "trim_interval_s": None if trimmer is None else trimmer.min_interval_s,
            "trim_working_set_bytes": None if trimmer is None else trimmer.working_set_bytes,
            "trim_seconds": None if trimmer is None else trimmer.trim_seconds,
            # what this worker's process started with (eagle3_compat.heap.engine_environment)
            "onednn_primitive_cache_capacity": os.environ.get(PRIMITIVE_CACHE_ENV),
            "thp_mem_alloc_enable": os.environ.get(THP_ENV),
            "vllm_sleep_when_idle": os.environ.get(IDLE_SLEEP_ENV),
            "anon_huge": anon_huge_bytes(),
            # huge pages refused to the engine's start, taken back at e3c_setup
            # (eagle3_compat.heap.engine_environment); what was huge then
            "huge_pages_after_start": getattr(self, "_e3c_huge_after_start", None),
            "huge_pages_refused": huge_pages_refused(),
            "anon_huge_at_setup": getattr(self, "_e3c_anon_huge_at_setup", None),
            # glibc's mmap threshold set at e3c_setup (eagle3_compat.heap.reuse_step_buffers)
            "mmap_threshold": getattr(self, "_e3c_mmap_threshold", None),
            "rss": psutil.Process().memory_info().rss,
            "anon": anon_rss(),
            "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "call_open": bool(state and state.groups),
            "call_prompts": state.prompts_known() if state else 0,
            "kept_maps": sorted(maps),
            "kept_bytes": sum(len(mm) for mm in maps.values() if not mm.closed),
            # CUDA: arenas page-locked for direct copies (eagle3_compat.offload.HostOffload.register)
            "pinned_files": len(getattr(self, "_e3c_pinned", {})),
            "registrations": getattr(offload, "registrations", 0),
            "registered_bytes": getattr(offload, "registered_bytes", 0),
            "register_seconds": getattr(offload, "register_seconds", 0.0),
        }
