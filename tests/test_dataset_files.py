"""Output-folder housekeeping of the CLI's ``generate`` (pure file logic)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from eagle3_compat.dataset import remove_stale_partials


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_partials_of_dead_writers_are_removed_live_ones_and_samples_kept(tmp_path, caplog):
    dead = _dead_pid()
    stale = tmp_path / f".data_3.pt.{dead}.tmp"
    live = tmp_path / f".data_4.pt.{os.getpid()}.tmp"
    sample = tmp_path / "data_3.pt"
    other = tmp_path / ".notes.tmp"
    for f in (stale, live, sample, other):
        f.write_bytes(b"x")
    with caplog.at_level("WARNING", logger="eagle3_compat.dataset"):
        removed = remove_stale_partials(tmp_path)
    assert removed == [stale]
    assert not stale.exists() and live.exists() and sample.exists() and other.exists()
    assert "removed 1 partial file(s)" in caplog.text
    assert remove_stale_partials(tmp_path) == []


def test_mismatching_folder_is_refused_before_torch_and_vllm_load(tmp_path):
    """Resuming into a folder made with other settings fails before the heavy
    imports (seconds, not the ~15 s of torch + vLLM + speculators)."""
    import json

    (tmp_path / "manifest.json").write_text(json.dumps(
        {"model": "m", "capture": "layer_output", "max_model_len": 128, "dtype": None, "layer_ids": [0, 2]}))
    code = (
        "import sys, pathlib\n"
        "from eagle3_compat.dataset import run_generate\n"
        "try:\n"
        "    run_generate(model='m', input_path=pathlib.Path('unused.jsonl'), output=pathlib.Path(sys.argv[1]),\n"
        "                 layer_ids=[0, 3], max_model_len=128, batch_size=1, tensor_parallel_size=1, dtype=None)\n"
        "except ValueError as e:\n"
        "    print('REFUSED', e)\n"
        "print('LOADED', sorted(m for m in ('torch', 'vllm', 'speculators') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REFUSED" in proc.stdout and "resuming would mix them" in proc.stdout and "layer_ids" in proc.stdout
    assert "LOADED []" in proc.stdout, proc.stdout


def test_partial_file_names_round_trip():
    from eagle3_compat.dataset import _partial_path, _partial_writer, data_path

    tmp = _partial_path(data_path(Path("/out"), 7), 4321)
    assert tmp.name == ".data_7.pt.4321.tmp" and not tmp.name.endswith("pt")  # the trainer skips it
    assert _partial_writer(tmp) == 4321
    assert _partial_writer(data_path(Path("/out"), 7)) is None
    assert _partial_writer(Path("/out/.sample_000000007.pt.99.tmp")) == 99  # the earlier layout's
    assert _partial_writer(Path("/out/.notes.1.tmp")) is None


def test_speculators_private_preprocessing_is_probed(monkeypatch):
    """The CLI uses two private functions of speculators: probed like adapter
    targets; a changed signature is a clear error, not a wrong call."""
    pytest = __import__("pytest")
    from conftest import HAVE_ENGINE

    if not HAVE_ENGINE:
        pytest.skip("speculators not installed")
    from eagle3_compat.testing import ensure_applied

    ensure_applied("float32")  # under transformers 5 speculators imports only after apply()
    from speculators.data_generation import preprocessing

    from eagle3_compat.dataset import speculators_preprocessing

    assert speculators_preprocessing("_preprocess_batch") is preprocessing._preprocess_batch
    assert speculators_preprocessing("_detect_assistant_pattern") is preprocessing._detect_assistant_pattern
    monkeypatch.setattr(preprocessing, "_preprocess_batch", lambda examples, tok, pattern, max_length: None)
    with pytest.raises(RuntimeError, match=r"_preprocess_batch takes \('examples', 'tok', 'pattern', 'max_length'\)"):
        speculators_preprocessing("_preprocess_batch")
    monkeypatch.delattr(preprocessing, "_detect_assistant_pattern")
    with pytest.raises(RuntimeError, match="_detect_assistant_pattern is missing"):
        speculators_preprocessing("_detect_assistant_pattern")


def test_writer_publishes_in_index_order_whatever_the_finishing_order(tmp_path):
    """Samples are saved as they arrive but renamed into place in order: the
    folder is always a prefix (speculators resumes at the largest index + 1)."""
    torch = __import__("pytest").importorskip("torch")
    from eagle3_compat.dataset import _Writer, data_path

    def sample(v):
        return {"input_ids": torch.tensor([v]), "hidden_states": [torch.zeros(1, 2)], "loss_mask": torch.ones(1)}

    def names():
        return sorted(p.name for p in tmp_path.iterdir())

    paths = [data_path(tmp_path, i) for i in range(3)]
    with _Writer(max_queued=8) as w:
        for p in paths:
            w.expect(p)
        w.submit(paths[2], sample(2))
        w._queued[-1].result()
        assert names() == [f".data_2.pt.{os.getpid()}.tmp"]  # saved, not yet in place
        w.submit(paths[0], sample(0))
        w._queued[-1].result()
        assert names() == [f".data_2.pt.{os.getpid()}.tmp", "data_0.pt"]
        w.submit(paths[1], sample(1))
    assert names() == ["data_0.pt", "data_1.pt", "data_2.pt"]
    assert [int(torch.load(p, weights_only=True)["input_ids"]) for p in paths] == [0, 1, 2]
    # a failure before the gap is filled: the saved-but-unpublished file goes, the prefix stays
    more = [data_path(tmp_path, i) for i in (3, 4)]
    try:
        with _Writer(max_queued=8) as w:
            for p in more:
                w.expect(p)
            w.submit(more[1], sample(4))
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert names() == ["data_0.pt", "data_1.pt", "data_2.pt"]


def test_writer_collections_see_only_what_the_job_made(tmp_path):
    """The writer's collections (one per GiB saved) would traverse every object
    of the process: what exists before the job is frozen while it runs and
    thawed after, also when the job fails; a freeze of the process's own is
    left as it was."""
    import gc

    torch = __import__("pytest").importorskip("torch")
    from eagle3_compat.dataset import _Writer, data_path

    assert gc.get_freeze_count() == 0
    before = gc.get_freeze_count() + len(gc.get_objects())
    with _Writer(max_queued=2) as w:
        assert gc.get_freeze_count() >= before // 2  # the objects of the process, not a handful
        w.expect(data_path(tmp_path, 0))
        w.submit(data_path(tmp_path, 0), {"input_ids": torch.tensor([1]), "hidden_states": [torch.zeros(1, 2)],
                                          "loss_mask": torch.ones(1)})
    assert gc.get_freeze_count() == 0
    try:
        with _Writer(max_queued=2):
            assert gc.get_freeze_count() > 0
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        theirs = gc.get_freeze_count()
        with _Writer(max_queued=2):
            pass
        # not thawed (objects of the freeze that died meanwhile leave it: torch 2.13's settings)
        assert gc.get_freeze_count() > theirs // 2
    finally:
        gc.unfreeze()


def test_writer_skips_zip_crc32_unless_asked(tmp_path, monkeypatch):
    """The job's files carry no zip CRC-32 (torch.load never checks them; they
    were ~1/3 of the writer's CPU), unless ``--zip-crc32``; torch's
    process-wide setting is restored after the job, also after a failure."""
    import zipfile

    torch = __import__("pytest").importorskip("torch")
    from eagle3_compat import __main__ as cli_main
    from eagle3_compat.dataset import _Writer, data_path

    def sample():
        return {"input_ids": torch.arange(3), "hidden_states": [torch.randn(3, 8).to(torch.bfloat16)] * 2,
                "loss_mask": torch.ones(3, dtype=torch.long)}

    def write(folder, **kw):
        folder.mkdir()
        obj = sample()
        with _Writer(max_queued=2, **kw) as w:
            w.expect(data_path(folder, 0))
            w.submit(data_path(folder, 0), obj)
        back = torch.load(data_path(folder, 0), weights_only=True)
        assert all(torch.equal(a, b) for a, b in zip(back["hidden_states"], obj["hidden_states"]))
        return zipfile.ZipFile(data_path(folder, 0))

    get, put = torch.serialization.get_crc32_options, torch.serialization.set_crc32_options
    assert get() is True
    records = write(tmp_path / "default").infolist()
    assert len(records) > 3 and all(r.CRC == 0 for r in records), [(r.filename, r.CRC) for r in records]
    assert get() is True
    checked = write(tmp_path / "asked", zip_crc32=True)
    assert checked.testzip() is None and all(r.CRC != 0 for r in checked.infolist())
    try:
        put(False)  # the process's own choice is what comes back
        write(tmp_path / "asked-in-a-process-without", zip_crc32=True)
        assert get() is False
    finally:
        put(True)
    try:
        with _Writer(max_queued=2) as w:
            assert w._pool.submit(get).result() is False  # where the saves run (per thread in torch 2.13)
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert get() is True
    # the CLI's flag reaches the job
    seen = []
    monkeypatch.setattr("eagle3_compat.dataset.run_generate", lambda **kw: seen.append(kw["zip_crc32"]) or dict.fromkeys(
        ["samples", "written_this_run", "tokens_this_run", "seconds_this_run"], 0))
    for extra in ([], ["--zip-crc32"]):
        cli_main.main(["generate", "--model", "m", "--input", "x.jsonl", "--output", str(tmp_path / "o"), *extra])
    assert seen == [False, True]


def test_cli_process_skips_the_collections_at_exit():
    """The command (console script and ``python -m``) freezes the process's
    objects when it is done, so the interpreter's collections at exit skip
    them (~1.5 s of the CLI job with vLLM loaded)."""
    import subprocess
    import sys
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "eagle3-compat"]
    assert script.value == "eagle3_compat.__main__:cli"
    code = ("import atexit, gc, runpy\n"
            "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count()))\n"
            "runpy.run_module('eagle3_compat', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", code, "status"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    frozen = int(done.stdout.rsplit("frozen at exit:", 1)[1])
    assert frozen > 10_000, done.stdout[-500:]  # the process's objects, not a handful


def test_truncated_file_of_a_killed_upstream_run_is_named(tmp_path):
    """speculators' script saves in place: a run killed mid-write leaves a
    truncated data_{k}.pt, which resuming must not keep silently."""
    torch = __import__("pytest").importorskip("torch")
    pytest = __import__("pytest")
    from eagle3_compat.dataset import check_upstream_tail

    sample = {"input_ids": torch.arange(3), "hidden_states": [torch.zeros(3, 2)], "loss_mask": torch.ones(3)}
    for i in range(6):
        torch.save(sample, tmp_path / f"data_{i}.pt")
    check_upstream_tail(tmp_path)
    whole = (tmp_path / "data_5.pt").read_bytes()
    (tmp_path / "data_5.pt").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"data_5.pt does not load as a sample .* delete it"):
        check_upstream_tail(tmp_path)
    (tmp_path / "manifest.json").write_text("{}")  # a folder of ours: files are whole by construction
    check_upstream_tail(tmp_path)


def test_cli_process_threads(monkeypatch):
    """One torch thread in the CLI's process without CUDA; the variable wins; bad values are named."""
    import pytest

    torch = pytest.importorskip("torch")
    from eagle3_compat.dataset import DRIVER_THREADS_ENV, _limit_driver_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv(DRIVER_THREADS_ENV, raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        torch.set_num_threads(2)
        _limit_driver_threads(torch)
        assert torch.get_num_threads() == 1
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        torch.set_num_threads(2)
        _limit_driver_threads(torch)
        assert torch.get_num_threads() == 2  # with CUDA: left as it is
        monkeypatch.setenv(DRIVER_THREADS_ENV, "3")
        _limit_driver_threads(torch)
        assert torch.get_num_threads() == 3
        monkeypatch.setenv(DRIVER_THREADS_ENV, "0")
        with pytest.raises(ValueError, match="EAGLE3_COMPAT_DRIVER_THREADS must be a positive integer"):
            _limit_driver_threads(torch)
    finally:
        torch.set_num_threads(before)
