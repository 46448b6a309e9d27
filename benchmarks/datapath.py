#!/usr/bin/env python
"""Host transport of captured rows at real widths, through the real vLLM engine.

Synthetic rows of hidden 7168 x 4 layers in bfloat16 (Kimi-K2.5's shape),
1 GB and 2 GB per call, go from the rank-0 worker of a real vLLM engine to
the user's process, two ways, side by side in one run:

``before``
    the transport of eagle3_compat 0.1 (re-implemented here from its own
    ``wire.py``, removed since): every step's rows copied at the step
    (``.to("cpu", copy=True)``), at the end of the call concatenated per
    layer and turned into ``bytes``, sent as the ``collective_rpc`` reply
    (vLLM's msgpack over ZMQ), rebuilt in the driver with
    ``frombuffer(bytearray(...))`` and cut per prompt with ``torch.cat``;
``arena``
    the library's path: :class:`eagle3_compat.arena.ArenaPool` (shared
    memory), the worker's real per-step code (``_Call.process``: slicing,
    offload, writes at each row's place), the real ``e3c_take`` (metadata
    only), and the driver's real ``collect_results`` (checks, one mapping
    per prompt, finiteness);
``arena-staged``
    the same with the worker's staged path (``EAGLE3_COMPAT_DIRECT=0``):
    each step's rows attributed and written after the step, the library's
    path before its direct copies (on the CPU the rows are not copied
    twice either way; the difference is where the write happens);
``arena-fresh``
    the same with a new file for every call (``EAGLE3_COMPAT_ARENA_POOL_BYTES=0``:
    the library's path before its pool; ``arena`` reuses the file of the
    previous call, so its first run is the cold one);
``rpc``
    the library's fallback for a rank-0 worker on another host
    (``EAGLE3_COMPAT_TRANSPORT=rpc``: a safetensors payload in the reply).

The rows are made once per worker (random bf16, one [8192, 7168] tensor per
layer, the output of one full step) before timing; each call "runs" its
prompts as 8192-token chunked steps over them.  Timed: from the first step
to the results in the user's process, in runs of their own.  Memory, in
one more run per mode (the first, which for ``arena`` also makes the
file): the proportional set size (PSS: shared pages split between the
processes that map them) of the driver and vLLM's engine and worker
processes, sampled every 20 ms; the peak above the level before the call,
as a multiple of the captured bytes.

    python benchmarks/datapath.py              # 1 GB and 2 GB, 3 repeats (RESULTS.md)
    python benchmarks/datapath.py --quick      # 0.1 GB, one repeat

Run it inside a test environment (``.tox/vllm016/bin/python``).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
HIDDEN, LAYERS, STEP_TOKENS, PROMPT_LEN = 7168, 4, 8192, 2000
ROW_BYTES = HIDDEN * 2 * LAYERS

from eagle3_compat.worker import CaptureWorkerExtension  # noqa: E402


class BenchExtension(CaptureWorkerExtension):
    """The library's worker extension plus synthetic steps (runs in the worker)."""

    def bench_prepare(self) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        self._bench_rows = [torch.randn(STEP_TOKENS, HIDDEN, generator=g).bfloat16() for _ in range(LAYERS)]
        self._e3c_layer_ids = list(range(LAYERS))  # the synthetic shape, not the tiny model's
        self._e3c_slots = list(range(LAYERS))
        self._e3c_hidden, self._e3c_dtype = HIDDEN, "bfloat16"

    def _bench_steps(self, lengths: list[int]):
        """(req_ids, counts, positions, token_ids) of chunked 8192-token steps."""
        from eagle3_compat.capture import make_request_id

        todo = [[i, 0, n] for i, n in enumerate(lengths)]
        while todo:
            req, cnt, pos, left = [], [], [], STEP_TOKENS
            for t in todo:
                if not left:
                    break
                k = min(t[2] - t[1], left)
                req.append(make_request_id(self._bench_call, t[0]))
                cnt.append(k)
                pos += range(t[1], t[1] + k)
                t[1] += k
                left -= k
            todo = [t for t in todo if t[1] < t[2]]
            yield req, cnt, pos, [1] * len(pos)

    def bench_arena(self, call: int, lengths: list[int], spec: Any, direct: bool = True) -> Any:
        import torch

        from eagle3_compat.capture import StepLayout
        from eagle3_compat.worker import _Step

        self._bench_call = call
        self.e3c_arm(call, direct)
        armed = self.e3c_add(call, 0, [[i, n] for i, n in enumerate(lengths)], spec)
        state = self._e3c_call
        for req, cnt, pos, tok in self._bench_steps(lengths):
            n = len(pos)
            step = _Step(n, state)
            layout = StepLayout(tuple(req), tuple(cnt))
            off = self._e3c_offload
            step.positions = off.submit("positions", torch.tensor(pos), owned=True)
            step.token_ids = off.submit("token_ids", torch.tensor(tok), owned=True)
            state.plan(step, layout)  # the model's forward pre-hook (direct copies)
            for s, rows in enumerate(self._bench_rows):
                # the hook's rows: hidden + residual, a tensor the capture made
                step.capture(off, s, rows, True, HIDDEN, rows.dtype)
            off.run(lambda step=step, layout=layout: state.process(step, layout, list(range(LAYERS))))
        reply = self.e3c_take(call, 0)
        reply["armed"] = armed
        return reply

    def bench_before(self, call: int, lengths: list[int]) -> Any:
        import torch

        self._bench_call = call
        chunks: dict[int, list] = {}
        for req, cnt, pos, _tok in self._bench_steps(lengths):
            n = len(pos)
            step = [rows[:n].to("cpu", copy=True) for rows in self._bench_rows]
            start = 0
            for r, k in zip(req, cnt):
                index = int(r.split(":")[2])
                chunks.setdefault(index, []).append((pos[start : start + k], [h[start : start + k] for h in step]))
                start += k
        meta, parts, row = [], [[] for _ in range(LAYERS)], 0
        for index, cs in chunks.items():
            for positions, layers in cs:
                meta.append([index, positions, row])
                for j in range(LAYERS):
                    parts[j].append(layers[j])
                row += len(positions)
        wire = []
        for p in parts:
            t = torch.cat(p, 0).contiguous()
            wire.append(["bfloat16", list(t.shape), t.view(torch.uint8).numpy().tobytes()])
        return {"meta": meta, "layers": wire}


