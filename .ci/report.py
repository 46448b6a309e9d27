"""After the matrix: per tox env, its wall time, engine starts and slowest tests.

Reads what each env left in its directory (``junit.xml`` from pytest,
``engine-starts.json`` from ``tests/_engine_starts.py``) and the env's total
from tox's own summary line in the log ``.ci/run`` kept.  Prints one table.
Usage: ``python3 .ci/report.py TOX_WORK_DIR TOX_LOG``.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SLOWEST = 5


def tox_totals(log: Path) -> dict[str, tuple[str, float]]:
    """``vllm016: OK (1953.66=setup[...]+cmd[...] seconds)`` -> {env: (status, seconds)}."""
    out: dict[str, tuple[str, float]] = {}
    if not log.is_file():
        return out
    pat = re.compile(r"^\s*(\S+): (OK|FAIL|SKIP)\S* .*?\((\d+(?:\.\d+)?)")
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    for line in log.read_text(errors="replace").splitlines():
        m = pat.match(ansi.sub("", line))
        if m:
            out[m.group(1)] = (m.group(2), float(m.group(3)))
    return out


def env_rows(work: Path, totals: dict[str, tuple[str, float]]) -> list[list[str]]:
    rows = []
    envs = sorted({p.parent.name for p in work.glob("*/junit.xml")} | set(totals))
    for env in envs:
        status, total = totals.get(env, ("?", float("nan")))
        junit = work / env / "junit.xml"
        tests, pytest_s, slow = "?", "?", ""
        if junit.is_file():
            root = ET.parse(junit).getroot()
            suite = root if root.tag == "testsuite" else root.find("testsuite")
            if suite is not None:
                cases = [(float(c.get("time", 0)), f"{c.get('classname', '')}::{c.get('name', '')}")
                         for c in suite.iter("testcase")]
                tests = suite.get("tests", str(len(cases)))
                pytest_s = f"{float(suite.get('time', 0)):.0f}"
                cases.sort(reverse=True)
                slow = "; ".join(f"{name.rsplit('.', 1)[-1]} {t:.0f}s" for t, name in cases[:SLOWEST])
        starts = "?"
        counted = work / env / "engine-starts.json"
        if counted.is_file():
            starts = str(json.loads(counted.read_text())["total"])
        rows.append([env, status, f"{total:.0f}" if total == total else "?", pytest_s, tests, starts, slow])
    return rows


def main(argv: list[str]) -> int:
    work = Path(argv[1] if len(argv) > 1 else ".tox")
    log = Path(argv[2]) if len(argv) > 2 else work / "ci-tox.log"
    rows = env_rows(work, tox_totals(log))
    head = ["env", "status", "tox s", "pytest s", "tests", "engine starts", f"{SLOWEST} slowest tests"]
    print("\n## CI time per env\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    starts = [int(r[5]) for r in rows if r[5].isdigit()]
    print(f"\nengine starts in all: {sum(starts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
