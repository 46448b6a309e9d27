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

import pytest

pytestmark = pytest.mark.engine

STEPS = {
    "vllm": "import vllm",
    "speculators": "import speculators.data_generation",
    "apply": "import eagle3_compat; eagle3_compat.apply()",
}

PROBE = textwrap.dedent(
    """
    import json, sys
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
    out = {{"after_apply": state()}}
    eagle3_compat.apply()  # twice: no-op
    out["twice"] = state()
    eagle3_compat.revert()
    out["after_revert"] = state()
    out["status_after_revert"] = eagle3_compat.status().note
    eagle3_compat.revert()  # second revert: no-op
    out["after_second_revert"] = state()
    eagle3_compat.apply()
    out["reapplied"] = state()
    eagle3_compat.revert()
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


def test_orders_cover_every_permutation():
    orders = list(itertools.permutations(STEPS))
    assert len(orders) == 6 and len(set(orders)) == 6


ORDERS = list(itertools.permutations(STEPS))


@pytest.mark.parametrize(
    "order",
    [pytest.param(o, marks=[] if o == ORDERS[0] else [pytest.mark.extended]) for o in ORDERS],
    ids="-".join,
)
def test_every_import_order(order):
    out = run(PROBE.format(steps="\n".join(STEPS[s] for s in order)))
    assert out["after_apply"] == PATCHED
    assert out["twice"] == PATCHED
    assert out["after_revert"] == ORIGINAL
    assert out["after_second_revert"] == ORIGINAL
    assert out["reapplied"] == PATCHED


def test_revert_restores_the_very_objects():
    out = run(
        textwrap.dedent(
            """
            import json
            from speculators.data_generation import VllmHiddenStatesGenerator as G
            before = {n: G.__dict__.get(n) for n in ("__init__", "generate", "__del__", "close", "__enter__")}
            import warnings
            import eagle3_compat
            eagle3_compat.apply()
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                eagle3_compat.apply(dtype="float32")  # different options: warns, keeps the first
            other = [str(x.message) for x in w]
            kept = eagle3_compat.status().options
            changed = [n for n, v in before.items() if G.__dict__.get(n) is not v]
            eagle3_compat.revert()
            same = all(G.__dict__.get(n) is v for n, v in before.items())
            print("RESULT" + json.dumps({"changed": changed, "same": same, "other": other,
                                          "kept": kept, "added_gone": "close" not in G.__dict__}))
            """
        )
    )
    assert sorted(out["changed"]) == ["__del__", "__enter__", "__init__", "close", "generate"]
    assert out["same"] and out["added_gone"]
    assert len(out["other"]) == 1 and "already ran" in out["other"][0]
    assert out["kept"] == {"dtype": None}


def test_failing_adapter_rolls_back_and_names_itself():
    out = run(
        textwrap.dedent(
            """
            import json
            import eagle3_compat
            from eagle3_compat.adapters import worker_capture, AdapterError
            from speculators.data_generation import VllmHiddenStatesGenerator as G
            init = G.__dict__["__init__"]
            def broken():
                raise AdapterError("worker-capture", "vllm InputBatch.req_ids", "missing")
            worker_capture.ADAPTER.__dict__  # frozen dataclass: replace the probe via object.__setattr__
            object.__setattr__(worker_capture.ADAPTER, "probe", broken)
            try:
                eagle3_compat.apply()
                msg = None
            except AdapterError as e:
                msg = str(e)
            print("RESULT" + json.dumps({"msg": msg, "rolled_back": G.__dict__["__init__"] is init,
                                          "applied": eagle3_compat.status().applied}))
            """
        )
    )
    assert "worker-capture" in out["msg"] and "InputBatch.req_ids" in out["msg"]
    assert out["rolled_back"] is True
    assert out["applied"] is False


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
        out = {"never": spawn()}
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
# extended (runs in the oldest and newest vLLM envs).
@pytest.mark.extended
@pytest.mark.parametrize("first", ["apply", "import speculators"])
def test_inheriting_child_applies_once_whatever_it_does_first(first):
    """A child with the parent's EAGLE3_COMPAT_APPLIED: importing speculators
    applies; an explicit apply() (whose probes import speculators, firing the
    hook from inside apply) must not trip over itself."""
    _need_pth()
    code = textwrap.dedent(
        """
        import json
        {first}
        import eagle3_compat
        from speculators.data_generation import VllmHiddenStatesGenerator as G
        from eagle3_compat import generator as g
        print("RESULT" + json.dumps({{"patched": G.__dict__["__init__"] is g.generator_init,
                                      "options": eagle3_compat.status().options}}))
        """
    ).format(first={"apply": "import eagle3_compat; eagle3_compat.apply(dtype='float32')",
                    "import speculators": "import speculators.data_generation"}[first])
    env = {**os.environ, "EAGLE3_COMPAT_APPLIED": json.dumps({"dtype": "float32"})}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[6:])
    assert out == {"patched": True, "options": {"dtype": "float32"}}


@pytest.mark.extended
def test_spawned_child_is_patched_exactly_when_the_parent_applied(tmp_path):
    """apply() inside ``if __name__ == "__main__":`` (the child does not re-run
    it): the child is patched, with the parent's options, iff the parent had
    applied when it started the child.  Needs the installed package's
    ``eagle3_compat_inherit.pth`` (tox installs it)."""
    _need_pth()
    script = tmp_path / "parent.py"
    script.write_text(SPAWN_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[6:])
    assert out["never"] == {"patched": False, "options": {}, "env": None}
    assert out["applied"]["patched"] is True
    assert out["applied"]["options"] == {"dtype": "float32"}
    assert out["reverted"] == {"patched": False, "options": {}, "env": None}
