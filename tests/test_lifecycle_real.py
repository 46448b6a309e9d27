"""apply()/revert() against the real speculators 0.3.0 and vLLM, in fresh interpreters.

Every order of ``import vllm`` / ``import speculators`` / ``apply()`` ends
with the generator patched; ``revert()`` then restores the original objects
(identity) and removes what apply() added; apply() twice is a no-op and a
re-apply after revert patches again.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import version

import pytest

pytestmark = pytest.mark.engine

STEPS = {
    "vllm": "import vllm",
    "speculators": "import speculators.data_generation",
    "apply": "import eagle3_compat; eagle3_compat.apply()",
}
# Right after speculators is imported (when that comes before apply): the
# original objects, for the identity check after revert().
SNAPSHOT = (
    "from speculators.data_generation import VllmHiddenStatesGenerator as _G\n"
    "before = {n: _G.__dict__.get(n) for n in NAMES}\n"
    "from eagle3_compat import generator as _g\n"
    "patched_on_import = _G.__dict__['__init__'] is _g.generator_init"
)

# One fresh interpreter per import order (each costs ~16 s of imports); each
# run also checks revert()'s identity guarantee (where speculators came before
# apply), apply() with other options, and an adapter failing mid-apply.
PROBE = textwrap.dedent(
    """
    import json, sys, warnings
    NAMES = ("__init__", "generate", "__del__", "close", "__enter__")
    before = None
    ran = []  # each step appends its name as it runs
    {steps}
    import eagle3_compat
    from speculators.data_generation import VllmHiddenStatesGenerator as G
    from eagle3_compat import generator as g
    def state():
        return {{
            "init": G.__dict__["__init__"] is g.generator_init,
            "generate": G.__dict__["generate"] is g.generator_generate,
            "close": "close" in G.__dict__,
        }}
    out = {{"after_apply": state(), "ran": ran, "spec_error": globals().get("spec_error")}}
    import transformers.configuration_utils as _cu
    # adapter transformers5 (transformers >= 5 only): torch resolvable there, and reverted
    out["cu_torch_applied"] = "torch" in vars(_cu)
    if before is not None:
        out["patched_on_import"] = patched_on_import
        out["changed"] = sorted(n for n, v in before.items() if G.__dict__.get(n) is not v)
    eagle3_compat.apply()  # twice: no-op
    out["twice"] = state()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        eagle3_compat.apply(dtype="float32")  # different options: warns, keeps the first
    out["other_options"] = [str(x.message) for x in w]
    out["kept"] = eagle3_compat.status().options
    out["other_options_state"] = state()
    eagle3_compat.revert()
    out["after_revert"] = state()
    out["cu_torch_after_revert"] = "torch" in vars(_cu)
    out["stand_in_after_revert"] = getattr(
        sys.modules.get("transformers.modeling_attn_mask_utils"), "__eagle3_compat_stand_in__", False)
    if before is not None:
        out["same_objects"] = all(G.__dict__.get(n) is v for n, v in before.items())
    out["status_after_revert"] = eagle3_compat.status().note
    eagle3_compat.revert()  # second revert: no-op
    out["after_second_revert"] = state()
    eagle3_compat.apply()
    out["reapplied"] = state()
    eagle3_compat.revert()

    # an adapter whose probe fails: everything this call applied is rolled back
    from eagle3_compat.adapters import worker_capture, AdapterError
    init = G.__dict__["__init__"]
    def broken():
        raise AdapterError("worker-capture", "vllm InputBatch.req_ids", "missing")
    object.__setattr__(worker_capture.ADAPTER, "probe", broken)  # frozen dataclass
    try:
        eagle3_compat.apply()
        out["failing_msg"] = None
    except AdapterError as e:
        out["failing_msg"] = str(e)
    out["failing_rolled_back"] = G.__dict__["__init__"] is init and "close" not in G.__dict__
    out["failing_applied"] = eagle3_compat.status().applied
    print("RESULT" + json.dumps(out))
    """
)

PATCHED = {"init": True, "generate": True, "close": True}
ORIGINAL = {"init": False, "generate": False, "close": False}


def run(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


_RUNS: dict[tuple[str, ...], dict] = {}


def probe(order: tuple[str, ...]) -> dict:
    """The probe's result for this import order (one interpreter per order per session)."""
    if order not in _RUNS:
        lines = []
        early = order.index("speculators") < order.index("apply")
        for step in order:
            if step == "speculators" and early and TF5:
                lines.append(TF5_IMPORT)
                continue
            lines.append(f"{STEPS[step]}; ran.append({step!r})")
            if step == "speculators" and early:
                lines.append(SNAPSHOT)
        _RUNS[order] = run(PROBE.format(steps="\n".join(lines)))
    return _RUNS[order]


ORDERS = list(itertools.permutations(STEPS))

# transformers 5 (vLLM 0.25+ here): speculators 0.3.0 cannot be imported
# before apply() (adapter transformers5: PydanticUndefinedAnnotation, name
# 'torch'); such an import fails as documented and the apply() after it
# recovers.
TF5 = int(version("transformers").split(".")[0]) >= 5
TF5_IMPORT = textwrap.dedent(
    """
    try:
        import speculators.data_generation
        spec_error = None
    except Exception as _e:
        spec_error = f"{type(_e).__name__}: {_e}"
    ran.append('speculators')"""
)


