#!/usr/bin/env python
"""Device-to-host offload on a GPU, with the project's own code and plain torch (no vLLM).

A stand-in engine step (a chain of bf16 matmuls on [tokens, hidden]) runs
repeatedly; four of its intermediate results play the captured layers.
Modes, each over the same steps in the same process:

``none``
    the step alone (the baseline);
``sync-pageable``
    each captured tensor copied with ``.to("cpu", copy=True)`` inside the
    step (what the worker hook did before);
``offload``
    :class:`eagle3_compat.offload.HostOffload`: non-blocking copies into
    pinned staging on a side stream; the writer thread waits for each copy
    and writes the rows to a host arena (:class:`eagle3_compat.arena.LocalSink`)
    at their place, as the worker does;
``offload-stage-only``
    the same copies, the writer thread only waits for them (no arena
    write): the device side alone.

Prints a table: ms per step (median over steps, every mode's wall time
including the final drain / synchronize divided by the steps), overhead
against ``none``, and GB/s moved.

    PYTHONPATH=src python benchmarks/offload_gpu.py [--tokens 8192] [--hidden 7168]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eagle3_compat.arena import LocalSink, layout_for
from eagle3_compat.offload import HostOffload


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--matmuls", type=int, default=7, help="matmuls per stand-in step")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dev = torch.device("cuda", 0)
    T, H, L = args.tokens, args.hidden, args.layers
    x0 = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    w = torch.randn(H, H, device=dev, dtype=torch.bfloat16) / H**0.5
    capture_at = sorted({round(i * (args.matmuls - 1) / max(L - 1, 1)) for i in range(L)})
    step_bytes = T * H * 2 * len(capture_at)
    # the arena of a call of `steps` steps, one prompt per step
    lengths = [T] * args.steps
    layout = layout_for(lengths, len(capture_at), H, "bfloat16")
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}; step: {args.matmuls} matmuls "
          f"[{T}, {H}] bf16, captured {len(capture_at)} x [{T}, {H}] = {step_bytes / 1e9:.2f} GB/step; "
          f"arena {layout.total / 1e9:.1f} GB host")

    def run(mode: str) -> float:
        sink = LocalSink(layout, torch.bfloat16, H) if mode == "offload" else None
        off = HostOffload(dev) if mode.startswith("offload") else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in range(args.steps):
            x = x0
            staged = []
            for k in range(args.matmuls):
                x = x @ w
                if k in capture_at:
                    if mode == "sync-pageable":
                        x.to("cpu", copy=True)
                    elif off is not None:
                        staged.append(off.submit(k, x))
            if off is not None:
                def write(staged=staged, s=s):
                    for j, st in enumerate(staged):
                        rows = st.wait()
                        if sink is not None:
                            sink.write(s, j, 0, T, rows)
                        st.release()
                off.run(write)
        if off is not None:
            off.drain()
            off.close()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / args.steps

    modes = ["none", "sync-pageable", "offload-stage-only", "offload"]
    for m in modes:  # warm-up: allocator, pinned pools, cuBLAS
        run(m)
    results: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for m in modes[r % len(modes):] + modes[: r % len(modes)]:
            results[m].append(run(m))
    base = statistics.median(results["none"])
    print("| mode | ms/step | overhead vs none | GB/s captured |")
    print("|---|---|---|---|")
    for m in modes:
        t = statistics.median(results[m])
        gbs = "" if m == "none" else f"{step_bytes / t / 1e9:.1f}"
        print(f"| {m} | {t * 1e3:.2f} | {t / base - 1:+.1%} | {gbs} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
