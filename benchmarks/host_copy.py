#!/usr/bin/env python
"""The offload's second hop on the host: pinned staging -> the call's arena.

On CUDA the worker copies each step's captured rows into pinned staging
buffers on a side stream; a writer thread then copies them into the call's
shared-memory arena (``benchmarks/RESULTS.md``, "GPU": at an 8 ms step of
4 x [8192, 7168] bf16 that thread, at 16-26 GB/s, is what holds the step
back; the link itself moves 55 GB/s).  This measures that host copy alone,
with plain torch, in the ways the writer could do it:

``one``
    each layer's rows with one ``copy_`` (torch's own intra-op threads, as
    many as ``--torch-threads``);
``segments``
    each layer's rows in segments of ``--segment`` rows (one per prompt of
    the step, as the writer copies them), one ``copy_`` each;
``pool-N``
    the segments of the step spread over N threads (``copy_`` releases the GIL).

The destination is a file in ``/dev/shm`` mapped like the worker maps the
arena, written twice first (warm pages, as with the arena pool).  Prints
GB/s per mode (median of ``--repeats``).

    PYTHONPATH=src python benchmarks/host_copy.py [--tokens 8192] [--hidden 7168] [--layers 4]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--segment", type=int, default=128, help="rows per prompt segment")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--torch-threads", default="1,4", help="intra-op threads for 'one'")
    ap.add_argument("--pools", default="2,4,8")
    args = ap.parse_args()
    pin = torch.cuda.is_available()
    src = [torch.randn(args.tokens, args.hidden).to(torch.bfloat16) for _ in range(args.layers)]
    if pin:
        src = [s.pin_memory() for s in src]
    per_layer = args.tokens * args.hidden * 2
    nbytes = per_layer * args.layers
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="e3c-hostcopy-")
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
        buf = torch.frombuffer(mm, dtype=torch.uint8)
        dst = [buf[j * per_layer:(j + 1) * per_layer].view(torch.bfloat16).view(args.tokens, args.hidden)
               for j in range(args.layers)]
        segs = [(j, a, min(a + args.segment, args.tokens))
                for j in range(args.layers) for a in range(0, args.tokens, args.segment)]

        def copy_segs(part):
            for j, a, b in part:
                dst[j][a:b].copy_(src[j][a:b])

        modes = {}
        for t in (int(x) for x in args.torch_threads.split(",")):
            modes[f"one (torch threads {t})"] = (t, lambda: [d.copy_(s) for d, s in zip(dst, src)])
        modes["segments (torch threads 1)"] = (1, lambda: copy_segs(segs))
        pools = {}
        for n in (int(x) for x in args.pools.split(",")):
            pools[n] = ThreadPoolExecutor(max_workers=n)

            def pooled(n=n):
                parts = [segs[k::n] for k in range(n)]
                list(pools[n].map(copy_segs, parts))

            modes[f"pool-{n} (segments over {n} threads)"] = (1, pooled)
        print(f"# {args.layers} x [{args.tokens}, {args.hidden}] bf16 = {nbytes / 1e9:.2f} GB per step; "
              f"source {'pinned' if pin else 'pageable'}; destination /dev/shm (warm); "
              f"{os.cpu_count()} cores; torch {torch.__version__}")
        print("| mode | ms per step | GB/s |")
        print("|---|---|---|")
        for name, (threads, fn) in modes.items():
            torch.set_num_threads(threads)
            fn()
            fn()  # warm pages
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            assert all(torch.equal(d, s) for d, s in zip(dst, src))
            print(f"| {name} | {med * 1e3:.2f} | {nbytes / med / 1e9:.1f} |", flush=True)
        for p in pools.values():
            p.shutdown()
        del dst, buf
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
