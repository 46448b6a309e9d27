"""The main job: prompts in, speculators' training folder out.

Output layout: speculators 0.3.0's own (``scripts/data_generation_offline.py``
at the v0.3.0 tag): one ``data_{i}.pt`` per sample in its "v1" format
(what ``speculators.train.data.Eagle3SampleFileDataset`` reads):
``{"input_ids": LongTensor[T], "loss_mask": LongTensor[T], "hidden_states":
[Tensor[T, H] per layer id]}``, ``data_config.json`` written by speculators'
own ``DataGenerationConfig``, and our ``manifest.json``.  Inputs: a dataset
through speculators' own ``load_and_preprocess_dataset`` (which also writes
``token_freq.pt`` where ``--token-freq-path`` says), or our JSONL of token
ids / conversations.

Resumable, and compatible with upstream's resume (the largest index + 1):
sample ``i`` is written to a temporary file and renamed into place whole,
and files are renamed in index order, so the folder always holds a prefix
``data_{start}..data_{k}`` however the engine's requests finish.  A rerun
skips the samples whose files exist and computes the rest.

Sharded jobs (``num_shards=N, shard_index=I``): shard ``I`` owns the samples
whose index ``i`` (position in the input) has ``i % N == I``; several shard
jobs (on any scheduler) write into one folder at once.  Each publishes its
own samples in its own index order (a killed shard job leaves a prefix of its
own sequence; its rerun skips the files there) and writes only files of its
own: its samples, ``manifest.shard-I-of-N.json`` (settings, counts,
speculators' ``data_config`` for the job) and ``token_freq.shard-I-of-N.json``
(loss-masked token counts of its samples).  ``eagle3-compat verify``
(:mod:`eagle3_compat.verify`) checks the folder once all have finished and
writes the shared files: ``manifest.json``, ``data_config.json`` and the
merged token frequencies.
"""

from __future__ import annotations

import gc
from collections import deque

import json
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .logs import get_logger
from .settings import DRIVER_THREADS
from .upstream import check_layer_plan, data_path, model_num_layers, upstream_resume_index

__all__ = ["Sample", "read_jsonl", "run_generate", "data_path"]

log = get_logger("eagle3_compat.dataset")
MANIFEST = "manifest.json"
_SHARD_FILE = re.compile(r"(manifest|token_freq)\.shard-(\d+)-of-(\d+)\.json")


def shard_manifest_name(shard_index: int, num_shards: int) -> str:
    """The manifest a job writes: ``manifest.json`` unsharded, else
    ``manifest.shard-I-of-N.json`` (one file per shard job: no job writes
    another's; ``.json``, so speculators' trainer, which reads every ``*pt``
    file of the folder, ignores it)."""
    return MANIFEST if num_shards == 1 else f"manifest.shard-{shard_index}-of-{num_shards}.json"


def shard_token_freq_name(shard_index: int, num_shards: int) -> str:
    """A shard job's token counts (JSON ``{token id: count}``), merged by ``verify``."""
    return f"token_freq.shard-{shard_index}-of-{num_shards}.json"


def in_shard(index: int, num_shards: int, shard_index: int) -> bool:
    """Whether sample ``index`` (its position in the input) belongs to shard
    ``shard_index`` of ``num_shards``: ``index % num_shards == shard_index``.
    Deterministic, needs no count of the input, and spreads long and short
    samples evenly whatever their order."""
    return index % num_shards == shard_index


def check_shard_args(num_shards: int, shard_index: int) -> None:
    for name, v in (("--num-shards", num_shards), ("--shard-index", shard_index)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an int, got {v!r}")
    if num_shards < 1:
        raise ValueError(f"--num-shards must be >= 1, got {num_shards}")
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"--shard-index must be in 0..{num_shards - 1} for --num-shards {num_shards}, "
                         f"got {shard_index} (a Slurm array: --array=0-{num_shards - 1}, "
                         "--shard-index $SLURM_ARRAY_TASK_ID)")


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_job_args(*, max_model_len: Any, max_in_flight: Any, tensor_parallel_size: Any,
                   pipeline_parallel_size: Any, gpu_memory_utilization: Any) -> None:
    """The job's numeric arguments, checked before anything heavy loads (the
    engine would otherwise start, minutes later, and fail on them or, for
    ``--max-model-len 1``, truncate every prompt to nothing); a
    ``ValueError`` names the option and the value."""
    # room for one prompt token and the one token vLLM samples
    _positive_int("--max-model-len", max_model_len, minimum=2)
    _positive_int("--max-in-flight", max_in_flight)
    if tensor_parallel_size is not None:
        _positive_int("--tensor-parallel-size", tensor_parallel_size)
    _positive_int("--pipeline-parallel-size", pipeline_parallel_size)
    if (isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float))
            or not 0 < gpu_memory_utilization <= 1):
        raise ValueError(f"--gpu-memory-utilization must be a fraction in (0, 1], got {gpu_memory_utilization!r}")


