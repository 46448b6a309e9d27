#!/usr/bin/env python
"""Host time the worker's capture spends per engine step (issue #16).

On CUDA the rows of a step go to the host by copies the GPU does on its
own, but the worker's Python still runs once per step on the host: the plan
(``StepSlicer.plan_step``, before the model), the layer hooks (one view of
the destination and one copy per run of rows and captured layer,
``HostOffload.submit_runs``), and the attribution after the step
(``StepSlicer.slice_step``, ``check_plan``, the runs' wire form).  vLLM's
step is partly bound by host time (scheduling, inputs, sampling), and the
hooks run inside the forward, so this time is on the step's path.  Shapes
of one full step: ``--tokens`` rows (8192) of ``--hidden`` (7168) x
``--layers`` (4) bfloat16, prompts of ``--prompt-tokens`` each (one run
per prompt and layer), into an arena of the call's prompts (page-locked on
CUDA, as the worker's kept pool file is).

    PYTHONPATH=src python benchmarks/host_cost.py                     # CUDA if present
    PYTHONPATH=src python benchmarks/host_cost.py --device cpu --hidden 1024

The script checks that every run's rows reached their place in the arena.

Runs without vLLM (plain torch), so it measures on a GPU machine where vLLM
cannot be installed.  Before/after figures: run it on two trees
(``PYTHONPATH=<old tree>/src``) on the same machine (RESULTS.md).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    import torch

    from eagle3_compat import arena
    from eagle3_compat.capture import StepLayout, StepSlicer, check_plan, clip_run, make_request_id
    from eagle3_compat.offload import HostOffload

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-tokens", default="128,512,2048")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.set_num_threads(1)  # as in vLLM's GPU workers
    T, H, L = args.tokens, args.hidden, args.layers
    xs = [torch.randn(T, H, device=dev).to(torch.bfloat16) for _ in range(L)]
    print(f"# {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}, torch {torch.__version__}; "
          f"a step of {T} tokens, {L} x [{T}, {H}] bf16 captured; ms of host time per step (median of "
          f"{args.steps - 5})")
    print("| prompt tokens | runs per layer | plan (+ places) | layer hooks (copies) | attribution | total |")
    print("|---|---|---|---|---|---|")
    for P in map(int, args.prompt_tokens.split(",")):
        per_step = T // P
        off = HostOffload(dev)
        layout = arena.layout_for([P] * per_step, L, H, "bfloat16")
        sink = arena.LocalSink(layout, torch.bfloat16, H)
        has_rows = hasattr(sink, "rows")
        unregister = off.register(sink.buf)
        positions = torch.arange(P, device=dev).repeat(per_step)
        token_ids = torch.randint(0, 1000, (T,), device=dev)
        slicer = StepSlicer(call=0, lengths={})
        times: list[tuple[float, float, float]] = []
        for s in range(args.steps):
            ids = [s * per_step + i for i in range(per_step)]
            for g in ids:
                slicer.lengths[g] = P  # type: ignore[index]
            step = StepLayout(tuple(make_request_id(0, g) for g in ids), (P,) * per_step)
            t0 = time.perf_counter()
            planned = slicer.plan_step(step)
            if has_rows:  # the worker's _Call.plan: each run's place, once for the step
                targets = []
                for seg in planned:
                    src, start, count = clip_run(seg, 0, T)  # type: ignore[misc]
                    targets.append((sink.rows(seg.index - s * per_step)[:, start : start + count], src, count))
            t1 = time.perf_counter()
            staged = []
            for j in range(L):  # the worker's _Step.capture, per layer hook
                if has_rows:
                    pairs = [(dst[j], xs[j][src : src + count]) for dst, src, count in targets]
                else:  # a tree before Sink.rows (the before figures): a view made per run and layer
                    pairs = []
                    for seg in planned:
                        src, start, count = clip_run(seg, 0, T)  # type: ignore[misc]
                        pairs.append((sink.view(seg.index - s * per_step, j)[start : start + count],
                                      xs[j][src : src + count]))
                staged.append(off.submit_runs(pairs))
            t2 = time.perf_counter()
            pos, tok = positions.cpu().tolist(), token_ids.cpu().tolist()  # waits for the copies too
            t3 = time.perf_counter()
            segs = slicer.slice_step(step, pos, tok, [T] * L)
            check_plan(slicer.steps - 1, planned, segs)
            [seg.to_wire() for seg in segs]
            for g in ids:
                slicer.forget(g)
            t4 = time.perf_counter()
            for st in staged:
                st.wait()
            if s >= 5:
                times.append((t1 - t0, t2 - t1, t4 - t3))
        for i in range(per_step):  # the copies put each run where it belongs
            for j in range(L):
                got = sink.rows(i)[j] if has_rows else sink.view(i, j)
                if not torch.equal(got.cpu(), xs[j][i * P : (i + 1) * P].cpu()):
                    raise SystemExit(f"prompt tokens {P}: prompt {i}, layer slot {j}: arena rows differ")
        med = [statistics.median(t[k] for t in times) * 1e3 for k in range(3)]
        print(f"| {P} | {per_step} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} | {sum(med):.2f} |")
        unregister()
        off.close()


if __name__ == "__main__":
    main()
