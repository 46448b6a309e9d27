"""Drop-in for speculators' pipeline (#17): the guards of ``generate`` and the
``run`` launcher's inheritance mechanism.  No engine starts here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_compat.upstream import check_layer_plan, upstream_resume_index

SRC = Path(__file__).resolve().parents[1] / "src"


# One row per rule of speculators 0.3.0's trainer (6-layer model: final layer 5).
@pytest.mark.parametrize(
    ("ids", "capture", "message"),
    [
        (None, "layer_output", "default layer ids [2, 3, 5] for a 6-layer model give 3 layers"),  # (a)
        ([0, 2, 5], "layer_output", "give 3 layers"),  # (a)
        ([0, 1, 2, 3, 5], "layer_output", "give 5 layers"),
        ([0, 2, 4, 5], "layer_input", "--capture layer_input: the last tensor would be the input of layer 5"),  # (b)
        ([5, 0, 2, 4], "layer_output", "not ascending"),  # (c)
        ([0, 4, 2, 5], "layer_output", "not ascending"),  # (c), ending at the final layer
        ([0, 2, 3, 4], "layer_output", "end at layer 4, not the final layer 5"),
        ([0, 2, 2, 5], "layer_output", "repeats [2]"),
        ([0, 2, 4, 6], "layer_output", "out of bounds"),
    ],
)
def test_trainer_rules_refuse_with_the_rule_and_the_fix(ids, capture, message):
    with pytest.raises(ValueError, match=None) as err:
        check_layer_plan(ids, 6, capture)
    assert message in str(err.value)
    if "repeats" not in message and "out of bounds" not in message:
        assert "exactly 4 layer ids per sample, ascending" in str(err.value)
        assert "--no-trainer-checks" in str(err.value) or "--layer-ids 0 2 4 5" in str(err.value)


def test_trainer_rules_accept_and_opt_out_keeps_order():
    assert check_layer_plan([0, 2, 4, 5], 6, "layer_output") == [0, 2, 4, 5]
    assert check_layer_plan(None, 32, "layer_output") == [2, 16, 29, 31]
    # other consumers: any ids in range, in the order given, either convention
    assert check_layer_plan([5, 0, 2], 6, "layer_input", trainer_checks=False) == [5, 0, 2]
    with pytest.raises(ValueError, match="repeats"):  # never, whoever reads the files
        check_layer_plan([1, 1], 6, "layer_output", trainer_checks=False)


def test_upstream_resume_index(tmp_path):
    assert upstream_resume_index(tmp_path / "missing") == 0
    for name in ("data_0.pt", "data_1.pt", "data_7.pt", "data_x.pt", "manifest.json", ".data_9.pt.1.tmp"):
        (tmp_path / name).write_bytes(b"")
    assert upstream_resume_index(tmp_path) == 8


def _model_config(tmp_path: Path, layers: int = 6) -> Path:
    # the guards read config.json only: no weights, no tokenizer needed
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers}))
    return model


GUARDED = [
    (["--layer-ids", "0", "2", "5"], "give 3 layers"),
    ([], "default layer ids [2, 3, 5]"),
    (["--layer-ids", "0", "2", "4", "5", "--capture", "layer_input"], "--capture layer_input"),
    (["--layer-ids", "5", "0", "2", "4"], "not ascending"),
    (["--layer-ids", "0,2,2,5"], "repeats [2]"),
    (["--layer-ids", "0", "2", "4", "5", "--token-freq-path", "{out}/token_freq.pt"], "inside --output-dir"),
]


@pytest.mark.parametrize(("extra", "message"), GUARDED)
def test_generate_refuses_before_anything_loads_or_is_written(tmp_path, extra, message):
    """The three traps of #17 (and a duplicate id, and token_freq.pt where the
    trainer would read it): exit 2 with the rule, before torch, vLLM or
    speculators are imported, with no output folder created."""
    model = _model_config(tmp_path)
    out = tmp_path / "out"
    argv = ["generate", "--target-model-path", str(model), "--train-data-path", str(tmp_path / "d.json"),
            "--output-dir", str(out), *[a.format(out=out) for a in extra]]
    code = (
        "import sys\n"
        "from eagle3_compat.__main__ import main\n"
        f"rc = main({argv!r})\n"
        "print('RC', rc)\n"
        "print('LOADED', sorted(m for m in ('torch', 'vllm', 'speculators', 'transformers') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "RC 2" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "LOADED []" in proc.stdout
    assert not out.exists()


def test_generate_refuses_the_earlier_layout_and_a_foreign_data_config(tmp_path):
    from eagle3_compat.dataset import _check_folder

    model = str(_model_config(tmp_path))
    out = tmp_path / "out"
    out.mkdir()
    (out / "sample_000000000.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="sample_NNNNNNNNN.pt files"):
        _check_folder(out, model, [0, 2, 4, 5], 128, "d.json", None)
    (out / "sample_000000000.pt").unlink()
    # a folder speculators' own script started: resumed only with its settings
    (out / "data_0.pt").write_bytes(b"")
    (out / "data_config.json").write_text(json.dumps({
        "model": {"target_model_path": model}, "hidden_states": {"layer_ids": [0, 2, 4, 5]},
        "data": {"seq_length": 128, "train_data_path": "d.json"}}))
    _check_folder(out, model, [0, 2, 4, 5], 128, "d.json", None)
    with pytest.raises(ValueError, match=r"other settings .*layer_ids"):
        _check_folder(out, model, [1, 2, 4, 5], 128, "d.json", None)


def test_input_mode_refuses_upstream_only_arguments(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3_compat", "generate", "--model", "m", "--input", "x.jsonl",
         "--output", str(tmp_path / "o"), "--max-samples", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--max-samples apply to --train-data-path" in proc.stderr


# --- eagle3-compat run -------------------------------------------------------

PROBE = """
import json, multiprocessing, os, subprocess, sys
import eagle3_compat, eagle3_compat._inherit as inherit

