"""The registry of settings (eagle3_compat.settings): every ``EAGLE3_COMPAT_*``
variable the source names is declared there once and documented in the
README; each reads as it always has (the same values, the same errors naming
the variable), through the modules that use it; ``status`` lists them all."""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_compat import settings

pytestmark = pytest.mark.once  # pure logic: the same on every vLLM release

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "eagle3_compat"
NAME = re.compile(r"EAGLE3_COMPAT_[A-Z0-9_]*[A-Z0-9]")
# read without the package before it is imported (interpreter start): the
# .pth line and the launcher's sitecustomize must stay this small
RAW_READERS = {"_boot/sitecustomize.py"}


def _sources() -> list[Path]:
    files = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
    return [*files, *sorted((ROOT / "src").glob("*.pth"))]


def _named_in_source() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in _sources():
        for name in NAME.findall(path.read_text(encoding="utf-8")):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_variable_in_the_source_is_declared():
    found = _named_in_source()
    assert "EAGLE3_COMPAT_LOG_LEVEL" in found  # the scan sees the source
    missing = {name: sorted(set(where)) for name, where in found.items() if name not in settings.SETTINGS}
    assert not missing, f"not declared in eagle3_compat/settings.py: {missing}"


def test_no_module_reads_its_variable_around_the_registry():
    pattern = re.compile(r"environ(?:\.get\(|\[)\s*[\"']EAGLE3_COMPAT_")
    offenders = []
    for path in _sources():
        rel = path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else path.name
        if rel in RAW_READERS or path.suffix == ".pth" or rel == "settings.py":
            continue
        offenders += [f"{rel}: {m.group(0)}" for m in pattern.finditer(path.read_text(encoding="utf-8"))]
    assert not offenders


def test_every_declared_variable_is_documented_in_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert not [name for name in settings.SETTINGS if name not in readme]


def test_each_declaration_is_complete():
    assert len(settings.SETTINGS) >= 15
    for name, s in settings.SETTINGS.items():
        assert s.name == name and NAME.fullmatch(name), name
        for text in (s.type, s.allowed, s.meaning, s.shown_default):
            assert text and "\n" not in text, (name, text)
        assert s.get({}) == s.default, name  # unset: the default
    with pytest.raises(ValueError, match="declared twice"):
        settings._declare(settings.TRANSPORT)
    with pytest.raises(KeyError, match="EAGLE3_COMPAT_NOPE is not an eagle3_compat setting"):
        settings.get("EAGLE3_COMPAT_NOPE")