def manifests(output: Path) -> dict[str, dict[str, Any]]:
    """Every manifest in ``output`` (``manifest.json`` and the shard jobs'), by file name."""
    found: dict[str, dict[str, Any]] = {}
    if not output.is_dir():
        return found
    for path in sorted(output.glob("manifest*.json")):
        if path.name == MANIFEST or (_SHARD_FILE.fullmatch(path.name) and path.name.startswith("manifest")):
            try:
                found[path.name] = json.loads(path.read_text())
            except ValueError as exc:
                raise ValueError(f"{path} is not valid JSON ({exc}); delete it if its job is gone") from exc
    return found


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON whole: readers (other shard jobs, ``verify``) never see half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


@dataclass
class Sample:
    index: int
    input_ids: list[int]
    loss_mask: list[int]


# speculators' private preprocessing functions, used like an adapter's targets:
# probed for the signature this module calls, a mismatch named.
_PREPROCESSING = {
    "_preprocess_batch": ("examples", "tokenizer", "max_length", "assistant_pattern"),
    "_detect_assistant_pattern": ("tokenizer",),
}


def speculators_preprocessing(name: str) -> Any:
    """speculators' private ``preprocessing.<name>``, checked against the
    parameters it had in 0.3.0 (it is private: a later release may change it)."""
    import inspect  # noqa: PLC0415

    from speculators.data_generation import preprocessing  # noqa: PLC0415

    fn = getattr(preprocessing, name, None)
    expected = _PREPROCESSING[name]
    params = tuple(inspect.signature(fn).parameters)[: len(expected)] if callable(fn) else None
    if params != expected:
        from importlib.metadata import version  # noqa: PLC0415

        raise RuntimeError(
            f"speculators {version('speculators')}: speculators.data_generation.preprocessing.{name} "
            f"{'is missing' if params is None else f'takes {params}'}, expected {expected} "
            "(speculators 0.3.0); conversations cannot be tokenized as speculators does"
        )
    return fn


def _conversation_sample(tokenizer: Any, conv: list[dict], max_length: int, pattern: str) -> tuple[list[int], list[int]]:
    # speculators 0.3.0's own preprocessing, one conversation at a time: its
    # batch function drops a failing conversation without a word, which would
    # shift every later sample; here a failure names the line.
    preprocess = speculators_preprocessing("_preprocess_batch")
    out = preprocess({"conversations": [conv]}, tokenizer, max_length, pattern)
    if len(out["input_ids"]) != 1:
        raise ValueError("speculators' preprocessing rejected this conversation")
    return out["input_ids"][0].tolist(), out["loss_mask"][0].tolist()


def read_jsonl(path: Path, tokenizer: Any, max_length: int) -> Iterator[Sample]:
    """Samples from a JSONL file: each line a list of token ids, an object with
    ``input_ids`` (and optional ``loss_mask``), or an object with
    ``conversations`` / ``messages`` (chat turns, tokenized with the model's
    chat template by speculators' preprocessing, loss mask on assistant turns)."""
    pattern = None
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            index = lineno - 1
            try:
                rec = json.loads(line)
                if isinstance(rec, list):
                    ids, mask = rec, [1] * len(rec)
                elif "input_ids" in rec:
                    ids = rec["input_ids"]
                    # only an absent (or null) loss_mask means "every token"; an
                    # empty or short one is refused below
                    mask = rec.get("loss_mask")
                    if mask is None:
                        mask = [1] * len(ids)
                elif "conversations" in rec or "messages" in rec:
                    if pattern is None:
                        pattern = speculators_preprocessing("_detect_assistant_pattern")(tokenizer)
                    conv = rec.get("conversations") or rec.get("messages")
                    ids, mask = _conversation_sample(tokenizer, conv, max_length, pattern)
                else:
                    raise ValueError("expected a list of token ids, input_ids, conversations or messages")
                if len(mask) != len(ids):
                    raise ValueError(f"loss_mask has {len(mask)} entries for {len(ids)} tokens")
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from exc
            yield Sample(index=index, input_ids=list(ids), loss_mask=[int(m) for m in mask])


def _validate(result: dict[str, Any], sample: Sample, layer_ids: Sequence[int]) -> None:
    # Finiteness, rows, positions and token ids were checked by the generator
    # (CaptureError); this guards the file's shape against the manifest.
    n = len(result["input_ids"])
    states = result["hidden_states"]
    if len(states) != len(layer_ids):
        raise RuntimeError(f"sample {sample.index}: {len(states)} tensors for layers {list(layer_ids)}")
    for k, h in zip(layer_ids, states):
        if h.dim() != 2 or h.shape[0] != n:
            raise RuntimeError(f"sample {sample.index}, layer {k}: shape {tuple(h.shape)} for {n} tokens")


# A sample is written to ".<name>.<writer pid>.tmp" (".data_7.pt.1234.tmp": no
# ".pt" suffix, so speculators' trainer, which reads every "*pt" file under
# the folder, never sees it) and renamed into place
# whole; these two functions are the only places that know the pattern.
def _partial_path(path: Path, pid: int) -> Path:
    return path.with_name(f".{path.name}.{pid}.tmp")


