#!/usr/bin/env python
"""The CLI job against plain vLLM prefill of the whole dataset, and its memory.

For each dataset size (number of samples; the prompts of the smaller set are
a prefix of the larger), in fresh processes:

``prefill``
    plain vLLM: one ``LLM.generate(all prompts, max_tokens=1)`` call, prefix
    caching off, the engine settings the generator uses (the ceiling);
``cli``
    ``eagle3-compat generate`` on a JSONL file of the same prompts, writing
    one file per sample (the streaming job);
``cli-driver-threads2``, ``cli-no-pool``
    the same with one change undone, for before/after figures in one run:
    torch's default threads in the CLI's own process
    (``EAGLE3_COMPAT_DRIVER_THREADS=2``), a new shared-memory file per
    sample (``EAGLE3_COMPAT_ARENA_POOL_BYTES=0``).

Both times include the engine's start (the CLI cannot be timed otherwise);
"s after start" is the time from that moment to the end (the engine's
start, the imports and the dataset's reading left out), from a run
without memory sampling; memory, from a second run of each, is the peak
proportional set size (PSS) of the process tree, sampled
every 50 ms, minus the tree's level right after the engine started (when
the first sample file appears, for ``cli``; when the LLM is built, for
``prefill``).  The table gives tokens/s, cli/prefill, and the peak extra
memory of each run, and of that the job's own process alone (the engine's
processes are vLLM's; plain prefill's grow with the dataset as well); the target is cli/prefill >= 0.95 and the cli's peak
within 10 % between the small and the large dataset.

    python benchmarks/cli_job.py                      # 200 and 2000 samples (RESULTS.md)
    python benchmarks/cli_job.py --samples 600 --modes prefill,cli,cli-driver-threads2,cli-no-pool

Run it inside a test environment (``.tox/vllm016/bin/python``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MAX_MODEL_LEN = 1024
# The CLI as shipped, and variants for before/after comparisons (environment overrides).
CLI_MODES = {
    "cli": {},
    "cli-driver-threads2": {"EAGLE3_COMPAT_DRIVER_THREADS": "2"},  # before: torch's default here
    "cli-no-pool": {"EAGLE3_COMPAT_ARENA_POOL_BYTES": "0"},  # before: a new file per sample
}


def tree_pss(pid: int, children: bool = True) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *(root.children(recursive=True) if children else [])]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def prefill_child(model: str, prompts_file: str) -> None:
    """Plain vLLM; touches ``<prompts_file>.ready`` once the engine is up."""
    from vllm import LLM, SamplingParams

    prompts = json.loads(Path(prompts_file).read_text())
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="auto", enforce_eager=True, compilation_config=0,
              max_model_len=MAX_MODEL_LEN, max_num_seqs=32, max_num_batched_tokens=8192,
              enable_prefix_caching=False, seed=0)
    Path(prompts_file + ".ready").touch()
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
    print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)


def run(cmd: list[str], ready, env: dict, memory: bool = True) -> dict:
    """Run ``cmd``; ``ready()`` says when the engine is up (memory base).

    ``memory=False``: only the moment the engine is up is watched, no PSS
    sampling (it reads every process's page tables, a core's worth of work
    on this 2-core machine): the timed runs."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    base, peak, t_ready = [None], [0], [None]
    root = [None, 0]  # the job's own process (the driver): PSS at engine start, peak
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            m = tree_pss(proc.pid) if memory else 0
            r = tree_pss(proc.pid, children=False) if memory else 0
            if base[0] is None and ready():
                base[0], root[0] = m, r
                t_ready[0] = time.perf_counter()
            peak[0] = max(peak[0], m)
            root[1] = max(root[1], r)
            time.sleep(0.05)

    th = threading.Thread(target=watch, daemon=True)
    t0 = time.perf_counter()
    th.start()
    out, _ = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    th.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed ({proc.returncode}): {out[-2000:]}")
    after = wall - (t_ready[0] - t0) if t_ready[0] is not None else float("nan")
    return {"wall": wall, "after_start": after, "peak": peak[0], "base": base[0] or 0, "out": out,
            "driver_peak": root[1], "driver_base": root[0] or 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", default="200,2000")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--modes", default="prefill,cli", help=f"prefill and any of {sorted(CLI_MODES)}")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        prefill_child(*args.child)
        return 0
    from eagle3_compat.testing import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="e3c-cli-bench-"))
    model = make_tiny_model(work / "model", "llama", layers=args.layers, hidden=args.hidden)
    sizes = [int(x) for x in args.samples.split(",")]
    rng = random.Random(0)
    # log-normal lengths, median ~60 tokens, 8..400
    lengths = [min(400, max(8, int(rng.lognormvariate(4.1, 0.7)))) for _ in range(max(sizes))]
    prompts_all = [[4 + rng.randrange(500) for _ in range(n)] for n in lengths]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    print(f"# vLLM CPU engine, {os.cpu_count()} cores; tiny Llama hidden {args.hidden}, {args.layers} layers, "
          f"bf16 (dtype auto); default layer ids; prompts median ~60 tokens")
    modes = [m for m in args.modes.split(",") if m != "prefill"]
    print("| samples | tokens | mode | tok/s | /prefill | s after start | /prefill | peak extra MiB "
          "| of which the job's own process |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        prompts = prompts_all[:n]
        tokens = sum(map(len, prompts))
        pfile = work / f"prompts-{n}.json"
        pfile.write_text(json.dumps(prompts))
        jfile = work / f"prompts-{n}.jsonl"
        jfile.write_text("".join(json.dumps(p) + "\n" for p in prompts))
        def both(cmd, ready, menv, out=None):
            """A timed run, then a run for memory (each from a clean output folder)."""
            got = []
            for memory in (False, True):
                if out is not None and out.exists():
                    shutil.rmtree(out)
                if Path(str(pfile) + ".ready").exists():
                    Path(str(pfile) + ".ready").unlink()
                r = run(cmd, ready, menv, memory)
                if out is not None:
                    written = len(list(out.glob("data_*.pt")))
                    assert written == n, (written, n)
                got.append(r)
            timed, sampled = got
            return dict(timed, **{k: sampled[k] for k in ("peak", "base", "driver_peak", "driver_base")})

        pre = both([sys.executable, __file__, "--child", str(model), str(pfile)],
                   lambda pfile=pfile: Path(str(pfile) + ".ready").exists(), env)
        rows = [("prefill", pre)]
        for mode in modes:
            out = work / f"out-{n}-{mode}"
            menv = dict(env, **CLI_MODES[mode])
            cli = both([sys.executable, "-m", "eagle3_compat", "generate", "--model", str(model),
                        "--input", str(jfile), "--output", str(out), "--max-model-len", str(MAX_MODEL_LEN),
                        "--no-trainer-checks"],
                       lambda out=out: any(out.glob("data_*.pt")), menv, out)
            rows.append((mode, cli))
        for mode, r in rows:
            tps = tokens / r["wall"]
            print(f"| {n} | {tokens} | {mode} | {tps:.0f} | {pre['wall'] / r['wall']:.2f} | "
                  f"{r['after_start']:.1f} | {pre['after_start'] / r['after_start']:.2f} | "
                  f"{(r['peak'] - r['base']) / 2**20:.0f} | {(r['driver_peak'] - r['driver_base']) / 2**20:.0f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
