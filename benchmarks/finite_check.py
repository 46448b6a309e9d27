"""The driver's finiteness check at the widths users run (hidden 7168, bf16).

Compares ``eagle3_compat.generator._all_finite`` (one ``torch.aminmax``
pass) with the two checks it replaced, re-implemented here as baselines, in
the same process on the same tensor:

    .tox/vllm016/bin/python benchmarks/finite_check.py [--rows 65536] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eagle3_compat.generator import _all_finite


def bit_pattern(t: torch.Tensor) -> bool:  # eagle3_compat 0.2.0.dev (session 5)
    return int(torch.bitwise_and(t.view(torch.int16), 0x7FFF).amax()) < 0x7F80


def float32_sum(t: torch.Tensor) -> bool:  # eagle3_compat 0.1
    return bool(torch.isfinite(t.sum(dtype=torch.float32)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=65536, help="rows of 7168 bf16 (65536: 0.94 GB)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    x = torch.randn(args.rows, 7168, dtype=torch.bfloat16)
    gb = x.numel() * x.element_size() / 1e9
    checks = {"aminmax (now)": _all_finite, "bit pattern (before)": bit_pattern, "float32 sum (0.1)": float32_sum}
    times: dict[str, list[float]] = {k: [] for k in checks}
    for _ in range(args.repeats):
        for name, fn in checks.items():
            t0 = time.perf_counter()
            assert fn(x)
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["aminmax (now)"])
    print(f"{gb:.2f} GB bf16 [{args.rows}, 7168], {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| check | s (median) | GB/s | time / aminmax |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.3f} | {gb / m:.1f} | {m / base:.1f}x |")


if __name__ == "__main__":
    main()
