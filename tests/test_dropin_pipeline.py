"""Drop-in for speculators 0.3.0's own pipeline (#17), on the real CPU engine.

Core: ``eagle3-compat generate`` with upstream's arguments writes upstream's
layout (``data_{i}.pt``, ``data_config.json`` by speculators' own
``DataGenerationConfig``, ``token_freq.pt`` counted by speculators), the
samples being speculators' own preprocessing of the dataset, in its order,
with hidden states equal to HF float32.

Extended: the full pipeline: a program written like upstream's script, run
unmodified through ``eagle3-compat run``; the same with ``eagle3-compat
generate``; speculators' vocab mapping; a few steps of speculators'
``Trainer`` on the CPU, loss finite and falling.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent
LAYERS = [0, 2, 4, 5]  # the tiny Llama has 6 layers: 4 ascending ids ending at the final one


def cli(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "eagle3_compat", *args], capture_output=True, text=True,
                          timeout=900, env=env, cwd=cwd)


def _turns(rng: random.Random, n: int) -> list[tuple[str, str]]:
    words = lambda k: " ".join(f"w{rng.randrange(200)}" for _ in range(k))  # noqa: E731
    return [("user" if t % 2 == 0 else "assistant", words(rng.randrange(2, 14))) for t in range(n)]


def write_sharegpt(path: Path, n: int, seed: int = 0) -> None:
    """ShareGPT's shape (Aeala/ShareGPT_Vicuna_unfiltered): conversations of from/value turns; a JSON array."""
    rng = random.Random(seed)
    role = {"user": "human", "assistant": "gpt"}
    rows = [{"id": f"s{i}", "conversations": [{"from": role[r], "value": v} for r, v in _turns(rng, 2 + 2 * (i % 3))]}
            for i in range(n)]
    path.write_text(json.dumps(rows))


def write_ultrachat(path: Path, n: int, seed: int = 1) -> None:
    """UltraChat's turns (HuggingFaceH4/ultrachat_200k: role/content), under the
    'conversations' key speculators reads from local files; JSON lines."""
    rng = random.Random(seed)
    rows = [{"prompt_id": f"u{i}", "conversations": [{"role": r, "content": v} for r, v in _turns(rng, 2 + 2 * (i % 2))]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def upstream_args(model: Path, data: Path, out: Path, tmp: Path, tag: str) -> list[str]:
    """The argument list an upstream user passes to scripts/data_generation_offline.py."""
    return ["--target-model-path", str(model), "--train-data-path", str(data), "--output-dir", str(out),
            "--layer-ids", *map(str, LAYERS), "--seq-length", "128", "--batch-size", "3",
            "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.8", "--seed", "3",
            "--token-freq-path", str(tmp / f"token_freq_{tag}.pt"), "--hf-cache-dir", str(tmp / "hf-cache"),
            "--num-preprocessing-workers", "1"]


def speculators_preprocessed(model: Path, data: Path, tmp: Path, max_samples: int | None = None):
    """What speculators' own preprocessing makes of ``data`` (seed 3, as the arguments above)."""
    from speculators.data_generation.preprocessing import load_and_preprocess_dataset

    ds, _ = load_and_preprocess_dataset(
        target_model_path=str(model), train_data_path=str(data), seq_length=128, build_dataset_num_proc=1,
        seed=3, max_samples=max_samples, token_freq_path=str(tmp / "token_freq_reference.pt"),
        cache_dir=str(tmp / "hf-cache"))
    return ds


# max|ours - HF| / max|HF| in float32.  The CLI's stream batches prompts as
# they arrive, so the engine's batches (and vLLM's kernels' summation order)
# vary with the machine's load: on vLLM 0.11 (IPEX kernels) under `tox -p 2`
# one sample's layer came 1.4e-4 from Hugging Face (below 1e-4 alone).  A row
# shifted by one or a neighbouring layer is > 0.3 away (findings.md section 1).
DROPIN_TOL = 5e-4


def check_folder(out: Path, model: Path, expected, layers=LAYERS, tol: float = DROPIN_TOL,
                 ours: bool = True) -> list[dict]:
    """Exactly upstream's files, v1 keys, speculators' samples in order, states against HF float32."""
    import torch

    from eagle3_compat.testing import hf_layer_outputs, max_rel_error

    n = len(expected)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"data_{i}.pt" for i in range(n)] + ["data_config.json"] + (["manifest.json"] if ours else []))
    samples = [torch.load(out / f"data_{i}.pt", weights_only=True) for i in range(n)]
    refs = hf_layer_outputs(model, [s["input_ids"].tolist() for s in samples], layers)
    for i, (s, ref) in enumerate(zip(samples, refs)):
        assert set(s) == {"input_ids", "hidden_states", "loss_mask"}, i
        assert s["input_ids"].tolist() == expected[i]["input_ids"].tolist(), i  # speculators' order
        assert s["loss_mask"].tolist() == expected[i]["loss_mask"].tolist(), i
        assert s["input_ids"].dtype == s["loss_mask"].dtype == torch.long
        assert len(s["hidden_states"]) == len(layers)
        for k, h, r in zip(layers, s["hidden_states"], ref):
            assert max_rel_error(h, r) < tol, (i, k)
    return samples


def count_like_speculators(samples) -> dict[int, int]:
    c: Counter[int] = Counter()
    for s in samples:
        c.update(s["input_ids"][s["loss_mask"].bool()].tolist())
    return dict(c)


