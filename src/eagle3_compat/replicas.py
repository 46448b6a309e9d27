"""Engine replicas as Ray actors: ``eagle3-compat generate --replicas N``.

Ray is the orchestrator vLLM's own batch-inference examples use: actors that
each own an engine, work pulled in small blocks, a failed actor's blocks
retried elsewhere.  Here:

* each replica is a Ray actor holding one ``VllmHiddenStatesGenerator``
  (vLLM's multiprocessing executor inside the actor: the actor is in no
  placement group, so vLLM does not pick its Ray executor, which its CPU
  platform refuses anyway).  It asks Ray for what its tensor x pipeline
  parallel workers need: that many GPUs where the cluster has GPUs, that
  many CPUs on the CPU platform;
* the driver (this process) reads the input and cuts it into chunks of
  ``chunk_size`` samples; a replica has at most two chunks at a time (one
  running, one queued), so a slow replica holds little and the others take
  the rest;
* a replica that dies (its process killed, its node lost) has its
  unfinished chunks handed to the others; a chunk's samples come back only
  when the whole chunk is done, and the driver writes each sample once, so
  none is lost and none written twice;
* the driver writes every file (the same writer as one engine: files
  renamed into place in index order), and shows one progress bar.

``ray`` is an optional dependency (``pip install 'eagle3_compat[ray]'``);
:func:`check_replica_args` fails at once without it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections import deque
from collections.abc import Iterator
from typing import Any

from .logs import get_logger

__all__ = ["INSTALL", "RayReplicas", "check_replica_args"]

log = get_logger("eagle3_compat.replicas")
INSTALL = "pip install 'eagle3_compat[ray]'"
DEFAULT_CHUNK = 8
QUEUED_PER_REPLICA = 2  # one chunk running, one waiting in the actor's queue
# Forwarded to the replicas (a remote cluster's workers do not share the driver's environment).
_ENV_PREFIXES = ("VLLM_", "EAGLE3_COMPAT_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "OMP_")
_PORT_STRIDE = 20  # replicas on one node: VLLM_PORT blocks this far apart


def check_replica_args(replicas: int, address: str | None, chunk_size: int | None) -> None:
    """Raise ``ValueError`` for bad values, or when Ray is not installed
    (before anything heavy is imported)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"--replicas must be a positive int, got {replicas!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"--chunk-size must be a positive int, got {chunk_size!r}")
    if importlib.util.find_spec("ray") is None:
        raise ValueError(f"--replicas runs engines as Ray actors, and Ray is not installed for "
                         f"{sys.executable}: {INSTALL}")


# --- moving a sample from a replica to the driver -----------------------------
# The replica's tensors are views of its shared-memory arena (or of a decoded
# payload).  They travel as the bytes of each storage plus each view's
# geometry, and are rebuilt as the same views of a storage of the driver's:
# torch.save then writes the same file as it does for a local engine's sample.


def pack_sample(res: dict[str, Any]) -> dict[str, Any]:
    """``{"input_ids", "hidden_states"}`` of a sample -> plain data (numpy
    buffers + geometry) that Ray moves without pickling torch objects."""
    storages: list[Any] = []
    where: dict[int, int] = {}

    def geometry(t: Any) -> tuple[int, str, int, tuple[int, ...], tuple[int, ...]]:
        import torch  # noqa: PLC0415

        s = t.untyped_storage()
        key = s.data_ptr()
        if key not in where:
            where[key] = len(storages)
            raw = torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),), (1,))
            storages.append(raw.clone().numpy())
        return (where[key], str(t.dtype).removeprefix("torch."), t.storage_offset(), tuple(t.shape),
                tuple(t.stride()))

    return {"storages": storages, "input_ids": geometry(res["input_ids"]),
            "hidden_states": [geometry(h) for h in res["hidden_states"]]}


