"""``verify --numerics``: a folder's numbers checked against the model.

The pure parts (the final norm and head read from the checkpoint, the
agreement, the choice of records) need no engine.  The folder tests write
folders of Hugging Face float32 states by hand (no capture involved), then
corrupt them as the field's silent bugs do, and check them against vLLM's
own prompt log-probabilities on one plain engine (and one CLI run).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
# release-independent (the engine only supplies the reference log-probs): run in one env
pytestmark = pytest.mark.once

from eagle3_compat import numerics  # noqa: E402
from eagle3_compat.dataset import CONVENTIONS  # noqa: E402

LAYERS = [0, 2, 3, 5]  # of the tiny models' 6: the final layer last
MAX_LEN = 256
# six prompts; 1 and 4 of the same length (their states can be swapped unseen by shapes)
LENGTHS = [40, 73, 9, 120, 73, 55]


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in LENGTHS]


def test_final_norm_and_head_match_hugging_face(tiny_models):
    """Our norm + head from two checkpoint tensors = the HF model's own ``norm`` and ``lm_head``."""
    from transformers import AutoModelForCausalLM

    for family in ("llama", "qwen3_moe"):
        path = tiny_models(family)
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        rows = torch.randn(17, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want = torch.log_softmax(model.lm_head(model.model.norm(rows)), dim=-1)
        got = numerics._log_probs(rows, *numerics.final_norm_and_head(path))
        assert (got - want).abs().max() < 1e-5, family
        # and a neighbour's rows do not
        assert (numerics._log_probs(rows.roll(1, 0), *numerics.final_norm_and_head(path)) - want).abs().max() > 1e-2


def test_final_norm_and_head_refuse_an_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ValueError, match="model type 'gpt2' are not known"):
        numerics.final_norm_and_head(tmp_path)


def test_logits_agreement_counts_positions_and_near_ties():
    g = torch.Generator().manual_seed(0)
    hidden, vocab, n = 16, 50, 30
    norm_w, head_w = torch.rand(hidden, generator=g) + 0.5, torch.randn(vocab, hidden, generator=g)
    rows = torch.randn(n, hidden, generator=g)
    tokens = torch.randint(0, vocab, (n,), generator=g).tolist()
    lp = numerics._log_probs(rows, norm_w, head_w, 1e-6)
    engine = [None] + [(int(lp[t - 1].argmax()), float(lp[t - 1, tokens[t]])) for t in range(1, n)]
    agree, worst, compared = numerics.logits_agreement(rows, tokens, engine, norm_w, head_w, 1e-6, 1e-3)
    assert (agree, compared) == (1.0, n - 1) and worst < 1e-5
    # rows one position late: the predictions of the wrong prefix
    agree, worst, _ = numerics.logits_agreement(rows.roll(1, 0), tokens, engine, norm_w, head_w, 1e-6, 1e-3)
    assert agree < 0.5 and worst > 1e-2
    # the engine's top-1 our second best by less than the margin: a near tie agrees
    top2 = lp[0].topk(2)
    gap = float(top2.values[0] - top2.values[1])
    tied = [None, (int(top2.indices[1]), engine[1][1])] + engine[2:]
    assert numerics.logits_agreement(rows, tokens, tied, norm_w, head_w, 1e-6, gap * 1.01)[0] == 1.0
    assert numerics.logits_agreement(rows, tokens, tied, norm_w, head_w, 1e-6, gap * 0.99)[0] == (n - 2) / (n - 1)


def test_shape_problems_are_named():
    ids = torch.arange(5)
    good = {"input_ids": ids, "hidden_states": [torch.zeros(5, 4)] * 2}
    assert numerics._shape_problem(good, 2) is None
    assert numerics._shape_problem(good, 3) == "2 hidden-state tensors for 3 layer ids"
    short = {"input_ids": ids, "hidden_states": [torch.zeros(5, 4), torch.zeros(4, 4)]}
    assert numerics._shape_problem(short, 2) == "hidden state 1 has shape (4, 4) for 5 tokens"