# One row per value: what each variable has always read as.
GOOD = [
    ("EAGLE3_COMPAT_STRICT", "", False),
    ("EAGLE3_COMPAT_STRICT", "0", False),
    ("EAGLE3_COMPAT_STRICT", "1", True),
    ("EAGLE3_COMPAT_STRICT", "yes", True),
    ("EAGLE3_COMPAT_STRICT", " 0", True),  # unstripped, as always
    ("EAGLE3_COMPAT_ALLOW_UNVERIFIED", "1", True),
    ("EAGLE3_COMPAT_DEBUG", "0", False),
    ("EAGLE3_COMPAT_DEBUG", "1", True),
    ("EAGLE3_COMPAT_VLLM_VERSION", "", None),
    ("EAGLE3_COMPAT_VLLM_VERSION", "0.16.0+cpu", "0.16.0+cpu"),
    ("EAGLE3_COMPAT_VLLM_VERSION", "not a version", "not a version"),  # checked where it is parsed
    ("EAGLE3_COMPAT_LOG_LEVEL", "", None),
    ("EAGLE3_COMPAT_LOG_LEVEL", " warning ", logging.WARNING),
    ("EAGLE3_COMPAT_LOG_LEVEL", "15", 15),
    ("EAGLE3_COMPAT_LOG_LEVEL", "chatty", None),  # an unknown name counts as unset
    ("EAGLE3_COMPAT_TRANSPORT", "", "auto"),
    ("EAGLE3_COMPAT_TRANSPORT", " SHM ", "shm"),
    ("EAGLE3_COMPAT_TRANSPORT", "rpc", "rpc"),
    ("EAGLE3_COMPAT_DIRECT", "", True),
    ("EAGLE3_COMPAT_DIRECT", " 0 ", False),
    ("EAGLE3_COMPAT_SHARD", "1", True),
    ("EAGLE3_COMPAT_SHARD", "0", False),
    ("EAGLE3_COMPAT_ARENA_POOL_BYTES", "", None),
    ("EAGLE3_COMPAT_ARENA_POOL_BYTES", "AUTO", None),
    ("EAGLE3_COMPAT_ARENA_POOL_BYTES", "0", 0),
    ("EAGLE3_COMPAT_ARENA_POOL_BYTES", "12345", 12345),
    ("EAGLE3_COMPAT_DRIVER_THREADS", "", None),
    ("EAGLE3_COMPAT_DRIVER_THREADS", " 3 ", 3),
    ("EAGLE3_COMPAT_CPU_TRIM_MIB", "", 64.0),
    ("EAGLE3_COMPAT_CPU_TRIM_MIB", "Off", None),
    ("EAGLE3_COMPAT_CPU_TRIM_MIB", "0.5", 0.5),
    ("EAGLE3_COMPAT_CPU_TRIM_INTERVAL_S", "", None),
    ("EAGLE3_COMPAT_CPU_TRIM_INTERVAL_S", "2.5", 2.5),
    ("EAGLE3_COMPAT_CPU_MMAP_MIB", "", 1024.0),
    ("EAGLE3_COMPAT_CPU_MMAP_MIB", "none", None),
    ("EAGLE3_COMPAT_CPU_MMAP_MIB", "256", 256.0),
    ("EAGLE3_COMPAT_APPLIED", "", None),
    ("EAGLE3_COMPAT_APPLIED", '{"dtype": null}', '{"dtype": null}'),  # JSON, read by _inherit
    ("EAGLE3_COMPAT_THP_AFTER_START", "1", True),
    ("EAGLE3_COMPAT_THP_AFTER_START", "yes", False),  # exactly "1"
]


@pytest.mark.parametrize("name,raw,value", GOOD)
def test_values_read_as_before(name, raw, value):
    assert settings.get(name, {name: raw}) == value


def test_reads_happen_at_call_time(monkeypatch):
    monkeypatch.setenv("EAGLE3_COMPAT_TRANSPORT", "rpc")
    assert settings.TRANSPORT.get() == "rpc"
    monkeypatch.setenv("EAGLE3_COMPAT_TRANSPORT", "shm")
    assert settings.TRANSPORT.get() == "shm"
    monkeypatch.delenv("EAGLE3_COMPAT_TRANSPORT")
    assert settings.TRANSPORT.get() == "auto"


