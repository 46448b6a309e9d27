"""The main job: a JSONL of prompts in, speculators' training files out.

Output layout: one ``.pt`` file per sample in speculators 0.3.0's "v1"
format (what ``speculators.train.data.Eagle3SampleFileDataset`` reads):
``{"input_ids": LongTensor[T], "loss_mask": LongTensor[T], "hidden_states":
[Tensor[T, H] per layer id]}``, plus ``manifest.json``.

Resumable: sample ``i`` is written to ``sample_{i:09d}.pt`` through a
temporary file and an atomic rename, so a file either exists whole or not
at all; a rerun skips the samples whose files exist and computes the rest.
Each sample is validated (rows equal tokens, finite) before it is written.
"""

from __future__ import annotations

import gc
from collections import deque

import json
import os
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .logs import get_logger

__all__ = ["Sample", "read_jsonl", "run_generate", "sample_path"]

log = get_logger("eagle3_compat.dataset")
MANIFEST = "manifest.json"


@dataclass
class Sample:
    index: int
    input_ids: list[int]
    loss_mask: list[int]


def sample_path(out: Path, index: int) -> Path:
    return out / f"sample_{index:09d}.pt"


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
                    mask = rec.get("loss_mask") or [1] * len(ids)
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


# A sample is written to ".<name>.<writer pid>.tmp" and renamed into place
# whole; these two functions are the only places that know the pattern.
def _partial_path(path: Path, pid: int) -> Path:
    return path.with_name(f".{path.name}.{pid}.tmp")


def _partial_writer(tmp: Path) -> int | None:
    """The writing process of a partial sample file; None for any other file."""
    m = re.fullmatch(r"\.sample_\d+\.pt\.(\d+)\.tmp", tmp.name)
    return int(m.group(1)) if m else None


def _write_atomic(path: Path, obj: Any) -> None:
    import torch  # noqa: PLC0415

    tmp = _partial_path(path, os.getpid())
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_partials(output: Path) -> list[Path]:
    """Delete the temporary files (``.sample_*.pt.<pid>.tmp``) that a killed
    run left behind, i.e. those whose writing process is gone; returns them.
    A file is only ever renamed into place whole, so these are never samples."""
    removed = []
    for tmp in output.glob(".sample_*.tmp"):
        pid = _partial_writer(tmp)
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


def _check_same_settings(output: Path, settings: dict[str, Any]) -> None:
    path = output / MANIFEST
    if not path.exists():
        return
    old = json.loads(path.read_text())
    old.setdefault("capture", "layer_output")  # manifests written before the option existed
    diff = {k: {"folder": old[k], "now": v} for k, v in settings.items() if k in old and old[k] != v}
    if diff:
        raise ValueError(
            f"{output} holds samples made with other settings {diff}; resuming would mix them. "
            "Use a new --output folder or the original settings."
        )


GC_EVERY_BYTES = 1 << 30


class _Writer:
    """Writes samples on a thread, atomically, at most ``max_queued`` waiting.

    The engine goes on while a sample is written; the queue's bound keeps
    memory bounded when the disk is slower than extraction.  A failed write
    is raised at the next submit or at exit, never dropped.
    """

    def __init__(self, max_queued: int) -> None:
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="e3c-writer")
        self._queued: deque = deque()
        self._max = max(1, max_queued)
        self._since_gc = 0  # touched by the writer thread only

    def submit(self, path: Path, obj: dict[str, Any]) -> None:
        while len(self._queued) >= self._max:
            self._queued.popleft().result()
        self._queued.append(self._pool.submit(self._write, path, obj))

    def _write(self, path: Path, obj: dict[str, Any]) -> None:
        _write_atomic(path, obj)
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

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            while self._queued:
                self._queued.popleft().result()
        finally:
            self._pool.shutdown(wait=True)


