"""Checks outside the capture core, each with a fast test that needs no engine.

Every test here is the killing test of a mutant in ``test_capture_mutants.py``
(``TARGETED``): the test passes against the real source and fails, at its own
assertion, when that one check is removed or bent.  The tests take only
``tmp_path`` and ``monkeypatch`` (the mutant runner calls them directly) and
reach the code through its module (``generator.collect_results``, not a name
imported once), so a mutated function is the one they run.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import types
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.once  # pure logic: the same on every vLLM release

from eagle3_compat import __main__ as cli  # noqa: E402
from eagle3_compat import arena, capture, dataset, generator, offload, replicas, upstream, verify  # noqa: E402

H = 4


# --- 1. layer ids -------------------------------------------------------------------

def test_negative_layer_id_is_refused():
    """-1 would index the last layer from the end: refused, naming the argument and the id."""
    with pytest.raises(ValueError, match=r"layer_ids: layer index -1 out of bounds \[0, 7\]"):
        generator.validate_layer_ids([2, -1, 5], 8)
    with pytest.raises(ValueError, match=r"--layer-ids: layer index -3 out of bounds"):
        upstream.check_layer_plan([-3, 2, 5, 7], 8, "layer_output")


def test_too_large_layer_id_is_refused():
    with pytest.raises(ValueError, match=r"layer_ids: layer index 8 out of bounds \[0, 7\]"):
        generator.validate_layer_ids([2, 8], 8)


def test_non_adjacent_repeated_layer_id_is_refused():
    """[2, 5, 2] would capture layer 2 twice: refused wherever the repeats are."""
    with pytest.raises(ValueError, match=r"layer_ids \[2, 5, 2\] repeats \[2\]"):
        generator.validate_layer_ids([2, 5, 2], 8)
    with pytest.raises(ValueError, match=r"--layer-ids \[1, 3, 1, 7\] repeats \[1\]"):
        upstream.check_layer_plan([1, 3, 1, 7], 8, "layer_output")


# --- 2. the driver's results ------------------------------------------------------------

PROMPTS = [[4, 5, 6], [7, 8]]
LAYERS = [1, 3]


def _captured(data, *, error=None, stage1_segments=None):
    """A two-stage reply as merge_stage_captures gives it: stage 0 holds
    slot 0, stage 1 slot 1, both sent as payloads (the RPC path)."""
    layout = arena.layout_for([len(p) for p in PROMPTS], len(LAYERS), H, "float32")
    segments = [[i, 0, len(p), list(p)] for i, p in enumerate(PROMPTS)]
    stages = []
    for stage in (0, 1):
        local = arena.LocalSink(layout, torch.float32, H)
        for i, p in enumerate(PROMPTS):
            local.write(i, stage, 0, len(p), data[i][stage])
        segs = stage1_segments if stage == 1 and stage1_segments is not None else segments
        stages.append({"stage": stage, "slots": [stage], "layers": [LAYERS[stage]], "segments": segs,
                       "transport": "rpc", "payload": local.payload([stage])})
    return layout, {"error": error, "stages": stages, "dtype": "float32", "hidden_size": H}


def _data():
    return [[torch.full((len(p), H), float(10 * i + j)) for j in range(2)] for i, p in enumerate(PROMPTS)]


def test_collect_results_raises_the_error_the_worker_reported():
    layout, captured = _captured(_data(), error="prompt 1: rows past its end")
    got = generator.collect_results(PROMPTS, LAYERS, layout, None, _captured(_data())[1], 7)
    assert float(got[1][1][0, 0]) == 11.0  # the same reply without the error: sound
    with pytest.raises(capture.CaptureError, match=r"^call 7: prompt 1: rows past its end$"):
        generator.collect_results(PROMPTS, LAYERS, layout, None, captured, 7)


def test_collect_results_checks_every_pipeline_stage_against_the_plan():
    """Stage 1's runs leave a gap in prompt 0: refused, naming the stage."""
    gap = [[0, 0, 2, [4, 5]], [1, 0, 2, [7, 8]]]  # prompt 0 has 3 tokens
    layout, captured = _captured(_data(), stage1_segments=gap)
    with pytest.raises(capture.CaptureError, match=r"^pipeline stage 1: prompt 0, layers \[3\]"):
        generator.collect_results(PROMPTS, LAYERS, layout, None, captured, 0)