def _partial_writer(tmp: Path) -> int | None:
    """The writing process of a partial sample file; None for any other file."""
    m = re.fullmatch(r"\.(?:data_\d+|sample_\d{9})\.pt\.(\d+)\.tmp", tmp.name)
    return int(m.group(1)) if m else None


def _partial_index(tmp: Path) -> int | None:
    m = re.fullmatch(r"\.data_(\d+)\.pt\.\d+\.tmp", tmp.name)
    return int(m.group(1)) if m else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_partials(output: Path, owns: Any = None) -> list[Path]:
    """Delete the temporary files (``.data_*.pt.<pid>.tmp``) that a killed
    run left behind, i.e. those whose writing process is gone; returns them.
    A file is only ever renamed into place whole, so these are never samples.

    ``owns(file_index) -> bool``: only such files are touched (a shard job
    leaves the other shards' alone: their writer may run on another machine,
    where this one's process table says nothing)."""
    removed = []
    for tmp in [*output.glob(".data_*.tmp"), *output.glob(".sample_*.tmp")]:
        pid = _partial_writer(tmp)
        if owns is not None:
            idx = _partial_index(tmp)
            if idx is None or not owns(idx):
                continue
        if pid is not None and not _pid_alive(pid):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    if removed:
        log.warning("removed %d partial file(s) left by an interrupted run in %s", len(removed), output)
    return removed


CONVENTIONS = {
    "layer_output": "output of decoder layer k before the final norm (HF hidden_states[k+1])",
    "layer_input": "input of decoder layer k, as vLLM's EAGLE-3 serving reads it (HF hidden_states[k])",
}
LAYOUT = "speculators-0.3.0: data_{i}.pt (v1 keys) + data_config.json"
DATA_CONFIG = "data_config.json"


def _check_same_settings(output: Path, settings: dict[str, Any]) -> None:
    """Refuse a folder whose manifests (``manifest.json``, the shard jobs')
    record other settings."""
    for name, old in manifests(output).items():
        old.setdefault("capture", "layer_output")  # manifests written before the option existed
        diff = {k: {"folder": old[k], "now": v} for k, v in settings.items() if k in old and old[k] != v}
        if diff:
            raise ValueError(
                f"{output} holds samples made with other settings {diff} ({name}); resuming would mix "
                "them. Use a new --output-dir folder or the original settings."
            )


def _ours(output: Path) -> bool:
    """Whether a job of ours wrote in ``output`` (its files are renamed into place whole)."""
    return bool(manifests(output))


def _check_folder(output: Path, model: str, layer_ids: list[int], seq_length: int,
                  data_source: str, token_freq_path: str | None) -> None:
    """Checks of the output folder that need no heavy import; raise before anything is written."""
    if token_freq_path is not None:
        tf = Path(token_freq_path).resolve()
        if tf.suffix == ".pt" and (tf.parent == output.resolve() or output.resolve() in tf.parents):
            raise ValueError(
                f"--token-freq-path {token_freq_path} is inside --output-dir {output}: speculators' "
                "trainer reads every *.pt file there as a sample and would fail on it; put it elsewhere "
                "(upstream's default is ./token_freq.pt)"
            )
    if not output.is_dir():
        return
    if next(output.glob("sample_" + "[0-9]" * 9 + ".pt"), None) is not None:
        raise ValueError(
            f"{output} holds sample_NNNNNNNNN.pt files (the layout of eagle3_compat before 0.1.0: "
            "speculators' pipeline does not read it); write to a new --output-dir"
        )
    cfg_path = output / DATA_CONFIG
    if cfg_path.exists() and not _ours(output):
        # a folder speculators' own script started: resume only with its settings
        cfg = json.loads(cfg_path.read_text())
        theirs = {
            "target_model_path": cfg.get("model", {}).get("target_model_path"),
            "layer_ids": cfg.get("hidden_states", {}).get("layer_ids"),
            "seq_length": cfg.get("data", {}).get("seq_length"),
            "train_data_path": cfg.get("data", {}).get("train_data_path"),
        }
        ours = {"target_model_path": model, "layer_ids": layer_ids, "seq_length": seq_length,
                "train_data_path": data_source}
        diff = {k: {"folder": theirs[k], "now": v} for k, v in ours.items() if theirs[k] != v}
        if diff:
            raise ValueError(f"{output}/{DATA_CONFIG} was written with other settings {diff}; resuming "
                             "would mix them. Use a new --output-dir folder or the original settings.")
    elif upstream_resume_index(output) > 0 and not _ours(output):
        log.warning("%s holds data_*.pt files but neither %s nor %s: their settings cannot be checked",
                    output, MANIFEST, DATA_CONFIG)


UPSTREAM_WRITERS = 4  # MAX_IO_WORKERS of speculators 0.3.0's script: files it may have been writing


