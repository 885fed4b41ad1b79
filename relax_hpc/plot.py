"""Figures of a run, from its JSONL records (works on a live run too).

    python -m relax_hpc.plot RUN_DIR [--out DIR]      # default: RUN_DIR/plots

Writes PNG files:
- reward.png      batch reward per step (and its 10-step mean), greedy accuracy per evaluated version
- kl_entropy.png  entropy, approximate KL to the sampling policy, KL to the reference (when used),
                  clip fraction
- time.png        where a step's time goes (stacked), the batch's generation time, and the overlap
                  of rollout and training against its bound
- staleness.png   mean and max staleness of the trained samples, samples set aside as stale
- overview.png    the four above, one panel each

On an eval job's RUN_DIR (kind=eval) it writes eval.png instead: per dataset, greedy accuracy
(and mean@k, pass@k with k > 1) of each model in the order eval.models lists them, so that the
checkpoints of a run read left to right. The eval job writes it itself after every scored pair.

Every figure marks the steps where the run stopped early and where it resumed (dotted lines).

With --trace it also writes trace.json, a Chrome-trace timeline (chrome://tracing, Perfetto):
the driver's generation of each batch and the phases of each trainer step, from the times the
records hold.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a cluster node

import matplotlib.pyplot as plt
from matplotlib.axes import Axes

from relax_hpc import cli
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.metrics.summary import step_records
from relax_hpc.paths import RunPaths

TIME_PHASES = ("wait", "read", "fwd_bwd", "optimizer", "push", "checkpoint")
Record = dict[str, Any]


def _series(records: list[Record], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], float(r[key])) for r in records if key in r]
    return [s for s, _ in points], [v for _, v in points]


def _mean_of(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i - max(0, i - window + 1) + 1) for i in range(len(values))]


def reward(ax: Axes, steps: list[Record], evals: list[Record]) -> None:
    """Batch reward and greedy accuracy; an sft run's steps have neither: its loss instead."""
    if not any("reward" in r for r in steps):
        x, y = _series(steps, "loss")
        ax.plot(x, y, color="tab:blue", alpha=0.3, linewidth=0.8, label="loss (response tokens)")
        ax.plot(x, _mean_of(y, 10), color="tab:blue", linewidth=1.8, label="10-step mean")
        ax.set(title="supervised loss", xlabel="step", ylabel="loss")
        ax.legend(loc="upper right", fontsize=8)
        return
    x, y = _series(steps, "reward")
    ax.plot(x, y, color="tab:blue", alpha=0.3, linewidth=0.8, label="batch reward")
    ax.plot(x, _mean_of(y, 10), color="tab:blue", linewidth=1.8, label="10-step mean")
    if evals:
        ax.plot([r["version"] for r in evals], [r["greedy_accuracy"] for r in evals], "o-", color="tab:orange",
                label="greedy accuracy (at policy version)")  # fmt: skip
    ax.set(title="reward and evaluation", xlabel="step / policy version", ylabel="reward, greedy accuracy",
           ylim=(-0.02, 1.02))  # fmt: skip
    ax.legend(loc="lower right", fontsize=8)


def kl_entropy(ax: Axes, steps: list[Record], _: list[Record]) -> None:
    """Entropy on the left axis; the KLs and the clip fraction, an order of magnitude smaller, on
    the right. 10-step means, the raw values faint behind them."""
    x, y = _series(steps, "entropy")
    ax.plot(x, y, color="tab:green", alpha=0.25, linewidth=0.8)
    ax.plot(x, _mean_of(y, 10), color="tab:green", linewidth=1.6, label="entropy")
    ax.set(title="entropy, KL and clipping (per loss token, 10-step means)", xlabel="step", ylabel="entropy")
    twin = ax.twinx()
    for key, color in (("approx_kl", "tab:red"), ("kl_ref", "tab:purple"), ("clip_fraction", "tab:gray")):
        x, y = _series(steps, key)
        if x:
            twin.plot(x, _mean_of(y, 10), color=color, linewidth=1.2, label=key)
    twin.set_ylabel("KL, clip fraction")
    lines = ax.get_legend_handles_labels(), twin.get_legend_handles_labels()
    ax.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], loc="upper right", fontsize=8)


