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
    write): the device side alone;
``offload-shm``
    ``offload`` into the arena the worker really writes: a file in
    ``/dev/shm`` made by :class:`eagle3_compat.arena.DriverArena` (pages
    allocated up front) and mapped by :class:`eagle3_compat.arena.ShmSink`;
``offload-direct``
    :meth:`HostOffload.register` on that arena (``cudaHostRegister``) and
    :meth:`HostOffload.submit_into`: each captured tensor copied straight
    into its place on the side stream: no staging buffer, no second host
    copy (one place per step: the floor of the direct path);
``worker-staged``, ``worker-direct``
    the worker's two paths on steps of ``--prompt-tokens``-token prompts
    (64 per 8192-token step), with the worker's own pieces: a
    :class:`~eagle3_compat.capture.StepLayout` of request ids, the call's
    :class:`~eagle3_compat.capture.StepSlicer`, the arena in ``/dev/shm``
    (:class:`~eagle3_compat.arena.ShmSink`).  ``worker-staged``
    (``EAGLE3_COMPAT_DIRECT=0``): rows into pinned staging, then the writer
    thread slices the step by its positions and copies each prompt's run
    into the arena.  ``worker-direct`` (the default): the runs planned
    before the step (``plan_step``), each layer's rows copied straight into
    the prompts' places (``submit_runs``, the pool file registered once);
    the writer thread slices by the positions and checks the plan
    (``check_plan``);
``copy-only``
    the captured tensors' copies into pinned staging without the step's
    compute: the link's own time for a step's bytes (the floor of any
    offload at that step length).

Prints a table: ms per step (median over steps, every mode's wall time
including the final drain / synchronize divided by the steps), overhead
against ``none``, and GB/s moved.

    PYTHONPATH=src python benchmarks/offload_gpu.py [--tokens 8192] [--hidden 7168] [--shards 8]