def check_upstream_tail(output: Path) -> None:
    """In a folder speculators' own script wrote (no manifest of ours), load
    the last files it may have been writing when it stopped: its
    ``torch.save`` writes in place, so a killed run can leave a truncated
    file that its resume (and ours) would keep.  Raises ``ValueError`` naming it."""
    import torch  # noqa: PLC0415

    if not output.is_dir() or _ours(output):
        return  # ours are renamed into place whole
    found = sorted((int(p.name[5:-3]), p) for p in output.glob("data_*.pt") if p.name[5:-3].isdigit())
    for _, path in found[-UPSTREAM_WRITERS:]:
        try:
            data = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
            missing = {"input_ids", "hidden_states", "loss_mask"} - set(data)
            if missing:
                raise ValueError(f"no {sorted(missing)}")
        except Exception as exc:  # noqa: BLE001
            raise ValueError(
                f"{path} does not load as a sample ({exc}); speculators' script writes in place, so a "
                "run killed while writing leaves such a file: delete it and run again to resume"
            ) from exc


GC_EVERY_BYTES = 1 << 30


class _Writer:
    """Writes samples on a thread, at most ``max_queued`` waiting, and renames
    them into place in submission order.

    The engine goes on while a sample is written; the queue's bound keeps
    memory bounded when the disk is slower than extraction.  Each sample is
    saved to a temporary file as soon as it arrives (nothing is held for
    ordering) and the files are renamed into place in the order they were
    submitted, so the folder always holds a prefix of the job, which is what
    speculators' own resume (largest index + 1) assumes.  A failed write is
    raised at the next submit or at exit, never dropped; on failure the
    unpublished temporary files are removed.

    ``zip_crc32=False`` (the job's default): the writer's ``torch.save``
    writes no CRC-32 of its zip records.  The setting
    (``torch.serialization.set_crc32_options``, in torch 2.8-2.13 of the
    supported vLLM releases) is made in the writer's thread, since torch
    2.13 keeps it per thread (2.8-2.11 for the whole process, while the
    writer is open), and restored at exit.  ``torch.load`` never checks
    them (PyTorch builds its zip reader with
    ``MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS``), and computing them was
    ~0.75 s of CPU per GiB saved at hidden 2048, a third of the writer's,
    and ~80 % of it at hidden 7168 (issue #16, ``benchmarks/writer_gc.py``);
    tools that test zip archives (``unzip -t``, Python's ``zipfile``)
    report such files' CRCs as bad.
    """

    def __init__(self, max_queued: int, zip_crc32: bool = False) -> None:
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="e3c-writer")
        self._queued: deque = deque()
        self._max = max(1, max_queued)
        self._since_gc = 0  # touched by the writer thread only
        self._order: deque[Path] = deque()  # submitted, not yet renamed into place (writer thread)
        self._saved: dict[Path, Path] = {}  # final path -> its temporary file (writer thread)
        self._froze = False
        self._zip_crc32 = zip_crc32
        self._crc_before: bool | None = None  # torch's setting to restore at exit (writer thread)

    def expect(self, path: Path) -> None:
        """Declare the next file in publication order (before its sample arrives)."""
        self._queued.append(self._pool.submit(self._order.append, path))

    def submit(self, path: Path, obj: dict[str, Any]) -> None:
        while len(self._queued) >= self._max:
            self._queued.popleft().result()
        self._queued.append(self._pool.submit(self._write, path, obj))

    def _write(self, path: Path, obj: dict[str, Any]) -> None:
        import torch  # noqa: PLC0415

        tmp = _partial_path(path, os.getpid())
        # Through a file object: torch.save given a path names the archive
        # inside the file after it (".data_7.pt.<pid>", so no two runs wrote
        # the same bytes); given a buffer it uses the fixed name "archive".
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
        self._saved[path] = tmp
        while self._order and self._order[0] in self._saved:
            done = self._order.popleft()
            os.replace(self._saved.pop(done), done)
        # The sample's states are views of its shared-memory arena, returned
        # when the tensors go.  torch.save on torch 2.8 (vLLM 0.11) leaves a
        # reference cycle around each saved storage that only the cyclic
        # collector breaks (measured: 128 MiB held until gc.collect()); a
        # collection per GiB written bounds what such cycles can hold.
        self._since_gc += sum(t.numel() * t.element_size() for t in obj["hidden_states"])
        del obj
        if self._since_gc >= GC_EVERY_BYTES:
            self._since_gc = 0
            gc.collect()

    def _crc32_option(self, value: bool | None) -> None:
        """In the writer's thread: set torch's CRC-32 option to ``value``
        (remembering what it was), or ``None``: restore it."""
        from torch import serialization  # noqa: PLC0415

        if value is None:
            if self._crc_before is not None:
                serialization.set_crc32_options(self._crc_before)
                self._crc_before = None
        elif serialization.get_crc32_options() != value:
            self._crc_before = serialization.get_crc32_options()
            serialization.set_crc32_options(value)

    def __enter__(self) -> _Writer:
        # Each collection above would traverse every object of the process
        # (0.25-0.29 s with vLLM, speculators and a tokenizer loaded: ~0.8 s of a
        # 2000-sample job's 7 s of CPU here, issue #16).  What exists before
        # the job is frozen (gc.freeze) while it runs, so a collection sees
        # only the objects made since, among them the saves' cycles; thawed
        # at the end.  Left alone where the process froze objects itself.
        self._froze = gc.get_freeze_count() == 0
        if self._froze:
            gc.freeze()
        # torch 2.13 keeps the setting per thread: set where the saves run
        self._pool.submit(self._crc32_option, self._zip_crc32).result()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            while self._queued:
                self._queued.popleft().result()
        finally:
            self._pool.submit(self._crc32_option, None)
            self._pool.shutdown(wait=True)
            for tmp in self._saved.values():  # only after a failure: samples not renamed into place
                tmp.unlink(missing_ok=True)
            if self._froze:
                gc.unfreeze()
        if exc_type is None and self._order:
            # a sample the engine never returned: the files after it are not
            # published either (the folder stays a prefix), and the job fails
            raise RuntimeError(f"{len(self._order)} sample file(s) expected but never written (first "
                               f"{self._order[0]}): a sample was lost between the engine and the writer")


