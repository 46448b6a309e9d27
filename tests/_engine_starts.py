"""Counts the vLLM engines a test session starts, per test, for CI's time table.

An engine start is a new ``VLLM::EngineCore`` process (vLLM titles its
engine-core process so) among this pytest process's descendants: engines of
the tests' own ``LLM`` objects and those of the subprocesses the tests run
(the CLI, user scripts) alike.  A background thread looks every 0.5 s; an
engine lives for seconds at least, so none is missed.  Each start is
charged to the test running when it is seen (a module fixture's engine to
the first test that uses it).  Written to ``$E3C_REPORT_DIR/engine-starts.json``
at the end of the session when that variable is set (tox sets it per env).
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from pathlib import Path

TITLE = "EngineCore"


class EngineStarts:
    def __init__(self, out: Path, interval_s: float = 0.5) -> None:
        import psutil  # noqa: PLC0415

        self._psutil = psutil
        self.out = out
        self.interval_s = interval_s
        self.current = "(collection)"
        self.by_test: Counter[str] = Counter()
        self._seen: set[tuple[int, float]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="e3c-engine-starts", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        me = self._psutil.Process(os.getpid())
        while not self._stop.wait(self.interval_s):
            self._poll(me)

    def _poll(self, me) -> None:
        try:
            children = me.children(recursive=True)
        except self._psutil.Error:
            return
        for proc in children:
            try:
                key = (proc.pid, proc.create_time())
                if key in self._seen:
                    continue
                title = " ".join(proc.cmdline()) or proc.name()
            except self._psutil.Error:
                continue
            if TITLE in title:
                self._seen.add(key)
                self.by_test[self.current] += 1

    def finish(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._poll(self._psutil.Process(os.getpid()))
        self.out.mkdir(parents=True, exist_ok=True)
        data = {"total": sum(self.by_test.values()), "by_test": dict(self.by_test.most_common())}
        (self.out / "engine-starts.json").write_text(json.dumps(data, indent=1))
