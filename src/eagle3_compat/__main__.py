"""Command line: ``python -m eagle3_compat {demo,status}`` (also ``eagle3-compat``)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def _demo(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import eagle3_compat

    report = eagle3_compat.apply(dtype="float32")
    print(report, file=sys.stderr)
    if not report.applied:
        print("eagle3_compat did not apply; see the status above", file=sys.stderr)
        return 2
    from speculators.data_generation import VllmHiddenStatesGenerator

    from eagle3_compat.testing import hf_layer_outputs, make_tiny_model, max_rel_error

    layer_ids = [0, 2, 5]
    prompts = [
        [((j if i % 2 == 0 else 7 * j + i) % 390) + 4 for j in range(n)]
        for i, n in enumerate([1, 5, 37, 200, 511, 64])
    ]
    with tempfile.TemporaryDirectory(prefix="eagle3_compat-demo-") as tmp:
        model = make_tiny_model(os.path.join(tmp, "tiny-llama"), "llama")
        t0 = time.perf_counter()
        with VllmHiddenStatesGenerator(str(model), layer_ids=layer_ids, max_model_len=512) as gen:
            t1 = time.perf_counter()
            results = gen.generate(prompts)
            t2 = time.perf_counter()
        ref = hf_layer_outputs(model, prompts, layer_ids)
    worst = 0.0
    print(f"{'prompt':>6} {'tokens':>6} {'layer':>5} {'shape':>12} {'max rel err':>12}")
    for i, (res, r) in enumerate(zip(results, ref)):
        for j, k in enumerate(layer_ids):
            err = max_rel_error(res["hidden_states"][j], r[j])
            worst = max(worst, err)
            shape = "x".join(map(str, res["hidden_states"][j].shape))
            print(f"{i:>6} {len(prompts[i]):>6} {k:>5} {shape:>12} {err:>12.2e}")
    ok = worst <= 1e-4
    print(
        f"engine start {t1 - t0:.1f}s, extraction {t2 - t1:.2f}s; "
        f"largest relative error vs Hugging Face float32: {worst:.2e} ({'OK' if ok else 'FAILED'})"
    )
    return 0 if ok else 1


def _status(_args: argparse.Namespace) -> int:
    import eagle3_compat

    print(eagle3_compat.status())
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagle3-compat", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="extract hidden states from a tiny local model and check them")
    sub.add_parser("status", help="versions found and adapters (without applying)")
    args = ap.parse_args(argv)
    return {"demo": _demo, "status": _status}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