def test_sample_indices_spread_by_index_not_name(tmp_path):
    for i in range(11):
        (tmp_path / f"data_{i}.pt").write_bytes(b"")
    (tmp_path / "data_x.pt").write_bytes(b"")
    assert numerics.sample_indices(tmp_path, 3) == [0, 5, 10]
    assert numerics.sample_indices(tmp_path, 1) == [0]
    assert numerics.sample_indices(tmp_path, 50) == list(range(11))
    with pytest.raises(ValueError, match="samples must be at least 1"):
        numerics.check_numerics(tmp_path, samples=0)
    with pytest.raises(ValueError, match=r"threshold must be in \[0, 1\]"):
        numerics.check_numerics(tmp_path, threshold=1.5)


def test_folder_settings_from_speculators_data_config(tmp_path):
    (tmp_path / "data_config.json").write_text(json.dumps({
        "model": {"target_model_path": "/m", "hidden_size": 8}, "data": {"seq_length": 99},
        "hidden_states": {"layer_ids": [1, 3]}}))
    s = numerics.folder_settings(tmp_path)
    assert (s["model"], s["layer_ids"], s["max_model_len"], s["capture"]) == ("/m", [1, 3], 99, "layer_output")
    assert s["convention"] == CONVENTIONS["layer_output"]


def _write_folder(out, model, prompts, states, layers=LAYERS):
    out.mkdir(parents=True)
    for i, (p, hs) in enumerate(zip(prompts, states)):
        torch.save({"input_ids": torch.tensor(p), "loss_mask": torch.ones(len(p), dtype=torch.long),
                    "hidden_states": [h.clone() for h in hs]}, out / f"data_{i}.pt")
    hidden = states[0][0].shape[-1]
    (out / "manifest.json").write_text(json.dumps({
        "model": str(model), "layer_ids": layers, "capture": "layer_output", "dtype": "float32",
        "max_model_len": MAX_LEN, "layer_convention": CONVENTIONS["layer_output"], "complete": True,
        "samples": len(prompts), "first_index": 0}))
    (out / "data_config.json").write_text(json.dumps({"model": {"target_model_path": str(model),
                                                                "hidden_size": hidden},
                                                      "hidden_states": {"layer_ids": layers}}))
    return out


def _corrupt(src, dst, change):
    shutil.copytree(src, dst)
    for f in dst.glob("data_*.pt"):
        i = int(f.stem.split("_")[1])
        data = torch.load(f, weights_only=True)
        new = change(i, data)
        if new is not None:
            torch.save(new, f)
    return dst


@pytest.fixture(scope="module")
def folders(tiny_models, tmp_path_factory):
    """The clean folder and its corrupted copies, all of Hugging Face float32 states."""
    from eagle3_compat.testing import hf_layer_outputs

    model, other = tiny_models("llama"), tiny_models("llama", seed=7)
    prompts = _prompts()
    states = hf_layer_outputs(model, prompts, LAYERS)
    root = tmp_path_factory.mktemp("numerics")
    clean = _write_folder(root / "clean", model, prompts, states)
    by_name = {"clean": clean}
    by_name["bf16"] = _corrupt(clean, root / "bf16", lambda i, d: {
        **d, "hidden_states": [h.to(torch.bfloat16).to(torch.float32) for h in d["hidden_states"]]})
    by_name["shifted"] = _corrupt(clean, root / "shifted", lambda i, d: {
        **d, "hidden_states": [h.roll(1, 0) for h in d["hidden_states"]]})
    by_name["layers"] = _corrupt(clean, root / "layers", lambda i, d: {
        **d, "hidden_states": list(reversed(d["hidden_states"]))})
    swapped = {1: states[4], 4: states[1]}
    by_name["swapped"] = _corrupt(clean, root / "swapped", lambda i, d: {
        **d, "hidden_states": [h.clone() for h in swapped[i]]} if i in swapped else None)
    theirs = hf_layer_outputs(other, prompts, LAYERS)
    by_name["other_model"] = _corrupt(clean, root / "other_model", lambda i, d: {
        **d, "hidden_states": theirs[i]})
    by_name["truncated"] = _corrupt(clean, root / "truncated", lambda i, d: {
        **d, "hidden_states": [h[:-3] for h in d["hidden_states"]]} if i == 3 else None)
    return model, by_name


