#!/usr/bin/env python
"""``generate()`` against plain vLLM prefill on a model wide enough for the data to matter.

A random-weight Llama of hidden 4096 (``--hidden``, ``--layers``; built
locally by :func:`eagle3_compat.testing.make_tiny_model`, nothing
downloaded), the same prompts (``--prompts`` x ``--tokens`` tokens), one
call at a time, each mode in a process of its own on the same engine
settings (float32 unless ``--dtype``, prefix caching off, 32 sequences and
8192 tokens a step, the model run eagerly):

``prefill``
    plain vLLM: ``LLM.generate(max_tokens=1)`` over the prompts, the ceiling;
``compat``
    speculators 0.3.0's ``VllmHiddenStatesGenerator.generate`` through
    ``eagle3_compat.apply()``, capturing every decoder layer (``--layers``
    of them: 2 x 24 x 1000 tokens x 4096 x 4 B = 0.79 GB per call by
    default, the workload of findings.md section 4, 64.2 s against 61.0 s
    and 6.1x peak extra memory before the data path's rework).

Each mode's process makes its engine, makes one untimed call of a few
prompts (warm-up), then runs the call ``--repeats`` + 1 times: the first
with the memory sampler (the proportional set size of the process and
vLLM's engine and worker processes every 20 ms, peak above the level
before the call with the results held, :func:`datapath.measure`), the
others timed alone.  ``compat`` checks its results' shapes and order.

    .tox/vllm016/bin/python benchmarks/generate_wide.py            # hidden 4096, 2 layers, 24 x 1000 tokens
    .tox/vllm016/bin/python benchmarks/generate_wide.py --quick    # hidden 512, 2 prompts (a smoke run)

Prints a markdown table: seconds per call (median of the timed runs),
prompt tokens/s, compat/prefill, peak extra memory as a multiple of the
captured bytes.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_MODEL_LEN = 2048


def child(mode: str, model: str, prompts_file: str, layers: int, dtype: str, repeats: int) -> dict:
    """One mode, in its own process; returns its measurements."""
    from datapath import measure  # the shared timed / PSS-sampled runner

    prompts = json.loads(Path(prompts_file).read_text())
    layer_ids = list(range(layers))
    t0 = time.perf_counter()
    if mode == "prefill":
        from vllm import LLM, SamplingParams

        from eagle3_compat.cpu_attention import engine_kwargs  # the generator's block size on this CPU build

        llm = LLM(model=model, dtype=dtype, enforce_eager=True, compilation_config=0,
                  max_model_len=MAX_MODEL_LEN, max_num_seqs=32, max_num_batched_tokens=8192,
                  enable_prefix_caching=False, seed=0, **engine_kwargs(dtype, model))
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

        def call(batch):
            return llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    else:
        import eagle3_compat

        eagle3_compat.apply(dtype=dtype)
        from speculators.data_generation import VllmHiddenStatesGenerator

        gen = VllmHiddenStatesGenerator(model, layer_ids=layer_ids, max_model_len=MAX_MODEL_LEN)
        call = gen.generate
    startup = time.perf_counter() - t0
    call(prompts[:2])  # warm-up, untimed
    runs = []
    for r in range(repeats + 1):
        dt, extra, out = measure(lambda: call(prompts), memory=r == 0)
        if mode == "compat":  # every result for its prompt, every layer's rows
            assert [s["input_ids"].tolist() for s in out] == prompts, "results not in prompt order"
            assert all(len(s["hidden_states"]) == layers and all(h.shape[0] == len(p) for h in s["hidden_states"])
                       for s, p in zip(out, prompts))
        del out
        runs.append((dt, extra))
    return {"startup_s": startup, "runs": runs}


def run_mode(mode: str, *args) -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    code = ("import json, sys\nfrom generate_wide import child\n"
            "if __name__ == '__main__':\n    print('RESULT' + json.dumps(child(*json.loads(sys.argv[1]))))\n")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps([mode, *args])], capture_output=True,
                          text=True, env=env, timeout=3600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        raise SystemExit(f"{mode} failed: {err[-5:] if err else proc.returncode}")
    return json.loads(line[len("RESULT"):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=1000, help="tokens per prompt")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per mode (plus one sampled)")
    ap.add_argument("--modes", default="prefill,compat")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.prompts, args.tokens, args.repeats = 512, 2, 64, 1
    from eagle3_compat.testing import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="e3c-wide-"))
    atexit.register(shutil.rmtree, work, True)
    model = make_tiny_model(work / "model", "llama", layers=args.layers, hidden=args.hidden)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 500) for _ in range(args.tokens)] for _ in range(args.prompts)]
    (work / "prompts.json").write_text(json.dumps(prompts))
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
    tokens = args.prompts * args.tokens
    captured = tokens * args.layers * args.hidden * itemsize
    print(f"# Llama hidden {args.hidden}, {args.layers} layers, {args.dtype}; {args.prompts} prompts x "
          f"{args.tokens} tokens per call; compat captures {args.layers} layers: {captured / 1e9:.2f} GB per call")
    print("| mode | s per call (median of timed) | tok/s | /prefill | peak extra memory / captured (sampled run) "
          "| runs (s) | engine start s |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for mode in args.modes.split(","):
        res = run_mode(mode, str(model), str(work / "prompts.json"), args.layers, args.dtype, args.repeats)
        runs = res["runs"]
        t = statistics.median(dt for dt, _ in runs[1:])
        base = t if mode == "prefill" else base
        ratio = f"{base / t:.2f}" if base and mode != "prefill" else ""
        listed = f"{runs[0][0]:.1f} (sampled), " + ", ".join(f"{dt:.1f}" for dt, _ in runs[1:])
        print(f"| {mode} | {t:.2f} | {tokens / t:.0f} | {ratio} | {runs[0][1] / captured:.2f}x | {listed} "
              f"| {res['startup_s']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
