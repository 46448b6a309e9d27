"""What a layer id means, against Hugging Face's ``output_hidden_states``.

HF's tuple has ``num_layers + 1`` entries: ``hidden_states[0]`` is the
embedding output (the input of layer 0), ``hidden_states[k + 1]`` the output
of layer ``k`` (the input of layer ``k + 1``), and the last entry has the
final norm applied.

* ``capture="layer_output"`` (default; speculators 0.3.0's contract): layer
  ``k`` -> HF ``hidden_states[k + 1]`` for ``k < L - 1``; for the last layer
  the pre-norm state, so HF's last entry is ``norm(captured)``.
* ``capture="layer_input"`` (opt-in; vLLM's EAGLE-3 serving reads
  ``hidden_states + residual`` just before layer ``k`` runs): layer ``k`` ->
  HF ``hidden_states[k]``, and equal to ``layer_output`` of ``k - 1``.

The reference is HF's own tuple (no hooks), float32, one prompt per forward.
"""

from __future__ import annotations

import pytest

from prompts import mixed_prompts

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("applied_f32")]

TOL = 1e-4


def _hf_hidden_states(model_path, prompts):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            out.append([h[0] for h in hs])
    return model, out


def _as_ref(hf, index):
    return [[states[i] for i in index] for states in hf]


@pytest.mark.parametrize("family", ["llama", "olmo2"])
def test_layer_ids_against_hf_hidden_states(tiny_models, family, vllm_minor):
    from speculators.data_generation import VllmHiddenStatesGenerator

    from conftest import FULL, VLLM_DIFFERS_FROM_HF
    from eagle3_compat.testing import max_rel_error

    if family != "llama" and not FULL:
        pytest.skip("extended: Olmo2 (single-tensor layers) runs in the full suite")
    model = tiny_models(family)
    n = 6
    prompts = mixed_prompts(5, 200, seed=21)
    layers = [0, 2, n - 1]
    hf_model, hf = _hf_hidden_states(model, prompts)

    # layer_output also captures layer 1, for the input/output relation below
    with VllmHiddenStatesGenerator(str(model), layer_ids=[0, 1, 2, n - 1], max_model_len=256) as g:
        out = g.generate(prompts)
    with VllmHiddenStatesGenerator(str(model), layer_ids=layers, max_model_len=256,
                                   capture="layer_input") as g:
        assert g.capture == "layer_input"
        inp = g.generate(prompts)

    try:
        _check_against_hf(out, inp, hf, hf_model, prompts, layers, n)
        # the input of layer 2 is the output of layer 1 (two engine runs:
        # equal up to the CPU kernels' run-to-run rounding)
        for a, b in zip(inp, out):
            assert max_rel_error(a["hidden_states"][1], b["hidden_states"][1]) < 1e-5
    except AssertionError as exc:
        if vllm_minor not in VLLM_DIFFERS_FROM_HF.get(family, ()):
            raise
        # Only on the releases the README names (Olmo2 on the vLLM 0.12 and
        # 0.13 CPU builds), where vLLM's own forward (no eagle3_compat)
        # disagrees with HF and is batch-dependent: both conventions are held
        # to vLLM's own forward, one prompt per call, at 1e-5, and only then
        # is the HF mismatch recorded as an expected failure.
        _check_against_vllm_own(model, prompts, hf, layers, n)
        pytest.xfail(f"vLLM {vllm_minor[0]}.{vllm_minor[1]}'s own {family} forward differs from HF: {exc}")