# One row per bad value: the variable, the value and the message the module
# raised before the registry (tests elsewhere match these).
BAD = [
    ("EAGLE3_COMPAT_TRANSPORT", "bogus",
     "EAGLE3_COMPAT_TRANSPORT must be one of ('auto', 'shm', 'rpc'), got 'bogus'"),
    ("EAGLE3_COMPAT_DIRECT", "yes", "EAGLE3_COMPAT_DIRECT must be 0 or 1, got 'yes'"),
    ("EAGLE3_COMPAT_SHARD", "2", "EAGLE3_COMPAT_SHARD must be 0 or 1, got '2'"),
    ("EAGLE3_COMPAT_ARENA_POOL_BYTES", "lots",
     "EAGLE3_COMPAT_ARENA_POOL_BYTES must be 'auto' or a number of bytes >= 0, got 'lots'"),
    ("EAGLE3_COMPAT_ARENA_POOL_BYTES", "-1",
     "EAGLE3_COMPAT_ARENA_POOL_BYTES must be 'auto' or a number of bytes >= 0, got '-1'"),
    ("EAGLE3_COMPAT_DRIVER_THREADS", "0", "EAGLE3_COMPAT_DRIVER_THREADS must be a positive integer, got '0'"),
    ("EAGLE3_COMPAT_DRIVER_THREADS", "two",
     "EAGLE3_COMPAT_DRIVER_THREADS must be a positive integer, got 'two'"),
    ("EAGLE3_COMPAT_CPU_TRIM_MIB", "nan", "EAGLE3_COMPAT_CPU_TRIM_MIB='nan': expected a number of MiB >= 0, or 'off'"),
    ("EAGLE3_COMPAT_CPU_TRIM_MIB", "-1", "EAGLE3_COMPAT_CPU_TRIM_MIB='-1': expected a number of MiB >= 0, or 'off'"),
    ("EAGLE3_COMPAT_CPU_TRIM_INTERVAL_S", "off",
     "EAGLE3_COMPAT_CPU_TRIM_INTERVAL_S='off': expected a number of seconds >= 0"),
    ("EAGLE3_COMPAT_CPU_MMAP_MIB", "inf", "EAGLE3_COMPAT_CPU_MMAP_MIB='inf': expected a number of MiB >= 0, or 'off'"),
]


@pytest.mark.parametrize("name,raw,message", BAD)
def test_a_bad_value_raises_naming_the_variable(name, raw, message):
    with pytest.raises(ValueError) as err:
        settings.get(name, {name: raw})
    assert str(err.value) == message


def test_every_checked_setting_has_a_bad_value_row():
    checked = {name for name, _raw, _msg in BAD}
    # the others take any text (flags, a level, a version, JSON) or are internal
    unchecked = {"EAGLE3_COMPAT_STRICT", "EAGLE3_COMPAT_ALLOW_UNVERIFIED", "EAGLE3_COMPAT_DEBUG",
                 "EAGLE3_COMPAT_LOG_LEVEL", "EAGLE3_COMPAT_VLLM_VERSION", "EAGLE3_COMPAT_APPLIED",
                 "EAGLE3_COMPAT_THP_AFTER_START"}
    assert checked | unchecked == set(settings.SETTINGS) and not checked & unchecked


