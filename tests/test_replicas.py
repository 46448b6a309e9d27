"""``generate --replicas N``: engine replicas as Ray actors on a local Ray cluster.

Ray is an optional extra: tox installs it in one env (vllm016, where the
``once`` tests run); elsewhere these tests skip.  The end-to-end test runs
two real engines as actors, kills one of them mid-job, and compares every
file with a single-engine run of the same input.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.once, pytest.mark.ray]


def test_replicas_without_ray_fail_at_once_with_the_install_command(tmp_path):
    code = (
        "import sys\n"
        "sys.modules['ray'] = None  # as if not installed\n"
        "from eagle3_compat.__main__ import main\n"
        "rc = main(['generate', '--model', 'm', '--input', 'x.jsonl', '--output', sys.argv[1],\n"
        "           '--replicas', '2'])\n"
        "print('RC', rc, 'LOADED', sorted(m for m in ('torch', 'vllm', 'speculators') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "o")], capture_output=True, text=True,
                          timeout=120)
    assert "RC 2 LOADED []" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "pip install 'eagle3_compat[ray]'" in proc.stderr and "--replicas" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_replica_arguments_are_checked():
    pytest.importorskip("ray")
    from eagle3_compat.replicas import check_replica_args

    check_replica_args(2, None, None)
    for args, msg in [((0, None, None), "--replicas must be a positive int"),
                      ((2, None, 0), "--chunk-size must be a positive int")]:
        with pytest.raises(ValueError, match=msg):
            check_replica_args(*args)


def test_replicas_refuse_the_ray_executor_inside_them(tmp_path):
    from eagle3_compat.dataset import run_generate

    pytest.importorskip("ray")
    with pytest.raises(ValueError, match="--replicas N with --distributed-executor-backend ray"):
        run_generate(model="m", output=tmp_path / "o", input_path=tmp_path / "x.jsonl", replicas=2,
                     distributed_executor_backend="ray")
    assert not (tmp_path / "o").exists()


# one row per case: (host's cpus, slot, replicas on the host, workers per replica) -> binding
BINDINGS = [
    (([0, 1], 0, 2, 1), "0"),  # this machine, 2 replicas: a core each
    (([0, 1], 1, 2, 1), "1"),
    (([0, 1], 0, 1, 1), "0,1"),  # one replica: all cores
    ((list(range(8)), 1, 2, 2), "4,5|6,7"),  # TP 2: a list per worker, disjoint
    (([0, 1, 2], 1, 2, 1), "1"),  # a core left over, not shared
    (([0, 1], 0, 2, 2), None),  # fewer cores than workers: vLLM's own binding
]


@pytest.mark.parametrize("args,expected", BINDINGS)
def test_cpu_replicas_of_one_host_get_disjoint_cores(args, expected):
    from eagle3_compat.replicas import cpu_binding

    assert cpu_binding(*args) == expected


def test_a_sample_crosses_from_replica_to_driver_as_the_same_views(tmp_path):
    """A replica's tensors are views of one storage (its arena); the driver
    rebuilds the same views, so torch.save writes the same bytes."""
    import torch

    from eagle3_compat.replicas import pack_sample, unpack_sample

    arena = torch.arange(3 * 5 * 4 + 7, dtype=torch.float32)
    states = [arena[7 + k * 20: 7 + (k + 1) * 20].view(5, 4) for k in range(3)]
    states.append(arena[7:27].view(4, 5).t())  # not contiguous: the stride travels too
    res = {"input_ids": torch.arange(5), "hidden_states": states}
    back = unpack_sample(pack_sample(res))
    assert back["input_ids"].tolist() == list(range(5))
    for a, b in zip(states, back["hidden_states"]):
        assert torch.equal(a, b) and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
    assert back["hidden_states"][0].untyped_storage().data_ptr() == back["hidden_states"][2].untyped_storage().data_ptr()
    assert back["hidden_states"][0].untyped_storage().data_ptr() != arena.untyped_storage().data_ptr()
    files = []
    for name, obj in (("a", res), ("b", back)):
        with open(tmp_path / name, "wb") as fh:
            torch.save({"input_ids": obj["input_ids"], "hidden_states": obj["hidden_states"]}, fh)
        files.append((tmp_path / name).read_bytes())
    assert files[0] == files[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.mark.engine
@pytest.mark.timeout(1800)  # three engine starts and a Ray cluster's
@pytest.mark.usefixtures("reap_semaphores")  # SIGKILLs processes: their semaphores stay
def test_two_replicas_one_killed_give_the_files_of_one_engine(tmp_path, tiny_models):
    pytest.importorskip("ray")
    model = tiny_models("llama")
    inp = tmp_path / "in.jsonl"
    lengths = (5, 60, 1, 33, 12, 90, 8, 40, 17, 3, 70, 25, 9, 14, 50, 6, 21, 44, 2, 30)
    inp.write_text("".join(json.dumps(list(range(4 + i, 4 + i + n))) + "\n" for i, n in enumerate(lengths)))
    common = ["generate", "--model", str(model), "--input", str(inp), "--layer-ids", "0,2,4,5",
              "--max-model-len", "128", "--max-in-flight", "1", "--dtype", "float32"]
    # One prompt in the engine at a time: a prompt's float32 states depend,
    # in the last bits, on which prompts share its batch, and the jobs
    # compared here batch differently; alone, each prompt's file is exact.
    one, two = tmp_path / "one", tmp_path / "two"
    # The reference engine on as many cores as each of the two replicas gets
    # (cpu_binding; one on this 2-core machine): float32 sums split over
    # another number of threads differ in the last bits (seen: 12 of 80
    # tensors, 9e-7 relative).
    from eagle3_compat.replicas import cpu_binding

    bind = cpu_binding(sorted(os.sched_getaffinity(0)), 0, 2, 1)
    assert bind is not None
    single = subprocess.run([sys.executable, "-m", "eagle3_compat", *common, "--output", str(one)],
                            capture_output=True, text=True, timeout=900,
                            env=dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=bind))
    assert single.returncode == 0, single.stderr[-3000:]

    log = tmp_path / "replicas.log"
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    env.pop("RAY_ADDRESS", None)  # a local Ray cluster of the job's own
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "eagle3_compat", *common, "--output", str(two),
                                 "--replicas", "2", "--chunk-size", "2"], stdout=f, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        pids: dict[int, int] = {}
        deadline = time.monotonic() + 500
        while time.monotonic() < deadline and proc.poll() is None and len(pids) < 2:
            pids = {int(r): int(p) for r, p in re.findall(r"replica (\d): pid (\d+)", log.read_text())}
            time.sleep(0.05)
        assert len(pids) == 2, log.read_text()[-3000:]
        while time.monotonic() < deadline and proc.poll() is None and not list(two.glob("data_*.pt")):
            time.sleep(0.01)
        engine_procs = _children(pids[0])
        assert engine_procs, "the replica's engine processes were not found"
        os.kill(pids[0], signal.SIGKILL)  # replica 0's actor process, mid-job
        proc.wait(timeout=500)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert "replica 0 died" in text, text[-4000:]
    # every sample once, and the same bytes as one engine wrote
    names = sorted(f"data_{i}.pt" for i in range(len(lengths)))
    assert sorted(p.name for p in one.glob("data_*.pt")) == names
    assert sorted(p.name for p in two.glob("data_*.pt")) == names
    assert not list(two.glob(".*.tmp"))
    for name in names:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    m1, m2 = (json.loads((d / "manifest.json").read_text()) for d in (one, two))
    assert m2["samples"] == m2["written_this_run"] == len(lengths) and m2["replicas"] == 2
    assert {k: v for k, v in m1.items() if k in m2 and k not in (
        "tokens_this_run", "seconds_this_run")} == {k: m2[k] for k in m1 if k in m2 and k not in (
        "tokens_this_run", "seconds_this_run")}
    assert m1["tokens_this_run"] == m2["tokens_this_run"] == sum(min(n, 127) for n in lengths)
    c1, c2 = (json.loads((d / "data_config.json").read_text()) for d in (one, two))
    for c in (c1, c2):
        c.pop("generated_at")
        c["reproducibility"].pop("command")
    assert c1 == c2
    # nothing left behind: the killed replica's engine, the other replica, Ray
    time.sleep(2)
    left = [p for p in [pids[1], *engine_procs] if _alive(p)]
    assert not left, f"processes left running: {left}"
