"""speculators 0.3.0's own preprocessing (chat template, loss masks) gives the
same token ids and loss masks under transformers 5 as under transformers 4.

The expected values below were produced by this very code path
(``eagle3_compat.dataset.read_jsonl`` -> speculators'
``_detect_assistant_pattern`` and ``_preprocess_batch``) with transformers
4.57.6 in the vLLM 0.17 environment, on the tiny tokenizer the suite makes
(word-level vocabulary ``<pad> <s> </s> <unk> w0 w1 ...``; its chat template
writes ``role content </s>`` per turn, so roles are ``<unk>`` = 3).  Every env
checks them: under transformers 5 (vLLM 0.19+ here) this is the comparison
with transformers 4 on the same data; under 4 a regression check.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.engine

CONVERSATIONS = [
    [{"from": "human", "value": "w1 w2 w3"}, {"from": "gpt", "value": "w4 w5"}],
    [{"role": "system", "content": "w9"}, {"role": "user", "content": "w1"},
     {"role": "assistant", "content": "w2 w3 w4"}, {"role": "user", "content": "w5 w6"},
     {"role": "assistant", "content": "w7"}],
    [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "hi"}, {"from": "human", "value": "more"}],
]

# (input_ids, loss_mask) per conversation, transformers 4.57.6
EXPECTED = [
    ([3, 5, 6, 7, 2, 3, 8, 9, 2], [0, 0, 0, 0, 0, 0, 1, 1, 0]),
    ([3, 13, 2, 3, 5, 2, 3, 6, 7, 8, 2, 3, 9, 10, 2, 3, 11, 2],
     [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0]),
    ([3, 3, 3, 2, 3, 3, 2, 3, 3, 2], [0, 0, 0, 0, 0, 1, 0, 0, 0, 0]),
]


def test_conversations_tokenize_and_mask_as_under_transformers_4(tmp_path):
    from transformers import AutoTokenizer

    from eagle3_compat.testing import ensure_applied, make_tiny_model

    ensure_applied("float32")  # under transformers 5 speculators imports only after apply()
    from eagle3_compat.dataset import read_jsonl

    model = make_tiny_model(tmp_path / "m", "llama")
    tok = AutoTokenizer.from_pretrained(str(model))
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in CONVERSATIONS))
    got = [(s.input_ids, s.loss_mask) for s in read_jsonl(inp, tok, 128)]
    assert got == EXPECTED