def test_collect_results_refuses_non_finite_hidden_states():
    data = _data()
    data[1][1][1, 2] = float("nan")
    layout, captured = _captured(data)
    with pytest.raises(capture.CaptureError, match=r"^prompt 1, layer 3: non-finite hidden states$"):
        generator.collect_results(PROMPTS, LAYERS, layout, None, captured, 0)


# --- 3. verify --------------------------------------------------------------------------

def _sample(ids, layers=2, rows=None, h=H):
    n = len(ids)
    return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.ones(n, dtype=torch.long),
            "hidden_states": [torch.zeros(n if rows is None else rows, h) for _ in range(layers)]}


def _folder(tmp_path, samples, cfg_hidden=H):
    """An unsharded folder as one job leaves it (manifest.json, data_config.json)."""
    out = tmp_path / "out"
    out.mkdir(parents=True)
    for i, s in enumerate(samples):
        torch.save(s, out / f"data_{i}.pt")
    (out / "manifest.json").write_text(json.dumps({
        "complete": True, "num_shards": 1, "samples": len(samples), "first_index": 0,
        "layer_ids": LAYERS, "max_model_len": 64}))
    (out / "data_config.json").write_text(json.dumps({"model": {"hidden_size": cfg_hidden}}))
    return out


def test_verify_refuses_hidden_state_rows_unlike_the_tokens(tmp_path):
    out = _folder(tmp_path, [_sample([1, 2, 3]), _sample([4, 5], rows=3)])
    res = verify.verify_folder(out, write=False)
    assert res.problems == ["data_1.pt: hidden_states[0] (3, 4), expected [2, H]"], f"problems {res.problems}"


def test_verify_refuses_more_hidden_state_tensors_than_layer_ids(tmp_path):
    out = _folder(tmp_path, [_sample([1, 2, 3]), _sample([4, 5], layers=3)])
    res = verify.verify_folder(out, write=False)
    assert res.problems == ["data_1.pt: 3 hidden state tensors, expected 2 (one per layer id)"], f"problems {res.problems}"


def test_verify_compares_the_hidden_size_with_data_config(tmp_path):
    assert verify.verify_folder(_folder(tmp_path / "a", [_sample([1, 2])]), write=False).ok
    out = _folder(tmp_path / "b", [_sample([1, 2]), _sample([3])], cfg_hidden=H + 1)
    res = verify.verify_folder(out, write=False)
    assert res.problems == [f"the files' hidden size {H} (data_0.pt), data_config.json says {H + 1}"], \
        f"problems {res.problems}"


# --- 4. resuming into an upstream folder ---------------------------------------------

def _upstream_folder(tmp_path, n, bad):
    """``data_0..data_{n-1}`` as speculators' script writes them; ``bad`` truncated."""
    out = tmp_path / "up"
    out.mkdir(parents=True)
    for i in range(n):
        if i == bad:
            (out / f"data_{i}.pt").write_bytes(b"PK\x03\x04 cut short")
        else:
            torch.save(_sample([i + 1]), out / f"data_{i}.pt")
    return out


def test_upstream_tail_is_picked_by_index_not_by_name(tmp_path):
    """By name data_10 sorts before data_2..data_9: the truncated last file must still be loaded."""
    out = _upstream_folder(tmp_path, 11, bad=10)
    with pytest.raises(ValueError, match=r"data_10\.pt does not load as a sample"):
        dataset.check_upstream_tail(out)


def test_upstream_tail_loads_every_file_the_writers_may_have_held(tmp_path):
    """speculators writes with several IO workers: the fourth file from the end may be partial too."""
    out = _upstream_folder(tmp_path, 11, bad=11 - dataset.UPSTREAM_WRITERS)
    with pytest.raises(ValueError, match=rf"data_{11 - dataset.UPSTREAM_WRITERS}\.pt does not load"):
        dataset.check_upstream_tail(out)
    ok = _upstream_folder(tmp_path / "ok", 11, bad=11 - dataset.UPSTREAM_WRITERS - 1)
    dataset.check_upstream_tail(ok)  # older files were complete when the writers moved on


# --- 5-7. the job's files (run_generate with a fake engine) -------------------------

