"""Tensor parallel 2 on the real engine: the ranks share the device-to-host copies.

After each decoder layer's all-reduce both ranks hold the same rows; each
copies its share of every step into the call's arena (on a GPU: over its own
link).  Checked here against Hugging Face float32: ``generate()`` and
``stream()`` with shared copies, and with ``EAGLE3_COMPAT_SHARD=0`` (rank 0
copies every row); the raw replies show who wrote how many rows.
"""

from __future__ import annotations

import pytest

from prompts import mixed_prompts

pytestmark = [pytest.mark.engine, pytest.mark.extended, pytest.mark.parallel, pytest.mark.usefixtures("applied_f32")]

LAYERS = [0, 2, 5]
TOL = 1e-4


def test_both_ranks_write_their_share_and_the_rows_match_the_reference(tiny_models, monkeypatch):
    import torch
    from speculators.data_generation import VllmHiddenStatesGenerator

    import eagle3_compat.generator as driver
    from eagle3_compat.testing import compare, hf_layer_outputs

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    raw: list[tuple[str, list]] = []
    rpc = driver._rpc

    def spy(self, method, *args):
        out = rpc(self, method, *args)
        if method in ("e3c_take", "e3c_exchange"):
            raw.append((method, out))
        return out

    monkeypatch.setattr(driver, "_rpc", spy)
    model = tiny_models("llama")
    # 35 prompts of up to 500 tokens: several steps, prompts chunked across them
    prompts = mixed_prompts(35, 500, seed=7)
    ref = hf_layer_outputs(model, prompts, LAYERS)
    with VllmHiddenStatesGenerator(str(model), layer_ids=LAYERS, max_model_len=512, tensor_parallel_size=2) as g:
        assert g._e3c_shardable == [2]
        shared = g.generate(prompts)
        compare(shared, ref, prompts, LAYERS, TOL)
        ((method, (primary, share)),) = raw
        total = sum(map(len, prompts)) * len(LAYERS)
        assert primary["shards"] == 2 and share["shard"] == 1 and primary["steps"] == share["steps"] >= 2
        # each rank wrote about half of every step's rows, together all of them
        assert primary["rows"] + share["rows"] == total
        assert 0.3 * total < share["rows"] < 0.7 * total, (primary["rows"], share["rows"])

        raw.clear()
        streamed = dict(g.stream(iter(prompts[:6]), max_in_flight=3))
        assert sorted(streamed) == list(range(6))
        for i, sample in streamed.items():
            for a, b in zip(sample["hidden_states"], shared[i]["hidden_states"]):
                assert torch.allclose(a, b, rtol=TOL, atol=TOL)
        takes = [(p, s) for _m, (p, s) in raw if p and p["taken"]]
        assert takes and all(s is not None and s["shard"] == 1 and len(s["taken"]) == len(p["taken"])
                             for p, s in takes)
        assert sum(t["rows"] for p, s in takes for t in (*p["taken"], *s["taken"])) == \
            sum(map(len, prompts[:6])) * len(LAYERS)

        raw.clear()
        monkeypatch.setenv("EAGLE3_COMPAT_SHARD", "0")
        alone = g.generate(prompts)
        ((method, (primary, share)),) = raw
        assert share is None and primary["shards"] == 1 and primary["rows"] == total
        compare(alone, ref, prompts, LAYERS, TOL)
        monkeypatch.setenv("EAGLE3_COMPAT_SHARD", "2")
        with pytest.raises(ValueError, match="EAGLE3_COMPAT_SHARD"):
            g.generate(prompts[:1])
