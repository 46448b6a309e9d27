#!/usr/bin/env python
"""Where plain vLLM's CPU engine memory goes as a job gets longer (issue #16).

The CLI job's own process stays level whatever the dataset's size
(``cli_job.py``), but the process tree's peak grows between a 200- and a
2000-sample run, in vLLM's engine process, for plain ``LLM.generate`` as
much as for the job.  This script shows what that growth is, on plain vLLM
with nothing of eagle3_compat's capture armed: the engine runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so its worker's heap is this
process's), prompts of random lengths go through it in rounds, and after
each round the script reads the resident memory, glibc's main heap
(``[heap]`` in ``/proc/self/smaps``) and the peak (``VmHWM``).  At the end
it calls ``malloc_trim(0)``, which returns the free pages glibc holds to the
kernel, and reads again: what falls away is memory vLLM's worker had freed
and glibc kept (the model's per-step buffers differ in size with the number
of tokens in each step, so freed chunks are rarely reused whole).

    .tox/vllm016/bin/python benchmarks/engine_heap.py              # hidden 2048, 8 rounds of 250 prompts
    .tox/vllm016/bin/python benchmarks/engine_heap.py --trim-every 0.5   # a thread trims every 0.5 s
    .tox/vllm016/bin/python benchmarks/engine_heap.py --quick      # a smoke run

With ``--trim-every S`` a thread calls ``malloc_trim(0)`` every S seconds
during the rounds, so the per-round seconds give the speed cost of keeping
the heap trimmed.  The script exits non-zero if ``malloc_trim`` raised the
heap (the reading would then be wrong).
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import gc
import os
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path


def readings() -> dict[str, int]:
    """Resident MiB, glibc's main heap MiB and the peak MiB of this process."""
    heap_kib = 0
    current = ""
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line
                parts = line.split()
                current = parts[5] if len(parts) > 5 else ""
            elif head == "Rss:" and current == "[heap]":
                heap_kib += int(line.split()[1])
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {"rss": int(status["VmRSS"].split()[0]) // 1024, "heap": heap_kib // 1024,
            "peak": int(status["VmHWM"].split()[0]) // 1024}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=250, help="prompts per round")
    ap.add_argument("--trim-every", type=float, default=None, help="seconds between malloc_trim(0) calls")
    ap.add_argument("--quick", action="store_true", help="hidden 256, 2 rounds of 40 prompts")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.rounds, args.prompts = 256, 2, 40
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from eagle3_compat.cpu_attention import engine_kwargs
    from eagle3_compat.testing import make_tiny_model

    work = tempfile.mkdtemp(prefix="e3c-engine-heap-")
    atexit.register(shutil.rmtree, work, True)
    model = str(make_tiny_model(Path(work) / "model", "llama", layers=args.layers, hidden=args.hidden))
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="auto", enforce_eager=True, compilation_config=0, max_model_len=1024,
              max_num_seqs=32, max_num_batched_tokens=8192, enable_prefix_caching=False, seed=0,
              **engine_kwargs(None, model))
    libc = ctypes.CDLL("libc.so.6")
    if args.trim_every:
        def trimmer() -> None:
            while True:
                time.sleep(args.trim_every)
                libc.malloc_trim(0)

        threading.Thread(target=trimmer, daemon=True).start()
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    gc.collect()
    start = readings()
    trim = f"malloc_trim(0) every {args.trim_every} s" if args.trim_every else "no malloc_trim during the rounds"
    print(f"# plain vLLM, engine in this process; tiny Llama hidden {args.hidden}, {args.layers} layers, bf16 "
          f"(dtype auto); prompts of random lengths (median ~60 tokens, 8..400); {trim}")
    print("| after | prompts | s | resident MiB | of which glibc heap MiB | peak MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| engine start | 0 | | {start['rss']} | {start['heap']} | {start['peak']} |")
    done = 0
    for r in range(args.rounds):
        lengths = [min(400, max(8, int(rng.lognormvariate(4.1, 0.7)))) for _ in range(args.prompts)]
        prompts = [{"prompt_token_ids": [4 + rng.randrange(500) for _ in range(n)]} for n in lengths]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        if len(outs) != len(prompts):
            raise SystemExit(f"round {r}: {len(outs)} outputs for {len(prompts)} prompts")
        del outs, prompts
        gc.collect()
        done += args.prompts
        m = readings()
        print(f"| round {r + 1} | {done} | {seconds:.1f} | {m['rss']} | {m['heap']} | {m['peak']} |", flush=True)
    before = readings()
    libc.malloc_trim(0)
    after = readings()
    print(f"| malloc_trim(0) | {done} | | {after['rss']} | {after['heap']} | {after['peak']} |")
    grown, kept = before["heap"] - start["heap"], after["heap"] - start["heap"]
    print(f"\nglibc heap: +{grown} MiB over {done} prompts; +{kept} MiB of it left after malloc_trim(0)")
    return 0 if after["heap"] <= before["heap"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