def _check_against_vllm_own(model, prompts, hf, layers, n):
    import torch
    from speculators.data_generation import VllmHiddenStatesGenerator

    from eagle3_compat.testing import compare, vllm_layer_outputs

    out_layers = [0, 1, 2, n - 1]
    # The reference gives layer *outputs*: layer_input k == layer_output k - 1
    # for k >= 1, so the layer_input captures of layers 2 and n - 1 are held
    # to the reference outputs of layers 1 and n - 2.  layer_input 0 is the
    # embedding output, which the reference (stopped after a layer) does not
    # give: it is held to HF's hidden_states[0] (a table lookup, the same in
    # vLLM and HF) instead.
    ref_ids = sorted(set(out_layers) | {k - 1 for k in layers if k >= 1})
    own = vllm_layer_outputs(model, prompts, ref_ids)
    at = {k: i for i, k in enumerate(ref_ids)}
    with VllmHiddenStatesGenerator(str(model), layer_ids=out_layers, max_model_len=256) as g:
        out1 = [g.generate([p])[0] for p in prompts]
    compare(out1, [[o[at[k]] for k in out_layers] for o in own], prompts, out_layers, 1e-5)
    with VllmHiddenStatesGenerator(str(model), layer_ids=layers, max_model_len=256,
                                   capture="layer_input") as g:
        inp1 = [g.generate([p])[0] for p in prompts]
    later = [j for j, k in enumerate(layers) if k >= 1]
    compare(
        [{"input_ids": r["input_ids"], "hidden_states": [r["hidden_states"][j] for j in later]} for r in inp1],
        [[o[at[layers[j] - 1]] for j in later] for o in own],
        prompts, [layers[j] for j in later], 1e-5,
    )
    first = [j for j, k in enumerate(layers) if k == 0]
    compare(
        [{"input_ids": r["input_ids"], "hidden_states": [r["hidden_states"][j] for j in first]} for r in inp1],
        _as_ref(hf, [0] * len(first)), prompts, [0] * len(first), TOL,
    )
    # ... and vLLM's own forward must be what differs from HF
    own_results = [{"input_ids": torch.tensor(p), "hidden_states": [o[at[0]]]} for p, o in zip(prompts, own)]
    with pytest.raises(AssertionError):
        compare(own_results, _as_ref(hf, [1]), prompts, [0], TOL)


def _check_against_hf(out, inp, hf, hf_model, prompts, layers, n):
    import torch

    from eagle3_compat.testing import compare, max_rel_error

    # layer_output: k -> hidden_states[k + 1] below the last layer
    inner = [{"input_ids": r["input_ids"], "hidden_states": r["hidden_states"][:3]} for r in out]
    compare(inner, _as_ref(hf, [1, 2, 3]), prompts, [0, 1, 2], TOL)
    # ... and for the last layer HF's entry is the final norm of the captured state
    norm = hf_model.model.norm
    for i, r in enumerate(out):
        last = r["hidden_states"][3]
        with torch.no_grad():
            assert max_rel_error(norm(last), hf[i][n]) < TOL, i
        assert max_rel_error(last, hf[i][n]) > 1e-2, i  # not already normed
    # layer_input: k -> hidden_states[k] (k = 0: the embeddings)
    compare(inp, _as_ref(hf, [0, 2, n - 1]), prompts, layers, TOL)


def test_capture_argument_is_checked(tiny_models):
    from speculators.data_generation import VllmHiddenStatesGenerator

    with pytest.raises(ValueError, match="capture must be one of"):
        VllmHiddenStatesGenerator(str(tiny_models("llama")), layer_ids=[1], capture="input")


@pytest.mark.extended
@pytest.mark.parallel
def test_layer_conventions_hold_across_pipeline_stages(tiny_models, monkeypatch):
    """Pipeline parallel 2 (stage 0 runs layers 0-2, stage 1 runs 3-5 and the
    final norm): both columns of the table hold whichever stage a layer is
    on.  Layer 2's output and layer 3's input are the state handed from one
    stage to the next (HF ``hidden_states[3]``); the last layer's output is
    still the pre-norm state although its stage applies the norm."""
    from speculators.data_generation import VllmHiddenStatesGenerator

    from eagle3_compat.testing import compare, max_rel_error

    import torch

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    model = tiny_models("llama")
    n = 6
    prompts = mixed_prompts(5, 200, seed=21)
    hf_model, hf = _hf_hidden_states(model, prompts)
    out_layers, in_layers = [0, 2, 3, n - 1], [0, 3, n - 1]
    with VllmHiddenStatesGenerator(str(model), layer_ids=out_layers, max_model_len=256,
                                   pipeline_parallel_size=2) as g:
        out = g.generate(prompts)
    with VllmHiddenStatesGenerator(str(model), layer_ids=in_layers, max_model_len=256,
                                   capture="layer_input", pipeline_parallel_size=2) as g:
        inp = g.generate(prompts)
    inner = [{"input_ids": r["input_ids"], "hidden_states": r["hidden_states"][:3]} for r in out]
    compare(inner, _as_ref(hf, [1, 3, 4]), prompts, out_layers[:3], TOL)
    for i, r in enumerate(out):
        last = r["hidden_states"][3]
        with torch.no_grad():
            assert max_rel_error(hf_model.model.norm(last), hf[i][n]) < TOL, i
        assert max_rel_error(last, hf[i][n]) > 1e-2, i  # not already normed
    compare(inp, _as_ref(hf, [0, 3, n - 1]), prompts, in_layers, TOL)
    for a, b in zip(inp, out):  # layer 3's input (stage 1) is layer 2's output (stage 0)
        assert max_rel_error(a["hidden_states"][1], b["hidden_states"][1]) < 1e-5
