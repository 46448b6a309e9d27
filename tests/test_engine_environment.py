"""Environment variations a user's run may have; each must give correct data.

Each case runs a small script in a fresh interpreter (the engine reads these
settings when it starts) and compares with Hugging Face float32:

* ``fork``: ``VLLM_WORKER_MULTIPROC_METHOD=fork`` instead of spawn (vLLM's
  CPU platform overrides it to spawn itself, ``platforms/cpu.py``; on CUDA a
  forked worker inherits the driver's modules; the worker extension is
  imported by name either way);
* ``plugins``: a ``VLLM_PLUGINS`` allow-list naming only some other plugin
  (eagle3_compat needs no vLLM plugin: its worker side is the engine's
  ``worker_extension_cls``, imported by name), with speculators imported
  before ``apply()``;
* ``apply-in-workers``: ``apply()`` at the top of the user's script, so that
  vLLM's spawned engine and worker processes, which re-import the script,
  run it too (checked by a marker each process writes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.engine]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    {pre}
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
        worst = compare(results, hf_layer_outputs(model, prompts, layers), prompts, layers, 1e-4)
        print("RESULT" + json.dumps({{"worst": worst}}))

    if __name__ == "__main__":
        main()
    """
)

CASES = {
    "fork": ("", {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}),
    "plugins": ("import speculators.data_generation", {"VLLM_PLUGINS": "some_other_plugin"}),
    "apply-in-workers": ("", {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}),
}


@pytest.mark.extended
@pytest.mark.parametrize("case", list(CASES))
def test_environment_case_gives_correct_data(tiny_models, tmp_path, case):
    pre, env_extra = CASES[case]
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT.format(pre=pre))
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {**os.environ, **env_extra, "E3C_MARKERS": str(markers)}
    proc = subprocess.run([sys.executable, str(script), str(tiny_models("llama"))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    assert json.loads(line[len("RESULT"):])["worst"] < 1e-4
    applied_in = len(list(markers.iterdir()))
    if case == "apply-in-workers":
        # the driver and vLLM's engine-core process (spawned: it re-imports the script)
        assert applied_in >= 2, applied_in
