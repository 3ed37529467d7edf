"""``paradyse plan CONFIG``: will it fit? The plans a job would run, before it is launched.

    paradyse plan configs/llama3-8b.yaml --gpu h100 --lengths 4096,32768,131072,262144
    paradyse plan cfg.yaml --profile profile.json --dataset data/mine --json plan.json --plot plan.png

From a paradyse config (its planner, memory budget and ``megatron_args``: the model and its parallel
layout; Megatron flags after ``--`` as on the job's command line, all validated as the job validates
them: :func:`~megatron_paradyse.run.job.job_arguments`), a cost profile (``--profile``, the config's
``cost.profile``, or ``--gpu``: a node's published figures, simulated) and sequence lengths
(``--lengths``, or every document of ``--dataset``, by the planner's length buckets): per length, the
plan each pipeline stage would choose, its predicted time and peak per rank; the longest length each
static strategy fits (Megatron's own TP+SP included) and the longest the planner fits; a plot and JSON
on request; with ``--vs-megatron``, the static Megatron configuration a careful user tunes for the lengths
(:mod:`megatron_paradyse.simulation.tuned`) and its time against the planner's. Nothing runs on a device: the
answer is the analytic cost model's, priced by the profile.

What imports megatron-core (the job's arguments, the stage planning, the datasets) is imported when a
plan is made, inside the functions: ``paradyse``'s parser imports this module for every command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import megatron_paradyse.mcore  # noqa: F401  (records the strategies' memory from their code)
from megatron_paradyse.config import load_config
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost import load_profile
from megatron_paradyse.cost.hardware import HARDWARE, hardware_profile, node_group
from megatron_paradyse.planner import InfeasibleSequenceError
from megatron_paradyse.run.config_cli import world_size
from megatron_paradyse.simulation.node import NodeModel
from megatron_paradyse.simulation.tuned import adaptive_curve, describe, times_in_common, tuned_megatron

__all__ = ["add_plan_arguments", "run_plan"]

_GIB = 2**30
STATIC = {
    "tp_sp/tp_sp": "Megatron TP+SP (stock)",
    "tp_sp/tp_sp+rc": "Megatron TP+SP, recomputed",
    "ulysses/zero3": "Ulysses + ZeRO-3",
    "ring/zero3": "ring CP + ZeRO-3",
    "lean/lean": "lean (streamed weights)",
}


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="paradyse YAML config (its megatron_args give the model and layout)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--gpu", choices=("a100", "h100", "h200"), help="price with a node's published figures")
    source.add_argument("--profile", help="price with this calibrated cost profile (default: the config's)")
    lengths = parser.add_mutually_exclusive_group(required=True)
    lengths.add_argument("--lengths", help="sequence lengths in tokens, e.g. 4096,32768,131072")
    lengths.add_argument("--dataset", help="prefix of an indexed dataset: every document's length")
    parser.add_argument(
        "--world-size",
        type=world_size,
        help="the job's ranks: its data-parallel size (default 1: the distributed optimizer's state unsharded)",
    )
    parser.add_argument(
        "--vs-megatron",
        action="store_true",
        help="with --gpu: also price the static Megatron configuration a careful user would tune for these "
        "lengths on the job's TP group of GPUs, and its time against the planner's",
    )
    parser.add_argument("--json", help="write the answer to this file")
    parser.add_argument("--plot", help="write a PNG of predicted peaks against length")
    parser.add_argument(
        "megatron_flags",
        nargs="*",
        metavar="-- MEGATRON_FLAGS",
        help="after a '--': the job's command-line Megatron flags, which override the config's megatron_args",
    )


def run_plan(args: argparse.Namespace) -> int:
    asked = None if args.lengths is None else _asked_lengths(args.lengths)  # refused at once, if wrong
    if args.vs_megatron and args.gpu is None:
        raise ValueError("--vs-megatron prices Megatron's configurations on a node's published figures: add --gpu")
    config = load_config(args.config)
    job = _Job.from_config(config, args.megatron_flags, world_size=args.world_size, gpu=args.gpu, profile=args.profile)
    if args.vs_megatron and job.args.pipeline_model_parallel_size > 1:
        raise ValueError(
            f"--vs-megatron compares the plans of one pipeline stage; the job runs "
            f"PP={job.args.pipeline_model_parallel_size}: plan it with --pipeline-model-parallel-size 1"
        )
    lengths = asked or _dataset_lengths(args.dataset, config)
    # planned as for a job whose longest micro-batch is the longest asked: no bucket is priced past it
    cap = max(lengths)
    planner = job.planners(bucket_cap=cap)
    if asked is None:  # a row per bucket of the documents, at its edge
        lengths = sorted({planner[0].bucket_layout(job.layout(n)).padded_len for n in lengths})
    static = {pair: job.longest(job.planners(pair, bucket_cap=cap)) for pair in STATIC}
    longest = job.longest(planner)
    rows = []
    for length in lengths:
        row = {"tokens": length}
        for stage, stage_planner in enumerate(planner):
            row[f"stage{stage}"] = _decide(stage_planner, job.layout(length))
        rows.append(row)
    answer = {
        "config": args.config,
        "cost_model": job.description,
        "tp": job.tp,
        "world_size": job.args.world_size,
        "pp": len(planner),
        "budget_gib": job.budget_bytes / _GIB,
        "static_gib": [f.static_bytes / _GIB for f in job.footprints()],
        "forwards_in_flight": [p.forwards_in_flight for p in planner],
        "seq_length": job.args.seq_length,
        "lengths": rows,
        "static_longest": static,
        "longest": longest,
    }
    if args.vs_megatron:
        answer["vs_megatron"] = _versus_megatron(job, planner, lengths, args.gpu)
    print(_format(answer))
    if args.json:
        Path(args.json).write_text(json.dumps(answer, indent=1) + "\n")
    if args.plot:
        _plot(answer, job, args.plot)
    return 0


def _decide(planner, layout: SequenceLayout) -> dict:
    if planner.past_longest(layout):  # said at once: no plan of it is priced, whatever its length
        return {"plan": None, "longest": planner.max_feasible_length(layout.p, causal=layout.causal)}
    try:
        decision = planner.decide(layout)
    except InfeasibleSequenceError as e:
        return {"plan": None, "leanest_peak_gib": e.report.leanest_peak_bytes / _GIB}
    plan = decision.plan
    return {
        "plan": plan.compact(),
        "time_s": planner.predicted_time_s(plan, layout),  # its own length's; the peak is its bucket's bound
        "peak_gib": plan.predicted_peak_bytes / _GIB,
        "bucket_tokens": decision.bucket_length,
    }


def _versus_megatron(job: _Job, planner: list, lengths: list[int], gpu: str) -> dict:
    """The job's layers on its TP group of ``gpu``'s GPUs, one sequence of each length (in ascending order):
    the planner's time against the static Megatron configuration a careful user tunes for them
    (:mod:`megatron_paradyse.simulation.tuned`), both priced as ``bench simulate`` prices them (its static count
    of 18 bytes a parameter, the optimizer state sharded over the configuration's data-parallel replicas)."""
    cost = planner[0].cost_model
    node = NodeModel(
        gpu=gpu,
        shape=cost.shape,
        num_layers=planner[0].num_layers,
        causal=job.causal,
        budget_bytes=job.budget_bytes,
        planner=planner[0].config,
        vocab_size=cost.vocab_size,
        rotary_dim=cost.rotary_dim,
        bias=cost.bias,
        normalization=cost.normalization,
    )
    ordered = sorted(lengths)
    adaptive, tuned = adaptive_curve(node, ordered, job.tp), tuned_megatron(node, ordered, job.tp)
    answer = {"line": describe(tuned, adaptive), "tuned": None if tuned.chosen is None else str(tuned.chosen)}
    if tuned.curve is not None:
        adaptive_s, tuned_s = times_in_common(adaptive, tuned.curve)
        answer.update(adaptive_s=adaptive_s, tuned_s=tuned_s, ratio=adaptive_s / tuned_s)
    return answer


class _Job:
    """What a job of the config would plan with: its arguments, cost models and budget."""

    def __init__(self, config, args, transformer, profile: dict, description: str, budget_bytes: float) -> None:
        self.config, self.args, self.transformer = config, args, transformer
        self.profile, self.description, self.budget_bytes = profile, description, budget_bytes
        self.tp = args.tensor_model_parallel_size
        self.causal = config.attention_mask == "causal"

    def longest(self, planners: list) -> int:
        """The longest length of one document every stage of ``planners`` fits."""
        return min(p.max_feasible_length(self.tp, causal=self.causal) for p in planners)

    def layout(self, length: int) -> SequenceLayout:
        """One document of ``length`` tokens, as the job's ranks lay it out."""
        return SequenceLayout.build(length, self.tp, causal=self.causal)

    @classmethod
    def from_config(
        cls, config, megatron_flags: list[str], *, world_size: int | None, gpu: str | None, profile: str | None
    ) -> _Job:
        from megatron_paradyse.run.job import job_arguments

        # the job's own arguments and model; without its world size, on one data-parallel rank: the
        # distributed optimizer's state unsharded, the global batch's micro-batches all on one (conservative)
        args, model_config = job_arguments(config, megatron_flags, world_size=world_size)
        tp = args.tensor_model_parallel_size
        budget = config.memory.budget_bytes(None if gpu is None else HARDWARE[gpu].allocator_bytes)
        if budget is None:
            raise ValueError("set memory.budget_gib, or pass --gpu for a GPU's memory")
        if gpu is not None:
            try:
                rates = hardware_profile(node_group(gpu, tp))
            except ValueError as e:
                raise ValueError(f"--gpu {gpu}: {e} (TP={tp})") from None
            group = "" if tp == HARDWARE[gpu].p else f" ({tp} of its GPUs)"
            description = f"{gpu} node{group}, simulated from its figures (megatron_paradyse/cost/hardware.py)"
        else:
            path = profile or config.cost.profile
            if path is None:
                raise ValueError("no cost profile: pass --gpu or --profile, or name one in cost.profile")
            rates = load_profile(path, p=tp, check_machine=False, host_link=config.planner.space.host_memory_gib > 0)
            description = f"calibrated profile {path}"
        args.padded_vocab_size = _padded_vocab(args, config)
        return cls(config, args, model_config.transformer, rates, description, budget)

    def footprints(self) -> list:
        """Every pipeline stage's static memory, its optimizer stepping as Megatron's would on the GPUs."""
        from megatron_paradyse.run.stage_planning import stage_footprints

        return stage_footprints(self.args, self.transformer, "cuda")

    def planners(self, pair: str | None = None, *, bucket_cap: int | None = None) -> list:
        """One planner per pipeline stage: the config's, or one that runs only ``pair`` on every layer;
        ``bucket_cap``: the longest micro-batch planned (:func:`stage_planners`)."""
        from megatron_paradyse.run.stage_planning import stage_cost_models, stage_planners

        planner_config = dataclasses.replace(self.config.planner, on_infeasible="stop")
        if pair is not None:
            option = LayerOption.parse(pair)
            planner_config = dataclasses.replace(
                planner_config,
                pairs=(f"{option.attention}/{option.mlp}",),
                attention=None,
                mlp=None,
                recompute=option.recompute,
                host_memory_gib=0.0,  # nor offload, nor MLP tiles
                mlp_tile_tokens=0,
                hysteresis=0.0,
                loss_chunk_tokens=0,  # Megatron's own loss, as a static run has it
            )
        footprints = self.footprints()
        costs = stage_cost_models(self.args, self.transformer, self.profile, footprints)
        return stage_planners(
            planner_config, self.args, self.transformer, costs, footprints, self.budget_bytes, bucket_cap=bucket_cap
        )


def _padded_vocab(args: argparse.Namespace, config) -> int:
    from megatron_paradyse.run.job import dataset_tokenizer

    vocab = args.vocab_size or dataset_tokenizer(config)[0]
    if vocab is None:
        raise ValueError("the vocabulary size is unknown: add --vocab-size to megatron_args")
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-vocab // multiple) * multiple


def _asked_lengths(text: str) -> list[int]:
    """``--lengths``: token counts separated by commas, each a whole number above 0."""
    lengths = []
    for item in text.split(","):
        try:
            length = int(item)
        except ValueError:
            length = 0
        if length < 1:
            raise ValueError(
                f"--lengths takes whole numbers of tokens above 0, separated by commas (like 4096,32768): "
                f"{item.strip()!r} in {text!r} is not one"
            )
        lengths.append(length)
    return lengths


def _dataset_lengths(path: str, config) -> list[int]:
    """The documents' lengths of the indexed dataset at ``path``, split as the job splits them
    (``data.max_len``)."""
    from megatron_paradyse.data import DocumentDataset

    try:
        dataset = DocumentDataset(path)
    except (OSError, ValueError) as e:  # each names the dataset, and what a dataset is where it is not one
        raise ValueError(f"--dataset: {e}") from None
    return sorted(set(dataset.lengths.clip(max=config.data.max_len).tolist()) - {0})


def _format(answer: dict) -> str:
    stages = answer["pp"]
    plans = [row[f"stage{stage}"]["plan"] or "" for row in answer["lengths"] for stage in range(stages)]
    width = max([44, *map(len, plans)])
    dp = answer["world_size"] // (answer["tp"] * stages)
    lines = [
        f"cost model: {answer['cost_model']}",
        f"TP={answer['tp']} PP={stages} DP={dp}; budget {answer['budget_gib']:.2f} GiB per rank, of which the "
        f"weights, gradients and optimizer state hold {', '.join(f'{g:.2f}' for g in answer['static_gib'])} GiB"
        + (f" (stages 0..{stages - 1})" if stages > 1 else ""),
    ]
    if max(answer["forwards_in_flight"]) > 1:
        lines.append(
            f"pipeline stages 0..{stages - 1} hold up to {', '.join(map(str, answer['forwards_in_flight']))} "
            f"forwards at once, each planned to hold what one of --seq-length {answer['seq_length']} tokens would; "
            f"peak: one forward's"
        )
    lines.append(f"{'tokens':>9}  {'stage':>5}  {'plan':<{width}} {'time s':>9} {'peak GiB':>9}")
    for row in answer["lengths"]:
        for stage in range(stages):
            d = row[f"stage{stage}"]
            if "longest" in d:
                text = f"does not fit: longer than {d['longest']} tokens, the longest that fits"
            elif d["plan"] is None:
                text = f"{'does not fit':<{width}} {'':>9} {d['leanest_peak_gib']:>9.2f}  (the leanest plan)"
            else:
                text = f"{d['plan']:<{width}} {d['time_s']:>9.4g} {d['peak_gib']:>9.2f}"
            lines.append(f"{row['tokens']:>9}  {stage:>5}  {text}")
    lines.append("longest sequence that fits, per static strategy (every layer alike):")
    for pair, longest in answer["static_longest"].items():
        lines.append(f"  {STATIC[pair]:<28} {pair:<16} {longest:>9} tokens")
    lines.append(f"longest sequence the planner fits: {answer['longest']} tokens")
    if versus := answer.get("vs_megatron"):
        lines.append(versus["line"])
        if versus["tuned"] is not None:
            lines.append(
                f"these lengths, one sequence each: the planner {versus['adaptive_s']:.4g} s, tuned Megatron "
                f"{versus['tuned_s']:.4g} s (adaptive_vs_tuned_megatron={versus['ratio']:.2f}, "
                f"over the lengths both fit)"
            )
    return "\n".join(lines)


def _plot(answer: dict, job: _Job, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    tokens = [r["tokens"] for r in answer["lengths"]]
    peaks = [max((r[f"stage{s}"].get("peak_gib") or 0.0) for s in range(answer["pp"])) for r in answer["lengths"]]
    ax.plot(tokens, peaks, "o-", label="planner: predicted peak")
    for pair, longest in answer["static_longest"].items():
        if longest:
            ax.axvline(longest, linestyle=":", alpha=0.6, label=f"{STATIC[pair]}: fits up to {longest}")
    ax.axhline(answer["budget_gib"], color="red", label="budget")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("GiB per rank")
    ax.set_title(f"paradyse plan {Path(answer['config']).name}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