def _preprocessed_dataset(
    model: str, train_data_path: str, seq_length: int, num_proc: int, seed: int,
    max_samples: int | None, token_freq_path: str, cache_dir: str | None,
    assistant_pattern: str | None, turn_dropout: bool,
) -> tuple[Any, int]:
    """speculators 0.3.0's own ``load_and_preprocess_dataset`` (tokenization,
    loss masks, shuffling, ``max_samples``, ``token_freq.pt``), as its
    script calls it; returns the dataset and how many conversations its
    preprocessing dropped (it skips failing ones with a log line only)."""
    from speculators.data_generation.preprocessing import (  # noqa: PLC0415
        load_and_preprocess_dataset,
        load_raw_dataset,
    )

    raw = load_raw_dataset(train_data_path, num_proc=num_proc, cache_dir=cache_dir)
    if train_data_path.endswith((".json", ".jsonl")) and "conversations" not in raw.column_names:
        shape = ("the ultrachat shape ('messages')" if "messages" in raw.column_names
                 else f"columns {raw.column_names}")
        raise ValueError(
            f"--train-data-path {train_data_path}: {shape}, but speculators 0.3.0 reads local files' "
            "'conversations' column only (its ultrachat normalisation applies to the hub dataset "
            "'ultrachat'): it would produce no sample. Rename the key to 'conversations' (turns as "
            "from/value or role/content)."
        )
    expected = len(raw) if max_samples is None else min(len(raw), max_samples)
    if Path(token_freq_path).exists():
        log.warning("%s exists: speculators keeps it as it is (not recounted for this dataset)",
                    token_freq_path)
    dataset, _tok = load_and_preprocess_dataset(
        target_model_path=model, train_data_path=train_data_path, seq_length=seq_length,
        build_dataset_num_proc=num_proc, seed=seed, max_samples=max_samples,
        token_freq_path=token_freq_path, cache_dir=cache_dir,
        assistant_pattern=assistant_pattern, turn_dropout=turn_dropout,
    )
    dropped = expected - len(dataset)
    if dropped:
        log.warning("speculators' preprocessing dropped %d of %d conversations (empty, unknown roles "
                    "or a chat-template error; its log lines above say which); %d samples follow",
                    dropped, expected, len(dataset))
    return dataset, dropped


def _count_tokens(counter: Any, ids: list[int], mask: list[int]) -> None:
    # As speculators' save_token_frequency_distribution counts: tokens under
    # the loss mask, over the preprocessed sample (before any truncation to
    # max_model_len - 1 by the generator).
    counter.update(t for t, m in zip(ids, mask) if m)


DRIVER_THREADS_ENV = DRIVER_THREADS.name


def _limit_driver_threads(torch: Any) -> None:
    """This process's torch threads: 1 where the engine computes on the same
    cores (no CUDA), unless ``EAGLE3_COMPAT_DRIVER_THREADS`` says otherwise.

    vLLM's CPU workers bind one OpenMP thread per core; torch's threads in
    this process (the finiteness check of each sample) would take those
    cores between the engine's parallel regions, and an OpenMP region waits
    for its slowest thread.
    """
    threads = DRIVER_THREADS.get()
    if threads is not None:
        torch.set_num_threads(threads)
    elif not torch.cuda.is_available():
        torch.set_num_threads(1)


