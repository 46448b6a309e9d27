"""The tests' semaphore reaper (``conftest.orphaned_semaphores``) removes only
what no live process holds.

tox runs several envs side by side on one machine, sharing ``/dev/shm``: the
reaper of one env's SIGKILL test must never take a semaphore an engine of
another env is using (CI's run of stop 39: an engine beside it failed to start,
its worker's semaphore gone)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from conftest import orphaned_semaphores

pytestmark = [
    pytest.mark.once,
    pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory"),
]


def _name() -> str:
    return f"/mp-e3ctest-{uuid.uuid4().hex[:10]}"


def test_a_live_semaphore_is_kept_and_a_dead_one_is_reaped():
    import _multiprocessing

    since = time.time_ns() - 1_000_000_000
    live_name, dead_name = _name(), _name()
    # Held here, as an engine process holds its locks (kind 1 = semaphore).
    live = _multiprocessing.SemLock(1, 1, 1, live_name, False)
    # Created by a process that then dies without unlinking it, as a SIGKILLed
    # process group leaves it (its resource tracker died with it).
    subprocess.run(
        [sys.executable, "-c",
         f"import _multiprocessing, os; _multiprocessing.SemLock(1, 1, 1, {dead_name!r}, False);"
         " os._exit(0)"],
        check=True,
    )
    live_path, dead_path = (f"/dev/shm/sem.{n[1:]}" for n in (live_name, dead_name))
    try:
        assert os.path.exists(live_path) and os.path.exists(dead_path)
        orphans = orphaned_semaphores(since)
        assert live_path not in orphans
        assert dead_path in orphans
        # Older than ``since``: never this test's to remove.
        assert dead_path not in orphaned_semaphores(time.time_ns() + 10_000_000_000)
    finally:
        del live
        for name in (live_name, dead_name):
            try:
                _multiprocessing.sem_unlink(name)
            except FileNotFoundError:
                pass