def run_generate(
    model: str,
    input_path: Path,
    output: Path,
    layer_ids: list[int] | None,
    max_model_len: int,
    batch_size: int | None,
    tensor_parallel_size: int,
    dtype: str | None,
    capture: str = "layer_output",
    max_in_flight: int = 64,
) -> dict[str, Any]:
    """Write one v1 training file per input line; resumable; returns the manifest.

    A folder is tied to its settings (model, layer ids, capture point,
    max_model_len, dtype): resuming with different ones is an error, never a
    folder of mixed samples.

    The job streams: at most ``max_in_flight`` prompts are in the engine, a
    new one is admitted as soon as one finishes, and each sample is written
    (atomically, by a writer thread) as its request finishes.
    ``batch_size`` is accepted for compatibility and no longer used.
    """
    early = {"model": model, "capture": capture, "max_model_len": max_model_len, "dtype": dtype}
    if layer_ids is not None:
        early["layer_ids"] = list(layer_ids)
    # before torch, vLLM and the engine are loaded: a mismatch fails in a second
    _check_same_settings(output, early)

    import torch  # noqa: PLC0415

    import eagle3_compat  # noqa: PLC0415

    status = eagle3_compat.apply(dtype=dtype)
    if not status.applied:
        raise RuntimeError(f"eagle3_compat could not apply:\n{status}")
    from speculators.data_generation import VllmHiddenStatesGenerator  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    output.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(output)
    tokenizer = AutoTokenizer.from_pretrained(model)
    # Read, tokenize and extract as one stream: memory is bounded by the
    # prompts in flight and the writes queued, whatever the file's length.
    counts = {"seen": 0, "todo": 0}
    pending: dict[int, Sample] = {}

    def prompts() -> Iterator[list[int]]:
        for sample in read_jsonl(input_path, tokenizer, max_model_len - 1):
            counts["seen"] += 1
            if sample_path(output, sample.index).exists():
                continue
            pending[counts["todo"]] = sample
            counts["todo"] += 1
            yield sample.input_ids

    tokens = 0
    t0 = time.perf_counter()
    with VllmHiddenStatesGenerator(
        model, layer_ids=layer_ids, max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
        capture=capture,
    ) as gen:
        layer_ids = gen.layer_ids
        settings = {**early, "layer_ids": layer_ids}
        _check_same_settings(output, settings)
        (output / MANIFEST).write_text(json.dumps({**settings, "complete": False}, indent=1) + "\n")
        try:
            from tqdm import tqdm  # noqa: PLC0415

            bar = tqdm(unit="sample", desc="extracting")
        except ImportError:  # pragma: no cover
            bar = None
        with _Writer(max_queued=max_in_flight) as writer:
            for k, res in gen.stream(prompts(), max_in_flight=max_in_flight):
                sample = pending.pop(k)
                _validate(res, sample, layer_ids)
                n = len(res["input_ids"])  # may be truncated to max_model_len - 1
                writer.submit(
                    sample_path(output, sample.index),
                    {
                        "input_ids": res["input_ids"],
                        "loss_mask": torch.tensor(sample.loss_mask[:n], dtype=torch.long),
                        "hidden_states": res["hidden_states"],
                    },
                )
                del res
                tokens += n
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        if bar is not None:
            bar.close()
    log.info("%d samples, %d written now", counts["seen"], counts["todo"])
    found = eagle3_compat.status().found
    manifest = {
        "format": "speculators-eagle3-v1",
        **settings,
        "complete": True,
        "layer_convention": CONVENTIONS[capture],
        "samples": counts["seen"],
        "written_this_run": counts["todo"],
        "tokens_this_run": tokens,
        "seconds_this_run": round(time.perf_counter() - t0, 3),
        "max_model_len": max_model_len,
        "versions": {
            "eagle3_compat": eagle3_compat.__version__,
            "vllm": found.vllm,
            "speculators": found.speculators,
            "torch": found.torch,
            "transformers": found.transformers,
        },
    }
    (output / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
