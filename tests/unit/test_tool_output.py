"""What the command-line tools show: `scale`'s help (what a user may type, nothing of argparse's
internals) and `plot`'s figures (axis labels, the run's stops and resumes marked)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt

from relax_hpc.metrics.jsonl import JsonlWriter
from relax_hpc.metrics.summary import step_records
from relax_hpc.paths import RunPaths
from relax_hpc.plot import mark, plot, reward, stops_and_resumes

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
