"""A program that drives speculators 0.3.0's API the way its own
``scripts/data_generation_offline.py`` (v0.3.0 tag) does, written here (the
script is not in the wheel).  It knows nothing of eagle3_compat: the tests run
it through ``eagle3-compat run`` to show that such a program works unmodified.

Same arguments and the same steps: ``load_and_preprocess_dataset`` (which
writes ``token_freq.pt``), ``VllmHiddenStatesGenerator(...).generate`` in
batches, one ``data_{i}.pt`` per sample (resuming at the largest index + 1),
then ``data_config.json`` through ``DataGenerationConfig.from_generator``.
"""

import argparse
import json
from pathlib import Path

import torch
from datasets import config as datasets_config

from speculators.data_generation.config_generator import DataGenerationConfig
from speculators.data_generation.preprocessing import load_and_preprocess_dataset
from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-model-path", required=True)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--train-data-path", required=True)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--max-samples", type=int, default=None)
    ap.add_argument("--token-freq-path", default="./token_freq.pt")
    ap.add_argument("--hf-cache-dir", default=None)
    ap.add_argument("--assistant-pattern", default=None)
    ap.add_argument("--turn-dropout", action="store_true")
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--layer-ids", type=int, nargs="+", default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-idx", type=int, default=0)
    ap.add_argument("--num-preprocessing-workers", type=int, default=8)
    return ap.parse_args()


def next_index(out: Path) -> int:
    found = [int(p.stem[5:]) for p in out.glob("data_*.pt") if p.stem[5:].isdigit()]
    return max(found) + 1 if found else 0


def main() -> None:
    args = arguments()
    dataset, _ = load_and_preprocess_dataset(
        target_model_path=args.target_model_path, train_data_path=args.train_data_path,
        seq_length=args.seq_length, build_dataset_num_proc=args.num_preprocessing_workers, seed=args.seed,
        max_samples=args.max_samples, token_freq_path=args.token_freq_path, cache_dir=args.hf_cache_dir,
        assistant_pattern=args.assistant_pattern, turn_dropout=args.turn_dropout,
    )
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    first = next_index(out)
    n = len(dataset)
    gen = VllmHiddenStatesGenerator(
        model_path=args.target_model_path, layer_ids=args.layer_ids, max_model_len=args.seq_length,
        gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tensor_parallel_size,
    )
    index = first
    for start in range(first - args.start_idx, n, args.batch_size):
        batch = dataset[start:min(start + args.batch_size, n)]
        for res, mask in zip(gen.generate(batch["input_ids"]), batch["loss_mask"]):
            sample = {"input_ids": res["input_ids"],
                      "hidden_states": [h.contiguous() for h in res["hidden_states"]],
                      "loss_mask": mask[: len(res["input_ids"])]}
            torch.save(sample, out / f"data_{index}.pt")
            index += 1
    config = DataGenerationConfig.from_generator(
        generator=gen, train_data_path=args.train_data_path, seq_length=args.seq_length,
        cache_dir=str(args.hf_cache_dir or datasets_config.HF_DATASETS_CACHE), num_samples=n,
        max_samples=args.max_samples, seed=args.seed,
    )
    (out / "data_config.json").write_text(json.dumps(config.to_dict(), indent=2))
    print(f"UPSTREAM-STYLE wrote {index - first} files")


if __name__ == "__main__":
    main()