``--shards N``: the worker-* modes copy tensor-parallel rank 0's share of
N ranks (each rank of a TP-N engine copies its own share over its own link).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eagle3_compat.arena import DriverArena, LocalSink, ShmSink, layout_for
from eagle3_compat.capture import StepLayout, StepSlicer, check_plan, clip_run, make_request_id, shard_rows
from eagle3_compat.offload import HostOffload


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--matmuls", type=int, default=7, help="matmuls per stand-in step")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ring", type=int, default=0,
                    help="arena of this many steps, reused in turn (0: one place per step, all fresh pages)")
    ap.add_argument("--arena-dir", default="/dev/shm")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt in the worker-* modes")
    ap.add_argument("--shards", type=int, default=1,
                    help="worker-* modes: copy the share of tensor-parallel rank 0 of this many ranks "
                         "(capture.shard_rows), as each rank does when the ranks share the copies")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch intra-op threads (0: torch's default; vLLM's GPU workers run with 1)")
    ap.add_argument("--modes", default=None, help="comma-separated subset of the modes")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dev = torch.device("cuda", 0)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    T, H, L = args.tokens, args.hidden, args.layers
    x0 = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    w = torch.randn(H, H, device=dev, dtype=torch.bfloat16) / H**0.5
    capture_at = sorted({round(i * (args.matmuls - 1) / max(L - 1, 1)) for i in range(L)})
    step_bytes = T * H * 2 * len(capture_at)
    # the arena of a call of `steps` steps, one prompt per step
    ring = args.ring or args.steps
    lengths = [T] * ring
    layout = layout_for(lengths, len(capture_at), H, "bfloat16")
    P = args.prompt_tokens
    if T % P:
        raise SystemExit("--tokens must be a multiple of --prompt-tokens")
    per_step = T // P
    # The worker-* modes: prompt i of step s is request e3c:0:<s * per_step + i>,
    # at place (s % ring) * per_step + i of one pool-like arena reused in turn.
    wlayout = layout_for([P] * (ring * per_step), len(capture_at), H, "bfloat16")
    positions = torch.arange(P, device=dev).repeat(per_step)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__} ({torch.get_num_threads()} threads); "
          f"step: {args.matmuls} matmuls "
          f"[{T}, {H}] bf16, captured {len(capture_at)} x [{T}, {H}] = {step_bytes / 1e9:.2f} GB/step; "
          f"arena {layout.total / 1e9:.1f} GB host")

    expected, x = [], x0
    for k in range(args.matmuls):
        x = x @ w
        if k in capture_at:
            expected.append(x.cpu())
    registrar = HostOffload(dev)  # register() only
    register_s: list[float] = []

    def open_sink(mode: str):
        """(sink, cleanup) for the modes that write an arena."""
        if mode.startswith("worker-"):
            arena = DriverArena(wlayout, directory=args.arena_dir)
            sink = ShmSink.open(arena.spec(), wlayout, torch.bfloat16, H)
            arena.unlink()
            assert not isinstance(sink, str), sink
            # a pool file the worker keeps: registered once, before the call
            unregister = registrar.register(sink.buf) if mode == "worker-direct" else (lambda: None)
            return sink, lambda: (unregister(), sink.close(), arena.discard())
        if mode == "offload":
            return LocalSink(layout, torch.bfloat16, H), lambda: None
        if mode in ("offload-shm", "offload-direct"):
            arena = DriverArena(layout, directory=args.arena_dir)
            sink = ShmSink.open(arena.spec(), layout, torch.bfloat16, H)
            arena.unlink()
            assert not isinstance(sink, str), sink
            if mode == "offload-direct":
                t0 = time.perf_counter()
                unregister = registrar.register(sink.buf)
                register_s.append((time.perf_counter() - t0) / (layout.total / 1e9))
                return sink, lambda: (unregister(), sink.close(), arena.discard())
            return sink, lambda: (sink.close(), arena.discard())
        return None, lambda: None

    def run_worker(mode: str) -> float:
        """The worker's staged or direct path over ``args.steps`` steps."""
        sink, cleanup = open_sink(mode)
        off = HostOffload(dev)
        slicer = StepSlicer(call=0, lengths={})
        direct = mode == "worker-direct"
        lo, hi = shard_rows(T, 0, args.shards)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in range(args.steps):
            ids = [s * per_step + i for i in range(per_step)]
            place = {g: (s % ring) * per_step + i for i, g in enumerate(ids)}
            for g in ids:
                slicer.lengths[g] = P  # type: ignore[index]  # e3c_add
            layout = StepLayout(tuple(make_request_id(0, g) for g in ids), (P,) * per_step)
            planned = slicer.plan_step(layout)  # the model's forward pre-hook
            targets = []  # and where each run goes (the worker's _Call.plan)
            if direct:
                for seg in planned:
                    part = clip_run(seg, lo, hi)
                    if part is not None:
                        targets.append((sink.rows(place[seg.index])[:, part[1] : part[1] + part[2]],
                                        part[0], part[2]))
            pos = off.submit("positions", positions)
            layers = []
            x = x0
            for k in range(args.matmuls):
                x = x @ w
                if k in capture_at:  # the layer hook
                    j = capture_at.index(k)
                    if direct:
                        layers.append(off.submit_runs([(dst[j], x[src : src + n]) for dst, src, n in targets]))
                    else:
                        layers.append(off.submit(j, x[lo:hi]))

            def process(layers=layers, pos=pos, layout=layout, planned=planned, ids=ids, place=place):
                rows = [st.wait() for st in layers]
                segs = slicer.slice_step(layout, pos.wait().tolist(), None, [T] * len(layers))
                check_plan(slicer.steps - 1, planned, segs)
                if not direct:
                    for seg in segs:
                        part = clip_run(seg, lo, hi)
                        if part is None:
                            continue
                        src, start, count = part
                        for j, r in enumerate(rows):
                            sink.write(place[seg.index], j, start, count, r[src - lo : src - lo + count])
                for st in (*layers, pos):
                    st.release()
                for g in ids:
                    slicer.forget(g)  # e3c_take

            off.run(process)
        off.drain()
        off.close()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        last = ((args.steps - 1) % ring) * per_step
        for j in range(len(capture_at)):
            got = torch.cat([sink.view(last + i, j) for i in range(per_step)])
            if not torch.equal(got[lo:hi], expected[j][lo:hi]):
                raise SystemExit(f"{mode}: arena rows of layer slot {j} differ from the device's")
        cleanup()
        return elapsed / args.steps

    def run(mode: str) -> float:
        if mode.startswith("worker-"):
            return run_worker(mode)
        sink, cleanup = open_sink(mode)
        off = HostOffload(dev) if mode.startswith("offload") or mode == "copy-only" else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in range(args.steps):
            x = x0
            staged = []
            if mode == "copy-only":
                staged = [off.submit(k, x0) for k in capture_at]
            for k in range(args.matmuls if mode != "copy-only" else 0):
                x = x @ w
                if k in capture_at:
                    if mode == "sync-pageable":
                        x.to("cpu", copy=True)
                    elif mode == "offload-direct":
                        staged.append(off.submit_into(sink.view(s % ring, capture_at.index(k)), x))
                    elif off is not None:
                        staged.append(off.submit(k, x))
            if off is not None:
                def write(staged=staged, s=s):
                    for j, st in enumerate(staged):
                        rows = st.wait()
                        if sink is not None and mode != "offload-direct":
                            sink.write(s % ring, j, 0, T, rows)
                        st.release()
                off.run(write)
        if off is not None:
            off.drain()
            off.close()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if sink is not None:  # the rows that arrived are the step's own
            last = (args.steps - 1) % ring
            for j in range(len(capture_at)):
                if not torch.equal(sink.view(last, j), expected[j]):
                    raise SystemExit(f"{mode}: arena rows of layer slot {j} differ from the device's")
        cleanup()
        return elapsed / args.steps

    modes = ["none", "sync-pageable", "offload-stage-only", "offload", "offload-shm",
             "offload-direct", "worker-staged", "worker-direct", "copy-only"]
    if args.modes:
        unknown = set(args.modes.split(",")) - set(modes)
        if unknown:
            raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {modes}")
        modes = ["none"] + [m for m in modes if m in args.modes.split(",") and m != "none"]
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
    if register_s:
        print(f"cudaHostRegister of the arena: {statistics.median(register_s):.3f} s/GB "
              f"(median of {len(register_s)})")
    registrar.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
