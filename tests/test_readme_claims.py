"""README claims, each held by a test (issue #15)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "eagle3_compat", *args], capture_output=True,
                          text=True, timeout=600, **kw)


def _rows(text: str) -> dict[str, str]:
    """``name  value`` table lines (two or more spaces between) as a dict."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(\S.*?)\s{2,}(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


# README: "`eagle3-compat status`: the status table, without applying" with
# "versions found, adapters active or skipped".
@pytest.mark.engine
def test_status_cli_prints_versions_and_adapters():
    from importlib.metadata import version

    import vllm
    from packaging.version import Version

    from eagle3_compat.adapters import ADAPTERS
    from eagle3_compat.versions import detect, minor

    proc = cli("status")
    assert proc.returncode == 0, proc.stderr
    rows = _rows(proc.stdout)
    found, dist = re.fullmatch(r"(\S+) \((\S+)\)", rows["vllm"]).groups()
    assert Version(found).release == Version(vllm.__version__).release
    assert version(dist) == found
    assert rows["speculators"] == version("speculators") == "0.3.0"
    assert rows["torch"] == version("torch")
    assert rows["transformers"] == version("transformers")
    assert rows["applied"] == "no"  # without applying
    vminor = minor(Version(vllm.__version__))
    ids = [a.id for a in ADAPTERS]
    assert ids  # transformers5, generator-engine, worker-capture
    found = detect()
    for a in ADAPTERS:
        need = a.applies_to(vminor) and a.needed_for(found)
        want = "not applied yet (needed on this vLLM)" if need else "skipped: not needed"
        assert rows[f"adapter {a.id}"].startswith(want), (a.id, proc.stdout)
    # after apply(), the same table says which are active
    from eagle3_compat.testing import ensure_applied

    report = ensure_applied("float32")
    after = _rows(str(report))
    assert after["applied"] == "yes"
    assert [k[len("adapter "):] for k, v in after.items() if v == "active"] == [
        a.id for a in ADAPTERS if a.applies_to(vminor) and a.needed_for(found)]


# README: "`eagle3-compat doctor`: versions (CPU or CUDA build), ..."
@pytest.mark.engine
def test_doctor_build_lines_match_torch_and_vllm():
    import torch
    from vllm.platforms import current_platform

    proc = cli("doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert rows["vllm build"] == ("cpu" if current_platform.is_cpu() else "cuda/other"), proc.stdout
    assert rows["torch build"] == (f"cuda {torch.version.cuda}" if torch.version.cuda else "cpu"), proc.stdout
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert rows["cuda devices"] == str(devices), proc.stdout


# README: "Other architectures are refused before weights load unless
# EAGLE3_COMPAT_ALLOW_UNVERIFIED=1."
@pytest.mark.engine
def test_allow_unverified_lets_an_unverified_architecture_through(tmp_path, tiny_models, monkeypatch,
                                                                   applied_f32):
    import vllm
    from speculators.data_generation import VllmHiddenStatesGenerator

    model = tiny_models("llama")
    other = tmp_path / "unverified"
    other.mkdir()
    for f in model.iterdir():
        if f.is_file() and f.name != "config.json":
            (other / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["LlamaForSequenceClassification"]
    (other / "config.json").write_text(json.dumps(cfg))

    class EngineReached(Exception):
        pass

    started = []

    def fake_llm(**kw):  # no engine starts: the constructor got past the refusal
        started.append(kw)
        raise EngineReached

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    for value in (None, "0"):
        if value is None:
            monkeypatch.delenv("EAGLE3_COMPAT_ALLOW_UNVERIFIED", raising=False)
        else:
            monkeypatch.setenv("EAGLE3_COMPAT_ALLOW_UNVERIFIED", value)
        with pytest.raises(ValueError, match="has not verified.*LlamaForSequenceClassification"):
            VllmHiddenStatesGenerator(str(other), layer_ids=[0])
        assert not started
    monkeypatch.setenv("EAGLE3_COMPAT_ALLOW_UNVERIFIED", "1")
    with pytest.raises(EngineReached):
        VllmHiddenStatesGenerator(str(other), layer_ids=[0, 5])
    assert len(started) == 1 and started[0]["model"] == str(other)


# README: generate's JSONL lines may be "{"conversations": [...]}" (and,
# per read_jsonl, "{"messages": [...]}" in the role/content form).
@pytest.mark.engine
def test_messages_lines_tokenize_like_conversations(tmp_path, tiny_models):
    from transformers import AutoTokenizer

    from eagle3_compat.dataset import read_jsonl

    tok = AutoTokenizer.from_pretrained(tiny_models("llama"))
    turns = [("user", "human", "w1 w2 w3"), ("assistant", "gpt", "w4 w5 w6 w7"),
             ("user", "human", "w8"), ("assistant", "gpt", "w9 w10")]
    conv = [{"from": f, "value": v} for _, f, v in turns]
    msgs = [{"role": r, "content": v} for r, _, v in turns]
    other = [{"role": "user", "content": "w2"}, {"role": "assistant", "content": "w3 w3"}]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in (
        {"conversations": conv}, {"messages": msgs}, {"conversations": msgs}, {"messages": other})) + "\n")
    a, b, c, d = list(read_jsonl(path, tok, 128))
    assert [s.index for s in (a, b, c, d)] == [0, 1, 2, 3]
    assert len(a.input_ids) > 10
    assert b.input_ids == a.input_ids and b.loss_mask == a.loss_mask
    assert c.input_ids == a.input_ids and c.loss_mask == a.loss_mask
    assert 0 < sum(a.loss_mask) < len(a.loss_mask)  # assistant turns only
    assert d.input_ids != a.input_ids  # the content is what is tokenized
    # the assistant text is what the mask covers
    masked = tok.decode([t for t, m in zip(b.input_ids, b.loss_mask) if m])
    assert "w4" in masked and "w10" in masked and "w1 " not in masked and "w8" not in masked


