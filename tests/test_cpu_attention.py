"""The engine's block size on vLLM's CPU platform (eagle3_compat.cpu_attention).

Pure logic with a stand-in for the build's AMX check, and, on every
release, the real call of the build's scheduler-metadata op (its keyword
signature must match this release, or the AMX check would be inconclusive
and a bfloat16 engine on an AMX machine would die at its first step).
The engine itself runs bfloat16 in ``test_engine_core.py::test_bfloat16_within_5e_2``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eagle3_compat.cpu_attention import FALLBACK_BLOCK_SIZE, engine_block_size

CONFIG = SimpleNamespace(hidden_size=256, num_attention_heads=4, head_dim=64)


def refusing(head):
    raise RuntimeError(f"Unsupported CPU attention configuration: head_dim={head} isa=0")


def _probe(call):
    seen = []

    def probe():
        if call is None:
            return None

        def check(head):
            seen.append(head)
            return call(head)

        return check

    return probe, seen


# one row per case: (dtype option, the build's AMX check, block size chosen, head sizes probed)
CASES = [
    (None, refusing, FALLBACK_BLOCK_SIZE, [64]),  # dtype auto: bfloat16 on the CPU
    ("bfloat16", refusing, FALLBACK_BLOCK_SIZE, [64]),
    ("float32", refusing, None, []),  # not bfloat16: AMX attention is never chosen
    ("float16", refusing, None, []),
    ("bfloat16", lambda head: None, None, [64]),  # the build has the kernels
    ("bfloat16", None, None, []),  # no AMX tiles, not the CPU platform, or no such op
]


@pytest.mark.parametrize(("dtype", "call", "block", "probed"), CASES)
def test_block_size_only_where_the_build_refuses_amx(dtype, call, block, probed):
    probe, seen = _probe(call)
    assert engine_block_size(dtype, CONFIG, probe=probe) == block
    assert seen == probed


def test_head_size_from_the_config_and_other_errors_leave_vllm_s_choice():
    probe, seen = _probe(refusing)
    no_head = SimpleNamespace(hidden_size=512, num_attention_heads=4)
    assert engine_block_size(None, no_head, probe=probe) == FALLBACK_BLOCK_SIZE and seen == [128]

    def odd(head):
        raise TypeError("unexpected keyword argument 'head_dim'")

    def other(head):
        raise RuntimeError("something else")

    for call in (odd, other):
        probe, _ = _probe(call)
        assert engine_block_size(None, CONFIG, probe=probe) is None


def test_the_build_s_scheduler_metadata_op_takes_the_probe_s_call(vllm_minor):
    """The AMX check calls the op as vLLM's CPU backend does; with the
    portable ISA it must run on this release (where the op exists)."""
    from eagle3_compat.cpu_attention import scheduler_metadata_call

    call = scheduler_metadata_call()
    if call is None:
        assert vllm_minor < (0, 12), "no cpu_attn_get_scheduler_metadata on this release"
        pytest.skip(f"vLLM {vllm_minor}: no CPU attention scheduler-metadata op")
    out = call(64, "vec")
    assert out is not None


def test_amx_permission_is_asked_only_for_cpu_models_with_amx_tiles(monkeypatch):
    """The worker asks for the AMX permission vLLM's AMX attention needs
    (without it a bfloat16 step dies of SIGILL: vLLM 0.32 on an AMX machine)."""
    import torch

    from eagle3_compat.cpu_attention import grant_amx

    asked = []
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: asked.append(1) or True, raising=False)
    for amx in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx, raising=False)
        asked.clear()
        assert grant_amx(torch.device("meta")) is False and asked == []  # not a CPU model: nothing asked
        assert grant_amx("cpu") is amx and asked == ([1] if amx else [])
