"""The README's support matrix agrees with the adapter records, tox and compat/."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

from eagle3_compat.adapters import ADAPTERS
from eagle3_compat.versions import SUPPORTED_VLLM

ROOT = Path(__file__).resolve().parent.parent


def _section() -> str:
    return (ROOT / "README.md").read_text().split("## Support matrix", 1)[1].split("\n## ", 1)[0]


def readme_rows():
    rows = {}
    for m in re.finditer(r"^\| (0\.\d+) \| `(vllm\d+)` \| (\w+(?: \+ \w+)?) \| ([^|]+) \|$", _section(), re.M):
        rows[m.group(1)] = (m.group(2), {a.strip() for a in m.group(4).split(",")}, m.group(3))
    return rows


def probed_ranges():
    """``| 0.20-0.24 | probed | between `vllm019` and `vllm025` |`` rows: releases CI does not run."""
    out = []
    pattern = r"^\| (0\.\d+)(?:-(0\.\d+))? \| probed \| between `(vllm\d+)` and `(vllm\d+)` \|$"
    for m in re.finditer(pattern, _section(), re.M):
        lo = int(m.group(1).split(".")[1])
        hi = int((m.group(2) or m.group(1)).split(".")[1])
        out.append((lo, hi, m.group(3), m.group(4)))
    return out


def _tox() -> configparser.ConfigParser:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    return tox


def test_every_supported_minor_has_a_row_an_env_and_a_lock_or_lies_in_a_probed_range():
    (lo_major, lo), (hi_major, hi) = SUPPORTED_VLLM
    rows = readme_rows()
    tested = sorted(int(v.split(".")[1]) for v in rows)
    probed = probed_ranges()
    covered = tested + [m for a, b, _, _ in probed for m in range(a, b + 1)]
    assert sorted(covered) == list(range(lo, hi + 1))  # each minor exactly once
    assert tested[0] == lo and tested[-1] == hi  # the ends of the range run in CI
    for a, b, below, above in probed:
        # a probed range lies between the two tested releases it names, nothing else between
        assert below == f"vllm{max(t for t in tested if t < a):03d}"
        assert above == f"vllm{min(t for t in tested if t > b):03d}"
    envlist = [e.strip() for e in _tox()["tox"]["envlist"].split(",")]
    for minor, (env, _, _) in rows.items():
        assert env == f"vllm{int(minor.split('.')[1]):03d}"
        assert env in envlist
        assert (ROOT / "compat" / f"{env}.txt").exists() and (ROOT / "compat" / f"{env}.in").exists()
    assert len(envlist) == len(set(envlist))


def test_suite_column_matches_tox():
    tox = _tox()
    setenv = tox["testenv"]["setenv"]
    default = re.search(r"^E3C_SUITE = \{env:E3C_SUITE:(\w+)\}$", setenv, re.M).group(1)
    for minor, (env, _, suite) in readme_rows().items():
        override = re.search(rf"^[\w,]*\b{env}\b[\w,]*: E3C_SUITE = (\w+)$", setenv, re.M)
        # or in the env's own section: E3C_SUITE = {env:E3C_SUITE:core}
        own = tox[f"testenv:{env}"].get("setenv", "") if tox.has_section(f"testenv:{env}") else ""
        own_default = re.search(r"^E3C_SUITE = \{env:E3C_SUITE:(\w+)\}$", own, re.M)
        want = override.group(1) if override else own_default.group(1) if own_default else default
        base, _, extra = suite.partition(" + ")
        assert base == want, (minor, env, suite)
        # "core + edge": the env also runs the tests marked edge (E3C_EDGE = 1 in its section)
        assert (extra == "edge") == bool(re.search(r"^E3C_EDGE = 1$", own, re.M)), (minor, env, suite)
        assert extra in ("", "edge"), (minor, env, suite)


def _locked(env: str, package: str) -> str | None:
    for line in (ROOT / "compat" / f"{env}.txt").read_text().splitlines():
        if line.lower().startswith(f"{package}=="):
            return line.split("==", 1)[1].strip()
    return None


def test_adapter_column_matches_the_records():
    """What apply() installs in that env: the vLLM range of each record, and
    its fine choice by the packages the env's lock pins (transformers)."""
    from eagle3_compat.versions import Found

    for minor, (env, listed, _) in readme_rows().items():
        version = tuple(int(x) for x in minor.split("."))
        found = Found(vllm=minor, vllm_dist="lock", speculators=_locked(env, "speculators"),
                      torch=_locked(env, "torch"), transformers=_locked(env, "transformers"))
        expected = {a.id for a in ADAPTERS if a.applies_to(version) and a.needed_for(found)}
        assert listed == expected, (minor, listed, expected)


def test_records_are_complete():
    for a in ADAPTERS:
        assert a.id and a.targets and a.upstream and a.remove_when
        assert a.vllm_min <= a.vllm_max
        doc = __import__(a.probe.__module__, fromlist=["_"]).__doc__
        for heading in ("Upstream symbol", "Why it breaks", "How it is fixed", "Remove when"):
            assert heading in doc, (a.id, heading)


def test_verified_families_table_matches_the_refusal_list():
    from eagle3_compat.adapters import VERIFIED_ARCHITECTURES
    from eagle3_compat.testing import FAMILIES, _config

    section = (ROOT / "README.md").read_text().split("Verified model families", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    assert listed == set(VERIFIED_ARCHITECTURES)
    # every verified architecture has a tiny-model family the suite runs
    made = {a for f in FAMILIES for a in _config(f, 512, 6, 256)["architectures"]}
    assert set(VERIFIED_ARCHITECTURES) <= made