def child(q):
    import eagle3_compat._inherit as inherit
    q.put(inherit._registered)

if __name__ == "__main__":
    out = {"argv": sys.argv, "main_file": os.path.basename(__file__), "registered": inherit._registered,
           "env": os.environ.get("EAGLE3_COMPAT_APPLIED"), "package": eagle3_compat.__file__,
           "marker": os.environ.get("SHADOWED_SITECUSTOMIZE_RAN")}
    out["subprocess"] = subprocess.run(
        [sys.executable, "-c", "import eagle3_compat._inherit as i; print(i._registered)"],
        capture_output=True, text=True).stdout.strip()
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start(); out["spawn"] = q.get(timeout=60); p.join()
    print("PROBE " + json.dumps(out))
"""


def test_run_without_the_pth_file_children_inherit(tmp_path):
    """As in an editable install: eagle3_compat from src/ on PYTHONPATH (a
    plain path entry, whose .pth files Python never reads), the base
    interpreter.  The program, a subprocess and a spawn child all have the
    inheritance hook; arguments reach the program untouched; a sitecustomize
    that ours shadows still runs."""
    import wrapt

    script = tmp_path / "prog.py"
    script.write_text(PROBE)
    shadowed = tmp_path / "theirs"
    shadowed.mkdir()
    (shadowed / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_SITECUSTOMIZE_RAN'] = '1'\n")
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3_COMPAT_APPLIED"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(shadowed), str(Path(wrapt.__file__).parents[1])])
    python = getattr(sys, "_base_executable", sys.executable)
    proc = subprocess.run([python, "-m", "eagle3_compat", "run", "--dtype", "float32", str(script),
                           "--layer-ids", "1", "2", "-x"], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PROBE "))
    out = json.loads(line[6:])
    assert out["argv"] == [str(script), "--layer-ids", "1", "2", "-x"]
    assert out["main_file"] == "prog.py"
    assert Path(out["package"]).is_relative_to(SRC)  # not an installed copy with its .pth
    assert json.loads(out["env"]) == {"dtype": "float32"}
    assert out["registered"] is True and out["subprocess"] == "True" and out["spawn"] is True
    assert out["marker"] == "1"


def test_run_without_launcher_nothing_is_inherited(tmp_path):
    """The control for the test above: the same program run plainly has no hook."""
    import wrapt

    script = tmp_path / "prog.py"
    script.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3_COMPAT_APPLIED"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(Path(wrapt.__file__).parents[1])])
    python = getattr(sys, "_base_executable", sys.executable)
    proc = subprocess.run([python, str(script)], capture_output=True, text=True, env=env, timeout=300)
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("PROBE "))[6:])
    assert out["registered"] is False and out["subprocess"] == "False" and out["spawn"] is False


def test_run_usage_errors(tmp_path):
    from eagle3_compat.launcher import launch_command

    with pytest.raises(ValueError, match="no such script"):
        launch_command(str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="--dtype"):
        launch_command("m", module=True, dtype="int8")
    argv, env = launch_command("pkg.mod", module=True, args=["--a", "1"], dtype=None,
                               environ={"PYTHONPATH": "/x"})
    assert argv[1:] == ["-m", "pkg.mod", "--a", "1"]
    assert env["PYTHONPATH"].split(os.pathsep)[1:] == ["/x"] and env["EAGLE3_COMPAT_APPLIED"] == '{"dtype": null}'


def test_run_module_form(tmp_path):
    """`eagle3-compat run -m MODULE ARGS`: as `python -m`, the hook inherited."""
    (tmp_path / "probe_mod.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3_COMPAT_APPLIED"}
    proc = subprocess.run([sys.executable, "-m", "eagle3_compat", "run", "-m", "probe_mod", "a", "--b"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("PROBE "))[6:])
    assert out["argv"][1:] == ["a", "--b"] and out["main_file"] == "probe_mod.py"
    assert json.loads(out["env"]) == {"dtype": None}
    assert out["registered"] is True and out["subprocess"] == "True" and out["spawn"] is True


def test_max_in_flight_defaults_agree(capsys):
    """stream(), run_generate and the CLI's help give one default, at least
    three engine steps' worth of prompts (tested on the engine in
    test_engine_core.test_stream_default_keeps_every_engine_step_full)."""
    import inspect
    import re

    from eagle3_compat.__main__ import main
    from eagle3_compat.dataset import run_generate
    from eagle3_compat.generator import DEFAULT_MAX_IN_FLIGHT, MAX_NUM_SEQS, generator_stream

    assert DEFAULT_MAX_IN_FLIGHT >= 3 * MAX_NUM_SEQS
    assert inspect.signature(generator_stream).parameters["max_in_flight"].default == DEFAULT_MAX_IN_FLIGHT
    assert inspect.signature(run_generate).parameters["max_in_flight"].default is None  # -> the generator's
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert re.search(r"--max-in-flight MAX_IN_FLIGHT prompts in the engine at once \(default (\d+):", help_text)
    assert int(re.search(r"in the engine at once \(default (\d+):", help_text).group(1)) == DEFAULT_MAX_IN_FLIGHT
