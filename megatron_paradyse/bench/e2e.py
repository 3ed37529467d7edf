"""End-to-end training on gloo or GPU ranks: every static strategy, stock Megatron TP+SP, the adaptive planner.

    python -m megatron_paradyse.bench e2e                    # p=4, code and DNA corpora, 3 repeats
    python -m megatron_paradyse.bench e2e --quick            # a smoke run: short sequences, 1 repeat
    python -m megatron_paradyse.bench e2e --budget-mib 40 --corpora dna --json runs/e2e.json
    python -m megatron_paradyse.bench e2e --pack 4096        # packed documents, attention per document
    python -m megatron_paradyse.bench e2e --dp 2             # TP=4 x DP=2 on 8 ranks
    torchrun --standalone --nproc-per-node 8 -m megatron_paradyse.bench e2e --p 8 --device cuda \
        --dtype bfloat16 --model configs/llama3-8b.yaml --layers 4 --profile p8.json  # scripts/node_check.sh

**Ranks.** It starts its ranks itself (gloo; ``--device cuda``: NCCL, one GPU each), or, under torchrun,
is one of them (``--p`` x ``--dp`` must be torchrun's world size): rank 0 builds the corpora and reads
the profile, hands them to the others, and prints; a bad argument stops every rank, rank 0 saying why.
On CUDA the model, the micro-batches and the gradients live on the rank's GPU, the peaks are the caching
allocator's allocated bytes (:class:`~megatron_paradyse.core.memory.PeakMemory`), and ``--profile`` must
be a profile calibrated there. ``--dtype bfloat16``: the model in bf16; its gradients, fp32 copies of its
weights and Adam's moments in fp32, as Megatron's mixed-precision optimizer keeps them
(:mod:`megatron_paradyse.bench._e2e_state`; 18 bytes per parameter); Megatron's and the Paradyse layers
use Transformer Engine's modules where it is installed on a GPU, else Megatron's local ones.

**Model.** The CPU demo's GPT by default; ``--model CONFIG``: the transformer of a paradyse config's
``megatron_args`` (its shape, grouped-query attention, SwiGLU, norm, biases, RoPE base, tied or untied
output layer), Megatron flags after a ``--`` overriding them (``-- --hidden-size 64``), ``--layers N``
of them. The vocabulary is the corpus's.

One launch of ``--p`` x ``--dp`` ranks (Megatron's ``parallel_state``: TP = p with sequence parallelism,
data-parallel size ``--dp``; rank ``r`` is TP rank ``r % p`` of DP rank ``r // p``) trains the GPT of the
CPU demo (``configs/tiny-cpu.yaml``: 4 layers, h=128, 8 heads, FFN 512, RoPE, fp32) on each corpus's
documents in curriculum order (short to long), b = 1, with Adam, under these *arms*, each from the
same initial weights:

- the static strategies ``tp_sp/tp_sp``, ``ulysses/zero3``, ``ring/zero3``, ``lean/lean``: the same
  pair on every layer for every sequence (the Paradyse layer spec);
- ``megatron``: Megatron-Core's own local spec (:mod:`megatron_paradyse.mcore.stock_spec`), TP+SP, natural
  token order with Megatron's causal mask: what a user trains with today;
- ``adaptive``: the :class:`~megatron_paradyse.planner.Planner` (every attention x MLP strategy per
  layer, per-layer recompute) on the calibrated :class:`~megatron_paradyse.cost.AnalyticCostModel`,
  planning each micro-batch within the budget. A sequence it finds no plan for is skipped and reported.
- ``adaptive+learn``: the same planner learning from the run, as ``planner.learn_time`` makes a training
  run do (:mod:`megatron_paradyse.cost.correction`): each step's forward + backward is measured as the
  training loop measures a micro-batch (:class:`~megatron_paradyse.run.log.MicroBatchMeter`), corrects
  the predicted time of the options its plan ran, and the ranks agree on the corrections after the step
  (one gather); now and then it runs a plan the model cannot tell from its choice
  (:mod:`megatron_paradyse.planner.exploration`, the config's default share and margin). What it learned
  carries over from one pass to the next, as from one epoch to the next: ``--learn-passes`` untimed
  passes (a run's earlier epochs) come before its timed repeats, which go on learning. It trains the
  sequences the adaptive arm's memory pass found within budget; its plans change as it learns, so after
  its timed passes every plan it ran is measured again for its peak (as in a memory pass, with Adam's
  moments made), and a sequence one of them takes over the budget is an OOM.

**Micro-batches.** One document each by default. With ``--pack TOKENS``, consecutive documents (in
curriculum order) packed greedily into micro-batches of at most TOKENS tokens in all, by the loader's
own packing (:func:`megatron_paradyse.data.pack`, the loader's ``token_budget``); a document longer
than TOKENS fills a micro-batch alone. Attention stays within each document (the layout's segments).
Megatron's local spec cannot do that on CPU (its packed-sequence path needs Transformer Engine or
flash-attn), so packed runs leave the ``megatron`` arm out and print ``adaptive_vs_megatron=nan``.

**Data parallelism** (``--dp N``). Micro-batch ``i`` goes to DP rank ``i % N``; a trailing remainder of
fewer than N micro-batches is dropped (and reported), so every DP rank runs the same number of steps.
After backward, the gradients of the parameters every TP rank holds whole are all-reduced within TP
(as without DP), then every gradient is averaged over the DP group, as Megatron's DDP does (one flat
gradient buffer, allocated before any step). Each rank's planner plans its DP rank's own micro-batch;
the ranks of a TP group plan the same (checked), and a step runs on every DP rank or on none.
After training, each arm records a checksum of every rank's parameters: equal between the DP replicas
of a TP rank when the gradients were averaged.

**A sequence**, in the tables and ratios, is one *step*: the micro-batches the N DP ranks run together
(one micro-batch without ``--dp``). Its length, which sets its bin and the ``longest`` column, is the
total tokens of its longest micro-batch (its documents' tokens in all when packed). It is trained,
an OOM or infeasible as a whole.

**Peak memory** per rank (all p x N ranks) and sequence is *measured*: the bytes the rank holds before
the step, counted from its tensors (fp32 weights, fp32 gradients allocated up front as Megatron's
gradient buffer, and Adam's two fp32 moments once they exist: 16 bytes per parameter), plus the
high-water mark above them during forward + backward + gradient all-reduces, and during the optimizer
step, from :class:`~megatron_paradyse.core.memory.PeakMemory` (on CPU a dispatch mode that counts the
storages every operator creates until they are freed: tensor bytes, no allocator caching or
fragmentation). The step's inputs (tokens, labels, loss mask, positions, the layout's index tensors)
count as held before it; Megatron's all-gather buffer and rotary tables are released before each step
(:mod:`megatron_paradyse.mcore.step_buffers`, as the training entry point does), so the step's own
are measured.

**Budget** (``--budget-mib``, per rank). Default, per corpus: midway between the largest peak of
``lean/lean`` and the peak of ``tp_sp/tp_sp`` on the longest sequence, so the fast static strategy
cannot hold the longest sequences and the memory-lean one can. A sequence whose measured peak
exceeds the budget on any rank is an **OOM**, as on a device of that size: it is not trained, its
time is not counted, and it counts as a budget violation. Peaks do not depend on weight values, so
each arm first runs an untimed *memory pass* over every sequence; its **timed passes** (``--repeats``)
then train from the initial weights on the sequences within budget only, the arms taking turns at each
step (an order shuffled per repeat and step), so that the machine's drift hits every arm alike: with
whole passes in turn, adaptive measured ``tp_sp/tp_sp``'s own plan at 0.949x of that arm on one corpus
and 1.037x on the other in the same run.

**Time** of a sequence: forward + backward + gradient all-reduces + Adam step (the adaptive arm's
``Planner.decide`` included), between barriers of all the ranks (a DP step ends with its slowest DP
rank); the median over the repeats. Bins are powers of two of the sequence's length.

**Ratios** (per corpus; the last line takes the worst corpus: the largest time ratios, the smallest
length ratio; its five keys are always printed, nan where a ratio has nothing to compare)::

    adaptive_vs_best_static = adaptive time / time of the fastest static arm that trains every sequence
                              within budget, over the sequences both trained (nan if no static arm does)
    adaptive_vs_megatron    = adaptive time / megatron time, over the sequences both trained
                              (nan with --pack: no megatron arm)
    max_len_ratio           = adaptive's longest trained sequence / the longest any static arm trained
    adaptive_vs_best_per_bucket_max
                            = over the length bins: adaptive time / time of the fastest static arm that
                              trains every sequence of the bin, over the bin's sequences adaptive trained
                              (the worst bin; what a user who picked the right static strategy for those
                              lengths would compare with)
    step_mem_err_max        = over both corpora, the largest |predicted - measured| / measured peak of the
                              adaptive arm's steps, in percent: the whole step (weights, gradients, Adam,
                              embedding, layers, output layer and loss, optimizer step) against the cost
                              model's peak for its plan at the step's exact length, or its optimizer
                              step's, whichever is larger (target <= 2, which
                              lets the adaptive arm plan at ``--plan-margin 0.03``)
    learn_vs_adaptive       = adaptive+learn time / adaptive time, over the sequences both trained
    learn_vs_best_per_bucket_max
                            = adaptive_vs_best_per_bucket_max for the adaptive+learn arm
                              (both nan without the arm)
    peak_predicted_over_measured_min, _max
                            = over every arm the cost model predicts, every step after the arm's first
                              and every rank: the predicted peak / the rank's measured one
    time_predicted_over_measured_min, _max
                            = over the same arms and every rank: the predicted forward + backward time
                              summed over the steps the arm trained / the rank's measured (each step's
                              median over the repeats), measured as the training loop measures a
                              micro-batch (:class:`~megatron_paradyse.run.log.MicroBatchMeter`: from the
                              forward's start to the gradient leaving the first layer)
    host_syncs              = the adaptive arm's host synchronisations in forward + backward, over its
                              memory pass's steps after the first (CUDA: the sync-debug mode's warnings;
                              CPU: :class:`~megatron_paradyse.core.host_sync.HostSyncs`)
    tokens_per_s            = the adaptive arm's tokens (every DP rank's) over its step times, the
                              least over the corpora
    mfu                     = the adaptive arm's model FLOPs (transformer layers, forward and backward,
                              attention per document) over its step times at every rank's GPU's dense
                              bf16 peak (``cost.hardware.HARDWARE``), in percent; nan without one

Per corpus, a table gives every rank's figures under each arm the cost model predicts (the peak of the
step of its largest measured peak, the forward + backward time summed over the steps trained), and
another each arm's tokens/s, MFU and host synchronisations with the first one's place.

Everything here is measured on this machine; nothing is simulated (``bench simulate`` is).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_paradyse.bench._e2e_arms import (
    DEMO,
    DEMO_LAYERS,
    LEARNING_RATE,
    MEGATRON_CANNOT_PACK,
    Settings,
    bench_on_rank,
    transformer_impl,
)
from megatron_paradyse.bench._e2e_report import print_corpus, summary_line
from megatron_paradyse.bench._e2e_results import (
    ADAPTIVE,
    LEARNING,
    MEGATRON,
    MIB,
    Corpus,
)
from megatron_paradyse.bench.memory import PAIRINGS
from megatron_paradyse.calibration.startup import cached_quick_profile
from megatron_paradyse.config import load_config
from megatron_paradyse.core.memory import freeze_what_lives_now
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.cost import load_profile
from megatron_paradyse.data import DocumentDataset, pack
from megatron_paradyse.data.corpora import build_code_corpus, build_dna_corpus
from megatron_paradyse.data.subset import spread_by_length
from megatron_paradyse.data.tokenizers import ByteTokenizer, KmerTokenizer
from megatron_paradyse.mcore.trace import LayerModel
from megatron_paradyse.run.config_cli import model_shape_from_args
from megatron_paradyse.run.megatron_flags import parse_megatron_args

__all__ = ["main"]


# -- the command --------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_paradyse.bench e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--p", type=int, default=4, help="tensor-parallel size (default 4)")
    parser.add_argument(
        "--model",
        metavar="CONFIG",
        help="the GPT of this paradyse config's megatron_args, Megatron flags after a '--' overriding them "
        "(default: the CPU demo's, configs/tiny-cpu.yaml); the vocabulary is the corpus's",
    )
    parser.add_argument("--layers", type=int, help="transformer layers (default: the model's)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the model's parameters and activations; bfloat16 with fp32 weights in the optimizer (default float32)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo ranks; cuda: one rank per GPU, NCCL (needs --profile) (default cpu)",
    )
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size: p x dp gloo ranks (default 1)")
    parser.add_argument(
        "--pack",
        type=int,
        metavar="TOKENS",
        help="pack consecutive documents into micro-batches of at most TOKENS tokens (default: one document each)",
    )
    parser.add_argument("--corpora", default="code,dna", help="comma-separated: code, dna (default both)")
    parser.add_argument("--sequences", type=int, default=16, help="documents per corpus (default 16)")
    parser.add_argument("--min-len", type=int, default=256, help="shortest document, tokens (default 256)")
    parser.add_argument("--max-len", type=int, default=4096, help="longest document, tokens (default 4096)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per arm; medians (default 3)")
    parser.add_argument("--budget-mib", type=float, help="memory budget per rank (default: derived per corpus)")
    parser.add_argument(
        "--plan-margin",
        type=float,
        default=0.03,
        help="the adaptive arm plans to the budget times 1 - this, room for the memory model's error (default 0.03)",
    )
    parser.add_argument("--arms", help="arms to run (default: all; no megatron with --pack)")
    parser.add_argument(
        "--learn-passes",
        type=int,
        default=10,
        help="untimed passes of the adaptive+learn arm before its timed repeats, learning (default 10)",
    )
    parser.add_argument("--cache-dir", type=Path, default=Path("paradyse-bench-cache"), help="corpora, profile")
    parser.add_argument("--profile", type=Path, help="cost profile (default: calibrated once into --cache-dir)")
    parser.add_argument("--json", type=Path, help="write every sequence's result here")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 6 sequences of 128..1024 tokens, 1 repeat (flags win)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    megatron_flags = []  # after a '--': they override --model's flags
    if "--" in argv:
        argv, megatron_flags = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    launched = "LOCAL_RANK" in os.environ  # under torchrun: this process is one of the ranks
    rank = int(os.environ.get("RANK", "0")) if launched else 0
    parser = _parser()
    if rank != 0:  # every rank parses the same arguments; rank 0 says what is wrong
        parser.exit = lambda status=0, message=None: sys.exit(status)
        parser.error = lambda message: sys.exit(2)
    args = parser.parse_args(argv)
    if args.quick:
        quick = {"sequences": 6, "min_len": 128, "max_len": 1024, "repeats": 1, "learn_passes": 1}
        for name, value in quick.items():
            if f"--{name.replace('_', '-')}" not in argv:
                setattr(args, name, value)
    try:
        arms = _checked(args, megatron_flags, launched=launched)
        model = _model(args.model, args.layers, megatron_flags)
        if launched:
            _join_launched_ranks(args)
        corpora, profile, where = _from_rank_zero(lambda: _inputs(args), launched)
    except ValueError as e:  # ProfileError and ConfigError included
        if dist.is_initialized():
            dist.destroy_process_group()
        parser.exit(2, f"bench e2e: error: {e}\n")
    settings = Settings(
        tp=args.p,
        dp=args.dp,
        **model,
        device=args.device,
        dtype=args.dtype,
        pack_tokens=args.pack,
        repeats=args.repeats,
        budget_bytes=None if args.budget_mib is None else args.budget_mib * MIB,
        profile=profile,
        arms=arms,
        plan_margin=args.plan_margin,
        learn_passes=args.learn_passes,
    )
    if rank == 0:
        _print_header(args, settings, where)
    start = time.perf_counter()
    if launched:
        try:
            results = bench_on_rank(rank, args.p * args.dp, corpora, settings)
        finally:
            dist.destroy_process_group()
    else:
        backend = "nccl" if args.device == "cuda" else "gloo"
        results = run_on_ranks(
            bench_on_rank, args.p * args.dp, args=(corpora, settings), timeout_s=3 * 3600, backend=backend
        )[0]
    if rank == 0:
        _print_results(args, corpora, results, time.perf_counter() - start)
    return 0


def _checked(args: argparse.Namespace, megatron_flags: list[str], *, launched: bool) -> tuple[str, ...]:
    """The arms to run, once the arguments are checked (every rank checks them alike)."""
    if min(args.repeats, args.p, args.dp) < 1 or (args.pack is not None and args.pack < 1):
        raise ValueError(
            f"--repeats, --p, --dp and --pack must be >= 1, got {args.repeats}, {args.p}, {args.dp}, {args.pack}"
        )
    if args.learn_passes < 0:
        raise ValueError(f"--learn-passes must be >= 0, got {args.learn_passes}")
    if not 0.0 <= args.plan_margin < 1.0:
        raise ValueError(f"--plan-margin must be in [0, 1), got {args.plan_margin}")
    if megatron_flags and args.model is None:
        raise ValueError(f"Megatron flags ({' '.join(megatron_flags)}) go with --model, which they override")
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {args.layers}")
    if args.device == "cuda":
        if args.profile is None:
            raise ValueError(
                "--device cuda needs --profile, a cost profile calibrated on this machine "
                "(paradyse calibrate --device cuda --p P ...): the quick one is calibrated on the CPU"
            )
        if torch.cuda.device_count() < (1 if launched else args.p * args.dp):
            raise ValueError(
                f"--device cuda runs one rank per GPU: {args.p * args.dp} ranks, and this machine has "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
    if launched and int(os.environ["WORLD_SIZE"]) != args.p * args.dp:
        raise ValueError(
            f"--p {args.p} x --dp {args.dp} makes {args.p * args.dp} ranks, and torchrun started "
            f"{os.environ['WORLD_SIZE']}: give --nproc-per-node {args.p * args.dp}"
        )
    return _arms(args.arms, args.budget_mib, packed=args.pack is not None)


def _join_launched_ranks(args: argparse.Namespace) -> None:
    """This process as a rank of torchrun's group (its environment: RANK, WORLD_SIZE, MASTER_ADDR, ...):
    NCCL on its own GPU, or gloo."""
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    freeze_what_lives_now()  # as run_on_ranks does: the imports are not the measured windows' to scan


def _from_rank_zero(make, launched: bool):
    """``make()`` here, or under torchrun on rank 0 alone (it writes the cache) and its result, or the
    ValueError it raised, on every rank."""
    if not launched:
        return make()
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (True, make())
        except ValueError as e:
            box[0] = (False, str(e))
    dist.broadcast_object_list(box, src=0)
    made, value = box[0]
    if not made:
        raise ValueError(value)
    return value


def _inputs(args: argparse.Namespace) -> tuple[list[Corpus], dict, str]:
    """The corpora (built into ``--cache-dir`` the first time) and the cost profile, with where it came from."""
    corpora = [_corpus(name, args) for name in _names(args.corpora)]
    for corpus in corpora:
        if len(corpus.micro_batches) < args.dp:
            raise ValueError(f"{corpus.name}: {len(corpus.micro_batches)} micro-batches, fewer than --dp {args.dp}")
    return (corpora, *_profile(args))


def _print_header(args: argparse.Namespace, settings: Settings, where: str) -> None:
    data_parallel = f"; DP={args.dp}, gradients averaged over the DP ranks" if args.dp > 1 else ""
    micro_batches = (
        "one document per micro-batch"
        if args.pack is None
        else f"consecutive documents packed into micro-batches of at most {args.pack} tokens, attention per document"
    )
    ranks = "gloo ranks" if args.device == "cpu" else "CUDA ranks (NCCL)"
    print(
        f"bench e2e: {args.p * args.dp} {ranks} (TP={args.p}, sequence parallel{data_parallel}), GPT "
        f"{_model_text(settings)}, {args.dtype} ({transformer_impl(args.device)} modules), Adam lr={LEARNING_RATE}, "
        f"b=1, {micro_batches}, curriculum order; "
        f"{args.repeats} timed repeat(s), medians; cost profile: {where}; adaptive plans to "
        f"{1 - args.plan_margin:.0%} of the budget"
        + (f"; {LEARNING} learns over {args.learn_passes} untimed passes first" if LEARNING in settings.arms else ""),
        flush=True,
    )
    print(
        "peak = weights + gradients + Adam moments held by the rank (16 B/param; in bf16 18 with the optimizer's "
        "fp32 weights; counted from its tensors) "
        "+ the micro-batch's inputs and index tensors + the high-water mark above them in "
        "forward+backward+all-reduces and in the optimizer step, measured by "
        "megatron_paradyse.core.memory.PeakMemory (CPU: a dispatch mode tracking every storage operators "
        "create: tensor bytes, no allocator caching; CUDA: the caching allocator's allocated bytes); "
        "OOM = measured peak over the budget on any rank; "
        "peak vs model and step_mem_err_max leave out each arm's first step (Adam makes its moments there)",
        flush=True,
    )
    if args.pack is not None:
        print(f"megatron arm: not run with --pack: {MEGATRON_CANNOT_PACK}; adaptive_vs_megatron=nan", flush=True)


def _print_results(args: argparse.Namespace, corpora: list[Corpus], results: list, seconds: float) -> None:
    for result in results:
        print_corpus(result, next(c for c in corpora if c.name == result.corpus))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    print(f"bench e2e: {seconds:.0f} s")
    print(summary_line(results), flush=True)


def _model(path: str | None, layers: int | None, megatron_flags: list[str]) -> dict:
    """Settings' model fields: the demo's layer (:data:`DEMO`), or the transformer of the paradyse config at
    ``path`` (its ``megatron_args``, then ``megatron_flags``): its layer's shape, norm, biases and RoPE base,
    its number of layers (``layers`` instead where given), and whether its output layer shares the
    embedding; its vocabulary is the corpus's."""
    if path is None:
        return dict(model=DEMO, layers=layers or DEMO_LAYERS, tied_embeddings=True)
    config = load_config(path)
    margs = parse_megatron_args(megatron_flags, config_flags=config.megatron_args)
    if margs.position_embedding_type != "rope":
        raise ValueError(
            f"--model {path}: bench e2e trains RoPE GPTs, and its flags give --position-embedding-type "
            f"{margs.position_embedding_type}"
        )
    if margs.add_qkv_bias and not margs.add_bias_linear:
        raise ValueError(f"--model {path}: --add-qkv-bias without the other biases: the cost model has no such layer")
    if (layers or margs.num_layers) is None:
        raise ValueError(f"--model {path}: its megatron_args give no --num-layers; give --layers N")
    model = LayerModel(
        shape=model_shape_from_args(margs),
        normalization=margs.normalization,
        norm_epsilon=margs.layernorm_epsilon,
        rotary_base=margs.rotary_base,
        bias=margs.add_bias_linear,
    )
    return dict(
        model=model, layers=layers or margs.num_layers, tied_embeddings=not margs.untie_embeddings_and_output_weights
    )


