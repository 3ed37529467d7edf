"""The paper's experiment, simulated: ``python -m megatron_paradyse.bench simulate [--gpus a100,h100,h200]``.

**Nothing here is measured.** The planner and the analytic cost model run on cost profiles built from
published GPU and NCCL figures (:mod:`megatron_paradyse.cost.hardware`), for the setting of the ParaDySe
paper (AAAI-26, section 7): one node of 8 GPUs, TP=8, one sequence per step in curriculum order (short
to long), the models of ``configs/paper-{bert,llama,gpt}.yaml`` (shape, layers on the node, mask, the
four strategy pairs, no recompute, gamma, memory margin), and sequence lengths drawn from the paper's
Table 3 histograms (GitHubCode, GRCh38).

For each GPU kind, model and dataset it plans every sequence under each of the paper's static
strategies (a uniform plan of one pair: MegatronTS ``tp_sp/tp_sp``, UlyssesZ ``ulysses/zero3``,
MegatronCZ ``ring/zero3``, METP ``lean/lean``), under ParaDySe's adaptive planner (the exact planner over
those four pairs, gamma = 5%), and under a planner that goes beyond the paper (any attention with any MLP
strategy, per-layer recompute). A curve is the predicted time per sequence summed over the sequences so
far; it ends at the first sequence no plan fits, as an out-of-memory error ended the paper's curves.

Beside them, the baseline a tuned Megatron user runs (:mod:`megatron_paradyse.simulation.tuned`): the static
configuration of the node (TP, CP all-to-all or ring, DP, recompute) that is fastest over the dataset among
those that train its longest sequence; and, on the H100 node, Llama-3-8B over the code corpus under every
such configuration against the planner with every lever (``adaptive_vs_tuned_megatron``).

Prints, per (GPU, model, dataset), the longest trainable length and cumulative times beside the paper's
reported numbers, the paper's ordering claims as PASS/FAIL lines, and last a ``key=value`` line. Writes
one PNG per GPU kind in the layout of the paper's Figure 2 under ``--out-dir``.

Assumptions (the paper states none of them): bf16 weights with fp32 gradients, fp32 master weights and
two fp32 Adam moments, 18 bytes per parameter, not sharded (no data parallelism); only the transformer
layers on the node, no embedding or output layer (``--head`` adds them); memory budget = what the
caching allocator can hold (the GPU's memory less the node's assumed memory outside it) less the presets'
margin (10%), as a job sizes it; ``--sequences`` sequences per dataset (the paper does not say
how many, so cumulative times scale with this choice; lengths and orderings do not).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

from megatron_paradyse.bench._simulation import (
    CONFIGS,
    DATASETS,
    MODELS,
    STATIC_PAIRS,
    Curve,
    Setting,
    load_paper_model,
    simulate_setting,
)
from megatron_paradyse.bench.frontier import frontier, llama3_node, print_frontier
from megatron_paradyse.cost.hardware import BYTES_PER_PARAM, HARDWARE
from megatron_paradyse.data.corpora import binned_lengths
from megatron_paradyse.simulation.tuned import NOT_PRICED, adaptive_curve, times_in_common, tuned_megatron
from megatron_paradyse.simulation.tuned import describe as tuned_line

__all__ = ["main", "ordering_checks", "print_setting"]

_GIB = 2**30
_K = 1024

# -- what the paper reports (paper.md section 8) ------------------------------------------------------
PAPER_MAX_GPT_GRCH38 = 329_728
TABLE5 = {  # variant -> (max sequence length, cumulative time s): GPT on GRCh38, A100 node
    "ParaDySe": (329_728, 3117.76),
    "w/o MegatronTS": (300_032, 3173.80),
    "w/o MegatronCZ": (300_032, 2795.91),
    "w/o UlyssesZ": (300_032, 2813.13),
    "w/o METP": (112_128, 1741.99),
    "w/o Smoothing": (300_032, 2800.49),
}
PAPER_CLAIMS = {
    ("gpt", "grch38"): "ParaDySe trains 181.22% longer sequences than the shortest-reaching baseline (2.81x)",
    ("gpt", "githubcode"): "ParaDySe extends the trainable length by up to 144.16% beyond baselines (2.44x)",
    ("bert", "githubcode"): "every baseline finishes the dataset; up to 89.29% less time on the longest sequences",
    ("bert", "grch38"): "ParaDySe reaches the end (624K); 58.01% faster training",
    ("llama", "grch38"): "ParaDySe reaches the end (624K); its longest length slightly trails the best baseline",
    ("llama", "githubcode"): "ParaDySe keeps METP's long-sequence support",
}
_LONGER = {("gpt", "grch38"): 2.8122, ("gpt", "githubcode"): 2.4416}


# -- checks -----------------------------------------------------------------------------------------
def ordering_checks(setting: Setting) -> list[tuple[str, bool, str]]:
    """The paper's qualitative claims on this setting: (claim, passed, detail)."""
    static = [c for c in setting.curves if c.run.static]
    adaptive = _adaptive(setting)
    by_name = {c.run.name: c for c in static}
    checks = []
    # fastest on short sequences, the paper's first bin (< 4K): MegatronTS (CPC slows the lean ones there)
    first = min(int(np.searchsorted(c.lengths, SHORT)) for c in static)
    if first:
        short = {c.run.name: c.cumulative_s[first - 1] for c in static}
        fastest = min(short, key=short.get)
        checks.append(
            (
                "MegatronTS is the fastest static strategy on short sequences",
                fastest == "tp_sp/tp_sp",
                f"the {first} sequences < {SHORT // _K}K: fastest {STATIC_PAIRS[fastest]} {short[fastest]:.3g} s, "
                f"METP {short['lean/lean']:.3g} s",
            )
        )
    furthest = max(static, key=lambda c: c.longest)
    lean = by_name["lean/lean"]
    checks.append(
        (
            "METP reaches furthest of the static strategies",
            lean.longest >= furthest.longest,
            f"METP {_fmt_longest(lean)}, furthest {STATIC_PAIRS[furthest.run.name]} {_fmt_longest(furthest)}",
        )
    )
    checks.append(
        (
            "ParaDySe reaches at least METP's length",
            adaptive.longest >= lean.longest,
            f"ParaDySe {_fmt_longest(adaptive)}, METP {_fmt_longest(lean)}",
        )
    )
    # never slower than a static strategy over the sequences both trained (gamma of slack: hysteresis)
    gamma = setting.model.planner.cache.hysteresis
    worst = max((adaptive.cumulative_s[len(c.lengths) - 1] / c.total_s, c.run.name) for c in static if c.lengths)
    checks.append(
        (
            "ParaDySe is no slower than any static strategy over the sequences it trains",
            worst[0] <= 1 + gamma + 1e-9,
            f"largest ratio {worst[0]:.3f} vs {STATIC_PAIRS[worst[1]]} (gamma = {gamma:g})",
        )
    )
    return checks


