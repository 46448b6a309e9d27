#!/usr/bin/env python
"""Throughput of ``eagle3-compat generate --replicas N`` (Ray actors) on this machine.

Modes, each a fresh ``eagle3-compat generate`` process on the same JSONL
input (a tiny Llama made here, float32):

``local``
    one engine in the job's own process (no Ray);
``ray1``
    ``--replicas 1``: one engine in a Ray actor (a local Ray cluster);
``ray2``
    ``--replicas 2``: two engines in two actors, sharing the machine.

Throughput is measured on the files as they appear (their modification
times): tokens of every sample but the first, over the time from the first
file to the last, so the engines' start does not count.  The target of
issue #18: ray2 >= 0.9 x ray1 on this 2-core machine (two replicas must not
lose throughput to each other); on a machine with more cores, or GPUs, more
replicas add throughput.  The machine's load average is printed: other jobs
on the same cores change the numbers.

    python benchmarks/replicas.py                  # RESULTS.md
    python benchmarks/replicas.py --samples 40 --quick

Run it inside the vllm016 test environment (``.tox/vllm016/bin/python``,
which has Ray).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 390) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _run(mode: str, model: Path, inp: Path, out: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "eagle3_compat", "generate", "--model", str(model), "--input", str(inp),
           "--output", str(out), "--max-model-len", str(args.max_model_len), "--dtype", "float32",
           "--layer-ids", "0,2,4,5", "--max-in-flight", str(args.max_in_flight)]
    if mode.startswith("ray"):
        cmd += ["--replicas", mode[3:], "--chunk-size", str(args.chunk_size)]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    files = sorted(out.glob("data_*.pt"), key=lambda p: p.stat().st_mtime_ns)
    import torch

    tokens = [len(torch.load(p, weights_only=True)["input_ids"]) for p in files]
    span = (files[-1].stat().st_mtime_ns - files[0].stat().st_mtime_ns) / 1e9
    return {"mode": mode, "samples": len(files), "tokens": sum(tokens), "span_s": span,
            "tok_s": sum(tokens[1:]) / span if span > 0 else float("nan"), "wall_s": wall,
            "load_before": load0, "load_after": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=240)
    ap.add_argument("--min-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=1000)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-in-flight", type=int, default=16)
    ap.add_argument("--chunk-size", type=int, default=8)
    ap.add_argument("--modes", default="ray1,ray2,local")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a small model and few samples (a smoke run)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.quick:
        args.samples, args.max_tokens = min(args.samples, 40), min(args.max_tokens, 200)
        args.min_tokens = min(args.min_tokens, 20)
    from eagle3_compat.testing import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory(prefix="e3c-replicas-bench-") as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "llama", "llama")
        inp = root / "in.jsonl"
        limit = args.max_model_len - 1
        inp.write_text("".join(json.dumps(p[:limit]) + "\n"
                               for p in _prompts(args.samples, args.min_tokens, args.max_tokens)))
        for rep in range(args.repeats):
            for mode in args.modes.split(","):
                row = _run(mode, model, inp, root / f"out-{mode}-{rep}", args)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"| mode | samples | tokens | span s | tok/s | wall s | load avg before/after |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['samples']} | {r['tokens']} | {r['span_s']:.1f} | {r['tok_s']:.0f} | "
              f"{r['wall_s']:.0f} | {r['load_before']:.1f} / {r['load_after']:.1f} |")
    by = {}
    for r in rows:
        by.setdefault(r["mode"], []).append(r["tok_s"])
    if "ray1" in by and "ray2" in by:
        best1, best2 = max(by["ray1"]), max(by["ray2"])
        print(f"\nray2 / ray1 (best of {args.repeats}): {best2 / best1:.2f} (target >= 0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
