#!/usr/bin/env python
"""Extraction throughput and memory: eagle3_compat vs plain vLLM prefill vs speculators 0.4.0.

For each workload (tiny model size x tensor parallel size) and the same
prompts, three modes run one after another, each in a fresh process:

1. ``prefill``: plain vLLM, ``LLM.generate(max_tokens=1)``, prefix caching
   off, the same token budget and ``max_num_seqs`` as the generator: the
   ceiling.
2. ``compat``: speculators 0.3.0's generator through eagle3_compat.
3. ``spec040``: speculators 0.4.0's own generator (installed with
   ``pip --target`` into ``$E3C_SPEC040`` so both versions can be imported,
   each in its own process).  Failures are reported as results.

The prompts are split into ``--calls`` consecutive calls; memory (resident
set of the process tree: the driver and vLLM's engine and worker
processes) is read after each call.  Prints a markdown table with prompt
tokens/s, the ratios compat/prefill and compat/spec040, peak RSS and the
RSS growth from the first to the last call.

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
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_NUM_SEQS = 32
MAX_MODEL_LEN = 2048


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
    if mode == "prefill":
        from vllm import LLM, SamplingParams

        llm = LLM(model=model, dtype="auto", enforce_eager=True, compilation_config=0,
                  max_model_len=MAX_MODEL_LEN, tensor_parallel_size=tp, max_num_seqs=MAX_NUM_SEQS,
                  max_num_batched_tokens=max(8192, MAX_MODEL_LEN), enable_prefix_caching=False, seed=0)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

        def run(batch):
            llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    else:
        if mode == "compat":
            import eagle3_compat

            eagle3_compat.apply()
        from speculators.data_generation import VllmHiddenStatesGenerator

        gen = VllmHiddenStatesGenerator(model, layer_ids=layer_ids, max_model_len=MAX_MODEL_LEN,
                                        tensor_parallel_size=tp)

        def run(batch):
            gen.generate(batch)
    after = []
    t_total = 0.0
    for batch in chunks:
        t0 = time.perf_counter()
        run(batch)
        t_total += time.perf_counter() - t0
        after.append(tree_rss())
    stop.set()
    tokens = sum(map(len, prompts))
    return {"tokens": tokens, "seconds": t_total, "tok_s": tokens / t_total, "peak_rss": peak[0],
            "rss_after_calls": after}


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
    proc = subprocess.run([sys.executable, "-c", code, args], capture_output=True, text=True, env=env,
                          timeout=3600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return {"error": (err[-1] if err else f"exit {proc.returncode}")[:160]}
    return json.loads(line[len("RESULT"):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (one model, TP 1, ~3k tokens)")
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--modes", default="prefill,compat,spec040")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent / "src"))
    from eagle3_compat.testing import make_tiny_model

    sizes = [("h256-l6", 256, 6), ("h1024-l12", 1024, 12)]
    tps = [int(t) for t in args.tp.split(",")]
    tokens, calls = args.tokens, args.calls
    if args.quick:
        sizes, tps, tokens, calls = sizes[:1], [1], 3000, 3
    modes = args.modes.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="e3c-bench-") as tmp:
        prompts_file = str(Path(tmp) / "prompts.json")
        prompts = prompts_for(tokens)
        Path(prompts_file).write_text(json.dumps(prompts))
        for name, hidden, layers in sizes:
            model = str(make_tiny_model(Path(tmp) / name, "llama", layers=layers, hidden=hidden))
            layer_ids = list(dict.fromkeys([2, layers // 2, layers - 3, layers - 1]))
            for tp in tps:
                res = {m: run_mode(m, model, tp, prompts_file, calls, layer_ids) for m in modes}
                rows.append((name, tp, res))
                print(f"# {name} tp={tp}: " + json.dumps(res)[:400], file=sys.stderr, flush=True)
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; "
          f"{tokens} prompt tokens in {calls} calls\n")
    print("| model | TP | mode | tok/s | compat/prefill | compat/spec040 | peak RSS MB | RSS growth first->last call |")
    print("|---|---|---|---|---|---|---|---|")
    for name, tp, res in rows:
        comp = res.get("compat", {})
        for mode, r in res.items():
            if "error" in r:
                print(f"| {name} | {tp} | {mode} | failed: {r['error']} | | | | |")
                continue
            growth = (r["rss_after_calls"][-1] - r["rss_after_calls"][0]) / r["rss_after_calls"][0]
            ratio1 = ratio3 = ""
            if mode == "compat":
                if "tok_s" in res.get("prefill", {}):
                    ratio1 = f"{comp['tok_s'] / res['prefill']['tok_s']:.2f}"
                if "tok_s" in res.get("spec040", {}):
                    ratio3 = f"{comp['tok_s'] / res['spec040']['tok_s']:.2f}"
            print(f"| {name} | {tp} | {mode} | {r['tok_s']:.0f} | {ratio1} | {ratio3} | "
                  f"{r['peak_rss'] / 2**20:.0f} | {growth:+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