def run_generate(
    model: str,
    output: Path,
    layer_ids: list[int] | None = None,
    max_model_len: int = 2048,
    batch_size: int | None = None,
    tensor_parallel_size: int | None = 1,
    dtype: str | None = None,
    capture: str = "layer_output",
    max_in_flight: int | None = None,
    *,
    input_path: Path | None = None,
    train_data_path: str | None = None,
    trainer_checks: bool = True,
    gpu_memory_utilization: float = 0.8,
    max_samples: int | None = None,
    seed: int = 0,
    token_freq_path: str | None = None,
    hf_cache_dir: str | None = None,
    assistant_pattern: str | None = None,
    turn_dropout: bool = False,
    num_preprocessing_workers: int = 8,
    start_idx: int = 0,
    pipeline_parallel_size: int = 1,
    distributed_executor_backend: str | None = None,
    num_shards: int = 1,
    shard_index: int = 0,
    replicas: int | None = None,
    ray_address: str | None = None,
    chunk_size: int | None = None,
    zip_crc32: bool = False,
) -> dict[str, Any]:
    """Write speculators' training folder; resumable; returns the manifest.

    Input: ``train_data_path`` (a dataset name or ``.json``/``.jsonl`` file,
    through speculators' own preprocessing, as its script does; with
    ``token_freq_path``, default ``./token_freq.pt``) or ``input_path`` (our
    JSONL: token ids, ``input_ids``/``loss_mask`` or conversations;
    ``token_freq.pt`` only where ``token_freq_path`` is given).  Sample ``i``
    goes to ``data_{start_idx + i}.pt``.

    Before anything heavy loads or anything is written: the layer plan is
    checked (:func:`eagle3_compat.upstream.check_layer_plan`; for speculators'
    trainer unless ``trainer_checks=False``), and a folder made with other
    settings (model, layer ids, capture point, max_model_len, dtype, input,
    number of shards) is refused, never mixed.

    The job streams: at most ``max_in_flight`` prompts (default
    :data:`eagle3_compat.generator.DEFAULT_MAX_IN_FLIGHT`) are in the engine, a
    new one is admitted as soon as one finishes, and each sample is saved by
    a writer thread as its request finishes (renamed into place in index
    order).  ``batch_size`` is accepted for compatibility and unused.
    ``pipeline_parallel_size``: the generator's (a run-time setting like
    ``tensor_parallel_size``: the files are the same, so a folder may be
    resumed with another value).  ``distributed_executor_backend``: the
    generator's too (vLLM's executor of one engine; ``"ray"`` for stages on
    several nodes).

    ``num_shards``/``shard_index``: only the samples ``i`` with
    ``i % num_shards == shard_index`` (see the module docstring; the shared
    files are written by :func:`eagle3_compat.verify.verify_folder`).
    ``replicas``: that many engines as Ray actors (:mod:`eagle3_compat.replicas`;
    ``ray_address`` an existing cluster, ``chunk_size`` samples per work unit).

    ``zip_crc32``: whether the samples' files carry the CRC-32 of their zip
    records.  Off by default: ``torch.load`` never checks them and they cost
    ~0.75 s of CPU per GiB written; on for tools that test zip archives.
    With torch 2.8-2.11 the setting is process-wide: while the job runs it
    holds for every ``torch.save`` of this process; it is restored after.
    """
    if max_in_flight is None:
        from .generator import DEFAULT_MAX_IN_FLIGHT  # noqa: PLC0415

        max_in_flight = DEFAULT_MAX_IN_FLIGHT
    if (input_path is None) == (train_data_path is None):
        raise ValueError("give exactly one of --train-data-path (speculators' datasets) and --input (JSONL)")
    if start_idx < 0:
        raise ValueError(f"--start-idx must be >= 0, got {start_idx}")
    check_job_args(max_model_len=max_model_len, max_in_flight=max_in_flight,
                   tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                   gpu_memory_utilization=gpu_memory_utilization)
    check_shard_args(num_shards, shard_index)
    if replicas is not None:
        from .replicas import check_replica_args  # noqa: PLC0415

        check_replica_args(replicas, ray_address, chunk_size)  # without ray: fails now, naming the install
        if distributed_executor_backend == "ray":
            raise ValueError(
                "--replicas N with --distributed-executor-backend ray: vLLM's Ray executor inside a "
                "replica actor is not supported by eagle3_compat; use shards (--num-shards) of "
                "multi-node engines instead"
            )
    elif ray_address is not None or chunk_size is not None:
        raise ValueError("--ray-address and --chunk-size go with --replicas N")
    sharded = num_shards > 1
    source = str(train_data_path if train_data_path is not None else input_path)
    if train_data_path is not None and token_freq_path is None:
        token_freq_path = "./token_freq.pt"  # speculators' default
    early: dict[str, Any] = {"model": model, "capture": capture, "max_model_len": max_model_len, "dtype": dtype}
    if layer_ids is not None:
        early["layer_ids"] = list(layer_ids)
    # before torch, vLLM and the engine are loaded: a mismatch fails in a second
    _check_same_settings(output, early)
    layer_ids = check_layer_plan(layer_ids, model_num_layers(model), capture, trainer_checks=trainer_checks)
    settings: dict[str, Any] = {**early, "layer_ids": layer_ids, "input": source, "start_idx": start_idx,
                                "num_shards": num_shards}
    if train_data_path is not None:
        settings.update(seed=seed, max_samples=max_samples, turn_dropout=turn_dropout,
                        assistant_pattern=assistant_pattern)
    _check_same_settings(output, settings)
    _check_folder(output, model, layer_ids, max_model_len, source, token_freq_path)

    import torch  # noqa: PLC0415

    import eagle3_compat  # noqa: PLC0415

    _limit_driver_threads(torch)
    status = eagle3_compat.apply(dtype=dtype)
    if not status.applied:
        raise RuntimeError(f"eagle3_compat could not apply:\n{status}")

    dropped = 0
    token_freq: Any = None
    private_tf: str | None = None
    if sharded or (train_data_path is None and token_freq_path is not None):
        # ours: over this job's samples (a shard's counts are merged by verify)
        from collections import Counter  # noqa: PLC0415

        token_freq = Counter()
    if train_data_path is not None:
        upstream_tf = token_freq_path
        if sharded:
            # speculators' preprocessing writes token_freq.pt for the whole
            # dataset: N jobs must not all write one shared file.  It goes to
            # a private folder here; verify writes the merged counts.
            import tempfile  # noqa: PLC0415

            private_tf = tempfile.mkdtemp(prefix="e3c-token-freq-")
            upstream_tf = os.path.join(private_tf, "token_freq.pt")
        dataset, dropped = _preprocessed_dataset(
            model, train_data_path, max_model_len, num_preprocessing_workers, seed, max_samples,
            upstream_tf, hf_cache_dir, assistant_pattern, turn_dropout)  # type: ignore[arg-type]
        if private_tf is not None:
            import shutil  # noqa: PLC0415

            shutil.rmtree(private_tf, ignore_errors=True)

        def samples() -> Iterator[Sample]:
            for i in range(len(dataset)):
                row = dataset[i]
                yield Sample(index=i, input_ids=row["input_ids"].tolist(), loss_mask=row["loss_mask"].tolist())
    else:
        from transformers import AutoTokenizer  # noqa: PLC0415

        tokenizer = AutoTokenizer.from_pretrained(model)

        def samples() -> Iterator[Sample]:
            yield from read_jsonl(input_path, tokenizer, max_model_len - 1)  # type: ignore[arg-type]

    if tensor_parallel_size is None:  # speculators' default: every accelerator (0 on a CPU: 1)
        tensor_parallel_size = max(1, torch.accelerator.device_count()) if hasattr(torch, "accelerator") else 1
    check_upstream_tail(output)
    output.mkdir(parents=True, exist_ok=True)

    def owns(file_index: int) -> bool:
        return in_shard(file_index - start_idx, num_shards, shard_index)

    remove_stale_partials(output, owns if sharded else None)
    resume_at = upstream_resume_index(output)
    manifest_path = output / shard_manifest_name(shard_index, num_shards)
    # Read, tokenize and extract as one stream: memory is bounded by the
    # prompts in flight and the writes queued, whatever the input's length.
    counts = {"seen": 0, "owned": 0, "todo": 0}
    pending: dict[int, Sample] = {}
    writer: _Writer | None = None

    def prompts() -> Iterator[list[int]]:
        for sample in samples():
            counts["seen"] += 1
            if not in_shard(sample.index, num_shards, shard_index):
                continue
            counts["owned"] += 1
            if token_freq is not None:
                _count_tokens(token_freq, sample.input_ids, sample.loss_mask)
            path = data_path(output, start_idx + sample.index)
            if path.exists():
                continue
            pending[counts["todo"]] = sample
            counts["todo"] += 1
            # the writer publishes in this order: this job's own index order
            writer.expect(path)  # type: ignore[union-attr]
            yield sample.input_ids

    gen_kwargs: dict[str, Any] = dict(
        layer_ids=layer_ids, max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization, capture=capture,
        pipeline_parallel_size=pipeline_parallel_size,
    )
    if distributed_executor_backend is not None:
        gen_kwargs["distributed_executor_backend"] = distributed_executor_backend
    if replicas is None:
        engines: Any = _LocalEngine(model, gen_kwargs)
    else:
        from .replicas import RayReplicas  # noqa: PLC0415

        engines = RayReplicas(model, gen_kwargs, dtype=dtype, replicas=replicas, address=ray_address,
                              chunk_size=chunk_size)
    tokens = 0
    t0 = time.perf_counter()
    # data_config.json names the datasets cache; finding it imports
    # `datasets` (0.5-1.5 s), done here while the engine starts, not after
    # the last sample.
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    finder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="e3c-cache-dir")
    cache_dir = finder.submit(_cache_dir, hf_cache_dir)
    finder.shutdown(wait=False)  # the thread ends with its one task
    with engines:
        if list(engines.layer_ids) != layer_ids:
            raise RuntimeError(f"internal: the generator captures {engines.layer_ids}, the plan was {layer_ids}")
        write_json_atomic(manifest_path, {**settings, "shard_index": shard_index, "complete": False})
        if resume_at:
            log.info("resuming in %s: %d file(s) there already (speculators would resume at data_%d)",
                     output, sum(1 for _ in output.glob("data_*.pt")), resume_at)
        try:
            from tqdm import tqdm  # noqa: PLC0415

            bar = tqdm(unit="sample", desc="extracting" if not sharded else
                       f"extracting (shard {shard_index} of {num_shards})")
        except ImportError:  # pragma: no cover
            bar = None
        with _Writer(max_queued=max_in_flight, zip_crc32=zip_crc32) as writer:
            for k, res in engines.stream(prompts(), max_in_flight=max_in_flight):
                sample = pending.pop(k)
                _validate(res, sample, layer_ids)
                n = len(res["input_ids"])  # may be truncated to max_model_len - 1
                writer.submit(
                    data_path(output, start_idx + sample.index),
                    {
                        "input_ids": res["input_ids"],
                        "hidden_states": res["hidden_states"],
                        "loss_mask": torch.tensor(sample.loss_mask[:n], dtype=torch.long),
                    },
                )
                del res
                tokens += n
                if bar is not None:
                    bar.update(1)
                    # refresh=False: drawn with the next update (tqdm's mininterval),
                    # not once per sample (1 ms a sample here, from the engine's cores)
                    bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.0f}", refresh=False)
        if bar is not None:
            bar.close()
        data_config = engines.data_config(
            train_data_path=source, seq_length=max_model_len, cache_dir=cache_dir.result(),
            num_samples=counts["seen"], max_samples=max_samples, seed=seed)
    data_config["reproducibility"]["command"] = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    # what a captured state is; speculators never reads this file back, so the key is ours to add
    data_config.setdefault("hidden_states", {})["layer_convention"] = CONVENTIONS[capture]
    log.info("%d samples, %d written now", counts["owned"], counts["todo"])
    shard_tf: str | None = None
    if sharded:
        shard_tf = shard_token_freq_name(shard_index, num_shards)
        write_json_atomic(output / shard_tf, {str(t): c for t, c in token_freq.items()})
    else:
        (output / DATA_CONFIG).write_text(json.dumps(data_config, indent=2))
        if token_freq is not None:
            if Path(token_freq_path).exists():  # type: ignore[arg-type]
                log.warning("%s exists: kept as it is, as speculators does (not recounted)", token_freq_path)
            else:
                Path(token_freq_path).parent.mkdir(parents=True, exist_ok=True)  # type: ignore[arg-type]
                torch.save(dict(token_freq), token_freq_path)
    found = eagle3_compat.status().found
    manifest = {
        "format": "speculators-eagle3-v1",
        "layout": LAYOUT,
        **settings,
        "complete": True,
        "trainer_checks": trainer_checks,
        "zip_crc32": zip_crc32,
        "layer_convention": CONVENTIONS[capture],
        "samples": counts["owned"],
        "first_index": start_idx,
        "written_this_run": counts["todo"],
        "dropped_by_preprocessing": dropped,
        "token_freq_path": None if token_freq_path is None else str(Path(token_freq_path).resolve()),
        "tokens_this_run": tokens,
        "seconds_this_run": round(time.perf_counter() - t0, 3),
        "versions": {
            "eagle3_compat": eagle3_compat.__version__,
            "vllm": found.vllm,
            "speculators": found.speculators,
            "torch": found.torch,
            "transformers": found.transformers,
        },
    }
    if replicas is not None:
        manifest["replicas"] = replicas
    if sharded:
        manifest.update(shard_index=shard_index, input_samples=counts["seen"], data_config=data_config,
                        token_freq_file=shard_tf)
    write_json_atomic(manifest_path, manifest)
    return manifest


