"""``python -m megatron_paradyse.data {stats,prepare,build-corpus,balance} ...``

# the two built-in corpora (no download), then their length histograms in the paper's bins
python -m megatron_paradyse.data build-corpus code --out-dir data/
python -m megatron_paradyse.data build-corpus dna --out-dir data/ --num-sequences 1000 --max-len 638976
python -m megatron_paradyse.data stats data/code-python3.11.7-byte
# a folder of *.txt files, or a JSONL file, to an indexed dataset
python -m megatron_paradyse.data prepare --input docs.jsonl --output-prefix data/docs --tokenizer byte
# data-parallel work imbalance of every step of one epoch
python -m megatron_paradyse.data balance data/code-python3.11.7-byte --p 8 --dp-size 8 --max-len 32768
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import get_args

import numpy as np

from megatron_paradyse.data.balance import WorkModel
from megatron_paradyse.data.corpora import build_code_corpus, build_dna_corpus
from megatron_paradyse.data.indexed import DocumentDataset, validate
from megatron_paradyse.data.loader import LoaderConfig, MicroBatchSampler, StreamPosition
from megatron_paradyse.data.prepare import prepare, read_manifest
from megatron_paradyse.data.samplers import Overflow, SamplerName, Spans
from megatron_paradyse.data.stats import format_histogram
from megatron_paradyse.data.tokenizers import get_tokenizer


def _stats(args: argparse.Namespace) -> int:
    dataset = DocumentDataset(args.dataset)
    manifest = read_manifest(args.dataset)
    if manifest:
        print(f"{args.dataset}: tokenizer={manifest['tokenizer']} source: {manifest['source']}")
    print(format_histogram(dataset.lengths, args.bin_scale))
    return 0


def _prepare(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    result = prepare(
        args.input,
        args.output_prefix,
        get_tokenizer(args.tokenizer),
        json_key=args.json_key,
        pattern=args.pattern,
        append_eod=args.append_eod,
    )
    print(
        f"{result.path_prefix}: {result.info.num_documents} documents, {result.info.num_tokens} tokens, "
        f"{len(result.skipped_empty)} empty inputs skipped, {time.perf_counter() - start:.2f} s"
    )
    return 0


def _build_corpus(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    if args.corpus == "code":
        prefix = build_code_corpus(args.out_dir)
    else:
        prefix = build_dna_corpus(args.out_dir, num_sequences=args.num_sequences, max_len=args.max_len, seed=args.seed)
    info = validate(prefix)
    print(f"{prefix}: {info.num_documents} documents, {info.num_tokens} tokens, {time.perf_counter() - start:.2f} s")
    return 0


def _balance(args: argparse.Namespace) -> int:
    lengths = Spans.build(DocumentDataset(args.dataset).lengths, args.max_len, args.overflow).length
    work = WorkModel.from_transformer(args.hidden_size)
    print("DP imbalance = max/mean - 1 of the predicted work per rank; per step, and over the epoch (sum of")
    print("step maxima / sum of step means - 1: the fraction of the epoch lost waiting for the slowest rank)")
    print(f"{'sampler':>10} {'steps':>6} {'epoch':>7} {'mean':>7} {'p50':>7} {'p90':>7} {'max':>7}")
    for sampler in args.sampler or get_args(SamplerName):
        config = LoaderConfig(
            p=args.p,
            max_len=args.max_len,
            overflow=args.overflow,
            token_budget=args.token_budget,
            sampler=sampler,
            bucket_size=args.bucket_size,
            seed=args.seed,
            micro_batches_per_step=args.micro_batches,
        )
        sampler_ = MicroBatchSampler(lengths, config, dp_size=args.dp_size, work=work)
        batches, position = [], StreamPosition(0, 0, 0)
        while position.epoch == 0:  # the steps that start in the first epoch
            batches.append(sampler_.global_batch(position))
            position = batches[-1].next
        per_step = 100 * np.array([batch.imbalance for batch in batches])
        loads = [batch.loads for batch in batches]
        epoch = 100 * (sum(x.max() for x in loads) / sum(x.mean() for x in loads) - 1)
        q50, q90 = np.percentile(per_step, [50, 90])
        print(
            f"{sampler:>10} {len(batches):>6} {epoch:>6.2f}% {per_step.mean():>6.2f}% {q50:>6.2f}% {q90:>6.2f}% "
            f"{per_step.max():>6.2f}%"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_paradyse.data", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    stats = commands.add_parser("stats", help="length histogram of an indexed dataset in the paper's bins")
    stats.add_argument("dataset", help="path prefix of the .bin/.idx pair")
    stats.add_argument(
        "--bin-scale",
        type=float,
        default=1.0,
        help="multiply the bin edges (a DNA corpus scaled to --max-len L: L/638976)",
    )
    stats.set_defaults(run=_stats)

    prep = commands.add_parser("prepare", help="tokenize a folder of text files or a JSONL file")
    prep.add_argument("--input", required=True, help="a folder (files matching --pattern) or a .jsonl file")
    prep.add_argument("--output-prefix", required=True)
    prep.add_argument("--tokenizer", default="byte", help="byte, or dnaK for overlapping DNA K-mers (dna3)")
    prep.add_argument("--json-key", default="text")
    prep.add_argument("--pattern", default="*.txt", help="file name pattern inside a folder")
    prep.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    prep.set_defaults(run=_prepare)

    corpus = commands.add_parser("build-corpus", help="build a built-in corpus (no download)")
    corpus.add_argument("corpus", choices=["code", "dna"])
    corpus.add_argument("--out-dir", required=True)
    corpus.add_argument("--num-sequences", type=int, default=1000, help="dna only")
    corpus.add_argument("--max-len", type=int, default=624 * 1024, help="dna only: longest sequence in tokens")
    corpus.add_argument("--seed", type=int, default=0, help="dna only")
    corpus.set_defaults(run=_build_corpus)

    bal = commands.add_parser("balance", help="DP work imbalance of every step of one epoch")
    bal.add_argument("dataset")
    bal.add_argument("--p", type=int, required=True, help="TP (sequence-sharing) group size")
    bal.add_argument("--dp-size", type=int, required=True)
    bal.add_argument("--micro-batches", type=int, default=4, help="micro-batches per DP rank per step")
    bal.add_argument("--max-len", type=int, required=True)
    bal.add_argument("--overflow", choices=get_args(Overflow), default="split")
    bal.add_argument("--token-budget", type=int, default=None, help="pack to this many tokens (default: unpacked)")
    bal.add_argument("--sampler", choices=get_args(SamplerName), action="append", help="default: all")
    bal.add_argument("--bucket-size", type=int, default=256)
    bal.add_argument("--seed", type=int, default=0)
    bal.add_argument("--hidden-size", type=int, default=4096, help="of the work model (causal, 4x MLP)")
    bal.set_defaults(run=_balance)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
