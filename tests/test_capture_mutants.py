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

import contextlib
import inspect
import sys
import types
from collections.abc import Iterator
from pathlib import Path

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


# -- mutants with a named killer -----------------------------------------------------
# Checks outside the capture core.  Each mutant is applied to the real module in
# place (every caller, wherever it imported the function from, runs the mutated
# code) and must make one named test of ``test_review_checks.py`` fail with the
# given exception whose message matches: the test's own assertion (a
# ``pytest.raises`` that saw nothing raises ``Failed: DID NOT RAISE``), never a
# mutant that merely breaks.
from eagle3_compat import __main__ as cli_mod  # noqa: E402
from eagle3_compat import dataset, generator, numerics, offload, replicas, upstream, verify  # noqa: E402,F401

_DID_NOT_RAISE = (pytest.fail.Exception, "DID NOT RAISE")

# name: (module, old text, new text, killing test, (exception, message regex))
TARGETED = {
    # -- layer ids, checked on the driver before the engine starts ------------------------
    "negative-layer-id-accepted": (
        generator, "if k < 0 or k >= num_layers:", "if k >= num_layers:",
        "test_negative_layer_id_is_refused", _DID_NOT_RAISE),
    "only-adjacent-layer-repeats-caught": (
        generator, "dup = sorted({k for k in ids if ids.count(k) > 1})",
        "dup = sorted({a for a, b in zip(ids, ids[1:]) if a == b})",
        "test_non_adjacent_repeated_layer_id_is_refused", _DID_NOT_RAISE),
    # -- the driver's results -------------------------------------------------------------
    "worker-reply-error-ignored": (
        generator, '        if captured["error"]:\n', "        if False:\n",
        "test_collect_results_raises_the_error_the_worker_reported", _DID_NOT_RAISE),
    "only-first-stage-checked": (
        generator, "        for st in stages:\n            try:\n",
        "        for st in stages[:1]:\n            try:\n",
        "test_collect_results_checks_every_pipeline_stage_against_the_plan", _DID_NOT_RAISE),
    "non-finite-states-handed-out": (
        generator, "if not _all_finite(t):", "if False:",
        "test_collect_results_refuses_non_finite_hidden_states", _DID_NOT_RAISE),
    # -- verify --numerics ---------------------------------------------------------------
    "numerics-rows-one-late": (
        numerics, "lp = _log_probs(rows[lo:hi], norm_w, head_w, eps)",
        "lp = _log_probs(rows[lo + 1:hi + 1], norm_w, head_w, eps)",
        "test_numerics::test_logits_agreement_counts_positions_and_near_ties", (AssertionError, "")),
    "numerics-near-ties-refused": (
        numerics, "if float(lp[j, top1]) >= float(best[j]) - tie:", "if float(lp[j, top1]) >= float(best[j]):",
        "test_numerics::test_logits_agreement_counts_positions_and_near_ties", (AssertionError, "")),
    "numerics-rows-not-compared-with-tokens": (
        numerics, "if h.dim() != 2 or h.shape[0] != len(ids):", "if h.dim() != 2:",
        "test_numerics::test_shape_problems_are_named", (AssertionError, "")),
    "numerics-sampled-by-name": (
        numerics, "found = sorted(int(m.group(1)) for p in folder.glob(\"data_*.pt\")",
        "found = list(int(m.group(1)) for p in sorted(folder.glob(\"data_*.pt\"))",
        "test_numerics::test_sample_indices_spread_by_index_not_name", (AssertionError, "")),
    # -- verify --------------------------------------------------------------------------
    "state-rows-not-compared-with-tokens": (
        verify, "h.dim() != 2 or h.shape[0] != t:", "h.dim() != 2:",
        "test_verify_refuses_hidden_state_rows_unlike_the_tokens", (AssertionError, r"^problems \[\]")),
    "extra-state-tensors-accepted": (
        verify, "len(states) != n_layers:", "len(states) < n_layers:",
        "test_verify_refuses_more_hidden_state_tensors_than_layer_ids", (AssertionError, r"^problems \[\]")),
    "hidden-size-not-compared-with-data-config": (
        verify, "\"hidden size\" in seen and seen[\"hidden size\"][0] != cfg_h:", "False:",
        "test_verify_compares_the_hidden_size_with_data_config", (AssertionError, r"^problems \[\]")),
    # -- resuming into speculators' own folder ----------------------------------------------
    "upstream-tail-picked-by-name": (
        dataset, "found = sorted((int(p.name[5:-3]), p) for p", "found = sorted((p.name, p) for p",
        "test_upstream_tail_is_picked_by_index_not_by_name", _DID_NOT_RAISE),
    "upstream-tail-last-file-only": (
        dataset, "found[-UPSTREAM_WRITERS:]", "found[-1:]",
        "test_upstream_tail_loads_every_file_the_writers_may_have_held", _DID_NOT_RAISE),
    # -- token frequencies ------------------------------------------------------------------
    "every-token-counted": (
        dataset, "counter.update(t for t, m in zip(ids, mask) if m)", "counter.update(ids)",
        "test_token_frequencies_count_only_tokens_under_the_loss_mask", (AssertionError, r"^token counts \{")),
    # -- input files ----------------------------------------------------------------------
    "short-loss-mask-accepted": (
        dataset, "if len(mask) != len(ids):", "if len(mask) > len(ids):",
        "test_loss_mask_shorter_or_empty_is_refused", _DID_NOT_RAISE),
    "empty-loss-mask-made-all-ones": (
        dataset, "                    if mask is None:\n", "                    if not mask:\n",
        "test_loss_mask_shorter_or_empty_is_refused", _DID_NOT_RAISE),
    "jsonl-numbered-from-one": (
        dataset, "index = lineno - 1", "index = lineno",
        "test_job_writes_sample_i_to_data_start_plus_i", (AssertionError, r"^files \['data_6\.pt'")),
    "file-name-off-by-one": (
        upstream, 'return out / f"data_{index}.pt"', 'return out / f"data_{index + 1}.pt"',
        "test_job_writes_sample_i_to_data_start_plus_i", (AssertionError, r"^files \['data_6\.pt'")),
    # -- the writer -------------------------------------------------------------------------
    "lost-sample-not-reported": (
        dataset, "if exc_type is None and self._order:", "if False:",
        "test_writer_reports_a_sample_never_written", _DID_NOT_RAISE),
    "lost-sample-not-reported-by-the-job": (
        dataset, "if exc_type is None and self._order:", "if False:",
        "test_job_fails_when_the_engine_loses_a_sample", _DID_NOT_RAISE),
    # -- the command line's numbers ---------------------------------------------------------
    "max-in-flight-not-checked-early": (
        dataset, '_positive_int("--max-in-flight", max_in_flight)', "pass",
        "test_cli_refuses_zero_prompts_in_flight", (AssertionError, "^generate went past its argument checks$")),
    "model-length-one-accepted": (
        dataset, '_positive_int("--max-model-len", max_model_len, minimum=2)',
        '_positive_int("--max-model-len", max_model_len, minimum=1)',
        "test_cli_refuses_a_model_length_without_room_for_a_token",
        (AssertionError, "^generate went past its argument checks$")),
    # -- replicas' bookkeeping --------------------------------------------------------------
    "replica-chunk-not-checked": (
        replicas, "            check_chunk_results(rank, chunk, results)\n", "",
        "test_replica_chunk_missing_a_sample_fails_naming_it", _DID_NOT_RAISE),
    "lost-replica-chunk-dropped": (
        replicas, "                retry.append(chunk)\n", "",
        "test_lost_replica_chunks_are_rerun_elsewhere_each_sample_once",
        (AssertionError, r"^samples \(position, state\) \[")),
    # -- the arena's free/reuse -------------------------------------------------------------
    "partly-released-file-reused": (
        arena, "            if not self.alive:\n", "            if len(self.alive) < len(self.layout.lengths):\n",
        "test_arena_file_is_not_reused_while_a_prompt_of_it_is_held",
        (AssertionError, "^a held result changed to 6.0 by a later call")),
    "too-small-file-reused": (
        arena, "if total <= f.capacity <= 2 * total]", "if f.capacity <= 2 * total]",
        "test_arena_pool_reuses_only_files_that_fit", (capture.CaptureError, "^an arena file of")),
    "released-files-kept-beyond-the-limit": (
        arena, "            while self._free and sum(f.capacity for f in self._free) > keep:\n",
        "            while False:\n",
        "test_arena_pool_keeps_no_more_than_its_bytes", (AssertionError, "^pool {")),
    # -- the offload's writer thread ----------------------------------------------------------
    "skipped-work-keeps-its-buffers": (
        offload, "                elif release is not None:", "                elif False:",
        "test_offload_work_skipped_after_an_error_still_frees_its_buffers",
        (AssertionError, r"^after the failure: \[\]")),
}