class _LocalEngine:
    """One generator in this process: ``stream`` and ``data_config`` as
    :class:`eagle3_compat.replicas.RayReplicas` has them."""

    def __init__(self, model: str, gen_kwargs: dict[str, Any]) -> None:
        self._model, self._kwargs = model, gen_kwargs
        self._gen: Any = None

    def __enter__(self) -> _LocalEngine:
        from speculators.data_generation import VllmHiddenStatesGenerator  # noqa: PLC0415

        self._gen = VllmHiddenStatesGenerator(self._model, **self._kwargs)
        return self

    def __exit__(self, *exc: object) -> None:
        self._gen.close()

    @property
    def layer_ids(self) -> list[int]:
        return list(self._gen.layer_ids)

    def stream(self, prompts: Iterator[list[int]], max_in_flight: int) -> Iterator[tuple[int, dict[str, Any]]]:
        return self._gen.stream(prompts, max_in_flight=max_in_flight)

    def data_config(self, **kw: Any) -> dict[str, Any]:
        return data_config_dict(self._gen, **kw)


def _cache_dir(cache_dir: str | None) -> str:
    if cache_dir is None:
        from datasets import config as datasets_config  # noqa: PLC0415

        cache_dir = str(datasets_config.HF_DATASETS_CACHE)
    return str(cache_dir)


def data_config_dict(gen: Any, *, train_data_path: str, seq_length: int, cache_dir: str,
                     num_samples: int, max_samples: int | None, seed: int) -> dict[str, Any]:
    """``data_config.json``'s content through speculators' own
    ``DataGenerationConfig``, with the arguments its script passes
    (``save_config`` in ``scripts/data_generation_offline.py``, v0.3.0)."""
    from speculators.data_generation.config_generator import DataGenerationConfig  # noqa: PLC0415

    config = DataGenerationConfig.from_generator(
        generator=gen, train_data_path=train_data_path, seq_length=seq_length, cache_dir=cache_dir,
        num_samples=num_samples, max_samples=max_samples, seed=seed,
    )
    return config.to_dict()