# -- output -----------------------------------------------------------------------------------------
_CHECKPOINTS = (16 * _K, 64 * _K, 128 * _K, 256 * _K)
SHORT = 4 * _K
"""The paper's first length bin ends here: "short sequences"."""


def _fmt_len(n: int | None) -> str:
    return "" if n is None else f"{n:,}"


def _fmt_longest(c: Curve) -> str:
    return "all fit" if c.max_feasible is None else f"{c.max_feasible:,}"


def _fmt_s(t: float | None) -> str:
    return "OOM" if t is None else f"{t:,.1f}"


def print_setting(setting: Setting) -> list[tuple[str, bool, str]]:
    """The setting's header, its curves, how they compare with the paper's claims and ablation, and the
    paper's ordering claims checked on it (returned)."""
    _print_header(setting)
    _print_curves(setting)
    key = (setting.model.name, setting.dataset_key)
    if key in PAPER_CLAIMS:
        print(f"paper: {PAPER_CLAIMS[key]}")
        _print_against_the_paper(setting, key)
    if setting.ablations:
        _print_ablation(setting)
    checks = ordering_checks(setting)
    for claim, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {claim} ({detail})")
    return checks


def _print_header(setting: Setting) -> None:
    """The GPU, model and dataset; the memory budget and the static bytes."""
    gpu, model, ds = setting.gpu, setting.model, setting.dataset
    shape = model.shape
    print(
        f"\n== {gpu.device_name} x{gpu.p} (SIMULATED) | {MODELS[model.name]} h={shape.hidden_size} "
        f"n={shape.num_attention_heads}, {model.num_layers} layers, {'causal' if model.causal else 'bidirectional'} "
        f"| {ds.name}: {setting.num_sequences} sequences, "
        f"max {ds.max_len:,} ==",
    )
    print(
        f"budget {setting.budget_bytes / _GIB:.1f} GiB per GPU ({gpu.memory_bytes / _GIB:.1f} GiB less "
        f"{gpu.outside_allocator_bytes / _GIB:.1f} outside the caching allocator, less {model.memory.margin:.0%}); "
        f"static {setting.static_bytes / _GIB:.1f} GiB (weights, grads, Adam: "
        f"{BYTES_PER_PARAM} B/param)",
    )


