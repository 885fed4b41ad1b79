"""What the command-line tools show: `scale`'s help (what a user may type, nothing of argparse's
internals), `plot`'s figures (axis labels, the run's stops and resumes marked, an eval job's
scores across its models) and the end-of-run summary's hints (commands that run as copied)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from relax_hpc.metrics.jsonl import JsonlWriter, read_jsonl
from relax_hpc.metrics.summary import run_summary, step_records
from relax_hpc.paths import RunPaths
from relax_hpc.plot import eval_panel, mark, plot, reward, stops_and_resumes

REPO = Path(__file__).resolve().parents[2]


def scale(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relax_hpc.scale", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


def test_scale_help_lists_the_user_s_commands_without_the_hidden_one():
    out = scale("--help")
    assert out.returncode == 0, out.stderr
    assert "SUPPRESS" not in out.stdout and not any(line.split()[:1] == ["serve"] for line in out.stdout.splitlines())
    assert "usage: python -m relax_hpc.scale [-h] run_dir {out,in,list} ..." in out.stdout
    assert all(f"    {command} " in out.stdout for command in ("out", "in", "list"))


def test_the_hidden_serve_command_still_parses(tmp_path):
    out = scale(str(tmp_path), "serve", "op-1")  # argparse accepts it; the run dir check answers
    assert (out.returncode, out.stderr.strip()) == (1, f"error: {tmp_path} is not a relax_hpc run (no config.yaml)")


def test_the_plots_name_the_reward_axis_and_mark_each_stop_and_resume(tmp_path):
    paths = RunPaths(tmp_path / "run")
    paths.create()
    writer = JsonlWriter(paths.train_metrics)
    writer.log({"event": "start", "step": 0})
    for step in range(1, 7):
        if step == 4:  # stopped with a checkpoint at 3, resumed there
            writer.log({"event": "end", "step": 3, "completed": False})
            writer.log({"event": "start", "step": 3})
        writer.log({"step": step, "loss": 0.1, "reward": step / 10, "entropy": 1.0, "staleness_mean": 0.0,
                    "staleness_max": 0})  # fmt: skip
    writer.log({"event": "end", "step": 6, "completed": True})
    assert stops_and_resumes(paths) == {3: "stop, resume"}
    fig, ax = plt.subplots()
    reward(ax, step_records(paths), [])
    mark(ax, stops_and_resumes(paths))
    assert ax.get_ylabel() == "reward, greedy accuracy" and ax.get_xlabel() == "step / policy version"
    assert [line.get_xdata() for line in ax.lines if line.get_linestyle() == ":"] == [[3, 3]]
    assert [t.get_text() for t in ax.texts] == [" stop, resume"]
    plt.close(fig)
    assert sorted(p.name for p in plot(paths.root, tmp_path / "plots")) == [
        "kl_entropy.png", "overview.png", "reward.png", "staleness.png", "time.png"
    ]  # fmt: skip


def eval_record(model: str, dataset: str, k: int, greedy: float) -> dict:
    figures = {"mean_at_k": greedy / 2, "pass_at_k": greedy + 0.1} if k > 1 else {}
    return {"model": model, "dataset": dataset, "k": k, "problems": 9, "greedy_accuracy": greedy, **figures}


def test_an_eval_job_s_plot_shows_each_dataset_s_scores_across_its_models_in_order(tmp_path):
    paths = RunPaths(tmp_path / "eval-run")
    paths.create()
    paths.eval_results.parent.mkdir(parents=True, exist_ok=True)
    writer = JsonlWriter(paths.eval_results)
    models = ["sft", "rl-step-2", "rl"]
    for i, model in enumerate(models):
        writer.log(eval_record(model, "addition", 4, 0.2 * (i + 1)))
        writer.log(eval_record(model, "held-out", 1, 0.1 * (i + 1)))
    fig, ax = plt.subplots()
    eval_panel(ax, [r for r in read_jsonl(paths.eval_results) if r["dataset"] == "addition"])
    assert [line.get_label() for line in ax.lines] == ["greedy accuracy", "mean@4", "pass@4"]
    assert [t.get_text() for t in ax.get_xticklabels()] == models
    assert [float(y) for y in ax.lines[0].get_ydata()] == [0.2, 0.4, pytest.approx(0.6)]  # type: ignore[arg-type,union-attr]
    assert ax.get_title() == "addition (9 problems, k=4)"
    plt.close(fig)
    fig, ax = plt.subplots()
    eval_panel(ax, [r for r in read_jsonl(paths.eval_results) if r["dataset"] == "held-out"])
    assert [line.get_label() for line in ax.lines] == ["greedy accuracy"]  # k = 1: no sampled figures
    plt.close(fig)
    (written,) = plot(paths.root, tmp_path / "plots")  # an eval RUN_DIR: its one figure
    assert written.name == "eval.png" and written.read_bytes().startswith(b"\x89PNG")


def test_the_summary_s_plot_hint_names_the_interpreter_that_runs_and_runs_as_copied(tmp_path, monkeypatch):
    """The end-of-run `plots:` line names this interpreter (`.venv/bin/python` from the repository,
    where the package is installed), not a bare `python` that a shell without the venv lacks."""
    paths = RunPaths(tmp_path / "run")
    paths.create()
    JsonlWriter(paths.train_metrics).log({"step": 1, "loss": 0.1, "reward": 0.1, "entropy": 1.0, "staleness_mean": 0.0,
                                          "staleness_max": 0})  # fmt: skip
    monkeypatch.chdir(REPO)
    line = next(x for x in run_summary(paths, 4).splitlines() if x.startswith("plots:"))
    command = line.removeprefix("plots:").strip()
    inside = not os.path.relpath(sys.executable, REPO).startswith(os.pardir)
    expected = os.path.relpath(sys.executable, REPO) if inside else sys.executable
    assert command == f"{expected} -m relax_hpc.plot {paths.root}", line
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = "/usr/bin:/bin"  # a shell with no venv active
    out = subprocess.run(f"{command} --out {tmp_path / 'plots'}", shell=True, cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
