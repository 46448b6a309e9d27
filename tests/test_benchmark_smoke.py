"""The benchmark script runs on a tiny workload and prints its table (no timing asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.extended]

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "extraction.py"


def test_benchmark_quick_prints_table(vllm_minor):
    if vllm_minor != (0, 16):
        pytest.skip("the benchmark is documented and run in the vllm016 env")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--modes", "prefill,compat"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [ln for ln in proc.stdout.splitlines() if ln.startswith("| h256-l6 ")]
    assert len(table) == 2, proc.stdout
    compat = next(ln for ln in table if "| compat |" in ln)
    assert "failed" not in compat


def test_datapath_quick_prints_table(vllm_minor):
    """The transport benchmark runs every path on the real engine; the
    script itself asserts that they deliver the same rows."""
    if vllm_minor != (0, 16):
        pytest.skip("the benchmark is documented and run in the vllm016 env")
    script = SCRIPT.parent / "datapath.py"
    proc = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [ln for ln in proc.stdout.splitlines() if ln.startswith("| 0.")]
    assert [ln.split("|")[2].strip() for ln in table] == ["before", "arena", "arena-staged", "arena-fresh", "rpc"], proc.stdout


def test_host_copy_prints_table():
    """The second-hop benchmark (plain torch, CPU here) checks its copies itself."""
    script = SCRIPT.parent / "host_copy.py"
    proc = subprocess.run([sys.executable, str(script), "--tokens", "256", "--hidden", "64", "--repeats", "1",
                           "--pools", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ln.split("|")[1].strip() for ln in proc.stdout.splitlines() if ln.startswith("| ") and "GB/s" not in ln]
    assert rows == ["one (torch threads 1)", "one (torch threads 4)", "segments (torch threads 1)",
                    "pool-2 (segments over 2 threads)"], proc.stdout


def test_host_cost_prints_table():
    """The worker's per-step host time (plain torch, CPU here); the script
    checks that the copies put every run in its place."""
    script = SCRIPT.parent / "host_cost.py"
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--tokens", "256", "--hidden", "32",
                           "--prompt-tokens", "16,64", "--steps", "7"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ln.split("|")[1:3] for ln in proc.stdout.splitlines() if ln.startswith("| ") and "prompt" not in ln]
    assert [[a.strip(), b.strip()] for a, b in rows] == [["16", "16"], ["64", "4"]], proc.stdout


def test_generate_wide_quick_prints_table(vllm_minor):
    """The wide-model benchmark's compat mode on the real engine; the script
    checks the results' order and shapes itself."""
    if vllm_minor != (0, 16):
        pytest.skip("the benchmark is documented and run in the vllm016 env")
    script = SCRIPT.parent / "generate_wide.py"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--modes", "compat"], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ln.split("|")[1].strip() for ln in proc.stdout.splitlines() if ln.startswith("| ") and "mode" not in ln]
    assert rows == ["compat"], proc.stdout


def test_engine_heap_quick_reads_the_heap(vllm_minor):
    """The engine-memory benchmark (plain vLLM in-process) reads real numbers:
    a row per round, prompts counted, and a heap that malloc_trim did not raise."""
    if vllm_minor != (0, 16):
        pytest.skip("the benchmark is documented and run in the vllm016 env")
    script = SCRIPT.parent / "engine_heap.py"
    proc = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [[c.strip() for c in ln.split("|")[1:-1]] for ln in proc.stdout.splitlines()
            if ln.startswith("| ") and "resident" not in ln]
    assert [r[0] for r in rows] == ["engine start", "round 1", "round 2", "malloc_trim(0)"], proc.stdout
    assert [int(r[1]) for r in rows] == [0, 40, 80, 80]
    resident = [int(r[3]) for r in rows]
    assert all(m > 500 for m in resident), rows  # the engine, model and KV cache are in this process
    assert int(rows[-1][4]) <= int(rows[-2][4]), rows