class _FakeEngine:
    """Stands in for the generator: each prompt's states are its first token
    id plus the layer's position (so a file shows whose states it holds),
    returned in reverse order; ``drop``: positions it never returns."""

    drop: tuple[int, ...] = ()

    def __init__(self, model, gen_kwargs):
        self.layer_ids = list(gen_kwargs["layer_ids"])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def stream(self, prompts, max_in_flight):
        todo = list(enumerate(prompts))
        for k, ids in reversed(todo):
            if k in self.drop:
                continue
            states = [torch.full((len(ids), H), float(ids[0] + j)) for j in range(len(self.layer_ids))]
            yield k, {"input_ids": torch.tensor(ids, dtype=torch.long), "hidden_states": states,
                      "loss_mask": None}

    def data_config(self, **kw):
        return {"reproducibility": {}, "model": {"hidden_size": H}, "data": kw}


def _fake_job(tmp_path, monkeypatch, lines, engine=_FakeEngine, **kw):
    """run_generate on a JSONL input, everything heavy replaced; returns the output folder."""
    import eagle3_compat
    import transformers

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    found = types.SimpleNamespace(vllm="0", speculators="0", torch="0", transformers="0")
    monkeypatch.setattr(eagle3_compat, "apply", lambda dtype=None: types.SimpleNamespace(applied=True))
    monkeypatch.setattr(eagle3_compat, "status", lambda: types.SimpleNamespace(found=found))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    monkeypatch.setattr(dataset, "_LocalEngine", engine)
    monkeypatch.setattr(dataset, "_limit_driver_threads", lambda torch: None)
    out = tmp_path / "out"
    dataset.run_generate(str(model), out, layer_ids=[0, 1, 2, 3], max_model_len=64, input_path=src,
                         hf_cache_dir=str(tmp_path / "cache"), **kw)
    return out


LINES = [{"input_ids": [11, 12, 13], "loss_mask": [0, 1, 1]}, [21, 22], {"input_ids": [31, 12, 33, 12],
                                                                       "loss_mask": [1, 1, 0, 0]}]


def test_job_writes_sample_i_to_data_start_plus_i(tmp_path, monkeypatch):
    out = _fake_job(tmp_path, monkeypatch, LINES, start_idx=5)
    names = sorted(p.name for p in out.glob("data_*.pt"))
    assert names == ["data_5.pt", "data_6.pt", "data_7.pt"], f"files {names} for samples 0..2 at --start-idx 5"
    for i, rec in enumerate(LINES):
        ids = rec if isinstance(rec, list) else rec["input_ids"]
        got = torch.load(out / f"data_{5 + i}.pt", weights_only=True)
        assert got["input_ids"].tolist() == ids, f"data_{5 + i}.pt holds {got['input_ids'].tolist()}, not line {i + 1}"
        assert float(got["hidden_states"][3][0, 0]) == ids[0] + 3
    assert verify.verify_folder(out, write=False).problems == []


def test_token_frequencies_count_only_tokens_under_the_loss_mask(tmp_path, monkeypatch):
    tf = tmp_path / "tf" / "token_freq.pt"
    _fake_job(tmp_path, monkeypatch, LINES, token_freq_path=str(tf))
    counts = torch.load(tf, weights_only=True)
    assert counts == {12: 2, 13: 1, 21: 1, 22: 1, 31: 1}, f"token counts {counts}"
    c = Counter()
    dataset._count_tokens(c, [5, 6, 5, 7], [0, 1, 1, 0])
    assert c == Counter({5: 1, 6: 1}), f"token counts {dict(c)}"


def test_loss_mask_shorter_or_empty_is_refused(tmp_path):
    for n, mask in enumerate(([1, 1], [])):
        src = tmp_path / f"in{n}.jsonl"
        src.write_text(json.dumps([5]) + "\n" + json.dumps({"input_ids": [1, 2, 3], "loss_mask": mask}) + "\n")
        with pytest.raises(ValueError, match=rf"in{n}\.jsonl:2: loss_mask has {len(mask)} entries for 3 tokens"):
            list(dataset.read_jsonl(src, None, 64))


def test_jsonl_samples_are_numbered_from_zero_by_line(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(rec) + "\n" for rec in LINES))
    got = [(s.index, s.input_ids[0]) for s in dataset.read_jsonl(src, None, 64)]
    assert got == [(0, 11), (1, 21), (2, 31)], f"samples (index, first token) {got}"


