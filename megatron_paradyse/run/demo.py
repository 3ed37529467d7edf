"""``paradyse demo`` (or ``python -m megatron_paradyse.run.demo``): the CPU demo, start to finish.

Trains the small GPT of ``configs/tiny-cpu.yaml`` on 4 gloo ranks, on files of the code corpus whose
lengths climb from a few hundred to a few thousand tokens, under a per-rank memory budget that the
long files do not fit with the fastest plan: the planner switches plans as the lengths grow. It
runs exactly what a cluster runs::

    torchrun --standalone --nproc-per-node 4 -m megatron_paradyse.pretrain_gpt --paradyse-config <config>

(Megatron's ``pretrain()``, the Paradyse layer spec, the planner, the dynamic-sequence data pipeline),
with a progress bar on stderr, the per-iteration table on stdout, and at the end the loss, the plans
chosen and a plot of lengths and plans. Into ``--output-dir``: ``config.yaml`` (the config it ran),
``train.log`` (every rank's output), ``iterations.jsonl``, ``plot.png``, and ``cache/`` (the corpus
and the calibrated cost profile, reused by the next run).
"""

from __future__ import annotations

import argparse
import collections
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from megatron_paradyse.config import load_config
from megatron_paradyse.run.log import format_header, format_rows, plan_switches, read_jsonl

__all__ = ["main"]

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.yaml"
RANKS = 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paradyse demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="paradyse config (default: %(default)s)")
    parser.add_argument("--output-dir", type=Path, default=Path("paradyse-demo"), help="default: %(default)s")
    parser.add_argument("--cache-dir", type=Path, help="corpus and cost profile (default: OUTPUT_DIR/cache)")
    parser.add_argument("--iterations", type=int, help="override the config's --train-iters")
    args = parser.parse_args(argv)
    try:
        config_path = _write_run_config(args.config, args.output_dir, args.cache_dir or args.output_dir / "cache")
    except ValueError as e:
        parser.exit(2, f"paradyse: error: {e}\n")
    extra = [] if args.iterations is None else ["--train-iters", str(args.iterations)]
    return _run(config_path, args.output_dir, extra)


def _write_run_config(source: Path, out: Path, cache: Path) -> Path:
    """The config with the demo's log and plot in ``out``, its corpus and profile in ``cache``; validated."""
    load_config(source)  # errors name the file the user gave
    data = yaml.safe_load(source.read_text()) or {}
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    data.setdefault("data", {})["cache_dir"] = str(cache.resolve())
    data.setdefault("log", {}).update(jsonl=str(out / "iterations.jsonl"), plot=str(out / "plot.png"))
    for name in ("iterations.jsonl", "plot.png"):
        (out / name).unlink(missing_ok=True)
    path = out / "config.yaml"
    header = f"# paradyse demo: {source}, with the cache, log and plot in this folder\n"
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))
    load_config(path)
    return path


def _train_iters(config_path: Path, extra: list[str]) -> int:
    flags = [*load_config(config_path).megatron_args, *extra]
    values = [flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag == "--train-iters"]
    return int(values[-1]) if values else 0


def _run(config_path: Path, out: Path, extra: list[str]) -> int:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
        "-m", "megatron_paradyse.pretrain_gpt", "--paradyse-config", str(config_path), *extra,
    ]  # fmt: skip
    total = _train_iters(config_path, extra)
    jsonl, log_path = out.resolve() / "iterations.jsonl", out.resolve() / "train.log"
    print(f"paradyse demo: {RANKS} gloo ranks; every rank's output goes to {log_path}", flush=True)
    print(f"  {shlex.join(['torchrun', *command[3:]])}", flush=True)  # torchrun is `python -m torch.distributed.run`
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    progress = _Progress(total, start)
    shown = 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while True:
                finished = proc.poll() is not None
                records = read_jsonl(jsonl) if jsonl.exists() else []
                if len(records) > shown:
                    rows = [format_header()] if shown == 0 else []
                    for record in records[shown:]:
                        rows += format_rows(record)
                    progress.clear()
                    print("\n".join(rows), flush=True)
                    shown = len(records)
                progress.draw(shown, _status(log_path))
                if finished:
                    break
                time.sleep(0.5)
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            progress.clear()
            print("paradyse demo: interrupted", file=sys.stderr)
            return 130
    progress.clear()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        print(f"paradyse demo: training failed (exit code {proc.returncode}) after {wall:.0f} s; "
              f"the end of {log_path}:", file=sys.stderr)  # fmt: skip
        print("".join(log_path.read_text().splitlines(keepends=True)[-40:]), file=sys.stderr)
        return 1
    _summary(read_jsonl(jsonl), wall, out.resolve(), shlex.join(["torchrun", *command[3:]]))
    return 0