def _names(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in ("code", "dna")]
    if unknown or not names:
        raise ValueError(f"--corpora takes code and/or dna, got {text!r}")
    return names


def _arms(text: str | None, budget_mib: float | None, *, packed: bool) -> tuple[str, ...]:
    known = (*PAIRINGS, MEGATRON, ADAPTIVE, LEARNING)
    if text is None:
        return tuple(a for a in known if not (packed and a == MEGATRON))
    arms = tuple(a for a in text.split(",") if a)
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise ValueError(f"--arms: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    if packed and MEGATRON in arms:
        raise ValueError(f"--arms: megatron cannot run with --pack: {MEGATRON_CANNOT_PACK}")
    required = {ADAPTIVE, PAIRINGS[0]} | (set() if packed else {MEGATRON})
    required |= set() if budget_mib else {"tp_sp/tp_sp", "lean/lean"}
    missing = sorted(required - set(arms))
    if missing:
        raise ValueError(f"--arms must include {', '.join(missing)} (the ratios and the derived budget need them)")
    return tuple(a for a in known if a in arms)


def _corpus(name: str, args: argparse.Namespace) -> Corpus:
    """``args.sequences`` documents of ``args.min_len..args.max_len`` tokens spread evenly in log length,
    in micro-batches of one document each or packed to ``args.pack`` tokens."""
    if name == "code":
        prefix, tokenizer = build_code_corpus(args.cache_dir), ByteTokenizer()
    else:
        # The binned lengths need a corpus of at least a few thousand tokens at the top.
        prefix, tokenizer = build_dna_corpus(args.cache_dir, max_len=max(args.max_len, 4096)), KmerTokenizer(3)
    dataset = DocumentDataset(prefix)
    docs = spread_by_length(dataset.lengths, args.sequences, args.min_len, args.max_len)
    documents = tuple(np.asarray(dataset[int(d)], dtype=np.int64) for d in docs)
    lengths = np.array([len(d) for d in documents])
    if args.pack is not None:  # a longer document counts as the budget: the packing puts it alone
        lengths = np.minimum(lengths, args.pack)
    micro_batches = tuple(pack(np.arange(len(documents)), lengths, args.pack))
    return Corpus(name, documents, micro_batches, tokenizer.vocab_size, tokenizer.pad_id)


def _profile(args: argparse.Namespace) -> tuple[dict, str]:
    """The ``--profile`` given, or the quick one with its fitted correction, read from or calibrated into
    ``--cache-dir`` (:func:`~megatron_paradyse.calibration.startup.cached_quick_profile`)."""
    if args.profile is None:
        profile = cached_quick_profile(args.cache_dir, args.p, device="cpu", dtype=getattr(torch, args.dtype))
        return profile, f"the quick profile in {args.cache_dir}"
    profile = load_profile(args.profile, p=args.p, check_machine=False)
    if profile["dtype"] != args.dtype:
        raise ValueError(
            f"--profile {args.profile}: its rates were measured in {profile['dtype']}, and the model trains in "
            f"{args.dtype} (--dtype): calibrate with --dtype {args.dtype}"
        )
    return profile, str(args.profile)


# -- output -------------------------------------------------------------------------------------------
def _model_text(settings: Settings) -> str:
    shape, model = settings.model.shape, settings.model
    kv = f" ({shape.num_query_groups} KV groups)" if shape.num_query_groups != shape.num_attention_heads else ""
    return (
        f"{settings.layers} layers h={shape.hidden_size} heads={shape.num_attention_heads}{kv} "
        f"ffn={shape.ffn_hidden_size}{' SwiGLU' if shape.gated_mlp else ''} {model.normalization} "
        f"RoPE (base {model.rotary_base}), {'tied' if settings.tied_embeddings else 'untied'} embeddings"
    )


if __name__ == "__main__":
    sys.exit(main())