def _print_curves(setting: Setting) -> None:
    """Each run's longest length and cumulative times, the adaptive runs' plans, and the longest under
    the authors' memory rule."""
    head = ["strategy", "paper", "max len", "reached", "total s"] + [f"cum@{c // _K}K s" for c in _CHECKPOINTS]
    rows = []
    tuned = [setting.tuned.curve] if setting.tuned.curve else []
    for c in [*setting.curves, *tuned]:
        row = [c.run.name, c.run.paper_name, _fmt_longest(c), _fmt_len(c.reached), _fmt_s(c.total_s)]
        row += [_fmt_s(c.cumulative_at(n)) if n <= setting.dataset.max_len else "" for n in _CHECKPOINTS]
        rows.append(row)
    _print_table(head, rows)
    for c in setting.curves:
        if not c.run.static:
            mix = "; ".join(f"{plan}: {n}" for plan, n in sorted(c.plans.items(), key=lambda kv: -kv[1])[:4])
            print(f"  {c.run.name}, sequences per plan (most used): {mix}")
    print(f"  {tuned_line(setting.tuned, _adaptive(setting))}")
    print(
        f"  memory rule: under the authors' threshold (GPU memory - 512 MiB) instead of a "
        f"{setting.model.memory.margin:.0%} margin, ParaDySe's longest would be "
        f"{_fmt_len(setting.paper_threshold_max) or 'beyond the dataset'}",
    )


def _print_against_the_paper(setting: Setting, key: tuple[str, str]) -> None:
    """ParaDySe's length against the shortest-reaching static strategy's and, where every run finishes,
    its time against the slowest static one's, as the paper's claims count them."""
    adaptive = _adaptive(setting)
    static = [c for c in setting.curves if c.run.static]
    shortest = min(static, key=lambda c: c.longest)
    paper_ratio = f" (paper {_LONGER[key]:.2f}x)" if key in _LONGER else ""
    if shortest.max_feasible is None:
        print("simulated: every static strategy trains the whole dataset")
    else:
        # a run that trains every sequence is credited with the dataset's longest: a lower bound
        at_least = "" if adaptive.max_feasible else "trains every sequence: >= "
        ratio = min(adaptive.longest, setting.dataset.max_len) / shortest.max_feasible
        print(
            f"simulated: ParaDySe {at_least}{ratio:.2f}x the length of the shortest-reaching baseline "
            f"({STATIC_PAIRS[shortest.run.name]} {shortest.max_feasible:,}){paper_ratio}"
        )
    finished = [c for c in static if c.stopped_at is None]
    if finished and adaptive.stopped_at is None:
        slowest = max(finished, key=lambda c: c.total_s)
        last = [c.cumulative_s[-1] - c.cumulative_s[-2] for c in (adaptive, slowest)]
        print(
            f"simulated: vs the slowest baseline that finishes ({STATIC_PAIRS[slowest.run.name]}): "
            f"{1 - adaptive.total_s / slowest.total_s:.2%} less time in all, "
            f"{1 - last[0] / last[1]:.2%} less on the longest sequence",
        )


