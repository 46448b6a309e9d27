"""Driver side: what ``VllmHiddenStatesGenerator`` runs once apply() is in effect.

speculators 0.3.0 drives vLLM 0.11's internals by hand (a ``Scheduler``,
a ``MultiprocExecutor``, ``Request`` objects, its own KV-cache sizing
through ``torch.cuda.mem_get_info``).  Every one of those changed between
0.11 and 0.16 (see the adapter records in :mod:`eagle3_compat.adapters`),
and the hand-made loop also aborts each request after one step, which
truncates chunked prompts.  The functions here keep the generator's public
API and results format but drive vLLM through its stable offline engine
(``vllm.LLM``: ``llm_engine.add_request`` / ``step`` / ``collective_rpc``),
which sizes the KV cache for whichever platform it runs on (CUDA or CPU),
does chunked prefill and both step phases itself, and returns
``collective_rpc`` replies as a list on every release.

The tensor-rank-0 worker (of each pipeline stage) writes each step's rows
straight into a shared-memory arena the driver created for the call
(:mod:`eagle3_compat.arena`); the driver checks the metadata with
:func:`eagle3_compat.capture.check_segments` and hands out tensors that are
views of that memory (files reused across calls: :class:`eagle3_compat.arena.ArenaPool`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from .arena import (
    ArenaPool,
    DriverArena,
    Probe,
    direct_choice,
    layout_for,
    pool_keep_bytes,
    shard_choice,
    tensors_from_payload,
    transport_choice,
)
from .capture import (
    CaptureError,
    check_segments,
    check_stage_layers,
    make_request_id,
    merge_stage_captures,
    parse_request_id,
    stage_replies,
)
from .logs import get_logger
from .worker import CAPTURE_POINTS, WORKER_EXTENSION

log = get_logger("eagle3_compat.generator")

# speculators 0.3.0's engine limits, kept so that results and memory use
# match what its users configured for.
MAX_NUM_SEQS = 32
MIN_MAX_BATCHED_TOKENS = 8192
# stream()'s default: prompts in flight.  The driver takes a step's finished
# prompts and admits their successors in one RPC, which the engine answers
# after the step in progress, so the engine needs a full step waiting behind
# the running one and the finished one being handed over: with 2 steps' worth
# (64) it ran dry at each step boundary and its steps fragmented (2000
# prompts: 150-330 steps instead of 64, 0.6x plain prefill); from 3 steps'
# worth on, every step was full (benchmarks/RESULTS.md, issue #16).
DEFAULT_MAX_IN_FLIGHT = 4 * MAX_NUM_SEQS

def _options() -> dict[str, Any]:
    from . import _state  # noqa: PLC0415

    return dict(_state.options)


def _num_layers(config: Any) -> int:
    if hasattr(config, "num_hidden_layers"):
        return int(config.num_hidden_layers)
    text = getattr(config, "text_config", None)
    if text is not None and hasattr(text, "num_hidden_layers"):
        return int(text.num_hidden_layers)
    raise ValueError("Cannot determine num_layers from config")


def _vocab_size(config: Any) -> int | None:
    for cfg in (config, getattr(config, "text_config", None)):
        v = getattr(cfg, "vocab_size", None)
        if isinstance(v, int):
            return v
    return None


def validate_layer_ids(layer_ids: Any, num_layers: int, name: str = "layer_ids") -> list[int]:
    """0.3.0's bounds check, plus the cases it let through silently: a
    negative id (Python would index from the end) and an id given twice,
    wherever the repeats are (each would be captured twice).  ``name`` is
    the argument the errors name (``--layer-ids`` on the command line)."""
    if isinstance(layer_ids, (str, bytes)) or not isinstance(layer_ids, Sequence):
        raise ValueError(f"{name} must be a list of ints, got {type(layer_ids).__name__}")
    ids = list(layer_ids)
    if not ids:
        raise ValueError(f"{name} is empty: give at least one decoder layer index")
    for k in ids:
        if isinstance(k, bool) or not isinstance(k, int):
            raise ValueError(f"{name} must be ints, got {k!r}")
        if k < 0 or k >= num_layers:
            raise ValueError(f"{name}: layer index {k} out of bounds [0, {num_layers - 1}] "
                             f"for a {num_layers}-layer model")
    dup = sorted({k for k in ids if ids.count(k) > 1})
    if dup:
        raise ValueError(f"{name} {ids} repeats {dup}: each layer can be captured once")
    return ids


def default_layer_ids(num_layers: int) -> list[int]:
    """speculators 0.3.0's default ``[2, L // 2, L - 3, L - 1]``; on very small
    models its entries coincide (6 layers: 2, 3, 3, 5) and a layer is captured
    once, in first-seen order.  Below 3 layers they do not fit the model
    (speculators 0.3.0 failed there with a bare bounds error): a
    ``ValueError`` that says to pass the ids."""
    raw = [2, num_layers // 2, num_layers - 3, num_layers - 1]
    if num_layers < 3:
        raise ValueError(
            f"speculators 0.3.0's default layer ids [2, L // 2, L - 3, L - 1] are {raw} for this "
            f"{num_layers}-layer model, outside [0, {num_layers - 1}]: pass layer_ids (--layer-ids) explicitly")
    return list(dict.fromkeys(raw))


def generator_init(
    self: Any,
    model_path: str,
    layer_ids: list[int] | None = None,
    max_model_len: int = 2048,
    gpu_memory_utilization: float = 0.8,
    tensor_parallel_size: int = 1,
    *,
    capture: str = "layer_output",
    pipeline_parallel_size: int = 1,
    distributed_executor_backend: str | None = None,
) -> None:
    """Replacement for ``VllmHiddenStatesGenerator.__init__``.

    Same signature as speculators 0.3.0, plus one keyword-only opt-in:
    ``capture="layer_output"`` (the default, 0.3.0's contract: the output of
    decoder layer ``k`` before the final norm, Hugging Face
    ``hidden_states[k + 1]`` for every layer but the last) or
    ``capture="layer_input"`` (vLLM's EAGLE-3 serving convention: the state
    layer ``k`` receives, Hugging Face ``hidden_states[k]``; for ``k >= 1``
    the same tensor as ``layer_output`` of ``k - 1``).

    ``pipeline_parallel_size=N`` (keyword-only, an addition too) splits the
    decoder layers over N pipeline stages (vLLM's ``pipeline_parallel_size``;
    ``tensor_parallel_size * N`` workers): each stage captures the requested
    layers it runs and the results are merged by layer id, the same tensors
    as with one stage.

    ``distributed_executor_backend`` (keyword-only, an addition): vLLM's, passed
    through (``None``: vLLM's default; ``"mp"``: worker processes on this
    host; ``"ray"``: workers placed by Ray, e.g. the stages of a replica
    larger than one node, on a Ray cluster spanning the nodes).  With
    ``"ray"`` the workers need not fit this host's devices, so that check is
    left to vLLM and Ray.
    """
    from transformers import AutoConfig, AutoTokenizer  # noqa: PLC0415
    from vllm import LLM  # noqa: PLC0415

    opts = _options()
    self.model_path = model_path
    self.tensor_parallel_size = tensor_parallel_size
    self.pipeline_parallel_size = pipeline_parallel_size
    self._request_counter = 0
    self._e3c_closed = True
    if not isinstance(model_path, (str, os.PathLike)):
        raise ValueError(f"model_path must be a path or model id, got {type(model_path).__name__}")
    model_path = os.fspath(model_path)
    if not os.path.exists(model_path) and (
        model_path.startswith((".", "/", "~")) or model_path.count("/") != 1
    ):
        raise ValueError(f"model_path {model_path!r} does not exist")
    _check_parallel(tensor_parallel_size, pipeline_parallel_size, distributed_executor_backend)
    _check_pipeline_release(pipeline_parallel_size)
    if capture not in CAPTURE_POINTS:
        raise ValueError(f"capture must be one of {CAPTURE_POINTS}, got {capture!r}")
    self.capture = capture
    self.tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=True)
    num_layers = _num_layers(config)
    if layer_ids is None:
        layer_ids = default_layer_ids(num_layers)
        log.info("auto-selected layers %s of %d", layer_ids, num_layers)
    self.layer_ids = validate_layer_ids(layer_ids, num_layers)
    self._e3c_vocab_size = _vocab_size(config)
    from .adapters import refuse_unverified  # noqa: PLC0415

    refuse_unverified(config)

    self._e3c_max_model_len = int(max_model_len)
    log.info(
        "starting vLLM for %s: layers %s (%s), max_model_len %d, tensor_parallel_size %d, "
        "pipeline_parallel_size %d, executor %s, dtype %s",
        model_path,
        self.layer_ids,
        capture,
        max_model_len,
        tensor_parallel_size,
        pipeline_parallel_size,
        distributed_executor_backend or "vLLM's default",
        opts.get("dtype") or "auto",
    )
    extra: dict[str, Any] = {} if distributed_executor_backend is None else {
        "distributed_executor_backend": distributed_executor_backend}
    from .cpu_attention import engine_block_size  # noqa: PLC0415

    # vLLM's default, except on a CPU build without the AMX attention
    # kernels vLLM would pick for bfloat16 (eagle3_compat.cpu_attention).
    self._e3c_block_size = engine_block_size(opts.get("dtype"), config)
    if self._e3c_block_size is not None:
        extra["block_size"] = self._e3c_block_size
    from vllm.platforms import current_platform  # noqa: PLC0415

    from .heap import IDLE_SLEEP_ENV, engine_environment  # noqa: PLC0415

    # A CPU engine's processes start with oneDNN's primitive cache capped
    # (eagle3_compat.heap): it grows with the distinct step sizes otherwise;
    # and, with several workers, told to let them sleep when idle where this
    # vLLM would spin them on their cores.
    workers = int(tensor_parallel_size or 1) * int(pipeline_parallel_size or 1)
    idle_sleep = workers > 1 and _knows_env(IDLE_SLEEP_ENV)
    from .cuda_engine import cuda_engine_environment  # noqa: PLC0415

    # On CUDA: spawned engine processes, and float32 Triton products in float32
    # (eagle3_compat.cuda_engine).
    cuda = contextlib.nullcontext() if not current_platform.is_cuda() else cuda_engine_environment(
        opts.get("dtype"))
    with engine_environment(bool(current_platform.is_cpu()), idle_sleep=idle_sleep), cuda:
        self.llm = LLM(
            model=model_path,
            tokenizer=model_path,
            trust_remote_code=True,
            dtype=opts.get("dtype") or "auto",
            max_model_len=max_model_len,
            enforce_eager=True,
            # No torch.compile: module hooks must run eagerly (the CPU platform
            # compiles by default even with enforce_eager).
            compilation_config=0,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=max(MIN_MAX_BATCHED_TOKENS, max_model_len),
            # A prefix-cache hit skips the cached rows: they would be missing.
            enable_prefix_caching=False,
            worker_extension_cls=WORKER_EXTENSION,
            seed=0,
            **extra,
        )
    self._e3c_closed = False
    self.vllm_config = self.llm.llm_engine.vllm_config
    self.executor = None  # 0.3.0 attribute; the engine owns its executor now
    self.scheduler = None
    infos = _rpc(self, "e3c_setup", self.layer_ids, capture)
    self._e3c_worker_info = infos[0]
    self._e3c_setup_infos = infos  # one per worker: stage, owned layers, slots, pid
    # Every requested layer is run by exactly one pipeline stage: checked
    # now, before any prompt (and again on every reply).
    try:
        check_stage_layers({i["stage"]: i["slots"] for i in infos if i["capturing"]}, self.layer_ids)
        self._e3c_shardable = _shardable(self, infos, distributed_executor_backend)
    except CaptureError:
        generator_close(self)
        raise
    log.info("capture ready: %s", infos[0] if len(infos) == 1 else infos)
    if any(n > 1 for n in self._e3c_shardable):
        log.info("tensor-parallel ranks share the device-to-host copies (ranks per pipeline stage: %s; "
                 "EAGLE3_COMPAT_SHARD=0: rank 0 copies every row)", self._e3c_shardable)


def _knows_env(name: str) -> bool:
    """Whether this vLLM defines the environment variable ``name`` (its
    ``vllm.envs.environment_variables``)."""
    try:
        from vllm import envs  # noqa: PLC0415
    except ImportError:  # pragma: no cover - the generator needs vLLM
        return False
    return name in getattr(envs, "environment_variables", {})


def _shardable(self: Any, infos: list[dict[str, Any]], backend: str | None) -> list[int]:
    """Per pipeline stage, how many tensor-parallel ranks can share the copies
    of a call's rows: all of the stage's ranks when every one of them sees
    the driver's ``/dev/shm`` (a :class:`~eagle3_compat.arena.Probe` file
    read by each worker), else 1 (rank 0 copies every row).  Not with Ray's
    executor: its steps and RPCs travel on different channels, and whether a
    rank > 0 has finished a step when the call's rows are collected is
    unverified there (the shares' checks would fail the call, not pass
    wrong rows)."""
    stages = 1 + max(int(i.get("stage", 0)) for i in infos)
    out = [1] * stages
    if backend == "ray" or all(int(i.get("tp_size", 1)) == 1 for i in infos) or not ArenaPool.available():
        return out
    with Probe() as probe:
        seen = _rpc(self, "e3c_probe", probe.path, probe.nonce)
    for stage in range(stages):
        ranks = [(i, ok) for i, ok in zip(infos, seen) if int(i.get("stage", 0)) == stage and i.get("slots")]
        if (len(ranks) > 1 and len(ranks) == int(ranks[0][0].get("tp_size", 1))
                and all(ok is True for _i, ok in ranks)):
            out[stage] = len(ranks)
    return out


def _call_shards(self: Any) -> list[int] | None:
    """This call's shares (``EAGLE3_COMPAT_SHARD``, read per call): None when
    rank 0 copies every row (off, the RPC path, or nothing to share)."""
    shardable = self.__dict__.get("_e3c_shardable") or [1]
    if not shard_choice() or transport_choice() == "rpc" or all(n == 1 for n in shardable):
        return None
    return list(shardable)


EXECUTOR_BACKENDS = ("mp", "ray")


def _check_parallel(tp: Any, pp: Any = 1, backend: Any = None) -> None:
    for name, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if backend is not None and backend not in EXECUTOR_BACKENDS:
        raise ValueError(
            f"distributed_executor_backend must be None or one of {EXECUTOR_BACKENDS}, got {backend!r}"
        )
    if tp * pp == 1 or backend == "ray":  # Ray places the workers, on any node of its cluster
        return
    import torch  # noqa: PLC0415

    if torch.cuda.is_available():
        available, what = torch.cuda.device_count(), "CUDA devices"
    else:
        available, what = os.cpu_count() or 1, "CPU cores (vLLM's CPU backend needs one per rank)"
    if tp * pp > available:
        asked = f"tensor_parallel_size={tp}" if pp == 1 else (
            f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} = {tp * pp} workers")
        raise ValueError(f"{asked} but only {available} {what} are available")


PIPELINE_VERIFIED = ((0, 11), (0, 16))


def _check_pipeline_release(pp: int) -> None:
    """Pipeline parallelism only where it was verified: vLLM 0.11-0.16 (on
    the 0.32 CPU build its engine core fails with a KeyError on our first
    request under PP; 0.17-0.29 are not verified)."""
    if pp == 1:
        return
    from .versions import detect, minor  # noqa: PLC0415

    found = detect().vllm_version
    lo, hi = PIPELINE_VERIFIED
    if found is not None and not lo <= minor(found) <= hi:
        raise ValueError(
            f"pipeline_parallel_size={pp}: eagle3_compat's pipeline-parallel capture is verified on "
            f"vLLM {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]} only, and this is vLLM {found}; use "
            "pipeline_parallel_size=1 (tensor parallelism works on every supported release)"
        )


def _as_prompt_list(token_ids: Any, vocab: int | None = None) -> list[list[int]]:
    """Validate ``generate()`` input, prompt by prompt in order; a ValueError
    names the first bad prompt's index and its problem."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:  # pragma: no cover
        torch = None  # type: ignore[assignment]
    if torch is not None and isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 2:
            raise ValueError(f"token_ids tensor must be 2-D [prompts, tokens], got {token_ids.dim()}-D")
        if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
            raise ValueError(f"token_ids tensor must hold integers, got {token_ids.dtype}")
        token_ids = token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise ValueError(f"token_ids must be a list of token-id lists, got {type(token_ids).__name__}")
    if len(token_ids) == 0:
        raise ValueError("token_ids cannot be empty")
    prompts = []
    for i, ids in enumerate(token_ids):
        if torch is not None and isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
                raise ValueError(f"prompt {i}: expected a 1-D integer tensor, got {ids.dim()}-D {ids.dtype}")
            ids = ids.tolist()
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise ValueError(f"prompt {i}: expected a list of token ids, got {type(ids).__name__}")
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"prompt {i}: token ids must be ints, got {t!r}")
            if t < 0:
                raise ValueError(f"prompt {i}: negative token id {t}")
            if vocab is not None and t >= vocab:
                raise ValueError(f"prompt {i}: token id {t} is not below the vocabulary size {vocab}")
        prompts.append(list(ids))
    return prompts


