#!/usr/bin/env python
"""The CLI job against plain vLLM prefill of the whole dataset, and its memory.

For each dataset size (number of samples; the prompts of the smaller set are
a prefix of the larger), in fresh processes:

``prefill``
    plain vLLM: one ``LLM.generate(all prompts, max_tokens=1)`` call, prefix
    caching off, the engine settings the generator uses (the ceiling);
``cli``
    ``eagle3-compat generate`` on a JSONL file of the same prompts, writing
    one file per sample (the streaming job);
``cli-out-shm``
    ``cli`` writing its samples under ``/dev/shm`` (memory), not the disk;
``cli-before``
    the CLI of another tree (``--before-src``: its ``src``, e.g. a git
    worktree of the commit before a change), the same job;
``cli-in-flight-all``
    every prompt admitted at once, as plain prefill has them (memory
    unbounded): a diagnostic;
``cli-off-omp0``
    ``cli`` with the job's threads moved off the core of the engine's
    OpenMP thread 0 once the engine is up: a diagnostic;
``cli-thp-no-huge``
    ``cli`` with transparent huge pages refused to the whole process tree
    (``prctl(PR_SET_THP_DISABLE)``): PyTorch's 2 MiB alignment without the
    huge pages, a diagnostic;
``cli-mmap-<MiB>``, ``prefill-mmap-<MiB>``
    ``cli`` or ``prefill`` with glibc's mmap threshold fixed at that size
    in every process of the tree (``MALLOC_MMAP_THRESHOLD_``, its trim
    threshold at 4 GiB), from their start: a diagnostic;
``cli-driver-threads2``, ``cli-no-pool``, ``cli-mmap-glibc``, ``cli-in-flight-64``, ``cli-no-trim``,
``cli-trim-every-step``, ``cli-trim-256``, ``cli-interval-30``, ``cli-onednn-1024``
    the same with one change undone, for before/after figures in one run:
    torch's default threads in the CLI's own process
    (``EAGLE3_COMPAT_DRIVER_THREADS=2``), a new shared-memory file per
    sample (``EAGLE3_COMPAT_ARENA_POOL_BYTES=0``), the earlier default of
    ``--max-in-flight`` (64, two engine steps' worth), the CPU worker's heap
    never trimmed (``EAGLE3_COMPAT_CPU_TRIM_MIB=off``), glibc's own mmap
    threshold in the worker (``EAGLE3_COMPAT_CPU_MMAP_MIB=off``); or the trim's
    settings changed: after every step (``=0``), at 256 MiB of growth over
    the working set (``=256``), at most once per 30 s
    (``EAGLE3_COMPAT_CPU_TRIM_INTERVAL_S=30``); or oneDNN's primitive cache
    at its own default of 1024 entries (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``;
    the generator starts a CPU engine with 64).

Both times include the engine's start (the CLI cannot be timed otherwise);
"s after start" is the time from that moment to the end (the engine's
start, the imports and the dataset's reading left out; "start s" is the
rest, median of the timed runs), from a run without
memory sampling; memory, from a second run of each, is the peak
proportional set size (PSS) of the process tree, sampled every 50 ms,
minus the tree's level right after the engine started (when the job's
``manifest.json`` appears, for ``cli``: it is written once the engine is
up, before the first step; when the LLM is built, for ``prefill``; until
2026-12-04 the ``cli``'s start was its first sample file, which left its
first engine step out of its time). The table gives tokens/s, cli/prefill,
and the peak extra memory of each run, and of that the job's own process
alone (the engine's processes are vLLM's; plain prefill's grow with the
dataset as well), and the peak PSS of the whole tree (engine, KV cache and
model included), and the CPU seconds (user + system) after the start of
the job's own process and of the engine's processes (median of the timed
runs): on a machine whose cores the engine's threads fill, what the job's
own process uses there is taken from the engine; the seconds the threads of
each waited for a core while runnable (``/proc/<tid>/schedstat``: a
preempted OpenMP thread holds up its whole parallel region); and the CPU
seconds of everything else on the machine (kernel threads such as the
disk's writeback, other processes) with the seconds the hypervisor took the
cores for something else (steal, ``/proc/stat``).  The target is cli/prefill
>= 0.95 and the cli's peak within 10 % between the small and the large
dataset.

    python benchmarks/cli_job.py                      # 200 and 2000 samples (RESULTS.md)
    python benchmarks/cli_job.py --samples 600 --modes prefill,cli,cli-driver-threads2,cli-no-pool
    python benchmarks/cli_job.py --samples 2000 --modes prefill,cli,cli-in-flight-64 --repeat 3

Run it inside a test environment (``.tox/vllm016/bin/python``).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MAX_MODEL_LEN = 1024
# The CLI as shipped, and variants for before/after comparisons: (environment, extra arguments).
CLI_MODES: dict[str, tuple[dict[str, str], list[str]]] = {
    "cli": ({}, []),
    "cli-driver-threads2": ({"EAGLE3_COMPAT_DRIVER_THREADS": "2"}, []),  # before: torch's default here
    "cli-no-pool": ({"EAGLE3_COMPAT_ARENA_POOL_BYTES": "0"}, []),  # before: a new file per sample
    "cli-in-flight-64": ({}, ["--max-in-flight", "64"]),  # before: the default was 64
    # every prompt admitted at once, as plain prefill does (memory unbounded): a diagnostic
    "cli-in-flight-all": ({}, ["--max-in-flight", "1000000"]),
    "cli-crc32": ({}, ["--zip-crc32"]),  # before 2026-12-05: torch.save's zip CRC-32 computed
    "cli-no-trim": ({"EAGLE3_COMPAT_CPU_TRIM_MIB": "off"}, []),
    # before 2026-12-05: glibc's own mmap threshold in the worker (eagle3_compat.heap.reuse_step_buffers)
    "cli-mmap-glibc": ({"EAGLE3_COMPAT_CPU_MMAP_MIB": "off"}, []),  # before: the worker's heap never trimmed
    # before 2026-12-05: torch's large CPU buffers on 4 KiB pages (eagle3_compat.heap.engine_environment)
    "cli-no-thp": ({"THP_MEM_ALLOC_ENABLE": "0"}, []),
    "cli-trim-every-step": ({"EAGLE3_COMPAT_CPU_TRIM_MIB": "0"}, []),  # a trim after every step
    "cli-trim-256": ({"EAGLE3_COMPAT_CPU_TRIM_MIB": "256"}, []),  # before: 256 MiB over the working set
    "cli-interval-30": ({"EAGLE3_COMPAT_CPU_TRIM_INTERVAL_S": "30"}, []),  # at most one trim per 30 s
    # before: oneDNN's own default capacity of its primitive cache (eagle3_compat.heap)
    "cli-onednn-1024": ({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}, []),
    # the capture alone: none of the engine settings above that the job makes (trim, huge pages,
    # primitive cache), i.e. the engine as plain prefill runs it
    "cli-capture-only": ({"EAGLE3_COMPAT_CPU_TRIM_MIB": "off", "THP_MEM_ALLOC_ENABLE": "0",
                          "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}, []),
}


# modes that start the job another way than ``python -m eagle3_compat``
CLI_LAUNCHERS: dict[str, list[str]] = {
    # before 2026-12-05: main() without cli()'s freeze, so the interpreter's
    # collections at exit traverse every object of the process
    "cli-exit-gc": ["-c", "import sys; from eagle3_compat.__main__ import main; sys.exit(main(sys.argv[1:]))"],
    # a diagnostic: THP_MEM_ALLOC_ENABLE's 2 MiB alignment without huge pages
    # (prctl PR_SET_THP_DISABLE, which the engine's processes inherit)
    "cli-thp-no-huge": ["-c", "import ctypes, sys; assert ctypes.CDLL(None).prctl(41, 1, 0, 0, 0) == 0; "
                        "from eagle3_compat.__main__ import cli; sys.exit(cli())"],
}


def cli_mode(mode: str) -> tuple[dict[str, str], list[str]]:
    """A mode of :data:`CLI_MODES`, or ``cli-trim-<MiB>``: the trim's threshold at that size."""
    if mode in CLI_MODES:
        return CLI_MODES[mode]
    if mode in CLI_LAUNCHERS or mode in ("cli-out-shm", "cli-off-omp0"):
        return {}, []
    if mode.startswith("cli-trim-") and mode[len("cli-trim-"):].isdigit():
        return {"EAGLE3_COMPAT_CPU_TRIM_MIB": mode[len("cli-trim-"):]}, []
    if mode.startswith("cli-mmap-") and mode[len("cli-mmap-"):].isdigit():
        return mmap_env(int(mode[len("cli-mmap-"):])), []
    raise SystemExit(f"unknown mode {mode!r}: prefill, cli-trim-<MiB>, cli-before or one of "
                     f"{sorted([*CLI_MODES, *CLI_LAUNCHERS])}")


