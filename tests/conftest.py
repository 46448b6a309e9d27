"""Shared fixtures: environment for the real CPU engine, tiny models, references."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Engine processes inherit these (they are spawned).  Set before vllm is imported.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
# MLA attention has no CPU implementation; DeepseekV2/V3 decoder layers are
# the same with it disabled (findings §1).
os.environ.setdefault("VLLM_MLA_DISABLE", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


def _have(mod: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(mod) is not None


HAVE_ENGINE = _have("vllm") and _have("speculators") and _have("torch")

# Where vLLM's *own* forward (no eagle3_compat) differs from Hugging Face
# float32 for a family (README, "Verified families"): only there may a family
# test record an expected failure against HF, and only after the capture
# matched vLLM's own forward one prompt per call (1e-5).  On any other release
# an HF mismatch fails the test.
VLLM_DIFFERS_FROM_HF = {
    "qwen3": {(0, 12), (0, 13)},
    "qwen3_moe": {(0, 12), (0, 13)},
    "olmo2": {(0, 12), (0, 13)},
}


# Where vLLM's *own* model module for a family does not import (README,
# "Verified families"): the family test records an expected failure there,
# naming vLLM's error, and only on these releases.  Seen (0.19 and 0.29 envs,
# transformers 5.24): vllm/model_executor/models/llava.py -> pixtral.py ->
# mistral_common -> transformers 5's image processing -> torchvision.transforms
# ("No module named 'torchvision'"); compat/envs.py leaves torchvision out
# (text models), and under transformers 4 (0.11-0.17) nothing imports it.
VLLM_CANNOT_LOAD = {
    "llava": ({(0, 19), (0, 25), (0, 29), (0, 32)}, "vllm.model_executor.models.llava"),
}


def vllm_cannot_load(family: str) -> str | None:
    """vLLM's own import error for ``family``'s model module, or None."""
    import importlib

    entry = VLLM_CANNOT_LOAD.get(family)
    module = entry[1] if entry else {"llava": "vllm.model_executor.models.llava"}.get(family)
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"{module}: {type(exc).__name__}: {exc}"
    return None


# Tiers (E3C_SUITE): "full" runs everything; "core" skips the tests marked
# "extended"; "parallel" is the core plus the extended tests of tensor or
# pipeline parallel 2 engines (marked "parallel": where a release's own
# multi-worker code runs; tox: the oldest release, beside 0.16's full suite).
SUITES = ("full", "core", "parallel")
SUITE = os.environ.get("E3C_SUITE", "full").strip() or "full"
if SUITE not in SUITES:
    raise pytest.UsageError(f"E3C_SUITE={SUITE!r}: expected one of {', '.join(SUITES)}")
FULL = SUITE == "full"
# Tests marked "edge" (speculators' own scripts end to end, a vLLM feature
# of one model family) run with the full suite and in the env of the newest
# release (E3C_EDGE=1, tox: vllm032), where vLLM and transformers differ most
# from the full-suite releases; the other core envs skip them.
EDGE = FULL or os.environ.get("E3C_EDGE", "0") == "1"
# Tests marked "lifecycle" start an engine of their own only to kill it,
# interrupt it or tear its capture down (processes and /dev/shm left clean,
# a clear error after): the full and parallel tiers run them (0.16, 0.11)
# and, in the core tier, the newest release's env (E3C_EDGE=1, vllm032); the
# releases between skip them (each such engine start is 15-40 s there).
LIFECYCLE = FULL or SUITE == "parallel" or EDGE
# The core and parallel tiers (every release but 0.16's full suite) turn off
# torch.compile in its processes and their engines.  Every engine the tests
# start runs its model eagerly anyway (the generator and the reference pass
# compilation_config=0; test_engine_core checks it on each release), but
# vLLM's CPU worker compiles its sampler's random-sampling function at
# warm-up (vllm/v1/sample/ops/topk_topp_sampler.py, compiled_random_sample):
# measured here, an engine start took 40 s with it and 25 s without on 0.25
# (inductor's vector-ISA probes and dynamo), 10-13 s and 8 s on 0.16.  The
# full suite (0.16) runs with it, as users do.
if not FULL:
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
# vLLM 0.11-0.17: the workers of a multi-worker engine (tensor or pipeline
# parallel 2; the multiproc executor) wait for the engine's next message by
# spinning on sched_yield(), each pinned to a core, for as long as the
# engine lives, unless VLLM_SLEEP_WHEN_IDLE=1 (then they sleep 0.1 s at a
# time after 3 s without a message; vllm/distributed/device_communicators/
# shm_broadcast.py, SpinSleepTimer).  0.19+ wait on a socket after 1 s and
# no longer know the variable.  Here, with two tox envs side by side on 2
# cores, an idle PP 2 engine's two spinning workers held both cores from the
# other env's work and, seen once (2026-12-05, kernel 6.18), starved the
# kernel's per-CPU page-list drain: a new engine's workers hung in
# migrate_pages() (its thread binding) until the spinners were killed, and
# both envs' PP tests timed out.  The generator sets it for its own CPU
# engines of several workers (eagle3_compat.heap.engine_environment; the PP
# fixture starts one without this setting to check that); this covers every
# other engine of the tests (plain vLLM references included).
def _vllm_spins_when_idle() -> bool:
    from eagle3_compat.versions import detect, minor

    v = detect().vllm_version
    return v is not None and minor(v) <= (0, 17)


if _vllm_spins_when_idle():
    os.environ.setdefault("VLLM_SLEEP_WHEN_IDLE", "1")
# Tests marked "once" check pure logic whose result does not depend on the
# vLLM release (the mutants of the capture core): tox runs them in one env
# (E3C_ONCE=1 there, 0 in the others); a plain pytest run includes them.
ONCE = os.environ.get("E3C_ONCE", "1") == "1"


def pytest_collection_modifyitems(config, items):
    no_engine = pytest.mark.skip(reason="vllm/speculators/torch not installed (run through tox)")
    core_only = pytest.mark.skip(
        reason=f"extended test: skipped with E3C_SUITE={SUITE} (tox runs it in the full suite's env, vllm016)"
    )
    edge_only = pytest.mark.skip(
        reason="edge test: runs with the full suite and in the newest release's env (E3C_EDGE=1)"
    )
    lifecycle_elsewhere = pytest.mark.skip(
        reason="lifecycle test: runs in the full and parallel tiers and the newest release's env (E3C_EDGE=1)"
    )
    once_elsewhere = pytest.mark.skip(reason="runs in one tox env only (E3C_ONCE=1: vllm016)")
    no_gpu = None
    if any("gpu" in item.keywords for item in items):
        from eagle3_compat.testing import gpu_unavailable

        why = gpu_unavailable()
        no_gpu = why and pytest.mark.skip(reason=f"GPU suite: {why}")
    for item in items:
        if "gpu" in item.keywords:
            if no_gpu:
                item.add_marker(no_gpu)
        elif "once" in item.keywords and not ONCE:
            item.add_marker(once_elsewhere)
        elif "engine" in item.keywords and not HAVE_ENGINE:
            item.add_marker(no_engine)
        elif "extended" in item.keywords and not FULL and not (SUITE == "parallel" and "parallel" in item.keywords):
            item.add_marker(core_only)
        elif "edge" in item.keywords and not EDGE:
            item.add_marker(edge_only)
        elif "lifecycle" in item.keywords and not LIFECYCLE:
            item.add_marker(lifecycle_elsewhere)


_ENGINE_STARTS = None


def pytest_sessionstart(session):
    """Where tox asks for it (``E3C_REPORT_DIR``), count the engines this session starts."""
    global _ENGINE_STARTS
    out = os.environ.get("E3C_REPORT_DIR")
    if out:
        from _engine_starts import EngineStarts

        _ENGINE_STARTS = EngineStarts(Path(out))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if _ENGINE_STARTS is not None:
        _ENGINE_STARTS.current = item.nodeid


def pytest_sessionfinish(session, exitstatus):
    if _ENGINE_STARTS is not None:
        _ENGINE_STARTS.finish()


def pytest_runtest_logreport(report):
    """With ``E3C_FAILURES_AT_ONCE=1`` (``tools/gpu_run.sh`` sets it), a failed
    test's report is written to stderr as it fails, not only in the final
    summary: a run stopped from outside (a device call's time limit) still
    shows why each case failed."""
    if report.failed and os.environ.get("E3C_FAILURES_AT_ONCE") == "1":
        import sys

        sys.stderr.write(f"\n=== FAILED {report.nodeid} ({report.when}) ===\n{report.longreprtext[-6000:]}\n")
        sys.stderr.flush()


_ROOT_CAUSE = ("Error:", "Error(", "Exception:", "error:", "EADDRINUSE", "Killed", "Traceback")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After the summary (CI shows the output's tail), the lines of each failed
    test's captured output that name an error: an engine that dies at start
    prints its root cause in its own process, far above the driver's
    "Engine core initialization failed"."""
    failed = terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", [])
    if not failed:
        return
    terminalreporter.section("root causes of the failures (error lines of captured output)")
    for rep in failed:
        lines: list[str] = []
        for _name, text in rep.sections:
            for line in text.splitlines():
                if any(k in line for k in _ROOT_CAUSE) and line not in lines:
                    lines.append(line)
        terminalreporter.write_line(f"{rep.nodeid}:")
        for line in lines[-12:]:
            terminalreporter.write_line("    " + line.strip()[:300])


@pytest.fixture(scope="session")
def vllm_minor():
    from eagle3_compat.versions import detect, minor

    return minor(detect().vllm_version)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> path of a tiny random-weight checkpoint (made once per session)."""
    from eagle3_compat.testing import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    cache = {}

    def get(family: str = "llama", **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in cache:
            name = family + "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
            cache[key] = make_tiny_model(root / name, family, **kw)
        return cache[key]

    return get


# The shared Llama generator: float32, layer ids unsorted and including the
# first and last layer of the 6-layer model.
GEN_LAYERS = [5, 0, 2]
GEN_MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def llama_gen(tiny_models):
    """One generator on the tiny Llama for every test that only calls
    generate() on it (an engine start costs ~12 s of a 2-core machine)."""
    from eagle3_compat.testing import ensure_applied

    ensure_applied("float32")
    from speculators.data_generation import VllmHiddenStatesGenerator

    g = VllmHiddenStatesGenerator(str(tiny_models("llama")), layer_ids=GEN_LAYERS, max_model_len=GEN_MAX_MODEL_LEN)
    yield g
    g.close()


@pytest.fixture
def applied_f32():
    """speculators' generator patched, engine dtype float32 (for tight references)."""
    from eagle3_compat.testing import ensure_applied

    return ensure_applied("float32")


@pytest.fixture(autouse=True)
def _children_do_not_inherit_apply(monkeypatch):
    """apply() in this process (an earlier test) is inherited by child
    processes through EAGLE3_COMPAT_APPLIED; tests that start interpreters
    choose that state themselves."""
    monkeypatch.delenv("EAGLE3_COMPAT_APPLIED", raising=False)


def orphaned_semaphores(since_ns: int) -> list[str]:
    """multiprocessing's named semaphores (``/dev/shm/sem.mp-*``) created
    since ``since_ns`` that no live process has mapped any more.

    multiprocessing unlinks them through its resource tracker; a test that
    SIGKILLs a whole process group kills that tracker as well, and the
    semaphores stay (32 bytes each; seen after the CLI's interrupted-run
    test).  A semaphore still in use is mapped by its holders, so one of
    another env running beside this one is left alone.

    Mapped is matched by inode, never by name: glibc's ``sem_open`` builds
    the semaphore in a temporary file, maps it and only then links it under
    its name, so its creator's ``/proc/<pid>/maps`` shows the temporary name
    (``/dev/shm/sem.XXXXXX (deleted)``).  Matching names took every live
    semaphore of a process that had created it as orphaned, and CI's run of
    stop 39 lost an engine of the env beside it to that."""
    import glob

    new: dict[int, str] = {}
    for path in glob.glob("/dev/shm/sem.mp-*"):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        if st.st_mtime_ns >= since_ns:
            new[st.st_ino] = path
    if not new:
        return []
    mapped: set[int] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                # address perms offset dev inode path
                mapped.update(int(line.split()[4]) for line in f if "/dev/shm/sem." in line)
        except (OSError, IndexError, ValueError):
            continue
    return sorted(path for ino, path in new.items() if ino not in mapped)


@pytest.fixture
def reap_semaphores():
    """For tests that SIGKILL an engine's processes: afterwards, remove the
    named semaphores the killed processes left (see ``orphaned_semaphores``)."""
    import time

    since = time.time_ns() - 1_000_000_000  # tmpfs timestamps are coarser than time_ns()
    yield
    for path in orphaned_semaphores(since):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