def unpack_sample(packed: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`pack_sample`, in the driver's own memory."""
    import torch  # noqa: PLC0415

    storages = [torch.from_numpy(a.copy()).untyped_storage() for a in packed["storages"]]

    def view(g: Any) -> Any:
        idx, dtype, offset, size, stride = g
        return torch.empty(0, dtype=getattr(torch, dtype)).set_(storages[idx], offset, size, stride)

    return {"input_ids": view(packed["input_ids"]), "hidden_states": [view(g) for g in packed["hidden_states"]],
            "loss_mask": None}


class _Replica:
    """One engine in a Ray actor (made a Ray class by :func:`_actor_class`).

    Started in two steps: the actor first says where it runs (host, the
    CPUs it may use), then the driver, knowing every replica's host, starts
    its engine (with its own cores on the CPU platform: see
    :func:`cpu_binding`)."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._gen: Any = None

    def where(self) -> dict[str, Any]:
        import socket  # noqa: PLC0415

        return {"pid": os.getpid(), "host": socket.gethostname(), "cpus": sorted(os.sched_getaffinity(0))}

    def start(self, model: str, gen_kwargs: dict[str, Any], dtype: str | None, env: dict[str, str]) -> list[int]:
        os.environ.update(env)
        if "VLLM_PORT" in env:  # engines of one node must not race for one port
            os.environ["VLLM_PORT"] = str(int(env["VLLM_PORT"]) + _PORT_STRIDE * self._rank)
        import eagle3_compat  # noqa: PLC0415

        report = eagle3_compat.apply(dtype=dtype)
        if not report.applied:
            raise RuntimeError(f"replica {self._rank}: eagle3_compat could not apply:\n{report}")
        from speculators.data_generation import VllmHiddenStatesGenerator  # noqa: PLC0415

        self._gen = VllmHiddenStatesGenerator(model, **gen_kwargs)
        return list(self._gen.layer_ids)

    def run(self, chunk: list[tuple[int, list[int]]], max_in_flight: int) -> list[tuple[int, dict[str, Any]]]:
        keys = [k for k, _ in chunk]
        out = []
        for j, res in self._gen.stream((ids for _, ids in chunk), max_in_flight=max_in_flight):
            out.append((keys[j], pack_sample(res)))
            del res
        return out

    def data_config(self, kw: dict[str, Any]) -> dict[str, Any]:
        from .dataset import data_config_dict  # noqa: PLC0415

        return data_config_dict(self._gen, **kw)

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()


def cpu_binding(cpus: list[int], slot: int, slots: int, workers: int) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for replica ``slot`` of ``slots`` on one
    host, each with ``workers`` (TP x PP) workers: disjoint, equal slices of
    ``cpus`` (``"0-3|4-7"``: one list per worker), or None where there are
    fewer CPUs than workers.  vLLM's "auto" binding gives every engine all
    the cores of a NUMA node: two engines on one node would each run a
    thread per core and spin against each other."""
    per = len(cpus) // (slots * workers)
    if per < 1:
        return None
    lists = []
    for w in range(workers):
        start = (slot * workers + w) * per
        lists.append(",".join(str(c) for c in cpus[start:start + per]))
    return "|".join(lists)


def check_chunk_results(rank: int, chunk: list[tuple[int, Any]], results: list[tuple[int, Any]]) -> None:
    """A replica's answer for ``chunk`` holds each of its positions exactly
    once: a sample missing would never be written, one repeated or foreign
    would be written over another's file."""
    want = sorted(k for k, _ in chunk)
    got = sorted(k for k, _ in results)
    if got != want:
        lost = sorted(set(want) - set(got))
        extra = sorted(k for k in set(got) if got.count(k) > 1 or k not in want)
        raise RuntimeError(
            f"replica {rank} answered a chunk of prompts {want[0]}..{want[-1]} with {len(got)} samples "
            f"for {len(want)} (missing positions {lost[:10]}, repeated or foreign {extra[:10]})")


def _actor_class(ray: Any, num_cpus: float, num_gpus: float) -> Any:
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_task_retries=0)(_Replica)


try:  # the errors that mean "this replica is gone" (its work is re-run elsewhere)
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    _LOST: tuple[type[BaseException], ...] = (RayActorError, ActorDiedError, ActorUnavailableError)
except ImportError:  # ray not installed: RayReplicas is never built (check_replica_args)
    _LOST = ()


