"""The core's tests have teeth: every check of the capture core and the arena,
removed or bent one at a time, is caught by the tests that need no engine.

Each mutant is the real ``eagle3_compat.capture``, ``eagle3_compat.arena``
or ``eagle3_compat.worker`` source with one textual change, loaded as a
separate module (the core's tests run the worker's own step code on top of
the capture core, so a capture mutant reaches them through the worker too).  The checks
run against it are the ones ``test_capture_core.py`` and ``test_arena.py``
run against the real modules, where they pass: exact reassembly, every
single fault refused with its own error (``pytest.raises(CaptureError,
match=...)``: a mutant that raises another error, the right error with
another message, or nothing, fails them), and the arena's examples.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from eagle3_compat import arena, capture
from eagle3_compat import worker as worker_mod

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.once  # ~1 min of pure logic: the same on every vLLM release
from test_arena import arena_examples  # noqa: E402
from test_capture_core import (  # noqa: E402
    check_fault,
    check_reassembly,
    core_examples,
    direct_examples,
    faulty,
    load_worker,
    scenarios,
    shard_examples,
)

# name: (module, old text, new text)
MUTANTS = {
    # -- worker side: attribution of a step's rows ------------------------------
    "positions-not-checked-consecutive": (
        capture, "if first < 0 or pos[:hi] != list(range(first, first + hi)):", "if first < 0:"),
    "unknown-prompt-index-not-checked": (capture, "        if plen is None:\n", "        if False:\n"),
    "layer-row-count-not-checked": (capture, "if rows < total:", "if False:"),
    "position-count-not-checked": (capture, "if len(positions) < total:", "if False:"),
    "token-count-not-checked": (capture, "if token_ids is not None and len(token_ids) < total:", "if False:"),
    "duplicate-request-id-allowed": (capture, "if len(set(self.req_ids)) != len(self.req_ids):", "if False:"),
    "rows-past-prompt-kept": (capture, "while hi and pos[hi - 1] >= plen:", "while False:"),
    "other-calls-rows-kept": (capture, "if parsed is None or parsed[0] != self.call:", "if parsed is None:"),
    # -- worker side: the direct path's plan ------------------------------------------
    "plan-not-checked": (capture, "    if want != got:\n", "    if False:\n"),
    "plan-restarts-every-chunk": (capture, "first = tally.get(index, self.planned.get(index, 0))", "first = 0"),
    "plan-keeps-rows-past-prompt": (capture, "count = min(n, plen - first)", "count = n"),
    "plan-row-offset-off-by-one": (capture, "out.append(Segment(index=index, src=src, start=first",
                                   "out.append(Segment(index=index, src=src + 1, start=first"),
    "run-offset-off-by-one": (capture, "                            src=start,\n",
                              "                            src=start + 1,\n"),
    "first-layout-reused": (capture, "        total = layout.total\n",
                            '        layout = self.__dict__.setdefault("_stale", layout)\n'
                            "        total = layout.total\n"),
    # -- worker side: the layer hook's copies and the writes after the step -------------
    # (a tensor-parallel rank > 0 copies rows lo..hi-1 of the step: the direct
    # path indexes the layer's whole tensor, the staged path its share)
    "direct-share-rows-offset": (worker_mod, "(place[slot], h[src : src + count])",
                                 "(place[slot], h[src - lo : src - lo + count])"),
    "staged-share-rows-offset": (worker_mod, "rows[slot][src - lo : src - lo + count]", "rows[slot][src : src + count]"),
    "staged-whole-step-as-share": (worker_mod, "offload.submit(slot, h[lo:hi], owned)", "offload.submit(slot, h, owned)"),
    "direct-rows-to-first-slot": (worker_mod, "(place[slot], h[", "(place[0], h["),
    # -- the wire: what the driver is told ----------------------------------------
    "token-ids-not-sent": (capture, "None if self.token_ids is None else list(self.token_ids)]", "None]"),
    # -- driver side: the coverage check ------------------------------------------
    "unknown-index-not-checked-by-driver": (capture, "if not 0 <= index < len(prompts):", "if False:"),
    "empty-run-allowed": (capture, "if count <= 0:", "if False:"),
    "gap-or-overlap-allowed": (capture, "if start != expected:", "if False:"),
    "token-ids-not-compared": (capture, "if tokens is not None and list(tokens) !=", "if False and list(tokens) !="),
    "incomplete-prompt-allowed": (capture, "if expected != n:", "if False:"),
    "runs-sorted-backwards": (capture, "key=lambda r: r[0])", "key=lambda r: -r[0])"),
    # -- driver side: pipeline-parallel replies --------------------------------------
    "empty-reply-accepted": (capture, "    if not isinstance(reply, (list, tuple)) or not reply:\n"
                                      "        raise CaptureError(f\"unexpected collective_rpc reply of type {type(reply).__name__}\")\n"
                                      "    out:",
                             "    if not isinstance(reply, (list, tuple)):\n"
                             "        raise CaptureError(f\"unexpected collective_rpc reply of type {type(reply).__name__}\")\n"
                             "    out:"),
    "non-dict-reply-skipped": (capture, "        if not isinstance(r, dict):\n            raise",
                               "        if not isinstance(r, dict):\n            continue\n            raise"),
    "two-ranks-of-a-stage-accepted": (capture, "        if stage in out:", "        if False:"),
    "stages-keyed-by-position": (capture, "        stage = int(r.get(\"stage\", 0))\n        if r.get(\"shard\"):",
                                 "        stage = rank\n        if r.get(\"shard\"):"),
    "no-capture-accepted": (capture, "    if not out:\n", "    if False:\n"),
    "slot-range-not-checked": (capture, "            if not 0 <= slot < len(layer_ids):", "            if False:"),
    "layer-from-two-stages-accepted": (capture, "            if slot in owner:", "            if False:"),
    "layer-from-no-stage-accepted": (capture, "    if missing:\n        held", "    if False:\n        held"),
    "stage-layers-not-checked": (capture, "    check_stage_layers({s[\"stage\"]: s[\"slots\"] for s in stages}, layer_ids)",
                                 "    pass"),
    "no-stage-accepted": (capture, "    if not replies:\n", "    if False:\n"),
    "stage-dtypes-not-compared": (capture, "            if r[key] != first[key]:", "            if False:"),
    "stage-rows-not-compared": (capture, "                if a != b:", "                if False:"),
    "stage-error-dropped": (capture, "        if r.get(\"error\"):", "        if False:"),
    # -- tensor-parallel ranks sharing the copies ---------------------------------
    "shares-overlap": (capture, "return total * shard // shards, total * (shard + 1) // shards",
                       "return total * shard // shards, total"),
    "clipped-run-keeps-its-start": (capture, "return a, seg.start + (a - seg.src), b - a", "return a, seg.start, b - a"),
    "share-runs-not-compared": (capture, "        if theirs != mine:", "        if False:"),
    "share-steps-not-compared": (
        capture, '        if int(h.get("steps", -1)) != int(primary.get("steps", -2)):', "        if False:"),
    "share-rows-not-counted": (capture, "        if written != expected:", "        if False:"),
    "share-error-dropped": (capture, '        if h.get("error"):', "        if False:"),
    "missing-share-accepted": (capture, "    if got != list(range(1, shards)):", "    if False:"),
    "share-without-its-stage-accepted": (capture, "    if stray:\n", "    if False:\n"),
    "bare-reply-shares-not-checked": (
        capture, '        return [fold_shards(int(reply.get("stage", 0)), reply, [])]', "        return [reply]"),
    "exchange-shares-not-checked": (capture, "            _fold_capture(stage, capture, shares)", "            pass"),
    # -- the arena ------------------------------------------------------------------
    "row-width-or-count-not-checked": (
        arena, "if rows.dim() != 2 or rows.shape[0] != count or rows.shape[1] != self.hidden:", "if False:"),
    "row-dtype-not-checked": (arena, "if rows.dtype != self.dtype:", "if False:"),
    "row-bounds-not-checked": (arena, "if start < 0 or start + count > n:", "if False:"),
    "blocks-overlap": (arena, "off = _align(off + size)", "off = _align(off + size // 2)"),
    "every-dtype-decoded-as-float32": (arena, "dtype = getattr(torch, name, None)", "dtype = torch.float32"),
    "bfloat16-decoded-as-float16": (
        arena, "dtype = getattr(torch, name, None)",
        'dtype = getattr(torch, "float16" if name == "bfloat16" else name, None)'),
    "payload-not-checked": (arena, "if t.dtype != dtype or tuple(t.shape) != (n, hidden):", "if False:"),
    "payload-names-not-checked": (arena, "if set(got) != expected:", "if False:"),
    "wrong-nonce-accepted": (
        arena, "if os.pread(fd, NONCE_BYTES, 0) != bytes.fromhex(spec[\"nonce\"]):", "if False:"),
    "worker-layout-not-compared": (arena, 'if spec.get("total") != layout.total:', "if False:"),
    "kept-mapping-nonce-not-checked": (
        arena, 'if mm[:NONCE_BYTES] != bytes.fromhex(spec["nonce"]) or len(mm) != capacity:', "if False:"),
    "small-file-accepted": (arena, "if capacity < layout.total:", "if False:"),
    "closed-pool-leases": (arena, "            if self._closed:\n                raise", "            if False:\n                raise"),
    "given-back-lease-reused": (arena, "        if f is None:\n", "        if False:\n"),
    "failed-file-reused": (arena, "            self._pool._retire(file)", "            self._pool._give_back(file)"),
}


def _load(module: types.ModuleType, name: str, code: str) -> types.ModuleType:
    mod = types.ModuleType(f"{module.__name__}_mutant_{name.replace('-', '_')}")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    if module is capture:  # the mutant must raise the real CaptureError (pytest.raises checks its class)
        code = code.replace("class CaptureError(RuntimeError):", "class _Unused(RuntimeError):")
        mod.__dict__["CaptureError"] = capture.CaptureError
    if module is arena:  # the arena must raise the real core's CaptureError
        code = code.replace("from .capture import CaptureError", "from eagle3_compat.capture import CaptureError")
    exec(compile(code, mod.__name__, "exec"), mod.__dict__)  # noqa: S102
    return mod


def mutant(name: str) -> tuple[types.ModuleType, types.ModuleType]:
    """(capture module, arena module) with mutation ``name`` applied to one of
    them; a worker mutation goes on an unchanged copy of the capture module
    (``test_capture_core.worker_for`` runs the worker that copy carries)."""
    module, old, new = MUTANTS[name]
    if module is worker_mod:
        core = _load(capture, name, inspect.getsource(capture))
        core.E3C_WORKER = load_worker(core, old, new)
        return core, arena
    src = inspect.getsource(module)
    assert src.count(old) == 1, f"mutation {name!r} no longer matches {module.__name__}"
    mod = _load(module, name, src.replace(old, new))
    return (mod, arena) if module is capture else (capture, mod)


def test_every_check_has_a_mutant():
    """Each ``raise CaptureError`` of the core and the arena is bent by some mutant."""
    for module in (capture, arena):
        raises = inspect.getsource(module).count("raise CaptureError(")
        mutated = sum(1 for m, *_ in MUTANTS.values() if m is module)
        assert mutated >= raises, (module.__name__, raises, mutated)


def test_real_modules_pass_every_check():
    core_examples(capture, arena)
    arena_examples(capture, arena)
    direct_examples(capture, arena)
    shard_examples(capture, arena)
    check_reassembly(([3, 5], [0, 2], 4, 2, 2, True, True, 0, 1))


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_caught(name, tmp_path):
    core, arena_mutant = mutant(name)

    def examples():
        core_examples(core, arena_mutant)
        arena_examples(core, arena_mutant, tmp_path)
        direct_examples(core, arena_mutant)
        shard_examples(core, arena_mutant)

    # no shrinking: finding any counterexample is the point, not the smallest
    quick = settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                     phases=[Phase.explicit, Phase.generate])

    @quick
    @given(scenarios())
    def exact(sc):
        check_reassembly(sc, core=core, arena=arena_mutant)

    @quick
    @given(faulty())
    def faults(case):
        check_fault(case, core=core, arena=arena_mutant)

    failures = []
    for check in (examples, exact, faults):
        try:
            check()
        except (Exception, pytest.fail.Exception) as exc:  # noqa: BLE001 - the checks demand specific errors
            failures.append(f"{check.__name__}: {type(exc).__name__}")
            break  # caught; the other checks would only cost time
    assert failures, f"mutant {name!r} passed every check"
