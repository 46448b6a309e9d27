"""Environment variations a user's run may have; each must give correct data.

Each case runs in a fresh interpreter (the engine reads these settings when
it starts) and compares with Hugging Face float32.  Two runs cover three
variations (each run costs an interpreter and an engine start):

* ``fork``: ``VLLM_WORKER_MULTIPROC_METHOD=fork`` instead of spawn (vLLM's
  CPU platform overrides it to spawn itself, ``platforms/cpu.py``; on CUDA a
  forked worker inherits the driver's modules; the worker extension is
  imported by name either way).  This run is the README's main command,
  ``python -m eagle3_compat demo``, with ``EAGLE3_COMPAT_DEBUG=1``: its table
  must say OK and the worker extension's INFO and per-step capture lines
  must come from vLLM's engine process, not the driver (logging visible in
  worker processes through vLLM's own handler).
* ``plugins+apply-in-workers``: a ``VLLM_PLUGINS`` allow-list naming only
  some other plugin (eagle3_compat needs no vLLM plugin: its worker side is
  the engine's ``worker_extension_cls``, imported by name), speculators
  imported before ``apply()``, and ``apply()`` at the top of the user's
  script, so that vLLM's spawned engine process, which re-imports the
  script, runs it too (checked by a marker each process writes); and
  ``EAGLE3_COMPAT_CPU_TRIM_MIB=0``, so that the worker trims its heap after
  every captured step (``eagle3_compat.heap``; counted by the worker).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.engine]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import speculators.data_generation  # before apply()
    import eagle3_compat
    eagle3_compat.apply(dtype="float32")
    open(os.path.join(os.environ["E3C_MARKERS"], str(os.getpid())), "w").write("applied")

    def main():
        from speculators.data_generation import VllmHiddenStatesGenerator
        from eagle3_compat.testing import compare, hf_layer_outputs
        model, layers = sys.argv[1], [0, 3, 5]
        prompts = [[4 + (i * 7 + j) % 390 for j in range(n)] for i, n in enumerate((1, 9, 300, 40))]
        with VllmHiddenStatesGenerator(model, layer_ids=layers, max_model_len=512) as g:
            results = g.generate(prompts)
            memory = g.llm.collective_rpc("e3c_memory")[0]
        worst = compare(results, hf_layer_outputs(model, prompts, layers), prompts, layers, 1e-4)
        print("RESULT" + json.dumps({"worst": worst, "trims": memory["heap_trims"],
                                     "trim_seconds": memory["trim_seconds"]}))

    if __name__ == "__main__":
        main()
    """
)


def _run_script(tmp_path, model):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    markers = tmp_path / "markers"
    markers.mkdir()
    # EAGLE3_COMPAT_CPU_TRIM_MIB=0: the worker trims its heap after every
    # captured step (eagle3_compat.heap), and the data stay exact.
    env = {**os.environ, "VLLM_PLUGINS": "some_other_plugin", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           "E3C_MARKERS": str(markers), "EAGLE3_COMPAT_CPU_TRIM_MIB": "0"}
    proc = subprocess.run([sys.executable, str(script), str(model)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    result = json.loads(line[len("RESULT"):])
    assert result["worst"] < 1e-4
    assert result["trims"] >= 1, result  # one per captured step
    assert 0 < result["trim_seconds"] < 60, result  # the time inside those trims
    # the driver and vLLM's engine-core process (spawned: it re-imports the script)
    applied_in = len(list(markers.iterdir()))
    assert applied_in >= 2, applied_in


def _run_demo_forked():
    env = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "fork", "EAGLE3_COMPAT_DEBUG": "1"}
    proc = subprocess.run([sys.executable, "-m", "eagle3_compat", "demo"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max rel err" in proc.stdout and "(OK)" in proc.stdout, proc.stdout
    # The driver is the CLI, an application: its own format, "LEVEL [pid] logger: message".
    driver = set(re.findall(r"\[(\d+)\] eagle3_compat\.generator: ", proc.stderr))
    assert driver, proc.stderr[-3000:]
    # The worker extension's set-up line (INFO: Python's last resort would
    # drop it) and its per-step debug lines, from vLLM's engine process (vLLM
    # prefixes that process's stderr with "(EngineCore_DP0 pid=N) "): through
    # vLLM's own handler (attach_to_vllm_logging), or through that process's
    # root handler where it has one (a forked process inherits the CLI's;
    # xgrammar, imported by vLLM's engine, calls logging.basicConfig(level=INFO)).
    lines = [ln for ln in proc.stderr.splitlines()
             if "capture hooks on" in ln or re.search(r"step \d+: \d+ rows", ln)]
    assert any("capture hooks on" in ln and re.search(r"\bINFO\b", ln) for ln in lines), proc.stderr[-3000:]
    assert any("rows" in ln for ln in lines), proc.stderr[-3000:]
    pids = set()
    for ln in lines:
        m = re.search(r"pid=(\d+)\)|\[(\d+)\] eagle3_compat\.worker: ", ln)
        assert m, ln
        pids.add(m.group(1) or m.group(2))
    assert not (pids & driver), (pids, driver)  # logged by vLLM's engine process, not the driver


@pytest.mark.extended
@pytest.mark.parametrize("case", ["fork", "plugins+apply-in-workers"])
def test_environment_case_gives_correct_data(tiny_models, tmp_path, case):
    if case == "fork":
        _run_demo_forked()
    else:
        _run_script(tmp_path, tiny_models("llama"))