class RayReplicas:
    """``replicas`` engines as Ray actors, used like one engine by
    :func:`eagle3_compat.dataset.run_generate`: ``stream(prompts)`` yields
    ``(position, sample)`` as chunks finish, each position exactly once."""

    def __init__(self, model: str, gen_kwargs: dict[str, Any], *, dtype: str | None, replicas: int,
                 address: str | None = None, chunk_size: int | None = None) -> None:
        check_replica_args(replicas, address, chunk_size)
        self._model, self._kwargs, self._dtype = model, dict(gen_kwargs), dtype
        self._n, self._address = replicas, address
        self._chunk = chunk_size or DEFAULT_CHUNK
        self._actors: dict[int, Any] = {}  # rank -> live actor
        self._started_ray = False
        self.layer_ids: list[int] = []
        self.lost: list[int] = []  # ranks of replicas that died during the job

    def _resources(self, ray: Any) -> tuple[float, float]:
        workers = int(self._kwargs.get("tensor_parallel_size") or 1) * int(
            self._kwargs.get("pipeline_parallel_size") or 1)
        if ray.cluster_resources().get("GPU", 0) > 0:
            return 1.0, float(workers)
        return float(workers), 0.0  # the CPU platform: a core per worker

    def __enter__(self) -> RayReplicas:
        import ray  # noqa: PLC0415

        if not ray.is_initialized():
            ray.init(address=self._address, include_dashboard=False, log_to_driver=True)
            self._started_ray = True
        env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
        if "PYTHONPATH" in os.environ:
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        num_cpus, num_gpus = self._resources(ray)
        workers = int(self._kwargs.get("tensor_parallel_size") or 1) * int(
            self._kwargs.get("pipeline_parallel_size") or 1)
        cls = _actor_class(ray, num_cpus, num_gpus)
        log.info("starting %d replica(s) on Ray (%s CPU, %s GPU each)", self._n, num_cpus, num_gpus)
        self._actors = {r: cls.remote(r) for r in range(self._n)}
        try:
            where = dict(zip(self._actors, ray.get([a.where.remote() for a in self._actors.values()])))
            hosts: dict[str, list[int]] = {}
            for r in sorted(where):
                hosts.setdefault(where[r]["host"], []).append(r)
            starts = []
            for r, a in self._actors.items():
                renv = dict(env)
                on_host = hosts[where[r]["host"]]
                bind = None
                if num_gpus == 0 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
                    bind = cpu_binding(where[r]["cpus"], on_host.index(r), len(on_host), workers)
                    if bind is not None:
                        renv["VLLM_CPU_OMP_THREADS_BIND"] = bind
                log.info("replica %d: pid %d on %s%s", r, where[r]["pid"], where[r]["host"],
                         f", cores {bind}" if bind else "")
                starts.append((r, a.start.remote(self._model, self._kwargs, self._dtype, renv)))
            layer_ids = []
            for r, ref in starts:
                try:
                    layer_ids.append(ray.get(ref))
                except _LOST as exc:  # killed while starting (e.g. by the OOM killer): go on without it
                    del self._actors[r]
                    self.lost.append(r)
                    log.warning("replica %d died while starting (%s); going on with the others",
                                r, type(exc).__name__)
            if not layer_ids:
                raise RuntimeError(f"none of the {self._n} replicas started (all died: see Ray's log above)")
            # the files of one job hold one set of layers, whichever replica made them
            odd = {r: ids for r, ids in zip(self._actors, layer_ids) if ids != layer_ids[0]}
            if odd:
                raise RuntimeError(f"the replicas capture different layers: {layer_ids[0]} and {odd}")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.layer_ids = layer_ids[0]
        return self

    def __exit__(self, *exc: object) -> None:
        import ray  # noqa: PLC0415

        try:
            closing = [a.close.remote() for a in self._actors.values()]
            if closing:
                ray.wait(closing, num_returns=len(closing), timeout=120)
            for a in self._actors.values():
                ray.kill(a)
            self._actors = {}
        finally:
            if self._started_ray:
                ray.shutdown()

    def stream(self, prompts: Iterator[list[int]], max_in_flight: int) -> Iterator[tuple[int, dict[str, Any]]]:
        import ray  # noqa: PLC0415

        lost_errors = _LOST
        source = enumerate(prompts)
        retry: deque[list[tuple[int, list[int]]]] = deque()
        running: dict[Any, tuple[int, list[tuple[int, list[int]]]]] = {}  # ref -> (rank, chunk)
        load = {r: 0 for r in self._actors}
        exhausted = False
        per_call = max(1, min(max_in_flight, self._chunk))

        def next_chunk() -> list[tuple[int, list[int]]] | None:
            nonlocal exhausted
            if retry:
                return retry.popleft()
            if exhausted:
                return None
            chunk = []
            for k, ids in source:
                chunk.append((k, ids))
                if len(chunk) == self._chunk:
                    break
            else:
                exhausted = True
            return chunk or None

        while True:
            # hand out chunks: the least loaded live replica first
            while self._actors:
                rank = min((r for r in self._actors), key=lambda r: load[r])
                if load[rank] >= QUEUED_PER_REPLICA:
                    break
                chunk = next_chunk()
                if chunk is None:
                    break
                running[self._actors[rank].run.remote(chunk, per_call)] = (rank, chunk)
                load[rank] += 1
            if not running:
                if retry or not exhausted:
                    raise RuntimeError(f"every replica died ({self._n} started; lost: {self.lost}); "
                                       "the samples written so far are kept: run the job again to resume")
                return
            (ref,), _ = ray.wait(list(running), num_returns=1)
            rank, chunk = running.pop(ref)
            load[rank] -= 1
            try:
                results = ray.get(ref)
            except lost_errors as exc:
                if rank in self._actors:
                    del self._actors[rank]
                    self.lost.append(rank)
                    log.warning("replica %d died (%s); its unfinished chunks go to the %d other(s)",
                                rank, type(exc).__name__, len(self._actors))
                retry.append(chunk)
                continue
            check_chunk_results(rank, chunk, results)
            for k, packed in results:
                yield k, unpack_sample(packed)

    def data_config(self, **kw: Any) -> dict[str, Any]:
        import ray  # noqa: PLC0415

        for rank, actor in list(self._actors.items()):
            try:
                return ray.get(actor.data_config.remote(kw))
            except Exception:  # noqa: BLE001  # a replica lost at the very end: ask another
                continue
        raise RuntimeError("no replica left to describe the job (data_config.json)")