@pytest.mark.edge
def test_generate_with_upstream_arguments_writes_upstream_layout(tmp_path, tiny_models):
    import torch

    model = tiny_models("llama")
    data = tmp_path / "sharegpt.json"
    write_sharegpt(data, 9)
    out = tmp_path / "out"
    args = ["generate", *upstream_args(model, data, out, tmp_path, "a"), "--max-samples", "7",
            "--dtype", "float32"]
    proc = cli(*args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected = speculators_preprocessed(model, data, tmp_path, max_samples=7)
    assert len(expected) == 7
    samples = check_folder(out, model, expected)
    assert all(0 < int(s["loss_mask"].sum()) < len(s["loss_mask"]) for s in samples)
    # token_freq.pt: where --token-freq-path says (not in the data folder), as speculators counts it
    freq = torch.load(tmp_path / "token_freq_a.pt", weights_only=True)
    assert freq == torch.load(tmp_path / "token_freq_reference.pt", weights_only=True)
    assert freq == count_like_speculators(samples)
    # data_config.json: speculators' own DataGenerationConfig
    config = json.loads((out / "data_config.json").read_text())
    assert config["version"] == "2.0" and config["format"]["file_pattern"] == "data_{idx}.pt"
    assert config["hidden_states"]["layer_ids"] == LAYERS
    assert config["data"] | {"chat_template_note": None} == {
        "train_data_path": str(data), "seq_length": 128, "max_samples": 7, "num_samples": 7, "seed": 3,
        "chat_template_note": None}
    assert config["model"]["target_model_path"] == str(model) and config["model"]["hidden_size"] == 256
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["trainer_checks"] is True and manifest["layer_ids"] == LAYERS
    assert manifest["samples"] == 7 and manifest["dropped_by_preprocessing"] == 0
    # speculators' trainer reads the folder: 3 fused layers + the final one
    from speculators.train.data import Eagle3SampleFileDataset

    ds = Eagle3SampleFileDataset(max_len=128, datapath=str(out))
    assert len(ds) == 7 and ds[0]["hidden_states"].shape[-1] == 3 * 256
    # a rerun resumes (nothing to do); a folder in the ultrachat 'messages' shape is refused by name
    again = cli(*args)
    assert again.returncode == 0 and json.loads((out / "manifest.json").read_text())["written_this_run"] == 0
    msgs = tmp_path / "messages.jsonl"
    msgs.write_text(json.dumps({"messages": [{"role": "user", "content": "w1"},
                                             {"role": "assistant", "content": "w2"}]}) + "\n")
    bad = cli("generate", *upstream_args(model, msgs, tmp_path / "out2", tmp_path, "b"))
    assert bad.returncode == 2 and "ultrachat shape ('messages')" in bad.stderr, bad.stderr[-3000:]
    assert not (tmp_path / "out2").exists()


@pytest.mark.extended
def test_upstream_pipeline_end_to_end_on_cpu(tmp_path, tiny_models):
    """An upstream-style program through `eagle3-compat run`, and `eagle3-compat
    generate` with the same arguments: the same folder; then speculators' vocab
    mapping and a few steps of its Trainer on the CPU."""
    import numpy as np
    import torch
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    from eagle3_compat.testing import max_rel_error

    model = tiny_models("llama")
    data = tmp_path / "ultrachat.jsonl"
    write_ultrachat(data, 14)
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3_COMPAT_APPLIED"}
    # 1. the unmodified program, run through the launcher
    out_run = tmp_path / "via-run"
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3_compat", "run", "--dtype", "float32",
         str(HERE / "dropin" / "upstream_style_generation.py"), *upstream_args(model, data, out_run, tmp_path, "run")],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert proc.returncode == 0 and "UPSTREAM-STYLE wrote 14 files" in proc.stdout, proc.stderr[-4000:]
    # 2. eagle3-compat generate, same arguments
    out_gen = tmp_path / "via-generate"
    proc = cli("generate", *upstream_args(model, data, out_gen, tmp_path, "gen"), "--dtype", "float32", env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected = speculators_preprocessed(model, data, tmp_path)
    samples = check_folder(out_gen, model, expected)
    via_run = check_folder(out_run, model, expected, ours=False)
    for a, b in zip(samples, via_run):
        for x, y in zip(a["hidden_states"], b["hidden_states"]):
            assert max_rel_error(x, y) < 1e-5
    freq = torch.load(tmp_path / "token_freq_gen.pt", weights_only=True)
    assert freq == torch.load(tmp_path / "token_freq_run.pt", weights_only=True) == count_like_speculators(samples)
    # 3. speculators' vocab mapping (what scripts/build_vocab_mapping.py computes and saves)
    d2t, t2d = build_vocab_mappings_from_distribution(token_freq_dict=freq, draft_vocab_size=128,
                                                      target_vocab_size=512)
    np.save(tmp_path / "d2t.npy", d2t.numpy())
    np.save(tmp_path / "t2d.npy", t2d.numpy())
    assert int(t2d.sum()) == 128 and set(freq) <= set((torch.arange(128) + d2t).tolist())
    # 4. speculators' Trainer with Eagle3DraftModel, on the CPU
    train_env = dict(env, TORCHDYNAMO_DISABLE="1")
    proc = subprocess.run(
        [sys.executable, str(HERE / "dropin" / "train_cpu.py"), "--verifier-name-or-path", str(model),
         "--data-path", str(out_gen), "--save-path", str(tmp_path / "checkpoints"),
         "--d2t-path", str(tmp_path / "d2t.npy"), "--t2d-path", str(tmp_path / "t2d.npy")],
        capture_output=True, text=True, timeout=900, env=train_env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("LOSSES "))[7:])
    print("speculators Trainer on the CPU, loss per step:", " ".join(f"{v:.3f}" for v in losses))
    assert len(losses) >= 10 and all(math.isfinite(v) for v in losses), losses
    k = max(2, len(losses) // 4)
    assert sum(losses[-k:]) / k < 0.8 * sum(losses[:k]) / k, losses
