"""A few steps of speculators 0.3.0's own ``Trainer`` with ``Eagle3DraftModel``
on the CPU, set up as its ``scripts/train.py`` (v0.3.0 tag) sets them up,
with the CPU workarounds (README, "speculators' pipeline on the CPU"):

* device ``"cpu"`` instead of ``torch.device(local_rank)``, and
  ``TrainerConfig(local_rank="cpu")`` (the trainer moves batches to it);
* no data-loader worker processes, no pinned memory;
* ``TORCHDYNAMO_DISABLE=1`` in the environment (set by the caller before
  torch is imported): the draft's compiled forward fails on the CPU with an
  InductorError.

Prints one ``LOSSES [...]`` line (the training loss of every step).
"""

import argparse
import json
import logging
import os

import numpy as np
import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, LlamaConfig

from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from speculators.train.data import Eagle3SampleFileDataset, create_collate_fn, standardize_data_v1
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
from speculators.train.trainer import Trainer, TrainerConfig


class Losses(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.values: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if isinstance(msg, dict) and "train" in msg:
            self.values.append(float(msg["train"]["loss"]))


def loader(files: list[str], seq_len: int) -> DataLoader:
    ds = Eagle3SampleFileDataset(file_list=files, max_len=seq_len, standardize_fn=standardize_data_v1)
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=seq_len, lengths=ds.approx_lengths,
                                                 num_replicas=1, rank=0)
    return DataLoader(ds, batch_sampler=sampler, num_workers=0, collate_fn=create_collate_fn(seq_len))


def main() -> None:
    assert os.environ.get("TORCHDYNAMO_DISABLE") == "1", "set TORCHDYNAMO_DISABLE=1 (CPU workaround)"
    ap = argparse.ArgumentParser()
    ap.add_argument("--verifier-name-or-path", required=True)
    ap.add_argument("--data-path", required=True)
    ap.add_argument("--save-path", required=True)
    ap.add_argument("--d2t-path", required=True)
    ap.add_argument("--t2d-path", required=True)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--total-seq-len", type=int, default=256)
    ap.add_argument("--ttt-steps", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    device = "cpu"
    d2t = torch.from_numpy(np.load(args.d2t_path)).to(device)
    t2d = torch.from_numpy(np.load(args.t2d_path)).to(device)
    vc = AutoConfig.from_pretrained(args.verifier_name_or_path)
    layer = LlamaConfig(
        vocab_size=vc.vocab_size, hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size,
        num_hidden_layers=1, num_attention_heads=vc.num_attention_heads,
        num_key_value_heads=vc.num_key_value_heads, hidden_act=vc.hidden_act,
        max_position_embeddings=vc.max_position_embeddings, initializer_range=vc.initializer_range,
        rms_norm_eps=vc.rms_norm_eps, head_dim=getattr(vc, "head_dim", None),
    )
    layer._attn_implementation = "simple_flex_attention"  # noqa: SLF001  (as upstream's train.py)
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=d2t.shape[0], norm_before_residual=True,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(proposal_type="greedy", speculative_tokens=args.ttt_steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=args.verifier_name_or_path, architectures=vc.architectures),
        ),
    )
    model = Eagle3DraftModel(config=config, t2d=t2d, d2t=d2t)
    files = sorted(str(p) for p in __import__("pathlib").Path(args.data_path).rglob("*.pt"))
    losses = Losses()
    logging.getLogger("speculators.metrics").addHandler(losses)
    logging.getLogger("speculators.metrics").setLevel(logging.INFO)
    kwargs = {"use_off_policy_tokens": False, "ttt_steps": args.ttt_steps, "ttt_step_loss_decay": 1.0}
    trainer = Trainer(model, TrainerConfig(
        lr=args.lr, num_epochs=args.epochs, save_path=args.save_path, local_rank=device,  # type: ignore[arg-type]
        train_call_kwargs=kwargs, val_call_kwargs=kwargs, scheduler_type="none",
    ), loader(files, args.total_seq_len), None)
    trainer.run_training()
    print("LOSSES " + json.dumps(losses.values))


if __name__ == "__main__":
    main()
