"""The README's support matrix agrees with the adapter records, tox and compat/."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

from eagle3_compat.adapters import ADAPTERS
from eagle3_compat.versions import SUPPORTED_VLLM

ROOT = Path(__file__).resolve().parent.parent


def readme_rows():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Support matrix", 1)[1]
    rows = {}
    for m in re.finditer(r"^\| (0\.\d+) \| `(vllm\d+)` \| (\w+) \| ([^|]+) \|$", section, re.M):
        rows[m.group(1)] = (m.group(2), {a.strip() for a in m.group(4).split(",")}, m.group(3))
    return rows


def test_every_supported_minor_has_a_row_an_env_and_a_lock():
    (lo_major, lo), (hi_major, hi) = SUPPORTED_VLLM
    minors = [f"{lo_major}.{m}" for m in range(lo, hi + 1)]
    rows = readme_rows()
    assert sorted(rows, key=lambda v: int(v.split(".")[1])) == minors
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    envlist = [e.strip() for e in tox["tox"]["envlist"].split(",")]
    for minor, (env, _, _) in rows.items():
        assert env == f"vllm{int(minor.split('.')[1]):03d}"
        assert env in envlist
        assert (ROOT / "compat" / f"{env}.txt").exists() and (ROOT / "compat" / f"{env}.in").exists()


def test_suite_column_matches_tox():
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    setenv = tox["testenv"]["setenv"]
    default = re.search(r"^E3C_SUITE = \{env:E3C_SUITE:(\w+)\}$", setenv, re.M).group(1)
    for minor, (env, _, suite) in readme_rows().items():
        override = re.search(rf"^[\w,]*\b{env}\b[\w,]*: E3C_SUITE = (\w+)$", setenv, re.M)
        assert suite == (override.group(1) if override else default), (minor, env, suite)


def test_adapter_column_matches_the_records():
    for minor, (_, listed, _) in readme_rows().items():
        version = tuple(int(x) for x in minor.split("."))
        expected = {a.id for a in ADAPTERS if a.applies_to(version)}
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
