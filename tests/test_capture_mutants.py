"""The property tests have teeth: deliberate mutants of the capture core fail them.

Each mutant is the real ``eagle3_compat.capture`` source with one textual
change, loaded as a separate module; the same property check that passes
on the real core must find a counterexample for every mutant.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from eagle3_compat import capture

pytest.importorskip("torch")
from test_capture_core import check_reassembly, scenarios  # noqa: E402

MUTANTS = {
    # rows attributed one too far (a running-offset bug)
    "off-by-one-offset": ("layers=[h[start:end] for h in layers]", "layers=[h[start + 1 : end + 1] for h in layers]"),
    # chunks of a prompt joined in reverse order
    "reversed-order": ("rows.sort(key=lambda r: r[0])", "rows.sort(key=lambda r: -r[0])"),
    # the last request of a step swallows the padding rows
    "padding-not-trimmed": (
        "            end = start + n\n",
        "            end = start + n if req_id != layout.req_ids[-1] else len(positions)\n",
    ),
    # the first step's layout reused for every later step
    "stale-metadata": (
        '        total = layout.total\n',
        '        layout = self.__dict__.setdefault("_stale", layout)\n        total = layout.total\n',
    ),
}


def mutant(name: str) -> types.ModuleType:
    old, new = MUTANTS[name]
    src = inspect.getsource(capture)
    assert src.count(old) == 1, f"mutation {name!r} no longer matches the source"
    mod = types.ModuleType(f"capture_mutant_{name.replace('-', '_')}")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(src.replace(old, new), mod.__name__, "exec"), mod.__dict__)  # noqa: S102
    return mod


def test_real_core_passes_the_check():
    check_reassembly(([3, 5], [0, 2], 4, 2, 2, True, True, 0, 1))


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_caught(name):
    mod = mutant(name)

    # no shrinking: finding any counterexample is the point, not the smallest
    @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate])
    @given(scenarios())
    def prop(sc):
        check_reassembly(sc, core=mod)

    with pytest.raises(Exception):  # noqa: B017,PT011 - any failure counts as caught
        prop()