def _print_ablation(setting: Setting) -> None:
    """The ablation runs beside the paper's Table 5."""
    print("ablation (paper Table 5: GPT on GRCh38, A100; its times depend on its unstated dataset size)")
    adaptive = _adaptive(setting)
    rows = []
    for c in [adaptive, *setting.ablations]:
        paper = TABLE5.get(c.run.paper_name, (None, None))
        full_same = adaptive.cumulative_at(c.reached)
        rows.append(
            [c.run.name, c.run.paper_name, _fmt_longest(c), _fmt_s(c.total_s), _fmt_s(full_same)]
            + [_fmt_len(paper[0]) or "-", _fmt_s(paper[1]) if paper[1] else "-"]
        )
    _print_table(["variant", "paper", "max len", "total s", "full to same s", "paper max", "paper s"], rows)


def _adaptive(setting: Setting) -> Curve:
    return next(c for c in setting.curves if c.run.name == "adaptive")


def _print_table(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print(
            "  " + "  ".join(v.rjust(w) if i > 1 else v.ljust(w) for i, (v, w) in enumerate(zip(map(str, r), widths))),
        )


def plot_gpu(settings: list[Setting], path: Path) -> None:
    """Cumulative time against sequence length, one panel per (dataset, model), as the paper's Figure 2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({s.dataset_key for s in settings}, key=list(DATASETS).index)
    models = sorted({s.model.name for s in settings}, key=list(MODELS).index)
    fig, axes = plt.subplots(
        len(datasets), len(models), figsize=(4.6 * len(models), 3.6 * len(datasets)), squeeze=False
    )
    styles = {
        "tp_sp/tp_sp": ("tab:blue", "-"),
        "ulysses/zero3": ("tab:orange", "-"),
        "ring/zero3": ("tab:green", "-"),
        "lean/lean": ("tab:purple", "-"),
        "adaptive": ("tab:red", "-"),
        "beyond": ("black", ":"),
        "tuned": ("tab:brown", "--"),
    }
    for s in settings:
        ax = axes[datasets.index(s.dataset_key)][models.index(s.model.name)]
        for c in [*s.curves, *([s.tuned.curve] if s.tuned.curve else [])]:
            if not c.lengths:
                continue
            color, style = styles[c.run.name]
            label = {"beyond": "beyond the paper (all + recompute)", "tuned": f"tuned {c.run.paper_name}"}.get(
                c.run.name, c.run.paper_name
            )
            x = np.array(c.lengths) / _K
            ax.plot(x, c.cumulative_s, style, color=color, lw=2.2 if c.run.name == "adaptive" else 1.4, label=label)
            if c.stopped_at is not None:
                ax.plot(x[-1], c.cumulative_s[-1], "x", color=color, ms=8, mew=2)
        ax.set_title(f"{s.dataset.name} - {MODELS[s.model.name]}")
        ax.set_xlabel("sequence length (K tokens)")
        ax.set_ylabel("cumulative time (s)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper left")
    gpu = settings[0].gpu
    fig.suptitle(f"SIMULATED on {gpu.device_name} x{gpu.p} from published figures (x: out of memory)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    gpus = _choices("--gpus", args.gpus, HARDWARE)
    models = _choices("--models", args.models, MODELS)
    datasets = _choices("--datasets", args.datasets, DATASETS)
    if not args.no_plots and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("the plots need matplotlib (pip install matplotlib==3.11.2); or pass --no-plots")

    print("SIMULATED, NOT MEASURED: the planner and the analytic cost model on cost profiles built from published")
    print("GPU datasheets, FlashAttention-2 and nccl-tests figures, and attention kernels measured on one H200")
    print("(megatron_paradyse/cost/hardware.py).")
    print("tuned Megatron: the static configuration of the node a careful user runs for each dataset, the fastest")
    print("that trains its longest sequence (megatron_paradyse/simulation/tuned.py); not priced:")
    for what in NOT_PRICED:
        print(f"  {what}")
    specs = {name: load_paper_model(name, args.configs) for name in models}
    lengths = {  # every dataset's: the Llama-3-8B comparison runs on the code corpus whichever are chosen
        key: binned_lengths(ds.shares, args.sequences, ds.max_len, args.seed, reference_max=ds.max_len)
        for key, ds in DATASETS.items()
    }
    results, checks, summary = [], [], {}
    for gpu_name in gpus:
        gpu = HARDWARE[gpu_name]
        settings = []
        for model_name in models:
            for key in datasets:
                ablate = (model_name, key) == ("gpt", "grch38")
                setting = simulate_setting(gpu, specs[model_name], key, lengths[key], head=args.head, ablations=ablate)
                checks += [(gpu_name, model_name, key, *c) for c in print_setting(setting)]
                summary.update(_summary(setting))
                settings.append(setting)
        if not args.no_plots:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            path = args.out_dir / f"figure2_{gpu_name}.png"
            plot_gpu(settings, path)
            print(f"\nplot: {path}")
        results += settings
    frontiers = [frontier(HARDWARE[gpu_name], args.configs) for gpu_name in gpus]
    print_frontier(frontiers)
    summary.update({f"llama3_8b_{f.gpu}_max_len": f.max_len for f in frontiers})
    for f in frontiers:  # the utilisation of one H100 node, as long-context systems report theirs
        if f.gpu == "h100":
            summary.update(mfu_128k=f"{100 * f.mfu_at_128k:.1f}", mfu_1m=f"{100 * f.mfu_at_1m:.1f}")
            ratio = versus_tuned_megatron(args.configs, np.sort(lengths["githubcode"]))
            summary["adaptive_vs_tuned_megatron"] = "n/a" if ratio is None else f"{ratio:.2f}"
    if args.json:
        args.json.write_text(json.dumps(_as_json(results), indent=1))
    _print_verdicts(checks, summary)
    return 0


def versus_tuned_megatron(configs: Path, lengths: np.ndarray) -> float | None:
    """Llama-3-8B on one H100 node over the code corpus's ``lengths`` (sorted): the adaptive planner's time
    (every lever) over the tuned Megatron configuration's (None: no configuration runs the model), printed
    with every configuration's curve."""
    node = llama3_node(HARDWARE["h100"], configs)
    adaptive = adaptive_curve(node, lengths)
    tuned = tuned_megatron(node, lengths)
    print(
        f"\nLlama-3-8B on one H100 node (configs/llama3-8b.yaml, every lever), SIMULATED, against each static Megatron "
        f"configuration | {DATASETS['githubcode'].name}: {len(lengths)} sequences, max {int(lengths[-1]):,}"
    )
    curves = [adaptive, *tuned.curves.values()]
    rows = [[c.run.paper_name, _fmt_longest(c), _fmt_len(c.reached), _fmt_s(c.total_s)] for c in curves]
    _print_table(["run", "max len", "reached", "total s"], rows)
    print(f"  {tuned_line(tuned, adaptive)}")
    if tuned.curve is None:
        return None
    adaptive_s, tuned_s = times_in_common(adaptive, tuned.curve)
    print(
        f"  over the sequences both train: adaptive {adaptive_s:,.1f} s, tuned Megatron {tuned_s:,.1f} s "
        f"({adaptive_s / tuned_s:.2f})"
    )
    return adaptive_s / tuned_s


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_paradyse.bench simulate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--gpus", default="a100,h100,h200", help=f"of {','.join(HARDWARE)}")
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {','.join(MODELS)}")
    parser.add_argument("--datasets", default=",".join(DATASETS), help=f"of {','.join(DATASETS)}")
    parser.add_argument("--sequences", type=int, default=1000, help="sequences drawn per dataset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--head", action="store_true", help="put the embedding and output layer on the node")
    parser.add_argument("--configs", type=Path, default=CONFIGS, help="folder of the paper-*.yaml presets")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/simulate"))
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--json", type=Path, help="write every curve to this file")
    return parser


def _print_verdicts(checks: list[tuple], summary: dict[str, int | str]) -> None:
    """The ordering checks that failed, the longest GPT sequence on GRCh38 against the paper's, and the
    ``key=value`` line (GPT on GRCh38 first, as the paper puts it)."""
    failed = [c for c in checks if not c[4]]
    print(f"\nordering checks: {len(checks) - len(failed)}/{len(checks)} pass")
    for gpu_name, model_name, key, claim, _, detail in failed:
        print(f"  FAIL {gpu_name} {model_name} {key}: {claim} ({detail})")
    for run, what in (("adaptive", "ParaDySe in the paper's setting"), ("beyond", "beyond the paper")):
        longest = summary.get(f"{run}_max_len_gpt_grch38_a100")
        if longest is not None:
            verdict = "PASS" if longest >= PAPER_MAX_GPT_GRCH38 else "FAIL"
            print(f"{verdict}: {what}: longest GPT sequence on GRCh38 (A100) {longest:,} >= {PAPER_MAX_GPT_GRCH38:,}")
    first = sorted(summary, key=lambda k: ("_gpt_grch38_" not in k, k.startswith("llama3_8b")))  # the paper's first
    fields = [f"{k}={summary[k]}" for k in first]
    print(" ".join([*fields, f"paper={PAPER_MAX_GPT_GRCH38}", f"ordering_ok={int(not failed)}"]))


def _summary(setting: Setting) -> dict[str, int]:
    """``adaptive_max_len_<model>_<dataset>_<gpu>`` (the dataset's longest where every sequence fit); for
    GPT on GRCh38 also under the authors' memory threshold, and beyond the paper."""
    where = f"{setting.model.name}_{setting.dataset_key}_{setting.gpu.name}"
    runs = {c.run.name: c for c in setting.curves}
    out = {f"adaptive_max_len_{where}": runs["adaptive"].max_feasible or runs["adaptive"].reached}
    if (setting.model.name, setting.dataset_key) == ("gpt", "grch38"):
        out[f"adaptive_max_len_{where}_authors_threshold"] = setting.paper_threshold_max or setting.dataset.max_len
        out[f"beyond_max_len_{where}"] = runs["beyond"].max_feasible or runs["beyond"].reached
    return out


def _choices(flag: str, text: str, known) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"{flag}: unknown {', '.join(unknown) or '(empty)'}; known: {', '.join(known)}")
    return names


def _as_json(settings: list[Setting]) -> list[dict]:
    out = []
    for s in settings:
        for c in [*s.curves, *s.ablations, *s.tuned.curves.values()]:
            out.append(
                {
                    "gpu": s.gpu.name,
                    "model": s.model.name,
                    "dataset": s.dataset_key,
                    "run": c.run.name,
                    "paper_name": c.run.paper_name,
                    "max_feasible": c.max_feasible,
                    "stopped_at": c.stopped_at,
                    "lengths": c.lengths,
                    "cumulative_s": c.cumulative_s,
                    "plans": c.plans,
                }
            )
    return out


if __name__ == "__main__":
    sys.exit(main())
