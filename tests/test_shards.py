"""Sharded jobs (``generate --num-shards N --shard-index I``) and ``eagle3-compat verify``.

The pure logic (which shard owns a sample, the housekeeping a shard job may
do, what verify finds in a folder) runs once; the end-to-end test runs the
real engine: a shard job killed mid-run, both shards at once into one
folder, verify, and the files compared byte for byte with one unsharded run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_compat.dataset import (
    check_shard_args,
    in_shard,
    remove_stale_partials,
    shard_manifest_name,
    shard_token_freq_name,
)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.once
@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_every_sample_belongs_to_exactly_one_shard(n):
    for i in range(50):
        owners = [s for s in range(n) if in_shard(i, n, s)]
        assert owners == [i % n]


@pytest.mark.once
def test_shard_arguments_and_names():
    check_shard_args(1, 0)
    check_shard_args(4, 3)
    for n, i, msg in [(0, 0, "--num-shards must be >= 1"), (2, 2, r"--shard-index must be in 0\.\.1"),
                      (2, -1, "--shard-index"), (True, 0, "must be an int")]:
        with pytest.raises(ValueError, match=msg):
            check_shard_args(n, i)
    assert shard_manifest_name(0, 1) == "manifest.json"
    assert shard_manifest_name(1, 4) == "manifest.shard-1-of-4.json"
    assert shard_token_freq_name(1, 4) == "token_freq.shard-1-of-4.json"
    # speculators' trainer reads every "*pt" file of the folder: none of ours may end so
    for name in (shard_manifest_name(1, 4), shard_token_freq_name(1, 4)):
        assert not name.endswith("pt")


@pytest.mark.once
def test_a_shard_job_removes_only_its_own_stale_partials(tmp_path):
    """Another shard's writer may run on another machine: its partial files
    look stale from here and must be left alone."""
    dead = _dead_pid()
    mine = tmp_path / f".data_4.pt.{dead}.tmp"  # index 4: shard 0 of 2
    theirs = tmp_path / f".data_5.pt.{dead}.tmp"  # index 5: shard 1 of 2
    for f in (mine, theirs):
        f.write_bytes(b"x")
    removed = remove_stale_partials(tmp_path, owns=lambda i: in_shard(i, 2, 0))
    assert removed == [mine] and theirs.exists()


# --- verify on synthetic folders (its logic; the real engine's files below) ---

LAYERS = [0, 1, 3]
H = 8


def _sample(n_tokens, dtype="float32", layers=3, h=H):
    import torch

    return {"input_ids": torch.arange(4, 4 + n_tokens), "loss_mask": torch.ones(n_tokens, dtype=torch.long),
            "hidden_states": [torch.full((n_tokens, h), float(k), dtype=getattr(torch, dtype))
                              for k in range(layers)]}


def _settings():
    return {"model": "m", "capture": "layer_output", "max_model_len": 64, "dtype": None,
            "layer_ids": LAYERS, "input": "in.jsonl", "start_idx": 0, "num_shards": 2,
            "format": "speculators-eagle3-v1", "trainer_checks": False, "first_index": 0,
            "token_freq_path": None, "versions": {"vllm": "0.16.0"}}


def _sharded_folder(tmp_path, total=7, tf_path=None):
    import torch

    out = tmp_path / "out"
    out.mkdir()
    for shard in range(2):
        own = [i for i in range(total) if i % 2 == shard]
        for i in own:
            torch.save(_sample(3 + i), out / f"data_{i}.pt")
        counts = {str(10 + i): i + 1 for i in own} | {"99": 2}  # token 99 in both shards
        (out / shard_token_freq_name(shard, 2)).write_text(json.dumps(counts))
        (out / shard_manifest_name(shard, 2)).write_text(json.dumps({
            **_settings(), "token_freq_path": tf_path, "complete": True, "shard_index": shard,
            "samples": len(own), "input_samples": total, "token_freq_file": shard_token_freq_name(shard, 2),
            "data_config": {"version": "2.0", "generated_at": f"t{shard}",
                            "reproducibility": {"command": f"x --shard-index {shard}"},
                            "model": {"hidden_size": H}, "data": {"num_samples": total}},
            "written_this_run": len(own), "tokens_this_run": 1, "seconds_this_run": 1.0}))
    return out


@pytest.mark.once
def test_verify_merges_a_sound_sharded_folder(tmp_path):
    import torch

    from eagle3_compat.verify import verify_folder

    tf = tmp_path / "token_freq.pt"
    out = _sharded_folder(tmp_path, tf_path=str(tf))
    res = verify_folder(out)
    assert res.problems == [] and res.samples == 7
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["samples"] == 7 and manifest["num_shards"] == 2 and manifest["complete"] is True
    assert sorted(manifest["shards"]) == ["0", "1"] and manifest["shards"]["1"]["samples"] == 3
    assert json.loads((out / "data_config.json").read_text())["data"]["num_samples"] == 7
    assert torch.load(tf, weights_only=True) == {10 + i: i + 1 for i in range(7)} | {99: 4}
    # a second verify finds the same and writes the same
    again = verify_folder(out)
    assert again.ok and json.loads((out / "manifest.json").read_text()) == manifest


def _problems(out, **kw):
    from eagle3_compat.verify import verify_folder

    res = verify_folder(out, **kw)
    assert not (out / "manifest.json").exists(), "verify wrote although the folder has problems"
    return res.problems


# one row per fault verify must name (and then write nothing)
FAULTS = [
    ("missing sample", lambda out: (out / "data_3.pt").unlink(), r"1 of 7 samples missing: data_\{3\}\.pt \(shard 1: 1\)"),
    ("extra sample", lambda out: (out / "data_7.pt").write_bytes((out / "data_0.pt").read_bytes()),
     r"1 data file\(s\) not of this job's 7 samples .*data_7\.pt"),
    ("truncated file", lambda out: (out / "data_4.pt").write_bytes((out / "data_4.pt").read_bytes()[:100]),
     r"data_4\.pt: does not load"),
    ("too few layers", lambda out: _save(out / "data_2.pt", _sample(5, layers=2)),
     r"data_2\.pt: 2 hidden state tensors, expected 3"),
    ("another hidden size", lambda out: _save(out / "data_5.pt", _sample(8, h=H + 1)),
     r"data_5\.pt: hidden_states\[0\] hidden size 9, data_0\.pt has 8"),
    ("another dtype", lambda out: _save(out / "data_6.pt", _sample(9, dtype="bfloat16")),
     r"data_6\.pt: hidden_states\[0\] dtype torch\.bfloat16"),
    ("rows != tokens", lambda out: _save(out / "data_1.pt", {**_sample(4), "input_ids": _sample(5)["input_ids"]}),
     r"data_1\.pt: loss_mask"),
    ("shard not finished", lambda out: _edit(out, 1, complete=False), r"manifest\.shard-1-of-2\.json: the job has not finished"),
    ("shard never ran", lambda out: (out / "manifest.shard-0-of-2.json").unlink(),
     r"shard 0 of 2: no manifest\.shard-0-of-2\.json .*--shard-index 0"),
    ("other settings", lambda out: _edit(out, 1, layer_ids=[0, 2, 3]),
     r"not the same settings everywhere: layer_ids: \[0, 1, 3\] in manifest\.shard-0-of-2\.json"),
    ("other vLLM", lambda out: _edit(out, 0, versions={"vllm": "0.15.1"}), r"versions"),
    ("other sharding", lambda out: (out / "manifest.shard-0-of-3.json").write_text("{}"),
     r"different --num-shards \[2, 3\]"),
]


def _save(path, obj):
    import torch

    torch.save(obj, path)


def _edit(out, shard, **changes):
    path = out / shard_manifest_name(shard, 2)
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.once
@pytest.mark.parametrize("fault", FAULTS, ids=[f[0] for f in FAULTS])
def test_verify_names_what_is_wrong_and_writes_nothing(tmp_path, fault):
    _, damage, expected = fault
    out = _sharded_folder(tmp_path)
    damage(out)
    problems = _problems(out)
    assert problems, "verify found nothing"
    assert any(__import__("re").search(expected, p) for p in problems), problems


@pytest.mark.once
def test_verify_cli_exits_1_listing_problems(tmp_path):
    out = _sharded_folder(tmp_path)
    (out / "data_3.pt").unlink()
    (out / "data_5.pt").unlink()
    proc = subprocess.run([sys.executable, "-m", "eagle3_compat", "verify", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "PROBLEM: 2 of 7 samples missing: data_{3, 5}.pt (shard 1: 2)" in proc.stdout
    ok = subprocess.run([sys.executable, "-m", "eagle3_compat", "verify", str(tmp_path / "nothing")],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 1 and "is not a folder" in ok.stdout


# --- the real engine: two shards + verify == one run ---------------------------

N_PROMPTS = 9


def _cli(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "eagle3_compat", *args], capture_output=True, text=True,
                          timeout=600, env=env, **kw)


def _port_env(offset):
    env = dict(os.environ)
    env["VLLM_PORT"] = str(int(os.environ.get("VLLM_PORT", "29500")) + offset)
    return env


@pytest.mark.engine
@pytest.mark.once  # release-independent file logic around the engine: one env runs it
@pytest.mark.timeout(1800)  # four engine starts, two at once
@pytest.mark.usefixtures("reap_semaphores")  # SIGKILLs processes: their semaphores stay
def test_two_shards_and_verify_give_the_files_of_one_run(tmp_path, tiny_models):
    import torch

    model = tiny_models("llama")
    inp = tmp_path / "in.jsonl"
    lines = [list(range(4 + i, 4 + i + n)) for i, n in enumerate((5, 60, 1, 33, 12, 90, 8, 40, 17))]
    lines[4] = {"input_ids": lines[4], "loss_mask": [0] * 6 + [1] * 6}
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    common = ["--model", str(model), "--input", str(inp), "--layer-ids", "0,2,4,5", "--max-model-len", "128",
              "--max-in-flight", "1", "--dtype", "float32"]
    # One prompt in the engine at a time: a prompt's float32 states depend,
    # in the last bits, on which prompts share its batch, and the jobs
    # compared here batch differently; alone, each prompt's file is exact.
    one, two = tmp_path / "one", tmp_path / "two"
    single = _cli("generate", *common, "--output", str(one), "--token-freq-path", str(tmp_path / "tf1.pt"))
    assert single.returncode == 0, single.stderr[-3000:]

    shard = [*common, "--output", str(two), "--num-shards", "2", "--token-freq-path", str(tmp_path / "tf2.pt")]
    # shard 0 killed once its first sample is on disk: its own files are a
    # prefix of its own sequence (data_0, data_2, ...), nothing else there
    log = tmp_path / "killed.log"
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "eagle3_compat", "generate", *shard, "--shard-index", "0"],
                                stdout=f, stderr=f, start_new_session=True, env=_port_env(0))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not list(two.glob("data_*.pt")) and proc.poll() is None:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first = sorted(int(p.name[5:-3]) for p in two.glob("data_*.pt"))
    assert first and first == list(range(0, 2 * len(first), 2)), (first, log.read_text()[-3000:])
    early = _cli("verify", str(two))
    assert early.returncode == 1 and "has not finished" in early.stdout and "shard 1 of 2: no" in early.stdout

    # both shards at once into the same folder (shard 0 resumes)
    jobs = [subprocess.Popen([sys.executable, "-m", "eagle3_compat", "generate", *shard, "--shard-index", str(i)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_port_env(40 * i))
            for i in (0, 1)]
    try:
        outs = [j.communicate(timeout=900) for j in jobs]
    finally:
        for j in jobs:
            if j.poll() is None:
                j.kill()
                j.wait()
    assert [j.returncode for j in jobs] == [0, 0], [e[-3000:] for _, e in outs]
    m0 = json.loads((two / "manifest.shard-0-of-2.json").read_text())
    assert m0["samples"] == 5 and m0["written_this_run"] == 5 - len(first) and m0["input_samples"] == N_PROMPTS
    # no shared file written before verify
    assert not (two / "manifest.json").exists() and not (two / "data_config.json").exists()
    assert not (tmp_path / "tf2.pt").exists()

    ok = _cli("verify", str(two))
    assert ok.returncode == 0, ok.stdout + ok.stderr[-3000:]
    assert f"OK: {N_PROMPTS} samples" in ok.stdout

    names = sorted(p.name for p in one.glob("data_*.pt"))
    assert names == sorted(f"data_{i}.pt" for i in range(N_PROMPTS))
    assert sorted(p.name for p in two.glob("data_*.pt")) == names
    for name in names:  # byte for byte: same tensors, same dtype, same storage layout
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    assert torch.load(tmp_path / "tf1.pt", weights_only=True) == torch.load(tmp_path / "tf2.pt", weights_only=True)
    c1, c2 = (json.loads((d / "data_config.json").read_text()) for d in (one, two))
    for c in (c1, c2):
        c.pop("generated_at")
        c["reproducibility"].pop("command")
    assert c1 == c2 and c2["data"]["num_samples"] == N_PROMPTS
    m1, m2 = (json.loads((d / "manifest.json").read_text()) for d in (one, two))
    for k in ("model", "layer_ids", "capture", "max_model_len", "dtype", "input", "layer_convention", "versions"):
        assert m1[k] == m2[k], k
    assert m2["samples"] == m1["samples"] == N_PROMPTS and m2["num_shards"] == 2
    # and speculators' own training dataset reads the merged folder
    from speculators.train.data import Eagle3SampleFileDataset

    assert len(Eagle3SampleFileDataset(max_len=128, datapath=str(two))) == N_PROMPTS
