"""Output-folder housekeeping of the CLI's ``generate`` (pure file logic)."""

from __future__ import annotations

import os
import subprocess
import sys

from eagle3_compat.dataset import remove_stale_partials


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_partials_of_dead_writers_are_removed_live_ones_and_samples_kept(tmp_path, caplog):
    dead = _dead_pid()
    stale = tmp_path / f".sample_000000003.pt.{dead}.tmp"
    live = tmp_path / f".sample_000000004.pt.{os.getpid()}.tmp"
    sample = tmp_path / "sample_000000003.pt"
    other = tmp_path / ".notes.tmp"
    for f in (stale, live, sample, other):
        f.write_bytes(b"x")
    with caplog.at_level("WARNING", logger="eagle3_compat.dataset"):
        removed = remove_stale_partials(tmp_path)
    assert removed == [stale]
    assert not stale.exists() and live.exists() and sample.exists() and other.exists()
    assert "removed 1 partial file(s)" in caplog.text
    assert remove_stale_partials(tmp_path) == []
