#!/usr/bin/env python
"""The CLI writer's CPU per GiB saved: its garbage collections (with and
without the job's freeze) and the zip CRC-32 of ``torch.save``.

The CLI job's writer (``eagle3_compat.dataset._Writer``) runs a full
``gc.collect()`` per GiB it saves (torch 2.8's ``torch.save`` leaves a
reference cycle around each saved storage, which only the cyclic collector
frees).  A full collection traverses every tracked object of the process,
and the job's process holds vLLM's, speculators' and a tokenizer's.  Since
2026-12-04 the writer freezes what exists when the job starts
(``gc.freeze``), so a collection sees only the job's own objects.

This loads what the job's process loads (vLLM, speculators, transformers
and a tokenizer: ``--no-imports`` skips that), then in the same process
writes the same samples through the writer three times a round,
alternately: ``now`` (as shipped: the freeze, no CRC-32), ``CRC-32`` (the
writer with ``zip_crc32=True``, as before 2026-12-05 and as ``--zip-crc32``
gives) and ``no freeze, CRC-32`` (as before 2026-12-04: the freeze skipped;
the writer leaves the collector alone where the process froze objects
itself, so that baseline is made by reporting a freeze that is not there).
Since 2026-12-05 the writer skips the CRC-32 of the zip records, which
``torch.load`` never checks.  The samples' states are taken in turn
from a pool of ``--pool-gib`` of distinct tensors (more than this CPU's
last-level cache, as a job's states are new each time; re-saving one
sample's states from the cache hides most of the CRC's cost).  Samples of
``--tokens`` tokens x ``--layers`` layers x ``--hidden`` bfloat16 go to a
temporary folder (removed at the end).  Prints the writer's CPU seconds
per GiB saved, and a full collection's time with and without the freeze.

    PYTHONPATH=src .tox/vllm016/bin/python benchmarks/writer_gc.py [--gib 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=3.0, help="GiB saved per run (one collection per GiB)")
    ap.add_argument("--tokens", type=int, default=77)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pool-gib", type=float, default=1.5, help="distinct states the samples cycle through")
    ap.add_argument("--no-imports", action="store_true", help="a bare process (torch only)")
    args = ap.parse_args()

    import torch

    if not args.no_imports:
        import speculators.data_generation  # noqa: F401
        import transformers
        import vllm  # noqa: F401

        from eagle3_compat.testing import make_tiny_model

        tok_dir = Path(tempfile.mkdtemp(prefix="e3c-writer-gc-tok-"))
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(make_tiny_model(tok_dir / "m", "llama"))
        finally:
            shutil.rmtree(tok_dir, ignore_errors=True)
    from eagle3_compat import dataset

    torch.set_num_threads(1)
    per_sample = args.tokens * args.hidden * args.layers * 2
    pool = [[torch.randn(args.tokens, args.hidden).to(torch.bfloat16) for _ in range(args.layers)]
            for _ in range(max(1, int(args.pool_gib * 2**30 // per_sample)))]
    n = max(1, int(args.gib * 2**30 // per_sample))

    def collect_ms() -> float:
        t0 = time.perf_counter()
        gc.collect()
        return (time.perf_counter() - t0) * 1e3

    def run(freeze: bool, crc: bool) -> float:
        out = Path(tempfile.mkdtemp(prefix="e3c-writer-gc-"))
        try:
            patch = mock.patch.object(dataset.gc, "get_freeze_count", return_value=0 if freeze else 1)
            c0 = time.process_time()
            with patch, dataset._Writer(max_queued=8, zip_crc32=crc) as w:
                for i in range(n):
                    path = dataset.data_path(out, i)
                    w.expect(path)
                    w.submit(path, {"input_ids": torch.arange(args.tokens), "hidden_states": list(pool[i % len(pool)]),
                                    "loss_mask": torch.ones(args.tokens, dtype=torch.long)})
            return (time.process_time() - c0) / (n * per_sample / 2**30)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    objects = len(gc.get_objects())
    if not args.no_imports:
        del tokenizer
    full = statistics.median(collect_ms() for _ in range(3))
    gc.freeze()
    frozen = statistics.median(collect_ms() for _ in range(3))
    gc.unfreeze()
    print(f"# {objects} tracked objects in this process; {n} samples of {per_sample / 2**20:.2f} MiB a run, "
          f"from {len(pool)} distinct ones ({args.pool_gib} GiB) "
          f"({args.gib} GiB: {int(n * per_sample // dataset.GC_EVERY_BYTES)} collections)")
    print(f"# a full gc.collect(): {full:.1f} ms; with those objects frozen: {frozen:.1f} ms")
    variants = {"now (freeze, no CRC-32)": (True, False), "CRC-32 (before 2026-12-05)": (True, True),
                "no freeze, CRC-32 (before 2026-12-04)": (False, True)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (freeze, crc) in variants.items():
            times[name].append(run(freeze, crc))
    base = statistics.median(times["no freeze, CRC-32 (before 2026-12-04)"])
    print("| writer | CPU s per GiB saved (median) | runs | /before |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.3f} | {', '.join(f'{t:.3f}' for t in ts)} | {med / base:.2f} |")


if __name__ == "__main__":
    main()