def mmap_env(mib: int) -> dict[str, str]:
    """glibc's mmap threshold fixed at ``mib`` MiB (its trim threshold at 4 GiB):
    buffers below it come from the heap and are reused, not mapped anew."""
    return {"MALLOC_MMAP_THRESHOLD_": str(mib << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def tree_pss(pid: int, children: bool = True) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *(root.children(recursive=True) if children else [])]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def tree_cpu(pid: int, into: dict[int, float], waits: dict[int, float] | None = None) -> None:
    """CPU seconds (user + system) of ``pid`` and each of its descendants,
    by pid, into ``into`` (a process that has exited keeps its last value;
    seen every 50 ms, each is at most that much short); and, into ``waits``,
    the seconds each one's threads waited for a core while runnable
    (``/proc/<pid>/task/<tid>/schedstat``, 2nd field, summed): on a machine
    whose cores the engine's threads fill, what another thread's work cost
    them (a preempted OpenMP thread holds up its whole parallel region)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            t = p.cpu_times()
            into[p.pid] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if waits is None:
            continue
        total = 0
        try:
            for task in os.scandir(f"/proc/{p.pid}/task"):
                try:
                    with open(f"{task.path}/schedstat") as f:
                        total += int(f.read().split()[1])
                except (OSError, IndexError, ValueError):
                    pass
        except OSError:
            continue
        waits[p.pid] = max(waits.get(p.pid, 0.0), total / 1e9)


def machine_cpu() -> tuple[float, float]:
    """The machine's CPU seconds since boot: (busy: user, nice, system, irq and
    softirq of every core; stolen by the hypervisor), from ``/proc/stat``."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq) / hz, steal / hz


