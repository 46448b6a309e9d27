"""apply()/revert() lifecycle, journal semantics and light import (no engine)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eagle3_compat._journal import NOTSET, Journal
from eagle3_compat.versions import minor, parse, vllm_supported


class Owner:
    a = "original-a"


class Child(Owner):
    pass


def test_journal_restores_identity_and_deletes_new_attributes():
    j = Journal()
    orig = vars(Owner)["a"]
    j.set(Owner, "a", "patched")
    j.set(Owner, "a", "patched-again")  # first original wins
    j.set(Owner, "new", 1)
    j.set(Child, "a", "child")  # inherited: must be deleted on undo, not copied down
    assert Owner.a == "patched-again" and Child.a == "child"
    j.undo()
    assert vars(Owner)["a"] is orig
    assert "new" not in vars(Owner)
    assert "a" not in vars(Child)
    j.undo()  # second undo is a no-op
    assert vars(Owner)["a"] is orig


def test_journal_undo_to_mark_rolls_back_only_later_changes():
    j = Journal()
    j.set(Owner, "x1", 1)
    mark = j.mark()
    j.set(Owner, "x2", 2)
    j.undo(mark)
    assert Owner.x1 == 1 and not hasattr(Owner, "x2")
    j.undo()
    assert not hasattr(Owner, "x1")
    assert repr(NOTSET) == "NOTSET"


@pytest.mark.parametrize(
    ("text", "supported"),
    [
        ("0.16.0+cpu", True),  # CPU build alias
        ("0.16.1.dev3+gabc1234", True),  # nightly counts as its release
        ("0.17.0rc1", True),  # release candidate counts as its release (0.17: inside)
        ("0.32.1", True),  # newest supported minor
        ("0.33.0rc1", False),  # next release candidate: outside
        ("0.11.0.post2", True),  # post release
        ("0.10.2", False),
        ("1.0.0", False),
    ],
)
def test_version_support(text, supported):
    assert vllm_supported(parse(text)) is supported


@given(
    st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(0, 9)),
    st.sampled_from(["", "+cpu", ".dev3+gabc1234", "rc1", ".post2", "a1"]),
)
def test_version_minor_property(rel, suffix):
    v = parse(".".join(map(str, rel)) + suffix)
    assert minor(v) == rel[:2]
    assert vllm_supported(v) == ((0, 11) <= rel[:2] <= (0, 32))


def test_bad_version_is_named():
    with pytest.raises(ValueError, match="not-a-version"):
        parse("not-a-version")


def _fresh(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_import_is_light():
    out = _fresh(
        """
        import sys, eagle3_compat
        heavy = [m for m in ("torch", "vllm", "speculators", "transformers") if m in sys.modules]
        print(heavy)
        """
    )
    assert out.strip() == "[]"


def test_not_installed_is_a_quiet_noop():
    out = _fresh(
        """
        import importlib.metadata as md, warnings
        real = md.version
        def fake(name):
            if name.startswith("vllm"):
                raise md.PackageNotFoundError(name)
            return real(name)
        md.version = fake
        import eagle3_compat
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            st = eagle3_compat.apply()
        print(st.applied, "|", st.note)
        """
    )
    assert out.startswith("False | not installed: vllm")


def test_unsupported_version_warns_or_raises_in_strict_mode():
    code = """
        import os, warnings, eagle3_compat
        os.environ["EAGLE3_COMPAT_VLLM_VERSION"] = "0.33.0rc1"
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            st = eagle3_compat.apply()
        if "not installed" in st.note:
            raise SystemExit(print("not installed"))
        print(st.applied, len(w), str(w[0].message) if w else "")
        os.environ["EAGLE3_COMPAT_STRICT"] = "1"
        try:
            eagle3_compat.apply()
        except eagle3_compat.UnsupportedVersionError as e:
            print("strict:", e)
        """
    out = _fresh(code)
    if "not installed" in out:
        pytest.skip("speculators not installed here")
    first, second = out.strip().splitlines()
    assert first.startswith("False 1 ") and "0.33.0rc1" in first and "0.11 to 0.32" in first
    assert second.startswith("strict:") and "0.33.0rc1" in second


INHERIT = """
    import json, os, sys
    calls = []
    import eagle3_compat
    from eagle3_compat import _inherit, _state
    eagle3_compat.apply = lambda **kw: calls.append(
        (kw, getattr(sys.modules.get(_inherit.TARGET), "EXECUTED", None), _state.applying))
    _state.applying = sys.argv[1] == "inside-apply"
    _inherit.install()
    _inherit.install()  # the .pth runs once; a second call must not hook twice
    print("before import:", calls)
    import speculators.data_generation.vllm_hidden_states_generator
    import speculators.data_generation.vllm_hidden_states_generator as again
    print("after import:", json.dumps(calls))
    """


@pytest.mark.parametrize("case", ["child", "inside-apply", "not-inherited", "malformed"])
def test_inherit_hook_applies_once_after_the_generator_module_ran(tmp_path, case):
    """``_inherit.install()`` (what the ``.pth`` runs) on a stand-in for
    speculators' generator module: apply() with the parent's options right
    after the module executed, once; not from inside apply() itself; nothing
    without (or with a malformed) ``EAGLE3_COMPAT_APPLIED``."""
    import json
    import os

    pkg = tmp_path / "speculators" / "data_generation"
    pkg.mkdir(parents=True)
    (tmp_path / "speculators" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "vllm_hidden_states_generator.py").write_text("EXECUTED = True\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("EAGLE3_COMPAT_APPLIED", None)
    if case in ("child", "inside-apply"):
        env["EAGLE3_COMPAT_APPLIED"] = json.dumps({"dtype": "float32"})
    elif case == "malformed":
        env["EAGLE3_COMPAT_APPLIED"] = "[1"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(INHERIT), case], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0] == "before import: []"
    calls = json.loads(out[1].split(":", 1)[1])
    if case == "child":
        assert calls == [[{"dtype": "float32"}, True, False]]
    else:
        assert calls == []
    if case == "malformed":
        assert "ignoring malformed EAGLE3_COMPAT_APPLIED='[1'" in proc.stderr
