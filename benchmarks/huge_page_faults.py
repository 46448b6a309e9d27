#!/usr/bin/env python
"""First touch of fresh memory: 4 KiB pages against transparent huge pages.

PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` puts its large CPU buffers on
transparent huge pages (``madvise(MADV_HUGEPAGE)``), and vLLM's CPU worker
maps its biggest per-step buffers anew at every op (above glibc's mmap
threshold), so a CPU engine's speed depends on what a fresh page costs.
On a virtual machine that reports free memory to its hypervisor (virtio
balloon free page reporting, :func:`eagle3_compat.heap.free_page_reporting_order`)
a huge page is carved from a block the host has dropped, and its first touch
faults in the host as well.

For each kind of page, a 512 MiB anonymous mapping is touched once per
4 KiB and unmapped, either at once again (memory just freed, not yet
reported) or after a pause longer than the kernel's reporting delay (2 s):
GiB/s of first touch and the CPU seconds it took, medians of ``--rounds``,
and huge/4 KiB ratios.  Plain Python and ``mmap``; nothing of vLLM or torch.

    python benchmarks/huge_page_faults.py            # RESULTS.md, "Huge pages on a machine that reports free memory"
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from eagle3_compat.heap import free_page_reporting_order, huge_page_order, huge_pages_reported  # noqa: E402

MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


def touch(size: int, huge: bool) -> tuple[float, float]:
    """(GiB/s, CPU s) of touching a fresh ``size``-byte mapping once per page."""
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if huge:
            m.madvise(MADV_HUGEPAGE)
        t, c = time.perf_counter(), time.process_time()
        for off in range(0, size, 4096):
            m[off] = 1
        wall, cpu = time.perf_counter() - t, time.process_time() - c
    finally:
        m.close()
    return size / 2**30 / wall, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pause", type=float, default=3.0, help="seconds free before the next touch (reported)")
    args = ap.parse_args()
    size = args.mib << 20
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as fh:
            thp = fh.read().strip()
    except OSError:
        thp = "n/a"
    print(f"# {os.cpu_count()} cores; THP {thp}; free page reporting order {free_page_reporting_order()} "
          f"(huge page order {huge_page_order()}): huge pages reported = {huge_pages_reported()}")
    print("| memory before the touch | pages | GiB/s (rounds) | CPU s per GiB | /4 KiB pages |")
    print("|---|---|---|---|---|")
    for label, pause in (("just freed", 0.0), (f"free for {args.pause:g} s", args.pause)):
        res: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for huge in (False, True):  # interleaved: each kind after the other's unmapping
                res[huge].append(touch(size, huge))
                time.sleep(pause)
        base = statistics.median(r[0] for r in res[False])
        for huge in (False, True):
            rates = [r[0] for r in res[huge]]
            cpu = statistics.median(r[1] for r in res[huge]) / (size / 2**30)
            print(f"| {label} | {'2 MiB (MADV_HUGEPAGE)' if huge else '4 KiB'} | {statistics.median(rates):.2f} "
                  f"({', '.join(f'{x:.2f}' for x in rates)}) | {cpu:.2f} | {statistics.median(rates) / base:.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