@pytest.fixture(scope="module")
def engine(folders):
    """One plain vLLM engine (nothing of the capture in it) for every folder."""
    from vllm import LLM

    from eagle3_compat.cpu_attention import engine_kwargs

    model, _ = folders
    llm = LLM(model=str(model), dtype="float32", max_model_len=MAX_LEN, enforce_eager=True,
              enable_prefix_caching=False, seed=0, **engine_kwargs("float32", str(model)))
    yield llm
    llm.llm_engine.engine_core.shutdown()


def _failed(res):
    return [s.index for s in res.failed]


@pytest.mark.engine
@pytest.mark.extended
def test_numerics_pass_clean_folders_and_fail_corrupted_ones(folders, engine):
    _, f = folders
    every = list(range(len(LENGTHS)))
    for name in ("clean", "bf16"):
        res = numerics.check_numerics(f[name], samples=len(LENGTHS), llm=engine)
        assert res.method == "logits" and res.ok, (name, res.table())
        assert [s.index for s in res.samples] == every
        assert min(s.agreement for s in res.samples) >= (0.99 if name == "clean" else 0.95), res.table()
    expect = {"shifted": every, "layers": every, "other_model": every, "swapped": [1, 4], "truncated": [3]}
    for name, bad in expect.items():
        res = numerics.check_numerics(f[name], samples=len(LENGTHS), llm=engine)
        assert not res.ok and _failed(res) == bad, (name, res.table())
        assert max(s.agreement for s in res.failed) < 0.5 or name == "truncated", (name, res.table())
    res = numerics.check_numerics(f["truncated"], samples=len(LENGTHS), llm=engine)
    (bad,) = res.failed
    assert "hidden state 0 has shape (117, 256) for 120 tokens" in bad.detail


def test_numerics_recompute_for_layers_short_of_the_final_one(folders, tmp_path):
    """Last id not the final layer: the states are recomputed with Hugging Face (no engine)."""
    model, f = folders
    prompts = _prompts()[:3]
    from eagle3_compat.testing import hf_layer_outputs

    states = hf_layer_outputs(model, prompts, [0, 2, 3])
    clean = _write_folder(tmp_path / "clean", model, prompts, states, layers=[0, 2, 3])
    res = numerics.check_numerics(clean)
    assert res.method == "recompute" and res.ok and min(s.agreement for s in res.samples) == 1.0, res.table()
    late = _corrupt(clean, tmp_path / "late", lambda i, d: {**d, "hidden_states": [h.roll(1, 0) for h in
                                                                                 d["hidden_states"]]})
    res = numerics.check_numerics(late)
    assert _failed(res) == [0, 1, 2], res.table()
    with pytest.raises(ValueError, match="the logits check needs the final layer's output last"):
        numerics.check_numerics(clean, method="logits")


@pytest.mark.engine
@pytest.mark.extended
def test_cli_verify_numerics_names_the_samples(folders):
    _, f = folders
    proc = subprocess.run([sys.executable, "-m", "eagle3_compat", "verify", str(f["swapped"]), "--check-only",
                           "--numerics", "--numerics-samples", "6"], capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:] + proc.stderr[-3000:]
    assert f"OK: {len(LENGTHS)} samples" in out  # the shapes are right: only the numbers show it
    assert "layer convention: output of decoder layer k before the final norm" in out
    assert "NUMERICS FAILED: 2 of 6 sampled records disagree with the model (sample(s) 1, 4)" in out, out