def _status(log_path: Path) -> str:
    """The last ``paradyse:`` line of the ranks' output: what the start-up is doing."""
    try:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.startswith("paradyse:")]
    except OSError:
        return ""
    return lines[-1].removeprefix("paradyse: ") if lines else "starting Megatron on 4 ranks"


def _summary(records, wall: float, out: Path, command: str) -> None:
    switches, plans = plan_switches(records)
    losses = [r.loss for r in records if r.loss is not None]
    skipped = sum(len(r.skipped) for r in records)
    print(f"\nparadyse demo: done in {wall // 60:.0f} min {wall % 60:.0f} s, {len(records)} iterations")
    if losses:
        k = min(5, len(losses))
        print(
            f"  loss: first {losses[0]:.3f}, last {losses[-1]:.3f} "
            f"(mean of the first {k}: {sum(losses[:k]) / k:.3f}, of the last {k}: {sum(losses[-k:]) / k:.3f})"
        )
    print(f"  plans: {len(plans)} different, {switches} switches, {skipped} micro-batches skipped")
    for plan, n in plans.items():
        print(f"    {n:>3} micro-batches  {plan}")
    for line in _prediction_lines([mb for r in records for mb in r.micro_batches]):
        print(f"  {line}")
    print(f"  plot: {out / 'plot.png'}")
    print(f"  table: {out / 'iterations.jsonl'}   ranks' output: {out / 'train.log'}")
    print(f"  the same run by hand: {command}")


def _prediction_lines(micro_batches: list) -> list[str]:
    """How the predictions held: forward + backward time within 25% (those whose time holds a one-time cost
    aside), and the measured peak under the predicted one."""
    lines = []
    timed = [mb for mb in micro_batches if mb.measured_time_s is not None and not mb.one_off]
    if timed:
        errors = [abs(mb.predicted_time_s / mb.measured_time_s - 1) for mb in timed]
        one_offs = collections.Counter(mb.one_off for mb in micro_batches if mb.one_off)
        aside = f"; aside, with a one-time cost: {', '.join(f'{n} {cost}' for cost, n in one_offs.items())}"
        lines.append(
            f"time: predicted within 25% of the measured for {sum(e <= 0.25 for e in errors)} of {len(timed)} "
            f"micro-batches (median error {statistics.median(errors):.1%}){aside if one_offs else ''}"
        )
    peaks = [mb for mb in micro_batches if mb.measured_peak_bytes is not None]
    if peaks:
        worst = max(mb.measured_peak_bytes / mb.predicted_peak_bytes for mb in peaks)
        under = sum(mb.measured_peak_bytes <= mb.predicted_peak_bytes for mb in peaks)
        lines.append(
            f"peak memory: measured at or under the predicted for {under} of {len(peaks)} micro-batches "
            f"(measured/predicted at most {worst:.3f})"
        )
    return lines


class _Progress:
    """``[#####.....] 12/40 iterations, 1:23 elapsed, ~2:05 left: <status>`` on stderr (terminals only)."""

    def __init__(self, total: int, start: float, width: int = 30) -> None:
        self.total, self.start, self.width = max(total, 1), start, width
        self.enabled = sys.stderr.isatty()

    def draw(self, done: int, status: str) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        filled = self.width * min(done, self.total) // self.total
        left = f", ~{_clock(elapsed / done * (self.total - done))} left" if done else ""
        text = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} iterations, {_clock(elapsed)}{left}"
        if done == 0 and status:
            text += f": {status}"
        sys.stderr.write("\r\033[K" + text[: os.get_terminal_size(sys.stderr.fileno()).columns - 1])
        sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


if __name__ == "__main__":
    sys.exit(main())
