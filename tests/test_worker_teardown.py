"""Worker teardown (e3c_teardown restores the runner) and the token-id-check warning."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from conftest import GEN_LAYERS


def _reply(checked=None):
    r = {"error": None, "segments": [], "transport": "shm"}
    if checked is not None:
        r["token_ids_checked"] = checked
    return r


def test_unchecked_token_ids_warn_once_per_generator_naming_the_model(caplog):
    from eagle3_compat.generator import _warn_unchecked_once

    a, b = SimpleNamespace(model_path="/m/llava-tiny"), SimpleNamespace(model_path="/m/other")
    with caplog.at_level(logging.WARNING, logger="eagle3_compat"):
        _warn_unchecked_once(a, _reply(True))
        _warn_unchecked_once(a, _reply())  # an older worker's reply: no key, nothing said
        assert not caplog.records
        _warn_unchecked_once(a, _reply(False))
        _warn_unchecked_once(a, _reply(False))
        _warn_unchecked_once(b, _reply(False))
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 2
    assert "/m/llava-tiny" in msgs[0] and "by position only" in msgs[0]
    assert "/m/other" in msgs[1]


@pytest.mark.engine
@pytest.mark.usefixtures("applied_f32")
def test_shared_generator_reports_token_ids_checked(llama_gen, monkeypatch):
    import eagle3_compat.generator as driver

    seen = []
    rpc = driver._rpc

    def spy(self, method, *args):
        out = rpc(self, method, *args)
        if method == "e3c_take":
            seen.append(out[0])
        return out

    monkeypatch.setattr(driver, "_rpc", spy)
    llama_gen.generate([[5, 6, 7], [8]])
    assert seen and seen[0]["token_ids_checked"] is True


@pytest.mark.engine
@pytest.mark.usefixtures("applied_f32")
@pytest.mark.lifecycle
def test_teardown_restores_the_runner_and_later_generate_is_a_clear_error(tiny_models, llama_gen):
    from speculators.data_generation import VllmHiddenStatesGenerator

    with VllmHiddenStatesGenerator(str(tiny_models("llama")), layer_ids=GEN_LAYERS, max_model_len=128) as g:
        (before,) = g.llm.collective_rpc("e3c_state")
        assert before["active"] and before["hooks"] == len(GEN_LAYERS) + 1
        assert before["execute_model_wrapped"] and before["execute_model_is_wrapt_wrapper"]
        assert not before["execute_model_is_original"]
        assert g.generate([[5, 6, 7]])[0]["hidden_states"][0].shape[0] == 3
        # The shared generator's engine (another process, same code) is untouched.
        (other,) = llama_gen.llm.collective_rpc("e3c_state")
        assert other["active"] and other["execute_model_wrapped"]

        g.llm.collective_rpc("e3c_teardown")
        (after,) = g.llm.collective_rpc("e3c_state")
        assert after == {
            **after,
            "active": False,
            "hooks": 0,
            "execute_model_wrapped": False,
            "execute_model_is_wrapt_wrapper": False,
            "execute_model_is_original": True,
        }
        assert after["signature"] == before["signature"]  # the wrapper kept it
        g.llm.collective_rpc("e3c_teardown")  # idempotent
        with pytest.raises(Exception, match="capture is not set up in this worker"):
            g.generate([[5, 6, 7]])
