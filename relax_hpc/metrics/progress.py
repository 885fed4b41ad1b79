"""The launcher's live progress line, built from the roles' metric files."""

from __future__ import annotations

import time
from collections import deque
from typing import TextIO

from relax_hpc.metrics.jsonl import JsonlFollower
from relax_hpc.paths import RunPaths


class Progress:
    """step, reward, greedy accuracy, trained samples/s, staleness, engines, elapsed time.

    On a terminal the line is redrawn in place; otherwise (a log file, a Slurm output file) a full
    line is printed every `log_every_s` seconds.
    """

    def __init__(self, paths: RunPaths, total_steps: int, out: TextIO, log_every_s: float):
        self.train = JsonlFollower(paths.train_metrics)
        self.evals = JsonlFollower(paths.eval_metrics)
        self.total = total_steps
        self.out = out
        self.tty = out.isatty()
        self.log_every_s = log_every_s
        self.started = time.monotonic()
        self.last_print = 0.0
        self.recent: deque[tuple[float, int]] = deque(maxlen=20)  # (time, samples) per step
        self.last_step: dict = {}
        self.last_eval: dict = {}
        self.since = time.time()
        self.trainer_end: dict | None = None  # the trainer's `end` record of this start, once written
        self.steps_this_start = 0  # trained steps recorded since this start

    def line(self, engines_up: int, engines_total: int) -> str:
        for record in self.train.new_records():
            if "step" in record and "samples" in record:  # a step of either kind (start and end have none)
                self.last_step = record
                if record["time"] >= self.since:  # rates from this start: a restart's gap is no step
                    self.recent.append((record["time"], record["samples"]))
                    self.steps_this_start += 1
            elif record.get("event") == "end" and record["time"] >= self.since:
                self.trainer_end = record
        for record in self.evals.new_records():
            self.last_eval = record
        s = self.last_step
        rate = 0.0
        if len(self.recent) >= 2:
            span = self.recent[-1][0] - self.recent[0][0]
            rate = sum(n for _, n in list(self.recent)[1:]) / span if span > 0 else 0.0
        elapsed = int(time.monotonic() - self.started)
        parts = [
            f"step {s.get('step', 0)}/{self.total}",
            f"reward {s['reward']:.3f}" if "reward" in s else f"loss {s['loss']:.4f}" if s else "reward -",
            f"greedy {self.last_eval['greedy_accuracy']:.2f}@v{self.last_eval['version']}"
            if self.last_eval
            else "greedy -",
            f"{rate:.0f} samples/s",
            f"staleness {s['staleness_mean']:.2f}" if "staleness_mean" in s else "staleness -",
            f"engines {engines_up}/{engines_total}",
            f"{elapsed // 3600:d}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}",
        ]
        return " | ".join(parts)

    def show(self, engines_up: int, engines_total: int, force: bool = False) -> None:
        text = self.line(engines_up, engines_total)
        now = time.monotonic()
        if self.tty:
            self.out.write("\r\033[K" + text)
        elif force or now - self.last_print >= self.log_every_s:
            self.out.write(text + "\n")
            self.last_print = now
        self.out.flush()

    def finish(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()