def prefill_child(model: str, prompts_file: str) -> None:
    """Plain vLLM; touches ``<prompts_file>.ready`` once the engine is up."""
    from vllm import LLM, SamplingParams

    from eagle3_compat.cpu_attention import engine_kwargs  # the generator's block size on this CPU build

    prompts = json.loads(Path(prompts_file).read_text())
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="auto", enforce_eager=True, compilation_config=0,
              max_model_len=MAX_MODEL_LEN, max_num_seqs=32, max_num_batched_tokens=8192,
              enable_prefix_caching=False, seed=0, **engine_kwargs(None, model))
    Path(prompts_file + ".ready").touch()
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
    print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)


def off_engine_main(pid: int) -> None:
    """Mode ``cli-off-omp0``: once the engine is up, every thread of the job's
    process ``pid`` moves off the cores of the engine's processes that vLLM
    bound to fewer cores than the job has (their main thread is OpenMP
    thread 0, which runs the step's serial parts too); threads the job
    starts later inherit it.  A diagnostic (a benchmark-side setting)."""
    import psutil

    mine = os.sched_getaffinity(pid)
    engine: set[int] = set()
    for c in psutil.Process(pid).children(recursive=True):
        try:
            theirs = os.sched_getaffinity(c.pid)
        except OSError:
            continue
        if theirs < mine:  # bound by vLLM (OpenMP thread 0 of the engine or a worker)
            engine |= theirs
    new = mine - engine
    print(f"# off-omp0: engine main threads on {sorted(engine)}, job to {sorted(new)}", file=sys.stderr)
    if not new:
        return
    for task in os.scandir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task.name), new)
        except OSError:
            pass


