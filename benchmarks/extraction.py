#!/usr/bin/env python
"""Extraction throughput and memory: eagle3_compat vs plain vLLM prefill vs speculators 0.4.0.

For each workload (tiny model size x tensor parallel size) and the same
prompts, three modes run, each in a fresh process:

1. ``prefill``: plain vLLM, ``LLM.generate(max_tokens=1)``, prefix caching
   off, the same token budget and ``max_num_seqs`` as the generator: the
   ceiling.
2. ``compat``: speculators 0.3.0's generator through eagle3_compat.
3. ``spec040``: speculators 0.4.0's own generator (installed with
   ``pip --target`` into ``$E3C_SPEC040`` so both versions can be imported,
   each in its own process).  Failures are reported as results.

speculators 0.4.0 on a machine without CUDA: it sizes its KV cache from
``torch.cuda.mem_get_info()`` (through ``speculators.utils.util.mem_get_info``),
which raises "Found no NVIDIA driver" on a CUDA build of torch without a
GPU.  When CUDA is unavailable the ``spec040`` child installs a
BENCHMARK-ONLY shim (:func:`_spec040_cpu_shim`) that answers that query so
that speculators' KV-cache budget (``free * gpu_memory_utilization * 0.2``)
equals ``VLLM_CPU_KVCACHE_SPACE`` GiB, the budget the two other modes get;
nothing else of 0.4.0 is changed.  0.4.0 cannot finish a call with more than
``max_num_seqs`` (32) prompts (the 33rd request is never scheduled and the
call raises "Request ... not found in captured states"), so its calls are
split into sub-calls of at most 32 prompts; the child also records, untimed
and after the timed calls, what a 33-prompt call does (``probe_33``).

The prompts are split into ``--calls`` consecutive calls; memory (resident
set of the process tree: the driver and vLLM's engine and worker
processes) is read after each call.  With ``--repeats R`` every workload runs
each mode R times, the order of the modes rotated from round to round so
that background load does not always hit the same mode; the table shows the
median throughput, the largest peak RSS and the largest RSS growth.

Prints a markdown table with prompt tokens/s, the ratios compat/prefill and
compat/spec040, peak RSS and the RSS growth from the first to the last call.

    python benchmarks/extraction.py               # the full set (see RESULTS.md)
    python benchmarks/extraction.py --quick       # a tiny smoke run

Run it inside a test environment (``.tox/vllm016/bin/python``), on CPU or CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_NUM_SEQS = 32
MAX_MODEL_LEN = 2048
SIZES = {"h256-l6": (256, 6), "h1024-l12": (1024, 12)}
# speculators 0.4.0's KV-cache budget: free * gpu_memory_utilization * CACHE_MEMORY_FRACTION
SPEC040_GPU_MEMORY_UTILIZATION = 0.8
SPEC040_CACHE_MEMORY_FRACTION = 0.2


def prompts_for(total_tokens: int, seed: int = 0) -> list[list[int]]:
    """A realistic length mix: log-normal lengths (median ~300, 16..2000)."""
    rng = random.Random(seed)
    out, n = [], 0
    while n < total_tokens:
        length = int(min(MAX_MODEL_LEN - 1, max(16, rng.lognormvariate(5.7, 0.9))))
        out.append([rng.randrange(4, 400) for _ in range(length)])
        n += length
    return out


def tree_rss() -> int:
    import psutil

    me = psutil.Process()
    total = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def _spec040_cpu_shim() -> str | None:
    """BENCHMARK-ONLY: let speculators 0.4.0 size its KV cache without CUDA.

    0.4.0 calls ``mem_get_info()`` (CUDA's free/total device memory) once in
    ``__init__``; on a CPU-only machine that raises.  The answer given here
    makes its budget equal to ``VLLM_CPU_KVCACHE_SPACE`` GiB, what vLLM gives
    the other two modes.  Returns a description, or None if no shim was needed.
    """
    import torch

    if torch.cuda.is_available():
        return None
    import speculators.data_generation.vllm_hidden_states_generator as vhsg

    kv_bytes = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")) * 2**30
    fake_free = int(kv_bytes / (SPEC040_GPU_MEMORY_UTILIZATION * SPEC040_CACHE_MEMORY_FRACTION)) + 1

    def mem_get_info() -> tuple[int, int]:
        return fake_free, fake_free

    vhsg.mem_get_info = mem_get_info
    return (f"benchmark-only shim: mem_get_info() answered on CPU so that the KV cache is "
            f"{kv_bytes / 2**30:g} GiB (VLLM_CPU_KVCACHE_SPACE)")


def _old_finite_check() -> str:
    """BENCHMARK-ONLY (mode ``compat-oldcheck``): the finiteness check before the fix.

    eagle3_compat's driver used to check every result tensor with
    ``torch.isfinite(t).all()`` (one elementwise pass per prompt and layer,
    slow for bfloat16 on CPU; RESULTS.md, "Profile").  It now sums in float32
    first (``eagle3_compat.generator._all_finite``).  This mode puts the old
    check back, by wrapping ``eagle3_compat.generator.assemble``, so the
    before/after can be reproduced; everything else is unchanged.
    """
    import torch

    import eagle3_compat.generator as g

    original = g.assemble

    def assemble(*args, **kwargs):
        kwargs["check_finite"] = lambda t: bool(torch.isfinite(t).all())
        return original(*args, **kwargs)

    g.assemble = assemble
    return "compat-oldcheck: compat with the pre-fix elementwise finiteness check (benchmark-only)"


def _order_errors(batch: list[list[int]], out: list[dict]) -> int:
    """How many results are not for the prompt at the same index (or have wrong row counts)."""
    bad = 0
    for ids, r in zip(batch, out):
        got = r["input_ids"].tolist()
        if got != ids or any(h.shape[0] != len(ids) for h in r["hidden_states"]):
            bad += 1
    return bad + abs(len(batch) - len(out))


def child(mode: str, model: str, tp: int, prompts_file: str, calls: int, layer_ids: list[int]) -> dict:
    """Runs in its own process; returns the measurements as a dict."""
    prompts = json.loads(Path(prompts_file).read_text())
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], tree_rss())
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()
    chunks = [prompts[i::calls] for i in range(calls)]
    notes: list[str] = []
    order_errors = 0
    gen = None
    t_start = time.perf_counter()
    if mode == "prefill":
        from vllm import LLM, SamplingParams

        from eagle3_compat.cpu_attention import engine_kwargs  # the generator's block size on this CPU build

        llm = LLM(model=model, dtype="auto", enforce_eager=True, compilation_config=0,
                  max_model_len=MAX_MODEL_LEN, tensor_parallel_size=tp, max_num_seqs=MAX_NUM_SEQS,
                  max_num_batched_tokens=max(8192, MAX_MODEL_LEN), enable_prefix_caching=False, seed=0,
                  **engine_kwargs(None, model))
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

        def run(batch):
            llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            return None
    else:
        if mode in ("compat", "compat-oldcheck"):
            import eagle3_compat

            eagle3_compat.apply()
            if mode == "compat-oldcheck":
                notes.append(_old_finite_check())
        from speculators.data_generation import VllmHiddenStatesGenerator

        if mode == "spec040":
            shim = _spec040_cpu_shim()
            if shim:
                notes.append(shim)
        gen = VllmHiddenStatesGenerator(model, layer_ids=layer_ids, max_model_len=MAX_MODEL_LEN,
                                        tensor_parallel_size=tp)

        if mode == "spec040":
            def run(batch):
                # 0.4.0 cannot finish a call of more than max_num_seqs prompts.
                out = []
                for i in range(0, len(batch), MAX_NUM_SEQS):
                    out.extend(gen.generate(batch[i : i + MAX_NUM_SEQS]))
                return out

            if max(map(len, chunks)) > MAX_NUM_SEQS:
                notes.append(f"calls split into sub-calls of <= {MAX_NUM_SEQS} prompts")
        else:
            run = gen.generate
    startup = time.perf_counter() - t_start
    after, per_call = [], []
    for batch in chunks:
        t0 = time.perf_counter()
        out = run(batch)
        per_call.append(time.perf_counter() - t0)
        if out is not None:  # untimed: are the results in prompt order?
            order_errors += _order_errors(batch, out)
        del out
        after.append(tree_rss())
    probe = None
    if mode == "spec040":  # untimed, after the measurements: a call of 33 short prompts
        try:
            gen.generate([[5 + i % 300] * 16 for i in range(MAX_NUM_SEQS + 1)])
            probe = "ok"
        except Exception as exc:  # noqa: BLE001 - the failure is the result
            probe = f"{type(exc).__name__}: {str(exc)[:90]}"
    stop.set()
    tokens = sum(map(len, prompts))
    t_total = sum(per_call)
    return {"tokens": tokens, "prompts": len(prompts), "seconds": t_total, "tok_s": tokens / t_total,
            "startup_s": startup, "per_call_s": per_call, "peak_rss": peak[0], "rss_after_calls": after,
            "order_errors": order_errors if mode != "prefill" else None, "probe_33": probe,
            "notes": notes}


def run_mode(mode: str, model: str, tp: int, prompts_file: str, calls: int, layer_ids: list[int]) -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if tp > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
    if mode == "spec040":
        target = env.get("E3C_SPEC040", str(Path(tempfile.gettempdir()) / "e3c-speculators-0.4.0"))
        if not (Path(target) / "speculators").exists():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target,
                            "speculators==0.4.0"], check=True)
        env["PYTHONPATH"] = target + os.pathsep + env.get("PYTHONPATH", "")
    code = (
        "import json, sys; sys.path.insert(0, %r)\n"
        "from extraction import child\n"
        "if __name__ == '__main__':\n"
        "    print('RESULT' + json.dumps(child(*json.loads(sys.argv[1]))))\n" % str(HERE)
    )
    args = json.dumps([mode, model, tp, prompts_file, calls, layer_ids])
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, args], capture_output=True, text=True, env=env,
                          timeout=3600)
    wall = time.perf_counter() - t0
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return {"error": (err[-1] if err else f"exit {proc.returncode}")[:160], "wall_s": wall}
    res = json.loads(line[len("RESULT"):])
    res["wall_s"] = wall
    res["load_avg_1m"] = os.getloadavg()[0]
    return res


def summarize(runs: list[dict]) -> dict:
    """Median throughput over the repeats; worst peak RSS and RSS growth."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"]}
    growth = [(r["rss_after_calls"][-1] - r["rss_after_calls"][0]) / r["rss_after_calls"][0] for r in ok]
    return {
        "tokens": ok[0]["tokens"],
        "tok_s": statistics.median(r["tok_s"] for r in ok),
        "tok_s_runs": [r["tok_s"] for r in ok],
        "failed_runs": len(runs) - len(ok),
        "peak_rss": max(r["peak_rss"] for r in ok),
        "growth": max(growth),
        "order_errors": ok[0]["order_errors"],
        "probe_33": ok[0]["probe_33"],
        "notes": ok[0]["notes"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (one model, TP 1, ~3k tokens)")
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma list of {', '.join(SIZES)}")
    ap.add_argument("--tokens", type=int, default=100_000, help="prompt tokens per workload")
    ap.add_argument("--tokens-large", type=int, default=None,
                    help="prompt tokens for h1024-l12 (default: --tokens; a prefix of the same prompts)")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--modes", default="prefill,compat,spec040")
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode (median reported)")
    ap.add_argument("--json", help="also write every run's raw measurements here")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent / "src"))
    from eagle3_compat.testing import make_tiny_model

    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"unknown size(s) {unknown}")
    tps = [int(t) for t in args.tp.split(",")]
    tokens, calls, repeats = args.tokens, args.calls, args.repeats
    if args.quick:
        sizes, tps, tokens, calls, repeats = sizes[:1], [1], 3000, 3, 1
    modes = args.modes.split(",")
    rows, raw = [], []
    with tempfile.TemporaryDirectory(prefix="e3c-bench-") as tmp:
        for name in sizes:
            hidden, layers = SIZES[name]
            n_tokens = args.tokens_large if (name == "h1024-l12" and args.tokens_large) else tokens
            prompts_file = str(Path(tmp) / f"prompts-{n_tokens}.json")
            if not Path(prompts_file).exists():
                Path(prompts_file).write_text(json.dumps(prompts_for(n_tokens)))
            model = str(make_tiny_model(Path(tmp) / name, "llama", layers=layers, hidden=hidden))
            layer_ids = list(dict.fromkeys([2, layers // 2, layers - 3, layers - 1]))
            for tp in tps:
                runs: dict[str, list[dict]] = {m: [] for m in modes}
                for rnd in range(repeats):
                    order = modes[rnd % len(modes):] + modes[: rnd % len(modes)]
                    for m in order:
                        r = run_mode(m, model, tp, prompts_file, calls, layer_ids)
                        runs[m].append(r)
                        raw.append({"size": name, "tp": tp, "mode": m, "round": rnd, **r})
                        brief = r.get("error") or f"{r['tok_s']:.0f} tok/s, load {r['load_avg_1m']:.1f}"
                        print(f"# {name} tp={tp} round {rnd} {m}: {brief}", file=sys.stderr, flush=True)
                rows.append((name, tp, n_tokens, {m: summarize(rs) for m, rs in runs.items()}))
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; "
          f"{calls} calls per run, {repeats} run(s) per mode, median tok/s\n")
    print("| model | TP | mode | prompt tokens | tok/s | compat/prefill | compat/spec040 | peak RSS MB "
          "| RSS growth first->last call | tok/s per run |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    notes: list[str] = []
    for name, tp, n_tokens, res in rows:
        comp = res.get("compat", {})
        for mode, r in res.items():
            if "error" in r:
                print(f"| {name} | {tp} | {mode} | {n_tokens} | failed: {r['error']} | | | | | |")
                continue
            ratio1 = ratio3 = ""
            if mode == "compat":
                if "tok_s" in res.get("prefill", {}):
                    ratio1 = f"{comp['tok_s'] / res['prefill']['tok_s']:.2f}"
                if "tok_s" in res.get("spec040", {}):
                    ratio3 = f"{comp['tok_s'] / res['spec040']['tok_s']:.2f}"
            per_run = ", ".join(f"{x:.0f}" for x in r["tok_s_runs"])
            if r["failed_runs"]:
                per_run += f" ({r['failed_runs']} failed)"
            print(f"| {name} | {tp} | {mode} | {r['tokens']} | {r['tok_s']:.0f} | {ratio1} | {ratio3} | "
                  f"{r['peak_rss'] / 2**20:.0f} | {r['growth']:+.1%} | {per_run} |")
            for n in r["notes"]:
                if n not in notes:
                    notes.append(n)
            if r["order_errors"]:
                msg = (f"{mode}: results not in prompt order (or wrong row counts) "
                       f"for {r['order_errors']} prompt(s) per run")
                if msg not in notes:
                    notes.append(msg)
            if r["probe_33"] and f"{mode} probe" not in " ".join(notes):
                notes.append(f"{mode} probe, one call of 33 prompts: {r['probe_33']}")
    if notes:
        print()
        for n in notes:
            print(f"* {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