def _functions(obj: object) -> list[tuple[str, types.FunctionType]]:
    """The plain functions of a class's namespace (methods, static and class
    methods, properties' accessors), by a name unique in the class."""
    out = []
    for attr, v in vars(obj).items():
        if isinstance(v, (staticmethod, classmethod)):
            v = v.__func__
        if isinstance(v, property):
            out += [(f"{attr}.{k}", f) for k, f in (("get", v.fget), ("set", v.fset)) if f is not None]
        elif inspect.isfunction(v):
            out.append((attr, v))
    return out


@contextlib.contextmanager
def mutated_in_place(module: types.ModuleType, old: str, new: str) -> Iterator[None]:
    """Run the mutated source of ``module`` and move its code into the real
    module's functions (their ``__code__``) and constants, for the ``with``
    block: every reference to a function, however it was imported, runs the
    mutant; the real module's classes and exceptions stay what they are."""
    src = inspect.getsource(module)
    assert src.count(old) == 1, f"mutation no longer matches {module.__name__}: {old!r}"
    ns: dict[str, object] = {"__name__": module.__name__, "__package__": module.__package__,
                             "__file__": module.__file__}
    exec(compile(src.replace(old, new), module.__file__, "exec"), ns)  # noqa: S102
    undo: list[tuple[object, str, object]] = []

    def move(orig: types.FunctionType, mutant: types.FunctionType) -> None:
        orig, mutant = inspect.unwrap(orig), inspect.unwrap(mutant)
        if orig.__code__.co_filename != module.__file__:  # generated (dataclass methods): not mutated
            return
        for attr in ("__code__", "__defaults__", "__kwdefaults__"):
            undo.append((orig, attr, getattr(orig, attr)))
            setattr(orig, attr, getattr(mutant, attr))

    for name, mutant in ns.items():
        orig = module.__dict__.get(name)
        if inspect.isfunction(orig) and inspect.isfunction(mutant):
            move(orig, mutant)
        elif inspect.isclass(orig) and inspect.isclass(mutant) and orig.__module__ == module.__name__:
            mine = dict(_functions(orig))
            for attr, fn in _functions(mutant):
                if attr in mine:
                    move(mine[attr], fn)
        elif isinstance(orig, (int, float, str, bytes, tuple, frozenset)) and orig != mutant:
            undo.append((module, name, orig))
            setattr(module, name, mutant)
    try:
        yield
    finally:
        for obj, attr, value in reversed(undo):
            setattr(obj, attr, value)


def _run_named(test_name: str, tmp_path: Path) -> None:
    """Call ``test_review_checks.<test_name>`` (or ``<module>::<test_name>``)
    with the fixtures it takes (``tmp_path``, ``monkeypatch``), undoing its
    monkeypatches after."""
    import importlib  # noqa: PLC0415

    module_name, _, name = test_name.rpartition("::")
    test = getattr(importlib.import_module(module_name or "test_review_checks"), name)
    params = inspect.signature(test).parameters
    assert set(params) <= {"tmp_path", "monkeypatch"}, (test_name, list(params))
    tmp_path.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        kw = {"tmp_path": tmp_path, "monkeypatch": mp}
        test(**{k: kw[k] for k in params})


@pytest.mark.parametrize("name", sorted(TARGETED))
def test_targeted_mutant_fails_its_named_test(name, tmp_path):
    module, old, new, killer, (error, match) = TARGETED[name]
    _run_named(killer, tmp_path / "real")  # the killer passes on the real module ...
    with mutated_in_place(module, old, new), pytest.raises(error, match=match):
        _run_named(killer, tmp_path / "mutant")  # ... and fails at its own check on the mutant
    _run_named(killer, tmp_path / "restored")  # and the real module is back


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