def run(cmd: list[str], ready, env: dict, memory: bool = True, log: Path | None = None, on_ready=None) -> dict:
    """Run ``cmd``; ``ready()`` says when the engine is up (memory base).

    ``memory=False``: only the moment the engine is up is watched, no PSS
    sampling (it reads every process's page tables, a core's worth of work
    on this 2-core machine): the timed runs. ``log``: the child's stderr
    goes there (else nowhere)."""
    err = log.open("w") if log is not None else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    finally:
        if log is not None:
            err.close()
    base, peak, t_ready = [None], [0], [None]
    series: list[tuple[float, int]] = []  # (time, the tree's PSS) after the engine's start
    root = [None, 0]  # the job's own process (the driver): PSS at engine start, peak
    # CPU seconds (user + system) of each process of the tree, last seen, and
    # at the engine's start: where the time after the start went
    cpu: dict[int, float] = {}
    cpu_at_ready: dict[int, float] = {}
    wait: dict[int, float] = {}  # run-queue wait, the same way
    wait_at_ready: dict[int, float] = {}
    machine_at_ready = [None]  # machine_cpu() then
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            m = tree_pss(proc.pid) if memory else 0
            r = tree_pss(proc.pid, children=False) if memory else 0
            tree_cpu(proc.pid, cpu, wait)
            if base[0] is None and ready():
                base[0], root[0] = m, r
                t_ready[0] = time.perf_counter()
                cpu_at_ready.update(cpu)
                wait_at_ready.update(wait)
                machine_at_ready[0] = machine_cpu()
                if on_ready is not None:
                    on_ready(proc.pid)
            peak[0] = max(peak[0], m)
            root[1] = max(root[1], r)
            if memory and base[0] is not None:
                series.append((time.perf_counter(), m))
            time.sleep(0.05)

    th = threading.Thread(target=watch, daemon=True)
    t0 = time.perf_counter()
    th.start()
    out, _ = proc.communicate()
    wall = time.perf_counter() - t0
    machine_end = machine_cpu()
    stop.set()
    th.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed ({proc.returncode}): {out[-2000:]}")
    after = wall - (t_ready[0] - t0) if t_ready[0] is not None else float("nan")
    # the tree's peak over the first and the second half of the time after
    # the start: equal where memory is bounded, larger in the second half
    # where it grows with the samples done
    halves = [0, 0]
    if series:
        mid = (series[0][0] + series[-1][0]) / 2
        for t, m in series:
            halves[t >= mid] = max(halves[t >= mid], m)
    used = {pid: t - cpu_at_ready.get(pid, 0.0) for pid, t in cpu.items()}
    driver_cpu = used.pop(proc.pid, 0.0)
    waited = {pid: t - wait_at_ready.get(pid, 0.0) for pid, t in wait.items()}
    driver_wait = waited.pop(proc.pid, 0.0)
    busy, stolen = (float("nan"),) * 2
    if machine_at_ready[0] is not None:
        busy = machine_end[0] - machine_at_ready[0][0]
        stolen = machine_end[1] - machine_at_ready[0][1]
    return {"driver_wait": driver_wait, "engine_wait": sum(waited.values()),
            # CPU s after the start of everything else on the machine (kernel
            # threads such as the disk's writeback, other processes), and the
            # time the hypervisor gave the machine's cores to someone else
            "other_cpu": busy - driver_cpu - sum(used.values()), "stolen": stolen,
            "wall": wall, "after_start": after, "peak": peak[0], "base": base[0] or 0, "out": out,
            "driver_peak": root[1], "driver_base": root[0] or 0, "halves": halves,
            "driver_cpu": driver_cpu, "engine_cpu": sum(used.values())}