# README/generator: speculators 0.3.0's default layer ids [2, L//2, L-3, L-1],
# a coinciding entry captured once.
@pytest.mark.parametrize(
    ("num_layers", "expected"),
    [(3, [2, 1, 0]), (4, [2, 1, 3]), (5, [2, 4]), (6, [2, 3, 5]), (7, [2, 3, 4, 6]), (8, [2, 4, 5, 7]),
     (32, [2, 16, 29, 31]), (61, [2, 30, 58, 60])],
)
def test_default_layer_ids(num_layers, expected):
    from eagle3_compat.generator import default_layer_ids, validate_layer_ids

    got = default_layer_ids(num_layers)
    assert got == expected
    assert validate_layer_ids(got, num_layers) == expected


@pytest.mark.parametrize(("num_layers", "raw"), [(1, r"\[2, 0, -2, 0\]"), (2, r"\[2, 1, -1, 1\]")])
def test_default_layer_ids_too_shallow_model_says_to_pass_them(num_layers, raw):
    from eagle3_compat.generator import default_layer_ids

    with pytest.raises(ValueError, match=rf"default layer ids .* are {raw} for this {num_layers}-layer model, "
                                         rf"outside \[0, {num_layers - 1}\]: pass layer_ids \(--layer-ids\)"):
        default_layer_ids(num_layers)


@pytest.mark.engine
def test_default_layer_ids_are_speculators_own():
    """The same rule as speculators 0.3.0's constructor source (deduplicated)."""
    import inspect

    from speculators.data_generation import vllm_hidden_states_generator as m

    src = inspect.getsource(m)
    assert "[2, num_layers // 2, num_layers - 3, num_layers - 1]" in src


# README: "generate ... [--capture layer_input]": layer k's input, HF hidden_states[k].
@pytest.mark.engine
@pytest.mark.extended
def test_generate_capture_layer_input_matches_hf_hidden_states(tmp_path, tiny_models):
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3_compat.testing import max_rel_error

    model = tiny_models("llama")
    prompts = [list(range(4, 4 + n)) for n in (5, 33, 1, 70)]
    prompts[1] = [(7 * j + 3) % 390 + 4 for j in range(33)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    out = tmp_path / "out"
    layers = [0, 2, 5]
    proc = cli("generate", "--model", str(model), "--input", str(inp), "--output", str(out),
               "--layer-ids", ",".join(map(str, layers)), "--max-model-len", "128", "--dtype", "float32",
               "--capture", "layer_input", "--no-trainer-checks")
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["capture"] == "layer_input" and manifest["layer_ids"] == layers
    assert manifest["trainer_checks"] is False
    assert manifest["samples"] == len(prompts)
    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    for i, ids in enumerate(prompts):
        data = torch.load(out / f"data_{i}.pt", weights_only=True)
        assert data["input_ids"].tolist() == ids
        with torch.no_grad():
            hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        assert len(data["hidden_states"]) == len(layers)
        for k, h in zip(layers, data["hidden_states"]):
            assert h.shape == hs[k][0].shape, (i, k)
            assert max_rel_error(h, hs[k][0]) < 1e-4, (i, k)
            if k + 1 < len(hs) - 1:  # not the layer's output (layer_output's convention)
                assert max_rel_error(h, hs[k + 1][0]) > 1e-2, (i, k)