def test_the_modules_read_through_the_registry(monkeypatch):
    """Each module's own accessor gives the registry's value and error."""
    from eagle3_compat import _inherit, adapters, arena, dataset, heap, logs, versions

    assert arena.POOL_ENV == settings.ARENA_POOL_BYTES.name
    assert arena.TRANSPORTS == settings.TRANSPORTS
    assert (heap.ENV, heap.INTERVAL_ENV, heap.MMAP_ENV, heap.START_WITHOUT_HUGE_PAGES_ENV) == (
        settings.CPU_TRIM_MIB.name, settings.CPU_TRIM_INTERVAL_S.name, settings.CPU_MMAP_MIB.name,
        settings.THP_AFTER_START.name)
    assert (heap.DEFAULT_MIB, heap.DEFAULT_MMAP_MIB) == (64.0, 1024.0)
    assert (logs.ENV_LEVEL, logs.ENV_DEBUG) == (settings.LOG_LEVEL.name, settings.DEBUG.name)
    assert dataset.DRIVER_THREADS_ENV == settings.DRIVER_THREADS.name
    assert versions.ENV_VLLM_VERSION == settings.VLLM_VERSION.name
    assert adapters.ENV_ALLOW_UNVERIFIED == settings.ALLOW_UNVERIFIED.name
    assert _inherit.ENV == settings.APPLIED.name
    import eagle3_compat

    assert (eagle3_compat.ENV_STRICT, eagle3_compat.ENV_APPLIED) == (settings.STRICT.name, settings.APPLIED.name)

    for name, accessor in [("EAGLE3_COMPAT_TRANSPORT", arena.transport_choice),
                           ("EAGLE3_COMPAT_DIRECT", arena.direct_choice),
                           ("EAGLE3_COMPAT_SHARD", arena.shard_choice),
                           ("EAGLE3_COMPAT_ARENA_POOL_BYTES", arena.pool_keep_bytes),
                           ("EAGLE3_COMPAT_CPU_TRIM_MIB", heap.threshold_from_env),
                           ("EAGLE3_COMPAT_CPU_TRIM_INTERVAL_S", heap.interval_from_env),
                           ("EAGLE3_COMPAT_CPU_MMAP_MIB", heap.mmap_threshold_from_env)]:
        monkeypatch.delenv(name, raising=False)
        assert accessor() == settings.SETTINGS[name].default, name
        monkeypatch.setenv(name, "??")
        with pytest.raises(ValueError, match=re.escape(name)):
            accessor()
        monkeypatch.delenv(name)

    class FakeTorch:
        threads = None

        class cuda:  # noqa: N801
            @staticmethod
            def is_available():
                return False

        @classmethod
        def set_num_threads(cls, n):
            cls.threads = n

    monkeypatch.setenv("EAGLE3_COMPAT_DRIVER_THREADS", "3")
    dataset._limit_driver_threads(FakeTorch)
    assert FakeTorch.threads == 3
    monkeypatch.setenv("EAGLE3_COMPAT_DRIVER_THREADS", "-2")
    with pytest.raises(ValueError, match="EAGLE3_COMPAT_DRIVER_THREADS must be a positive integer, got '-2'"):
        dataset._limit_driver_threads(FakeTorch)

    monkeypatch.setenv("EAGLE3_COMPAT_DEBUG", "0")
    monkeypatch.setenv("EAGLE3_COMPAT_LOG_LEVEL", "error")
    assert logs.level_from_env(None) == logging.ERROR
    monkeypatch.setenv("EAGLE3_COMPAT_LOG_LEVEL", "chatty")
    assert logs.level_from_env(7) == 7
    monkeypatch.setenv("EAGLE3_COMPAT_DEBUG", "1")
    assert logs.level_from_env(None) == logging.DEBUG

    monkeypatch.setenv("EAGLE3_COMPAT_VLLM_VERSION", "0.33.0rc1")
    found = versions.detect()
    assert (found.vllm, found.vllm_dist) == ("0.33.0rc1", "EAGLE3_COMPAT_VLLM_VERSION override")

    assert heap.allow_huge_pages_after_start({}) is False  # not asked to: nothing read from prctl


def test_status_lists_every_setting(monkeypatch, capsys):
    import eagle3_compat
    import eagle3_compat.__main__ as cli

    monkeypatch.setattr(eagle3_compat, "status", lambda: "the status table")
    for name in settings.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("EAGLE3_COMPAT_TRANSPORT", "rpc")
    monkeypatch.setenv("EAGLE3_COMPAT_SHARD", "2")
    assert cli._status(argparse.Namespace()) == 0
    out = capsys.readouterr().out
    assert out.startswith("the status table\n")
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^  (EAGLE3_COMPAT_\S+)\s{2,}(.+?)\s{2,}(.+)$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    assert list(rows) == list(settings.SETTINGS)
    for name, s in settings.SETTINGS.items():
        value, meaning = rows[name]
        assert meaning.startswith(s.meaning), name
        if name == "EAGLE3_COMPAT_TRANSPORT":
            assert value == "rpc"
        elif name == "EAGLE3_COMPAT_SHARD":
            assert value == "2 (INVALID)"  # listed, not raised: status is for bug reports
        else:
            assert value == f"(default: {s.shown_default})", name
    assert rows["EAGLE3_COMPAT_CPU_TRIM_MIB"][0] == "(default: 64)"


def test_the_registry_imports_nothing_heavy():
    code = ("import sys, eagle3_compat.settings\n"
            "print([m for m in ('torch', 'vllm', 'speculators', 'transformers') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
