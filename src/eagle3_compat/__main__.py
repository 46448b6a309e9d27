"""Command line: ``python -m eagle3_compat {generate,verify,run,doctor,demo,status}`` (also ``eagle3-compat``)."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time


def _demo(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import eagle3_compat

    report = eagle3_compat.apply(dtype="float32")
    print(report, file=sys.stderr)
    if not report.applied:
        print("eagle3_compat did not apply; see the status above", file=sys.stderr)
        return 2
    from speculators.data_generation import VllmHiddenStatesGenerator

    from eagle3_compat.testing import hf_layer_outputs, make_tiny_model, max_rel_error

    layer_ids = [0, 2, 5]
    prompts = [
        [((j if i % 2 == 0 else 7 * j + i) % 390) + 4 for j in range(n)]
        for i, n in enumerate([1, 5, 37, 200, 511, 64])
    ]
    with tempfile.TemporaryDirectory(prefix="eagle3_compat-demo-") as tmp:
        model = make_tiny_model(os.path.join(tmp, "tiny-llama"), "llama")
        t0 = time.perf_counter()
        with VllmHiddenStatesGenerator(str(model), layer_ids=layer_ids, max_model_len=512) as gen:
            t1 = time.perf_counter()
            results = gen.generate(prompts)
            t2 = time.perf_counter()
        ref = hf_layer_outputs(model, prompts, layer_ids)
    worst = 0.0
    print(f"{'prompt':>6} {'tokens':>6} {'layer':>5} {'shape':>12} {'max rel err':>12}")
    for i, (res, r) in enumerate(zip(results, ref)):
        for j, k in enumerate(layer_ids):
            err = max_rel_error(res["hidden_states"][j], r[j])
            worst = max(worst, err)
            shape = "x".join(map(str, res["hidden_states"][j].shape))
            print(f"{i:>6} {len(prompts[i]):>6} {k:>5} {shape:>12} {err:>12.2e}")
    ok = worst <= 1e-4
    print(
        f"engine start {t1 - t0:.1f}s, extraction {t2 - t1:.2f}s; "
        f"largest relative error vs Hugging Face float32: {worst:.2e} ({'OK' if ok else 'FAILED'})"
    )
    return 0 if ok else 1


def _layer_ids(values: list[str] | None) -> list[int] | None:
    """``--layer-ids 2 16 29 31`` (speculators' form) or ``--layer-ids 2,16,29,31``."""
    if not values:
        return None
    try:
        return [int(x) for v in values for x in v.split(",") if x.strip()]
    except ValueError as exc:
        raise SystemExit(f"eagle3-compat generate: --layer-ids: integers expected, got {values}") from exc


def _generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from eagle3_compat.dataset import run_generate

    if args.input is not None:
        upstream_only = {"--max-samples": args.max_samples is not None, "--seed": args.seed is not None,
                         "--hf-cache-dir": args.hf_cache_dir is not None,
                         "--assistant-pattern": args.assistant_pattern is not None,
                         "--turn-dropout": args.turn_dropout,
                         "--num-preprocessing-workers": args.num_preprocessing_workers is not None}
        given = [k for k, v in upstream_only.items() if v]
        if given:
            raise SystemExit(f"eagle3-compat generate: {', '.join(given)} apply to --train-data-path "
                             "(speculators' preprocessing), not to --input")
    try:
        manifest = run_generate(
            model=args.model,
            output=Path(args.output),
            input_path=Path(args.input) if args.input is not None else None,
            train_data_path=args.train_data_path,
            layer_ids=_layer_ids(args.layer_ids),
            max_model_len=args.max_model_len,
            batch_size=args.batch_size,
            max_in_flight=args.max_in_flight,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend,
            gpu_memory_utilization=args.gpu_memory_utilization,
            dtype=args.dtype,
            capture=args.capture,
            trainer_checks=not args.no_trainer_checks,
            max_samples=args.max_samples,
            seed=0 if args.seed is None else args.seed,
            token_freq_path=args.token_freq_path,
            hf_cache_dir=args.hf_cache_dir,
            assistant_pattern=args.assistant_pattern,
            turn_dropout=args.turn_dropout,
            num_preprocessing_workers=8 if args.num_preprocessing_workers is None else args.num_preprocessing_workers,
            start_idx=args.start_idx,
            num_shards=args.num_shards,
            shard_index=args.shard_index,
            replicas=args.replicas,
            ray_address=args.ray_address,
            chunk_size=args.chunk_size,
            zip_crc32=args.zip_crc32,
        )
    except ValueError as exc:  # bad arguments or folder: the message says what and how to fix it
        print(f"eagle3-compat generate: error: {exc}", file=sys.stderr)
        return 2
    shard = "" if args.num_shards == 1 else f" (shard {args.shard_index} of {args.num_shards})"
    print(
        f"{manifest['samples']} samples in {args.output}{shard} ({manifest['written_this_run']} written now, "
        f"{manifest['tokens_this_run']} tokens in {manifest['seconds_this_run']:.1f}s)"
    )
    if args.num_shards > 1:
        print(f"when every shard has finished: eagle3-compat verify {args.output}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from pathlib import Path

    from eagle3_compat.verify import verify_folder

    res = verify_folder(Path(args.folder), token_freq_path=args.token_freq_path, write=not args.check_only)
    for problem in res.problems:
        print(f"PROBLEM: {problem}")
    if res.problems:
        print(f"{len(res.problems)} problem(s) in {args.folder}; nothing written")
        return 1
    for path in res.written:
        print(f"wrote {path}")
    print(f"OK: {res.samples} samples in {args.folder}")
    from eagle3_compat.numerics import folder_settings

    try:
        print(f"layer convention: {folder_settings(Path(args.folder))['convention']}")
    except ValueError:
        pass
    if args.numerics:
        return _numerics(args)
    return 0


def _numerics(args: argparse.Namespace) -> int:
    from eagle3_compat.numerics import check_numerics

    res = check_numerics(args.folder, model=args.model, samples=args.numerics_samples,
                         threshold=args.numerics_threshold)
    print(res.table())
    if not res.ok:
        bad = ", ".join(str(s.index) for s in res.failed)
        print(f"NUMERICS FAILED: {len(res.failed)} of {len(res.samples)} sampled records disagree with the "
              f"model (sample(s) {bad})")
        return 1
    print(f"NUMERICS OK: {len(res.samples)} sampled records agree with the model")
    return 0


def _run(args: argparse.Namespace) -> int:
    from eagle3_compat.launcher import launch

    return launch(args.target, module=args.module, args=args.args, dtype=args.dtype)


def _doctor(_args: argparse.Namespace) -> int:
    """Versions, adapters and worker-side checks; non-zero exit when something would fail."""
    import importlib
    import multiprocessing

    import eagle3_compat
    from eagle3_compat.versions import detect

    found = detect()
    problems: list[str] = []
    rows = [
        ("vllm", f"{found.vllm} ({found.vllm_dist})" if found.vllm else "NOT INSTALLED"),
        ("vllm build", "cpu" if found.vllm and "cpu" in found.vllm else ("cuda/other" if found.vllm else "-")),
        ("speculators", found.speculators or "NOT INSTALLED"),
        ("torch", found.torch or "NOT INSTALLED"),
        ("transformers", found.transformers or "NOT INSTALLED"),
    ]
    try:
        import torch

        rows.append(("torch build", f"cuda {torch.version.cuda}" if torch.version.cuda else "cpu"))
        rows.append(("cuda devices", str(torch.cuda.device_count() if torch.cuda.is_available() else 0)))
    except Exception as exc:  # noqa: BLE001
        problems.append(f"torch does not import: {exc}")
    try:
        report = eagle3_compat.apply()
        rows += [(f"adapter {a}", "applies (probe ok)") for a in report.active]
        rows += [(f"adapter {a}", f"skipped: {why}") for a, why in report.skipped.items()]
        if not report.applied:
            problems.append(f"apply() did not apply: {report.note}")
        eagle3_compat.revert()
    except Exception as exc:  # noqa: BLE001
        problems.append(f"apply() failed: {exc}")
    try:
        from eagle3_compat.worker import WORKER_EXTENSION

        mod, _, cls = WORKER_EXTENSION.rpartition(".")
        getattr(importlib.import_module(mod), cls)
        rows.append(("worker extension", f"{WORKER_EXTENSION} importable (workers import it by name)"))
    except Exception as exc:  # noqa: BLE001
        problems.append(f"worker extension not importable: {exc}")
    from eagle3_compat.heap import free_page_reporting_order, huge_pages_reported

    order = free_page_reporting_order()
    rows.append(("free page reporting", "none (free memory stays with this machine)" if order is None else
                 f"blocks of {2 ** order * (os.sysconf('SC_PAGE_SIZE') // 1024)} KiB and up go back to the "
                 "hypervisor (virtio balloon)" + (
                     ": a fresh transparent huge page faults in the host too, so a CPU engine starts "
                     "without huge pages here and its workers take them back after loading "
                     "(benchmarks/huge_page_faults.py)"
                     if huge_pages_reported() else "")))
    method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "(vLLM default)")
    rows.append(("worker start method", f"{method}; this process: {multiprocessing.get_start_method()}"))
    from eagle3_compat.settings import DEBUG, LOG_LEVEL

    level = LOG_LEVEL.raw()
    rows.append(("log level", ("INFO" if level is None else level) + (" + debug" if DEBUG.get() else "")))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")
    for p in problems:
        print(f"PROBLEM: {p}")
    print("OK" if not problems else f"{len(problems)} problem(s)")
    return 0 if not problems else 1


def _status(_args: argparse.Namespace) -> int:
    import eagle3_compat
    from eagle3_compat.settings import table

    print(eagle3_compat.status())
    print()
    print(table())
    return 0


def _configure_logging() -> None:
    """The command line is an application: it shows our INFO lines on stderr.

    Root keeps Python's default WARNING level (other libraries stay quiet);
    the ``eagle3_compat`` logger gets ``EAGLE3_COMPAT_LOG_LEVEL`` (default
    INFO; ``EAGLE3_COMPAT_DEBUG=1``: DEBUG).  Nothing happens where the root
    logger already has handlers (``main()`` called from a configured program).
    """
    import logging

    from eagle3_compat.logs import ROOT, level_from_env

    if logging.getLogger().handlers:
        return
    logging.basicConfig(format="%(levelname)s [%(process)d] %(name)s: %(message)s")
    logging.getLogger(ROOT).setLevel(level_from_env(logging.INFO))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagle3-compat", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="extract hidden states from a tiny local model and check them")
    sub.add_parser("status", help="versions found, adapters (without applying) and every EAGLE3_COMPAT_* "
                                  "setting")
    sub.add_parser("doctor", help="check versions, adapters and the worker side; exit 1 on problems")
    g = sub.add_parser(
        "generate", help="extract hidden states into speculators' training folder "
        "(the arguments of speculators 0.3.0's scripts/data_generation_offline.py)")
    g.add_argument("--target-model-path", "--model", dest="model", required=True,
                   help="model path (or id already in the HF cache)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--train-data-path", default=None,
                     help="'sharegpt', 'ultrachat' or a .json/.jsonl file of conversations, through "
                          "speculators' own load_and_preprocess_dataset")
    src.add_argument("--input", default=None,
                     help="JSONL: token-id lists, {input_ids}, {conversations} or {messages}")
    g.add_argument("--output-dir", "--output", dest="output", required=True,
                   help="output folder: data_{i}.pt, data_config.json, manifest.json (resumable)")
    g.add_argument("--layer-ids", nargs="+", default=None,
                   help="decoder layer ids, space- or comma-separated (default: speculators 0.3.0's)")
    g.add_argument("--seq-length", "--max-model-len", dest="max_model_len", type=int, default=2048,
                   help="maximum sequence length for preprocessing and the model (default 2048)")
    g.add_argument("--batch-size", type=int, default=None,
                   help="accepted for compatibility; unused: the job streams (see --max-in-flight)")
    g.add_argument("--max-in-flight", type=int, default=None,
                   help="prompts in the engine at once (default 128: four steps' worth, so the engine "
                        "never waits for the next step's prompts); a new one is admitted as soon as one "
                        "finishes (memory is bounded by this, whatever the input's length)")
    g.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="default: every accelerator (1 on a CPU)")
    g.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="pipeline stages (vLLM's pipeline_parallel_size; tensor x pipeline workers); "
                        "each stage captures the layers it runs (default 1)")
    g.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default=None,
                   help="vLLM's executor for the workers of one engine (default: vLLM's choice); "
                        "'ray' places them on a Ray cluster, e.g. pipeline stages on several nodes")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    g.add_argument("--max-samples", type=int, default=None)
    g.add_argument("--seed", type=int, default=None, help="shuffle seed of speculators' preprocessing (0)")
    g.add_argument("--token-freq-path", default=None,
                   help="token frequencies for build_vocab_mapping (default with --train-data-path: "
                        "./token_freq.pt, as speculators; with --input: not written unless given)")
    g.add_argument("--hf-cache-dir", default=None)
    g.add_argument("--assistant-pattern", default=None)
    g.add_argument("--turn-dropout", action="store_true")
    g.add_argument("--num-preprocessing-workers", type=int, default=None)
    g.add_argument("--start-idx", type=int, default=0, help="index of the first output file (data_{start-idx}.pt)")
    g.add_argument("--num-shards", type=int, default=1,
                   help="split the job into N independent jobs writing into one folder (a Slurm array, "
                        "an indexed Kubernetes job); then run `eagle3-compat verify DIR`")
    g.add_argument("--shard-index", type=int, default=0,
                   help="this job's shard, 0..N-1: the samples i with i %% N == I")
    g.add_argument("--replicas", type=int, default=None,
                   help="run N engine replicas as Ray actors (pip install 'eagle3_compat[ray]')")
    g.add_argument("--ray-address", default=None,
                   help="an existing Ray cluster (default: RAY_ADDRESS, else a local one)")
    g.add_argument("--chunk-size", type=int, default=None,
                   help="samples per unit of work handed to a replica (default 8)")
    g.add_argument("--dtype", default=None, choices=[None, "auto", "float32", "bfloat16", "float16"])
    g.add_argument("--capture", default="layer_output", choices=["layer_output", "layer_input"],
                   help="layer_output: speculators 0.3.0 (output of layer k); layer_input: vLLM "
                        "EAGLE-3 serving (input of layer k; with --no-trainer-checks only)")
    g.add_argument("--zip-crc32", action="store_true",
                   help="write the CRC-32 of each file's zip records (for tools that test zip archives; "
                        "torch.load never checks them; ~0.75 s of CPU per GiB written)")
    g.add_argument("--no-trainer-checks", action="store_true",
                   help="the folder is not for speculators 0.3.0's trainer: skip its rules (4 ascending "
                        "layer ids ending at the final layer, layer outputs); recorded in the manifest")
    v = sub.add_parser(
        "verify", help="check a data folder (every sample once, same settings, loadable files, shapes); "
                       "for a sharded job, then write manifest.json, data_config.json and token "
                       "frequencies; exit 1 listing the problems")
    v.add_argument("folder")
    v.add_argument("--token-freq-path", default=None,
                   help="where the merged token frequencies go (default: the jobs' --token-freq-path)")
    v.add_argument("--check-only", action="store_true", help="check, write nothing")
    v.add_argument("--numerics", action="store_true",
                   help="also check the states' numbers on a sample of records: the final norm and LM head "
                        "applied to the last layer against the engine's own prompt log-probs (when the last "
                        "id is the final layer), else recomputed with Hugging Face; exit 1 below the threshold")
    v.add_argument("--model", default=None, help="--numerics: the model (default: the folder's)")
    v.add_argument("--numerics-samples", type=int, default=8, metavar="N",
                   help="--numerics: records checked, spread over the folder (default %(default)s)")
    v.add_argument("--numerics-threshold", type=float, default=None, metavar="F",
                   help="--numerics: agreement a record needs (default 0.95 float32, 0.90 bfloat16)")
    r = sub.add_parser(
        "run", help="run a Python program (e.g. speculators' own scripts) with apply() in effect in it "
                    "and its child processes: eagle3-compat run [--dtype D] SCRIPT|-m MODULE [ARGS...]")
    r.add_argument("--dtype", default=None, choices=[None, "auto", "float32", "bfloat16", "float16"],
                   help="passed to apply()")
    r.add_argument("-m", dest="module", action="store_true", help="TARGET is a module, as with python -m")
    r.add_argument("target", help="script path, or module name with -m")
    r.add_argument("args", nargs=argparse.REMAINDER, help="the program's own arguments, untouched")
    args = ap.parse_args(argv)
    _configure_logging()
    commands = {"demo": _demo, "status": _status, "doctor": _doctor, "generate": _generate, "run": _run,
                "verify": _verify}
    return commands[args.cmd](args)


def cli() -> int:
    """:func:`main` as a program (the ``eagle3-compat`` command and
    ``python -m eagle3_compat``).

    After the command, the process's objects are frozen (``gc.freeze``) so
    that the interpreter's collections at exit skip them: with vLLM,
    speculators and a tokenizer loaded those took ~1.8 s of the CLI job's
    wall and CPU after its last sample (issue #16; 0.27 s left with the
    freeze).  The operating system frees the memory either way, and
    nothing of the project waits for a collection at exit: samples are
    closed and renamed into place, the shared-memory names are gone once
    mapped, the engine is shut down by ``close()``.
    """
    try:
        return main()
    finally:
        gc.freeze()


if __name__ == "__main__":
    sys.exit(cli())