def time_breakdown(ax: Axes, steps: list[Record], _: list[Record]) -> None:
    timed = [r for r in steps if "time_step" in r]
    if not timed:
        ax.set(title="where the time goes (no timed steps yet)")
        return
    x = [r["step"] for r in timed]
    phases = [_mean_of([r[f"time_{p}"] for r in timed], 10) for p in TIME_PHASES]
    ax.stackplot(x, *phases, labels=TIME_PHASES, alpha=0.8)
    generate = _mean_of([r["time_generate"] for r in timed], 10)
    ax.plot(x, generate, color="black", linewidth=1.2, label="generate (its batch)")
    ax.set(title="where a step's time goes (10-step means)", xlabel="step", ylabel="seconds")
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    twin = ax.twinx()
    twin.plot(x, _mean_of([r["overlap_gain"] for r in timed], 10), color="tab:cyan", linestyle="--", label="overlap")
    twin.plot(x, _mean_of([r["overlap_bound"] for r in timed], 10), color="tab:cyan", linestyle=":", label="bound")
    twin.set_ylabel("overlap of rollout and training (x)")
    twin.legend(loc="upper right", fontsize=7)


def staleness(ax: Axes, steps: list[Record], _: list[Record]) -> None:
    x, mean = _series(steps, "staleness_mean")
    high = _series(steps, "staleness_max")[1]
    ax.plot(x, _mean_of(mean, 10), color="tab:blue", linewidth=1.4, label="staleness_mean (10-step mean)")
    ax.step(x, [max(high[max(0, i - 9) : i + 1]) for i in range(len(high))], color="tab:red", linewidth=1.0,
            where="post", label="staleness_max (over 10 steps)")  # fmt: skip
    ax.set(title="staleness of trained samples (versions)", xlabel="step", ylim=(-0.05, max(high, default=0) + 0.5))
    x, aside = _series(steps, "stale_samples_total")
    if any(aside):  # a second axis only when something was set aside
        twin = ax.twinx()
        twin.plot(x, aside, color="tab:gray", linestyle="--", label="set aside (total)")
        twin.set_ylabel("samples set aside as stale")
    ax.legend(loc="upper left", fontsize=8)


def stops_and_resumes(paths: RunPaths) -> dict[int, str]:
    """Steps where the trainer stopped early (its end records) or resumed (its starts after the
    first), from train.jsonl: what each figure marks, e.g. {40: "stop, resume"}."""
    marks: dict[int, list[str]] = {}
    for r in read_jsonl(paths.train_metrics):
        if r.get("event") == "end" and not r.get("completed"):
            marks.setdefault(int(r["step"]), []).append("stop")
        elif r.get("event") == "start" and r.get("step"):
            marks.setdefault(int(r["step"]), []).append("resume")
    return {step: ", ".join(dict.fromkeys(words)) for step, words in marks.items()}


def mark(ax: Axes, marks: dict[int, str]) -> None:
    """A thin vertical line at each stop or resume, named at the top of the panel."""
    for step, words in marks.items():
        ax.axvline(step, color="tab:gray", linestyle=":", linewidth=0.9)
        ax.text(step, 0.98, f" {words}", transform=ax.get_xaxis_transform(), rotation=90, va="top", fontsize=6,
                color="tab:gray")  # fmt: skip


FIGURES: dict[str, Callable[[Axes, list[Record], list[Record]], None]] = {
    "reward": reward,
    "kl_entropy": kl_entropy,
    "time": time_breakdown,
    "staleness": staleness,
}