def _before_driver(reply: dict, lengths: list[int]) -> list[list[Any]]:
    import torch

    from eagle3_compat.generator import _all_finite

    layers = [torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(torch.bfloat16).reshape(shape)
              for _d, shape, raw in reply["layers"]]
    by_prompt: dict[int, list] = {}
    for index, positions, row in reply["meta"]:
        by_prompt.setdefault(index, []).append((positions[0], row, len(positions)))
    out = []
    for i, _n in enumerate(lengths):
        runs = sorted(by_prompt[i])
        per = [torch.cat([layers[j][r : r + k] for _p, r, k in runs], 0) for j in range(LAYERS)]
        assert all(_all_finite(t) for t in per)
        out.append(per)
    return out


def tree_pss() -> int:
    import psutil

    me = psutil.Process()
    total = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def measure(fn, memory: bool = True) -> tuple[float, int, Any]:
    """(seconds, peak PSS above the start, result).

    ``memory=False``: timed alone, no sampling (peak -1).  The sampler reads
    every process's page tables (PSS) every 20 ms, which takes a core of a
    2-core machine while GBs are mapped: timed runs leave it out."""
    import gc

    gc.collect()
    if not memory:
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, -1, out
    base = tree_pss()
    peak = [base]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], tree_pss())
            time.sleep(0.02)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    peak[0] = max(peak[0], tree_pss())  # the results, held
    stop.set()
    th.join()
    return dt, peak[0] - base, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-gb", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--modes", default="before,arena,arena-staged,arena-fresh,rpc",
                    help="comma-separated subset of before,arena,arena-staged,arena-fresh,rpc")
    args = ap.parse_args()
    if args.quick:
        args.sizes_gb, args.repeats = "0.1", 1
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(HERE))
    from vllm import LLM

    from eagle3_compat.arena import ArenaPool, layout_for
    from eagle3_compat.capture import make_request_id, merge_stage_captures, rank0_reply, stage_replies
    from eagle3_compat.generator import collect_results
    from eagle3_compat.testing import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="e3c-datapath-"))
    atexit.register(shutil.rmtree, work, True)
    model = make_tiny_model(work / "m", "llama")
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, compilation_config=0,
              max_model_len=1024, worker_extension_cls="datapath.BenchExtension", seed=0)
    llm.collective_rpc("e3c_setup", args=([0], "layer_output"))
    llm.collective_rpc("bench_prepare")
    call = [0]

    pools = {"arena": ArenaPool(), "arena-fresh": ArenaPool(keep_bytes=0)}

    def arena_mode(lengths, force_rpc=False, pool="arena", direct=True):
        def run():
            layout = layout_for(lengths, LAYERS, HIDDEN, "bfloat16")
            arena = None if force_rpc else pools[pool].lease(layout)
            spec = None if arena is None else arena.spec()
            captured = merge_stage_captures(
                stage_replies(llm.collective_rpc("bench_arena", args=(call[0], lengths, spec, direct))), list(range(LAYERS)))
            if arena is not None:
                arena.unlink()
            prompts = [[1] * n for n in lengths]
            out = collect_results(prompts, list(range(LAYERS)), layout, arena, captured, call[0])
            call[0] += 1
            return out
        return run

    def before_mode(lengths):
        def run():
            reply = rank0_reply(llm.collective_rpc("bench_before", args=(call[0], lengths)))
            call[0] += 1
            return _before_driver(reply, lengths)
        return run

    modes = {"before": before_mode, "arena": arena_mode,
             "arena-staged": lambda ls: arena_mode(ls, direct=False),
             "arena-fresh": lambda ls: arena_mode(ls, pool="arena-fresh"),
             "rpc": lambda ls: arena_mode(ls, True)}
    modes = {m: modes[m] for m in args.modes.split(",")}
    print(f"# vLLM engine (CPU, {os.cpu_count()} cores); rows {LAYERS} x [tokens, {HIDDEN}] bfloat16 "
          f"({ROW_BYTES} B/token), prompts of {PROMPT_LEN} tokens, steps of {STEP_TOKENS}")
    print("| GB/call | mode | s (median of timed runs) | GB/s | peak extra memory / captured (sampled run) "
          "| kept between calls / captured | runs |")
    print("|---|---|---|---|---|---|---|")
    for gb in (float(x) for x in args.sizes_gb.split(",")):
        tokens = int(gb * 1e9 / ROW_BYTES)
        lengths = [PROMPT_LEN] * (tokens // PROMPT_LEN) + ([tokens % PROMPT_LEN] if tokens % PROMPT_LEN else [])
        captured_bytes = sum(lengths) * ROW_BYTES
        rows: dict[str, list[tuple[float, int]]] = {m: [] for m in modes}
        names = list(modes)
        # run 0 of each mode: memory sampled (its time is listed, not counted);
        # runs 1..repeats: timed alone.  For "arena", run 0 also makes the file.
        for r in range(args.repeats + 1):
            for m in names[r % len(names):] + names[: r % len(names)]:
                dt, extra, out = measure(modes[m](lengths), memory=r == 0)
                assert [t.shape[0] for t in out[-1]] == [lengths[-1]] * LAYERS
                sample = out[len(out) // 2][LAYERS - 1]
                rows[m].append((dt, extra))
                rows[m + ":check"] = [float(sample.float().sum())]  # every mode: the same rows
                del out, sample
        sums = {rows[m + ":check"][0] for m in modes}
        assert len(sums) == 1, f"modes disagree on the rows: {sums}"
        for m in modes:
            t = statistics.median(x[0] for x in rows[m][1:])
            mem = rows[m][0][1] / captured_bytes
            runs = f"{rows[m][0][0]:.2f}s (sampled), " + ", ".join(f"{x[0]:.2f}s" for x in rows[m][1:])
            kept = pools[m].stats()["free_bytes"] / captured_bytes if m in pools else 0.0
            print(f"| {captured_bytes / 1e9:.2f} | {m} | {t:.2f} | {captured_bytes / t / 1e9:.2f} | {mem:.2f}x "
                  f"| {kept:.2f}x | {runs} |")
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