@pytest.mark.parametrize(
    "order",
    [pytest.param(o, marks=[] if o == ORDERS[0] else [pytest.mark.extended]) for o in ORDERS],
    ids="-".join,
)
def test_every_import_order(order):
    out = probe(order)
    assert out["ran"] == list(order)  # the interpreter ran these steps, in this order
    assert out["after_apply"] == PATCHED
    assert out["twice"] == PATCHED
    assert out["after_revert"] == ORIGINAL
    assert out["after_second_revert"] == ORIGINAL
    assert out["reapplied"] == PATCHED
    assert out["cu_torch_applied"] is TF5
    assert out["cu_torch_after_revert"] is False and out["stand_in_after_revert"] is False
    if order.index("speculators") < order.index("apply") and TF5:
        # the documented failure, and apply() recovered from it (PATCHED above)
        # transformers 5.16-5.19 (0.32): speculators' pydantic configs; 5.24 (0.19-0.29):
        # first the module transformers removed (the stand-in comes with apply())
        assert ("PydanticUndefinedAnnotation" in out["spec_error"]
                and "name 'torch' is not defined" in out["spec_error"]) or (
            "No module named 'transformers.modeling_attn_mask_utils'" in out["spec_error"]), out["spec_error"]
    elif order.index("speculators") < order.index("apply"):
        assert out["spec_error"] is None
        assert out["same_objects"] is True
        # no EAGLE3_COMPAT_APPLIED in this child (conftest): importing
        # speculators does not patch; only apply() does
        assert out["patched_on_import"] is False


def test_revert_restores_the_very_objects():
    if TF5:
        pytest.skip("transformers 5: speculators 0.3.0 cannot be imported before apply(), so its "
                    "original objects cannot be recorded first (checked in the transformers 4 envs)")
    out = probe(ORDERS[0])  # speculators imported before apply: originals recorded
    assert out["changed"] == ["__del__", "__enter__", "__init__", "close", "generate"]
    assert out["same_objects"] is True
    assert out["after_revert"] == ORIGINAL  # added attributes gone
    assert len(out["other_options"]) == 1 and "already ran" in out["other_options"][0]
    assert out["kept"] == {"dtype": None} and out["other_options_state"] == PATCHED


def test_failing_adapter_rolls_back_and_names_itself():
    out = probe(ORDERS[0])
    assert "worker-capture" in out["failing_msg"] and "InputBatch.req_ids" in out["failing_msg"]
    assert out["failing_rolled_back"] is True
    assert out["failing_applied"] is False


SPAWN_SCRIPT = textwrap.dedent(
    """
    import json, multiprocessing as mp, os

    def child(q):
        import subprocess, sys
        from speculators.data_generation import VllmHiddenStatesGenerator as G
        from eagle3_compat import generator as g
        import eagle3_compat
        q.put({"patched": G.__dict__["__init__"] is g.generator_init,
               "options": eagle3_compat.status().options,
               "env": os.environ.get("EAGLE3_COMPAT_APPLIED")})

    def spawn():
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        out = q.get(timeout=240)
        p.join()
        return out

    if __name__ == "__main__":
        import eagle3_compat
        out = {}
        eagle3_compat.apply(dtype="float32")
        out["applied"] = spawn()
        eagle3_compat.revert()
        out["reverted"] = spawn()
        print("RESULT" + json.dumps(out))
    """
)


def _need_pth():
    import site

    if not any(os.path.exists(os.path.join(d, "eagle3_compat_inherit.pth")) for d in site.getsitepackages()):
        pytest.skip("eagle3_compat is not installed from its wheel here (PYTHONPATH run); tox installs it")


# Interpreter mechanics (environment, .pth, import hook), not vLLM behaviour:
# extended (E3C_SUITE=core skips them).  The child that just
# imports speculators is the "applied" case of the spawn test below.
@pytest.mark.extended
def test_inheriting_child_that_applies_first_applies_once():
    """A child with the parent's EAGLE3_COMPAT_APPLIED that calls apply()
    itself: apply()'s probes import speculators, firing the inherit hook from
    inside apply; it must not trip over itself."""
    _need_pth()
    code = textwrap.dedent(
        """
        import json
        import eagle3_compat; eagle3_compat.apply(dtype='float32')
        from speculators.data_generation import VllmHiddenStatesGenerator as G
        from eagle3_compat import generator as g
        print("RESULT" + json.dumps({"patched": G.__dict__["__init__"] is g.generator_init,
                                     "options": eagle3_compat.status().options}))
        """
    )
    env = {**os.environ, "EAGLE3_COMPAT_APPLIED": json.dumps({"dtype": "float32"})}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[6:])
    assert out == {"patched": True, "options": {"dtype": "float32"}}


@pytest.mark.extended
def test_spawned_child_is_patched_exactly_when_the_parent_applied(tmp_path):
    """apply() inside ``if __name__ == "__main__":`` (the child does not re-run
    it): the child is patched, with the parent's options, iff the parent had
    applied when it started the child (after revert(): not).  A child of a
    parent that never applied is the import-order probes' case (not patched
    on import).  Needs the installed package's ``eagle3_compat_inherit.pth``
    (tox installs it)."""
    _need_pth()
    script = tmp_path / "parent.py"
    script.write_text(SPAWN_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[6:])
    assert out["applied"]["patched"] is True
    assert out["applied"]["options"] == {"dtype": "float32"}
    assert out["reverted"] == {"patched": False, "options": {}, "env": None}