def generator_generate(self: Any, token_ids: Any) -> list[dict[str, Any]]:
    """Replacement for ``VllmHiddenStatesGenerator.generate`` (same signature and results)."""
    import torch  # noqa: PLC0415
    from vllm import SamplingParams  # noqa: PLC0415

    if getattr(self, "_e3c_closed", True):
        raise RuntimeError("this VllmHiddenStatesGenerator is closed")
    prompts = _as_prompt_list(token_ids, self._e3c_vocab_size)
    # speculators 0.3.0 truncates to max_model_len - 1 (vLLM needs room for the
    # one sampled token).  Kept, but never silently.
    max_len = self._e3c_max_model_len - 1
    cut = [i for i, ids in enumerate(prompts) if len(ids) > max_len]
    if cut:
        log.warning(
            "truncating %d prompt(s) to max_model_len - 1 = %d tokens: indices %s",
            len(cut),
            max_len,
            cut if len(cut) <= 20 else cut[:20] + ["..."],
        )
        prompts = [ids[:max_len] for ids in prompts]

    call = self._request_counter
    self._request_counter += 1
    engine = self.llm.llm_engine
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    req_ids = [make_request_id(call, i) for i in range(len(prompts))]
    layout = _layout(self, prompts)
    arena = None
    try:
        _rpc(self, "e3c_arm", call, direct_choice(), _call_shards(self))
        arena = _add_group(self, call, 0, list(enumerate(map(len, prompts))), layout)
        for rid, ids in zip(req_ids, prompts):
            engine.add_request(rid, {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            engine.step()
        captured = merge_stage_captures(stage_replies(_rpc(self, "e3c_take", call, 0)), self.layer_ids)
    except BaseException as exc:
        _discard_arena(self)
        died = _after_failure(self, exc, req_ids, "generate()")
        if died is not None:
            raise died from exc
        raise
    self.__dict__.pop("_e3c_arena", None)  # collect_results gives it back, whatever happens
    results = collect_results(prompts, self.layer_ids, layout, arena, captured, call)
    _warn_unchecked_once(self, captured)
    log.debug(
        "call %d: %d prompts, %d steps, %d foreign rows, %s transport",
        call,
        len(prompts),
        captured["steps"],
        captured["foreign_rows"],
        captured["transport"],
    )
    return [
        {
            "input_ids": torch.as_tensor(ids, dtype=torch.long),
            "hidden_states": states,
            "loss_mask": None,
        }
        for ids, states in zip(prompts, results)
    ]


def generator_stream(
    self: Any, token_ids: Iterable[Any], max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Extract prompts as the engine finishes them: ``(index, sample)`` pairs.

    An addition of eagle3_compat (speculators 0.3.0 has no such method).
    ``token_ids`` is any iterable of prompts (read lazily); at most
    ``max_in_flight`` of them are in the engine at once, and new ones are
    admitted in the same worker round trip that hands over the finished
    ones, so the engine stays full across what would be call boundaries.
    Memory is bounded by the prompts in flight (the rows of at most
    ``2 * max_in_flight`` prompts: those in the engine and those being
    handed over), whatever the length of the input.  Samples come out in the order
    they finish; ``index`` is the prompt's position in the input.  Each
    sample is what :meth:`generate` gives for that prompt, checked the same
    way; its tensors are views of the prompt's own shared-memory arena,
    returned to the system when they are released.
    """
    import torch  # noqa: PLC0415
    from vllm import SamplingParams  # noqa: PLC0415

    if getattr(self, "_e3c_closed", True):
        raise RuntimeError("this VllmHiddenStatesGenerator is closed")
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise ValueError(f"max_in_flight must be a positive int, got {max_in_flight!r}")
    if max_in_flight < 3 * MAX_NUM_SEQS and not self.__dict__.get("_e3c_noted_in_flight"):
        self._e3c_noted_in_flight = True  # once per generator (replicas stream chunk by chunk)
        log.info("stream(): max_in_flight=%d is below 3 steps' worth of prompts (%d): with more prompts "
                 "than that the engine waits for new ones at step boundaries (slower, same results)",
                 max_in_flight, 3 * MAX_NUM_SEQS)
    call = self._request_counter
    self._request_counter += 1
    engine = self.llm.llm_engine
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    max_len = self._e3c_max_model_len - 1
    source = enumerate(token_ids)
    in_flight: dict[int, tuple[list[int], Any, Any]] = {}  # index -> (prompt, layout, arena)
    finished: list[int] = []  # out of the engine, rows not taken yet
    exhausted = False
    try:
        _rpc(self, "e3c_arm", call, direct_choice(), _call_shards(self))
        while True:
            # Refill every slot that is free once the finished prompts are
            # taken.  Taking them and adding their successors is one RPC: the
            # engine answers RPCs between steps, so each one waits for the
            # step in progress, and one wait per round (not two) keeps the
            # engine from idling while the driver catches up.
            admitted: list[tuple[int, list[int]]] = []
            while not exhausted and len(in_flight) - len(finished) + len(admitted) < max_in_flight:
                try:
                    index, ids = next(source)
                except StopIteration:
                    exhausted = True
                    break
                try:
                    (prompt,) = _as_prompt_list([ids], self._e3c_vocab_size)
                except ValueError as exc:
                    raise ValueError(str(exc).replace("prompt 0", f"prompt {index}", 1)) from None
                if len(prompt) > max_len:
                    log.warning(
                        "truncating prompt %d from %d to max_model_len - 1 = %d tokens",
                        index, len(prompt), max_len,
                    )
                    prompt = prompt[:max_len]
                admitted.append((index, prompt))
            taken = _exchange(self, call, finished, admitted, in_flight)
            for index, prompt in admitted:
                engine.add_request(make_request_id(call, index), {"prompt_token_ids": prompt}, params)
            for index, captured in zip(finished, taken):
                prompt, layout, arena = in_flight.pop(index)
                (states,) = collect_results([prompt], self.layer_ids, layout, arena, captured, call)
                _warn_unchecked_once(self, captured)
                yield index, {
                    "input_ids": torch.as_tensor(prompt, dtype=torch.long),
                    "hidden_states": states,
                    "loss_mask": None,
                }
            finished = []
            if not in_flight:
                break
            while not finished:
                for out in engine.step():
                    if not out.finished:
                        continue
                    parsed = parse_request_id(out.request_id)
                    if parsed is None or parsed[0] != call or parsed[1] not in in_flight:
                        raise CaptureError(
                            f"the engine finished request {out.request_id!r}, not one of this stream's"
                        )
                    finished.append(parsed[1])
    except BaseException as exc:
        for *_, arena in in_flight.values():
            if arena is not None:
                arena.discard()
        died = _after_failure(self, exc, [make_request_id(call, i) for i in in_flight], "stream()")
        if died is not None:
            raise died from exc
        raise


def _after_failure(self: Any, exc: BaseException, req_ids: list[str], where: str) -> Exception | None:
    """Leave the generator sound after ``exc`` interrupted a call; the error to
    raise instead of ``exc`` (an :class:`EngineDiedError`), or None.

    A consumer that stops a stream (GeneratorExit) or bad input (ValueError)
    aborts the call's requests; KeyboardInterrupt / SystemExit shut the
    engine down (no engine processes left behind); anything else is checked
    for a dead engine, which closes the generator.
    """
    if isinstance(exc, (GeneratorExit, ValueError)) and not _engine_dead(self):
        _abort(self, req_ids)
        return None
    if not isinstance(exc, Exception):
        generator_close(self)
        return None
    if isinstance(exc, EngineDiedError) or _died(self, exc):
        generator_close(self)
        return EngineDiedError(
            f"the vLLM engine of this VllmHiddenStatesGenerator died during {where} "
            f"({type(exc).__name__}: {exc}); the generator is closed. Look above for the "
            "engine process's own error (out of memory, a killed worker, ...)."
        )
    _abort(self, req_ids)
    return None


def collect_results(
    prompts: list[list[int]],
    layer_ids: list[int],
    layout: Any,
    arena: DriverArena | None,
    captured: dict[str, Any],
    call: int,
) -> list[list[Any]]:
    """The driver's side of a finished call: check, then map (or decode) the rows.

    Gives the arena back in every case; raises :class:`CaptureError` naming
    the call, prompt and layers when anything does not add up.
    """
    try:
        if captured["error"]:
            raise CaptureError(f"call {call}: {captured['error']}")
        stages = captured["stages"]
        for st in stages:
            try:
                check_segments(prompts, st["segments"], st["layers"])
            except CaptureError as exc:
                if len(stages) == 1:
                    raise
                raise CaptureError(f"pipeline stage {st['stage']}: {exc}") from None
        dtype, hidden = captured["dtype"], captured["hidden_size"]
        if any(st["transport"] == "shm" for st in stages):
            if arena is None:
                raise CaptureError("the worker wrote to a shared-memory arena this call did not create")
            results = arena.tensors(dtype, hidden)
        else:
            results = [[None] * len(layer_ids) for _ in prompts]
        # Stages that could not map the arena (another host) sent their slots.
        for st in stages:
            if st["transport"] != "shm":
                got = tensors_from_payload(st["payload"], layout, dtype, hidden, st["slots"])
                for mine, theirs in zip(results, got):
                    for j in st["slots"]:
                        mine[j] = theirs[j]
    finally:
        if arena is not None:
            arena.discard()
    for i, per_layer in enumerate(results):
        for layer_id, t in zip(layer_ids, per_layer):
            if not _all_finite(t):
                raise CaptureError(f"prompt {i}, layer {layer_id}: non-finite hidden states")
    return results


def _layout(self: Any, prompts: Sequence[Sequence[int]]) -> Any:
    info = self._e3c_worker_info
    dtype_name = str(info["dtype"]).removeprefix("torch.")
    return layout_for([len(p) for p in prompts], len(self.layer_ids), info["hidden_size"], dtype_name)


def _add_group(self: Any, call: int, group: int, prompts: list[tuple[int, int]], layout: Any) -> Any:
    """Create the group's arena (unless the RPC path is forced), have the
    rank-0 worker map it, remove its name; the arena, or None."""
    transport = transport_choice()
    arena = None
    if transport != "rpc" and ArenaPool.available():
        arena = self._e3c_arena = _pool(self).lease(layout)
    spec = None if arena is None else dict(arena.spec(), required=transport == "shm")
    armed = stage_replies(_rpc(self, "e3c_add", call, group, [list(p) for p in prompts], spec))
    if arena is not None:
        arena.unlink()  # the capturing workers have it mapped (or said why not)
        _warn_if_rpc(self, armed)
    return arena


def _exchange(
    self: Any,
    call: int,
    take: list[int],
    admitted: list[tuple[int, list[int]]],
    in_flight: dict[int, Any],
) -> list[Any]:
    """One RPC for a stream's round: the worker hands over the prompts in
    ``take`` (their replies are returned, in order) and maps one new arena
    per admitted prompt.  Each admitted prompt enters ``in_flight`` as soon
    as its arena exists (so a failure later still gives it back)."""
    transport = transport_choice()
    pool = _pool(self) if transport != "rpc" and ArenaPool.available() else None
    arenas, items = [], []
    for index, prompt in admitted:
        layout = _layout(self, [prompt])
        arena = None if pool is None else pool.lease(layout)
        in_flight[index] = (prompt, layout, arena)
        spec = None if arena is None else dict(arena.spec(), required=transport == "shm")
        items.append([index, [[index, len(prompt)]], spec])
        arenas.append(arena)
    if not take and not items:
        return []
    replies = stage_replies(_rpc(self, "e3c_exchange", call, take, items))
    for reply in replies:
        if len(reply.get("taken", ())) != len(take) or len(reply.get("added", ())) != len(items):
            raise CaptureError(
                f"unexpected reply to the capture exchange of call {call} (taking {len(take)}, "
                f"adding {len(items)}): {str(reply)[:200]}"
            )
    for j, arena in enumerate(arenas):
        if arena is not None:
            arena.unlink()  # the capturing workers have it mapped (or said why not)
            _warn_if_rpc(self, [r["added"][j] for r in replies])
    # Each taken prompt: its stages' captures merged by layer.
    return [merge_stage_captures([r["taken"][j] for r in replies], self.layer_ids) for j in range(len(take))]


def _pool(self: Any) -> ArenaPool:
    """The generator's pool of shared-memory files (made at first use)."""
    pool = self.__dict__.get("_e3c_pool")
    if pool is None:
        pool = self._e3c_pool = ArenaPool(keep_bytes=pool_keep_bytes())
    return pool


def _discard_arena(self: Any) -> None:
    arena = self.__dict__.pop("_e3c_arena", None)
    if arena is not None:
        arena.discard()


def _warn_if_rpc(self: Any, armed: list[dict[str, Any]]) -> None:
    """Warn (once) when a capturing worker could not map the arena."""
    for a in armed:
        if a["transport"] != "shm":
            stage = f"pipeline stage {a['stage']}: " if len(armed) > 1 else ""
            _warn_rpc_once(self, stage + a["why"])
            return


def _warn_rpc_once(self: Any, why: str) -> None:
    if not getattr(self, "_e3c_warned_rpc", False):
        self._e3c_warned_rpc = True
        log.warning(
            "hidden states travel through the RPC channel, not shared memory (%s); this is "
            "slower and holds a copy in the rank-0 worker",
            why,
        )


def _warn_unchecked_once(self: Any, captured: dict[str, Any]) -> None:
    """Warn (once per generator) when the worker could not read the token ids
    of some rows, so they were attributed to prompts by position only."""
    if captured.get("token_ids_checked", True) or getattr(self, "_e3c_warned_unchecked", False):
        return
    self._e3c_warned_unchecked = True
    log.warning(
        "%s: the token ids the model saw could not be read in the worker (the model is fed "
        "embeddings and the runner has no input_ids buffer); rows were attributed to prompts "
        "by position only, without the token-id check",
        getattr(self, "model_path", "<unknown model>"),
    )


def _all_finite(t: Any) -> bool:
    """Whether every value of ``t`` is finite.

    One ``torch.aminmax`` pass: NaN propagates to both results (documented
    behaviour of ``aminmax``) and an infinity is the minimum or the maximum.
    Measured on this CPU at hidden 7168 bf16 (0.94 GB): 12 GB/s, against 3.1
    for the masked integer maximum of the bit patterns used before and 1.7
    for a float32 sum (``benchmarks/finite_check.py``); no temporary tensor.
    """
    import torch  # noqa: PLC0415

    if not t.numel() or not t.is_floating_point():
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


class EngineDiedError(RuntimeError):
    """The generator's vLLM engine process died; the generator is closed."""


def _rpc(self: Any, method: str, *args: Any) -> list[Any]:
    """``collective_rpc`` that cannot hang on a dead engine.

    vLLM's client waits on the reply of a utility call without a deadline; if
    the engine process dies (OOM killer, a crashed worker) that wait never
    ends (seen with vLLM 0.16).  The call runs in a helper thread while this
    one watches the engine's liveness flag.
    """
    if _engine_dead(self):
        raise EngineDiedError(f"the vLLM engine is dead (before {method})")
    box: queue.Queue = queue.Queue(maxsize=1)

    def call() -> None:
        try:
            box.put((True, self.llm.collective_rpc(method, args=args)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.put((False, exc))

    # A daemon thread, not a ThreadPoolExecutor: a call stuck on a dead engine
    # must not be joined at interpreter exit (that would hang the program).
    threading.Thread(target=call, name=f"e3c-rpc-{method}", daemon=True).start()
    while True:
        try:
            ok, value = box.get(timeout=0.5)
        except queue.Empty:
            if _engine_dead(self):
                raise EngineDiedError(f"the vLLM engine died during {method}") from None
            continue
        if ok:
            return value
        raise value


def _died(self: Any, exc: BaseException, grace: float = 5.0) -> bool:
    """Whether ``exc`` came from a dead engine.

    A worker that dies under a live engine-core process first surfaces as a
    failed RPC ("Executor failed."); the engine's dead flag follows shortly
    after, so it is polled for a few seconds rather than read once.
    """
    import time  # noqa: PLC0415

    if "Executor failed" in str(exc):
        return True
    deadline = time.monotonic() + grace
    while True:
        if _engine_dead(self):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _engine_dead(self: Any) -> bool:
    core = getattr(getattr(getattr(self, "llm", None), "llm_engine", None), "engine_core", None)
    resources = getattr(core, "resources", None)
    return bool(getattr(resources, "engine_dead", False))


def _abort(self: Any, req_ids: list[str]) -> None:
    try:
        self.llm.llm_engine.abort_request(req_ids)
        while self.llm.llm_engine.has_unfinished_requests():
            self.llm.llm_engine.step()
        _rpc(self, "e3c_disarm")
    except Exception:  # the engine may be gone; the original error matters
        log.debug("abort after a failed call also failed", exc_info=True)


def generator_close(self: Any) -> None:
    """Shut the engine down (idempotent); free the kept shared memory."""
    _discard_arena(self)
    pool = self.__dict__.pop("_e3c_pool", None)
    if pool is not None:
        log.debug("arena pool at close: %s", pool.stats())
        pool.close()
    if getattr(self, "_e3c_closed", True):
        return
    self._e3c_closed = True
    llm = self.__dict__.pop("llm", None)
    if llm is None:
        return
    try:
        engine_core = llm.llm_engine.engine_core
        engine_core.shutdown()
    except Exception:
        log.debug("engine shutdown raised", exc_info=True)


def generator_del(self: Any) -> None:
    try:
        generator_close(self)
    except Exception:
        pass


def generator_enter(self: Any) -> Any:
    return self


def generator_exit(self: Any, *exc: Any) -> None:
    generator_close(self)