def _cores(spec: str) -> list[int]:
    """``0-3,6`` -> [0, 1, 2, 3, 6] (the syntax of VLLM_CPU_OMP_THREADS_BIND)."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", default="200,2000")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--no-memory", action="store_true", help="timed runs only (no run for memory)")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per mode (medians; all shown)")
    ap.add_argument("--engine-cores", default=None,
                    help="e.g. 0: vLLM's OpenMP threads on these cores (VLLM_CPU_OMP_THREADS_BIND) and the "
                         "rest of every process on the others (taskset), in every mode; stands in for a GPU "
                         "node, where the job's own work runs beside the engine, not on its cores")
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="keep each run's stderr there (<samples>-<mode>-<run>.log); e.g. with EAGLE3_COMPAT_DEBUG=1")
    ap.add_argument("--before-src", type=Path, default=None,
                    help="mode cli-before: the CLI from this tree's src (e.g. a git worktree of an "
                         "earlier commit), for before/after figures of a code change in one run")
    ap.add_argument("--modes", default="prefill,cli", help=f"prefill, cli-trim-<MiB>, cli-before (with --before-src) and any of "
                                              f"{sorted([*CLI_MODES, *CLI_LAUNCHERS])}")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        prefill_child(*args.child)
        return 0
    from eagle3_compat.testing import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="e3c-cli-bench-"))
    atexit.register(shutil.rmtree, work, True)  # the samples written: GBs per run
    model = make_tiny_model(work / "model", "llama", layers=args.layers, hidden=args.hidden)
    sizes = [int(x) for x in args.samples.split(",")]
    rng = random.Random(0)
    # log-normal lengths, median ~60 tokens, 8..400
    lengths = [min(400, max(8, int(rng.lognormvariate(4.1, 0.7)))) for _ in range(max(sizes))]
    prompts_all = [[4 + rng.randrange(500) for _ in range(n)] for n in lengths]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    pin: list[str] = []
    if args.engine_cores is not None:
        engine = set(_cores(args.engine_cores))
        rest = sorted(set(range(os.cpu_count() or 1)) - engine)
        if not rest:
            raise SystemExit(f"--engine-cores {args.engine_cores} leaves no core for the rest")
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.engine_cores
        pin = ["taskset", "-c", ",".join(map(str, rest))]
    print(f"# vLLM CPU engine, {os.cpu_count()} cores"
          + (f" (engine on {args.engine_cores}, the rest on {pin[-1]})" if pin else "")
          + f"; tiny Llama hidden {args.hidden}, {args.layers} layers, "
          f"bf16 (dtype auto); default layer ids; prompts median ~60 tokens")
    modes = [m for m in args.modes.split(",") if m != "prefill"]
    prefill_modes = [m for m in modes if m.startswith("prefill-mmap-")]
    modes = [m for m in modes if m not in prefill_modes]
    print("| samples | tokens | mode | tok/s | /prefill | s after start | /prefill | start s | peak extra MiB "
          "| of which the job's own process | peak MiB, whole tree | its 1st / 2nd half after start "
          "| CPU s after start: the job's own process / the engine's "
          "| s its threads waited for a core (runnable): the job's / the engine's "
          "| CPU s after start of the rest of the machine / stolen by the hypervisor (each run) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        prompts = prompts_all[:n]
        tokens = sum(map(len, prompts))
        pfile = work / f"prompts-{n}.json"
        pfile.write_text(json.dumps(prompts))
        jfile = work / f"prompts-{n}.jsonl"
        jfile.write_text("".join(json.dumps(p) + "\n" for p in prompts))
        jobs = {"prefill": ([*pin, sys.executable, __file__, "--child", str(model), str(pfile)],
                            lambda pfile=pfile: Path(str(pfile) + ".ready").exists(), env, None)}
        for mode in prefill_modes:
            jobs[mode] = (jobs["prefill"][0], jobs["prefill"][1],
                          dict(env, **mmap_env(int(mode[len("prefill-mmap-"):]))), None)
        for mode in modes:
            out = work / f"out-{n}-{mode}"
            if mode == "cli-out-shm":
                # the samples into memory (tmpfs), not onto the disk: the
                # kernel's writeback out of the comparison
                out = Path("/dev/shm") / f"{work.name}-out-{n}"
                atexit.register(shutil.rmtree, out, True)
            if mode == "cli-before":
                if args.before_src is None:
                    raise SystemExit("mode cli-before needs --before-src")
                extra_env, extra_args = {"PYTHONPATH": str(args.before_src.resolve())}, []
            else:
                extra_env, extra_args = cli_mode(mode)
            menv = dict(env, **extra_env)
            launcher = CLI_LAUNCHERS.get(mode, ["-m", "eagle3_compat"])
            jobs[mode] = ([*pin, sys.executable, *launcher, "generate", "--model", str(model),
                           "--input", str(jfile), "--output", str(out), "--max-model-len", str(MAX_MODEL_LEN),
                           "--no-trainer-checks", *extra_args],
                          # the manifest is written once the engine is up, before the first step
                          lambda out=out: (out / "manifest.json").exists(), menv, out)

        runs: dict[str, int] = {}

        def once(mode, memory):
            cmd, ready, menv, out = jobs[mode]
            if out is not None and out.exists():
                shutil.rmtree(out)
            Path(str(pfile) + ".ready").unlink(missing_ok=True)
            log = None
            if args.log_dir is not None:
                args.log_dir.mkdir(parents=True, exist_ok=True)
                runs[mode] = runs.get(mode, 0) + 1
                log = args.log_dir / f"{n}-{mode}-{runs[mode]}.log"
            r = run(cmd, ready, menv, memory, log, off_engine_main if mode == "cli-off-omp0" else None)
            if out is not None:
                written = len(list(out.glob("data_*.pt")))
                assert written == n, (written, n)
            return r

        # timed runs, the modes interleaved round by round (background load
        # hits them alike); the median of each; memory from one more run each
        timed = {mode: [] for mode in jobs}
        for _ in range(args.repeat):
            for mode in jobs:
                timed[mode].append(once(mode, memory=False))
        sampled = {mode: None if args.no_memory else once(mode, memory=True) for mode in jobs}
        med = {mode: {k: statistics.median(r[k] for r in runs)
                      for k in ("wall", "after_start", "driver_cpu", "engine_cpu", "driver_wait", "engine_wait",
                                "other_cpu", "stolen")}
               for mode, runs in timed.items()}
        pre = med["prefill"]
        for mode in jobs:
            r, m = med[mode], sampled[mode]
            spread = "" if args.repeat == 1 else " (" + ", ".join(f"{x['after_start']:.1f}" for x in timed[mode]) + ")"
            # each run's steal beside its time: a run the hypervisor took
            # cores from is told apart from a slower job
            stolen = "" if args.repeat == 1 else " (" + ", ".join(f"{x['stolen']:.1f}" for x in timed[mode]) + ")"
            mem = ("not measured | not measured | not measured | not measured" if m is None else
                   f"{(m['peak'] - m['base']) / 2**20:.0f} | {(m['driver_peak'] - m['driver_base']) / 2**20:.0f} "
                   f"| {m['peak'] / 2**20:.0f} | {m['halves'][0] / 2**20:.0f} / {m['halves'][1] / 2**20:.0f}")
            print(f"| {n} | {tokens} | {mode} | {tokens / r['wall']:.0f} | {pre['wall'] / r['wall']:.2f} | "
                  f"{r['after_start']:.1f}{spread} | {pre['after_start'] / r['after_start']:.2f} | "
                  f"{statistics.median(x['wall'] - x['after_start'] for x in timed[mode]):.1f} | {mem} "
                  f"| {r['driver_cpu']:.1f} / {r['engine_cpu']:.1f} | {r['driver_wait']:.1f} / {r['engine_wait']:.1f} "
                  f"| {r['other_cpu']:.1f} / {r['stolen']:.1f}{stolen} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