def eval_panel(ax: Axes, rows: list[Record]) -> None:
    """One dataset's results.jsonl records: each figure across the models, in the records' order."""
    k = rows[0]["k"]
    names = [r["model"] for r in rows]
    series = {"greedy accuracy": "greedy_accuracy"}
    if k > 1:
        series |= {f"mean@{k}": "mean_at_k", f"pass@{k}": "pass_at_k"}
    for label, key in series.items():
        ax.plot(names, [r[key] for r in rows], "o-", label=label)
    title = f"{rows[0]['dataset']} ({rows[0]['problems']} problems, k={k})"
    ax.set(title=title, xlabel="model", ylabel="score", ylim=(0, 1.02))
    ax.tick_params(axis="x", labelrotation=30)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)


def eval_figure(paths: RunPaths, out: Path) -> Path:
    """eval.png: one panel per dataset of the eval job's results.jsonl."""
    records = read_jsonl(paths.eval_results)
    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    fig, axes = plt.subplots(1, len(datasets), figsize=(1 + 6 * len(datasets), 4), layout="constrained", squeeze=False)
    for ax, dataset in zip(axes.flat, datasets, strict=True):
        eval_panel(ax, [r for r in records if r["dataset"] == dataset])
    out.mkdir(parents=True, exist_ok=True)
    return _save(fig, out / "eval.png")


def plot(run_dir: Path, out: Path) -> list[Path]:
    """Write every figure of the run to `out`; returns the files written."""
    paths = RunPaths(run_dir)
    steps = step_records(paths)
    if not steps and paths.eval_results.is_file():
        return [eval_figure(paths, out)]
    if not steps:
        raise SystemExit(f"{paths.train_metrics}: no trained step yet, nothing to plot")
    evals = [r for r in read_jsonl(paths.eval_metrics) if "greedy_accuracy" in r]
    marks = stops_and_resumes(paths)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in FIGURES.items():
        fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
        draw(ax, steps, evals)
        mark(ax, marks)
        written.append(_save(fig, out / f"{name}.png"))
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), layout="constrained")
    for ax, draw in zip(axes.flat, FIGURES.values(), strict=True):
        draw(ax, steps, evals)
        mark(ax, marks)
    fig.suptitle(f"{paths.root.name}: step {steps[-1]['step']}")
    written.append(_save(fig, out / "overview.png"))
    return written


def trace(run_dir: Path, out: Path) -> Path:
    """A Chrome-trace file of the run: one track for the driver's batches, one for the trainer's
    step phases (each phase placed before the end of its step, in the order the loop runs them)."""
    paths = RunPaths(run_dir)
    events = [
        _span("driver", f"generate batch {r['batch']}", r["time"] - r["seconds"], r["seconds"])
        for r in read_jsonl(paths.rollout_metrics)
        if "seconds" in r
    ]
    for r in step_records(paths):
        if "time_step" not in r:
            continue
        end = r["time"]
        begin = end - r["time_step"]
        for phase in TIME_PHASES:
            events.append(_span("trainer", f"{phase} (step {r['step']})", begin, r[f"time_{phase}"]))
            begin += r[f"time_{phase}"]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "trace.json"
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def _span(track: str, name: str, start_s: float, seconds: float) -> Record:
    return {"name": name, "ph": "X", "pid": 1, "tid": track, "ts": start_s * 1e6, "dur": seconds * 1e6}


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m relax_hpc.plot", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path, help="the run's RUN_DIR (run.dir)")
    parser.add_argument("--out", type=Path, help="folder for the PNG files (default: RUN_DIR/plots)")
    parser.add_argument("--trace", action="store_true", help="also write trace.json, a Chrome-trace timeline")
    args = parser.parse_args(argv)
    out = args.out or RunPaths(args.run_dir).plots
    for path in plot(args.run_dir, out):
        print(path)
    if args.trace:
        print(trace(args.run_dir, out))
    return 0


if __name__ == "__main__":
    cli.run(main)