def test_writer_reports_a_sample_never_written(tmp_path):
    paths = [dataset.data_path(tmp_path, i) for i in range(3)]
    with pytest.raises(RuntimeError, match=r"2 sample file\(s\) expected but never written \(first .*data_1\.pt\)"):
        with dataset._Writer(max_queued=4) as w:
            for p in paths:
                w.expect(p)
            w.submit(paths[0], _sample([1]))
            w.submit(paths[2], _sample([3]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data_0.pt"]  # the prefix only


def test_job_fails_when_the_engine_loses_a_sample(tmp_path, monkeypatch):
    lossy = type("Lossy", (_FakeEngine,), {"drop": (1,)})
    with pytest.raises(RuntimeError, match=r"2 sample file\(s\) expected but never written \(first .*data_1\.pt\)"):
        _fake_job(tmp_path, monkeypatch, LINES, engine=lossy)


# --- the command line's arguments ------------------------------------------------------

@pytest.mark.parametrize("args,said", [
    (["--max-in-flight", "0"], "--max-in-flight must be an int >= 1, got 0"),
    (["--max-model-len", "1"], "--max-model-len must be an int >= 2, got 1"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be an int >= 1, got 0"),
    (["--pipeline-parallel-size", "-1"], "--pipeline-parallel-size must be an int >= 1, got -1"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be a fraction in (0, 1], got 1.5"),
])
def test_cli_refuses_bad_numbers_before_anything_loads(tmp_path, monkeypatch, args, said):
    _cli_refuses(tmp_path, monkeypatch, args, said)


def test_cli_refuses_zero_prompts_in_flight(tmp_path, monkeypatch):
    _cli_refuses(tmp_path, monkeypatch, ["--max-in-flight", "0"], "--max-in-flight must be an int >= 1, got 0")


def test_cli_refuses_a_model_length_without_room_for_a_token(tmp_path, monkeypatch):
    _cli_refuses(tmp_path, monkeypatch, ["--max-model-len", "1"], "--max-model-len must be an int >= 2, got 1")


def _cli_refuses(tmp_path, monkeypatch, args, said):
    import contextlib
    import io

    import eagle3_compat

    def too_far(*a, **k):
        raise AssertionError("generate went past its argument checks")

    monkeypatch.setattr(eagle3_compat, "apply", too_far)
    monkeypatch.setattr(dataset, "_limit_driver_threads", too_far)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    (tmp_path / "in.jsonl").write_text("[1, 2]\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(["generate", "--model", str(model), "--input", str(tmp_path / "in.jsonl"),
                       "--output-dir", str(tmp_path / "out"), "--layer-ids", "0", "1", "2", "3", *args])
    assert rc == 2 and said in err.getvalue(), (rc, err.getvalue())
    assert not (tmp_path / "out").exists()


# --- replicas' bookkeeping -------------------------------------------------------------

class _Lost(Exception):
    pass


class _Ref:
    def __init__(self, fn):
        self.fn = fn


def _fake_ray(monkeypatch):
    ray = types.ModuleType("ray")
    ray.wait = lambda refs, num_returns=1: (refs[:1], refs[1:])
    ray.get = lambda ref: ref.fn()
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setattr(replicas, "_LOST", (_Lost,))


class _Actor:
    """A replica: ``behave(chunk)`` -> its results (or raises)."""

    def __init__(self, behave):
        self.run = types.SimpleNamespace(remote=lambda chunk, per_call: _Ref(lambda: behave(chunk)))


def _replicas(actors, chunk=2):
    r = replicas.RayReplicas.__new__(replicas.RayReplicas)
    r._actors, r._chunk, r._n, r.lost = dict(enumerate(actors)), chunk, len(actors), []
    return r


def _packed(chunk):
    return [(k, replicas.pack_sample({"input_ids": torch.tensor(ids), "hidden_states": [
        torch.full((len(ids), H), float(k))]})) for k, ids in chunk]


def test_replica_chunk_missing_a_sample_fails_naming_it(monkeypatch):
    _fake_ray(monkeypatch)
    short = _Actor(lambda chunk: _packed(chunk)[:-1])
    prompts = iter([[1], [2, 3], [4]])
    with pytest.raises(RuntimeError, match=r"replica 0 answered a chunk of prompts 0\.\.1 with 1 samples for 2 "
                                           r"\(missing positions \[1\]"):
        list(_replicas([short]).stream(prompts, max_in_flight=8))


def test_lost_replica_chunks_are_rerun_elsewhere_each_sample_once(monkeypatch):
    _fake_ray(monkeypatch)

    def dies(chunk):
        raise _Lost("killed")

    r = _replicas([_Actor(dies), _Actor(_packed)])
    got = [(k, float(s["hidden_states"][0][0, 0])) for k, s in r.stream(iter([[1], [2], [3], [4], [5]]), 8)]
    assert sorted(got) == [(k, float(k)) for k in range(5)], f"samples (position, state) {sorted(got)}"
    assert r.lost == [0] and list(r._actors) == [1]


# --- the arena's free/reuse ------------------------------------------------------------

def _call(pool, lengths, value, hidden=64):
    """One call through the pool: the worker (its mappings of the pool's files
    kept in ``pool.worker_cache``, as the rank-0 worker keeps them) writes
    ``value + i`` to prompt i; the results."""
    layout = arena.layout_for(lengths, 1, hidden, "float32")
    lease = pool.lease(layout)
    cache = pool.__dict__.setdefault("worker_cache", {})
    sink = arena.ShmSink.open(lease.spec(), layout, torch.float32, hidden, cache)
    assert not isinstance(sink, str), sink
    for i, n in enumerate(lengths):
        sink.write(i, 0, 0, n, torch.full((n, hidden), float(value + i)))
    sink.close()
    lease.unlink()
    return lease.tensors("float32", hidden)


def test_arena_file_is_not_reused_while_a_prompt_of_it_is_held(tmp_path):
    import gc

    pool = arena.ArenaPool(directory=str(tmp_path))
    try:
        out = _call(pool, [64, 64], 1.0)
        kept = out[1][0]
        del out
        gc.collect()
        again = _call(pool, [64, 64], 5.0)
        assert float(kept[3, 3]) == 2.0, f"a held result changed to {float(kept[3, 3])} by a later call"
        assert float(again[1][0][3, 3]) == 6.0
        assert pool.stats()["files_made"] == 2
    finally:
        pool.close()
        arena.forget_all(pool.__dict__.get("worker_cache", {}))


def test_arena_pool_reuses_only_files_that_fit(tmp_path):
    import gc

    pool = arena.ArenaPool(directory=str(tmp_path))
    try:
        out = _call(pool, [16], 1.0)
        del out
        gc.collect()
        assert pool.stats()["free_files"] == 1
        big = _call(pool, [4096], 2.0)
        assert float(big[0][0][4095, 63]) == 2.0
        assert pool.stats()["files_made"] == 2, f"pool {pool.stats()}"
    finally:
        pool.close()
        arena.forget_all(pool.__dict__.get("worker_cache", {}))


def test_arena_pool_keeps_no_more_than_its_bytes(tmp_path):
    import gc

    pool = arena.ArenaPool(keep_bytes=0, directory=str(tmp_path))
    try:
        out = _call(pool, [16], 1.0)
        del out
        gc.collect()
        assert pool.stats()["free_files"] == 0 and len(pool.pop_forget()) == 1, f"pool {pool.stats()}"
    finally:
        pool.close()
        arena.forget_all(pool.__dict__.get("worker_cache", {}))


# --- the offload's writer thread ---------------------------------------------------------

def _writer_offload():
    """The CUDA offload's writer thread and work queue, without a device."""
    off = offload.HostOffload.__new__(offload.HostOffload)
    off.cuda, off._error, off._pools = True, None, {}
    off._work = queue.Queue()
    off._thread = threading.Thread(target=off._writer, daemon=True)
    off._thread.start()
    return off


def test_offload_work_skipped_after_an_error_still_frees_its_buffers():
    """After a failed piece of work the writer skips the rest, but each skipped
    piece's staging buffers go back to their pools (else the next submit of
    their slot would wait for ever, inside the engine's step)."""
    off = _writer_offload()
    freed = []
    try:
        def fails():
            raise RuntimeError("copy failed")

        off.run(fails, lambda: freed.append("first"))
        off.run(lambda: freed.append("ran"), lambda: freed.append("second"))
        off.run(lambda: freed.append("ran"), lambda: freed.append("third"))
        with pytest.raises(RuntimeError, match="^copy failed$"):
            off.drain()
        assert freed == ["second", "third"], f"after the failure: {freed}"
        off.run(lambda: freed.append("ran"), lambda: freed.append("fourth"))
        off.drain()  # the error was reported: work runs again
        assert freed[-1] == "ran"
    finally:
        off.close()
