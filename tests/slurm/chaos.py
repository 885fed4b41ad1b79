"""Chaos on the test Slurm cluster: one run receives a seeded random schedule of faults, and what
it left in RUN_DIR must still be exact (tests/slurm/test_chaos.py runs a short schedule,
tools/bench/chaos.py the full one).

Each fault waits for a few new steps, strikes, and waits for training to go past the step it
struck at. Per fault it records the steps trained again (records past the checkpoint that
recovery dropped) and the time lost: from the fault to the first new step, less the median step.
Every process of the run is found by its command line (the cluster's nodes are this machine).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import psutil

from relax_hpc.ckpt.layout import read_trainer_state
from relax_hpc.config.load import read_frozen
from relax_hpc.data.prompts import load_prompts
from relax_hpc.exchange.spool import read_batch
from relax_hpc.fence import read_lease, refused_writes
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.paths import RunPaths
from relax_hpc.rollout.plan import BatchPlan
from tests.slurm.jobs import REPO, finished, job_id, job_state, slurm, submit, wait_until

HEALTH = (
    "launch.health.engine_timeout_s=6", "launch.health.driver_timeout_s=20", "launch.health.step_timeout_s=10",
    "launch.health.step_factor=3", "launch.health.restart_backoff_s=1", "launch.health.trainer_restarts=50",
    "rollout.max_engine_restarts=50", "launch.slurm.max_timeouts=1000",
)  # fmt: skip
# Every trained batch kept (the prompt check reads them); dynamic sampling is off by default.
RECOVERY_STEPS = 3
STEPS_PER_FAULT = 16
# Training goes on while an elastic engine job starts and registers (before its scancel): its steps.
JOIN_STEPS = 40
RUN = ("ckpt.every_steps=2", "ckpt.keep_trained_batches=true", "rollout.prompts_per_step=8", "rollout.eval_every=0")


def role_pids(run_dir: Path, role: str) -> list[int]:
    """Live processes of a role of this run: trainer (the ranks), driver, engine-K, or any."""
    marks = {
        "trainer": "relax_hpc.trainer.main",
        "driver": "relax_hpc.rollout.driver",
        "any": "",
    }
    mark = marks.get(role, f"--engine-id {role}")
    out = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        line = " ".join(proc.info["cmdline"] or [])
        if proc.info["status"] == psutil.STATUS_ZOMBIE or f"--run-dir {run_dir}" not in line or mark not in line:
            continue
        if role != "any" and ("torch.distributed.run" in line or Path(proc.info["cmdline"][0]).name == "srun"):
            continue  # the role's own processes: not torchrun's agent, not the step's srun client
        out.append(proc.pid)
    return sorted(out)


@dataclass
class Chaos:
    run_dir: Path
    rng: random.Random
    nodes: int = 4
    job: str = ""
    faults: list[dict[str, Any]] = field(default_factory=list)  # each fault recovered from
    injected: int = 0  # faults struck (a fault never recovered from stops the schedule)
    latest_seen: list[int] = field(default_factory=list)  # the checkpoint `latest` named, in time
    high: int = 0  # the highest step seen in the record (recovery may drop it later)
    superseded_ended_s: list[float] = field(default_factory=list)  # SIGCONT -> the old process gone
    # Each process continued after its replacement: role, pids, when its successor was seen
    superseded: list[dict[str, Any]] = field(default_factory=list)
    elastic_job: str = ""  # the elastic engine job a fault is about to cancel

    def steps(self) -> list[dict[str, Any]]:
        return [r for r in read_jsonl(RunPaths(self.run_dir).train_metrics) if "loss" in r]

    def last_step(self) -> int:
        self._watch_checkpoint()
        steps = self.steps()
        last = steps[-1]["step"] if steps else 0
        self.high = max(self.high, last)
        return last

    def start_after(self, t: float) -> dict[str, Any] | None:
        """The trainer's first start record after time `t`."""
        self.last_step()
        starts = [r for r in read_jsonl(RunPaths(self.run_dir).train_metrics) if r.get("event") == "start"]
        return next((r for r in starts if r["time"] > t), None)

    def _watch_checkpoint(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # `latest` moving at this moment
            state = read_trainer_state(RunPaths(self.run_dir).ckpt)
            step = state["step"] if state else 0
            if not self.latest_seen or self.latest_seen[-1] != step:
                self.latest_seen.append(step)

    def events_since(self, kind: str, t: float) -> list[dict[str, Any]]:
        records = read_jsonl(RunPaths(self.run_dir).events_metrics)
        return [e for e in records if e.get("event") == kind and e["time"] > t]

    def strike(self, kind: str) -> None:
        """Wait 1-3 new steps, inject `kind`, wait for training past the step it struck at."""
        before = wait_until(self.last_step, 300, "training to start", every=0.1)
        target = before + self.rng.randint(1, 3)
        wait_until(lambda: self.last_step() >= target, 300, f"step {target} before {kind}", every=0.1)
        if kind in PREPARE:  # what the fault needs, before the clock starts
            PREPARE[kind](self)
        at_step, injected = self.last_step(), time.time()
        self.high = at_step
        self.injected += 1
        FAULTS[kind](self)
        since, retrained = injected, 0
        if kind in RESTART_THE_RUN:  # recovered: a step trained after the next start
            start = wait_until(lambda: self.start_after(injected), 600, f"the start after {kind}", every=0.1)
            since, retrained = start["time"], max(0, self.high - start["step"])
        # Recovered: RECOVERY_STEPS steps past the fault (a hung driver shows only once the batches
        # it had published are used up). Lost: that span less those steps at the median step time.
        goal = at_step + RECOVERY_STEPS
        new = lambda: next((r for r in self.steps() if r["time"] > since and r["step"] >= goal), None)  # noqa: E731
        recovered = wait_until(new, 600, f"step {goal} after {kind}", every=0.1)
        steps = self.steps()
        median = statistics.median(b["time"] - a["time"] for a, b in itertools.pairwise(steps))
        lost = recovered["time"] - injected - median * RECOVERY_STEPS
        self.faults.append(
            {"kind": kind, "at_step": at_step, "retrained": retrained, "time_lost_s": round(max(0.0, lost), 2),
             "recovered": recovered["step"] >= goal}
        )  # fmt: skip

    def hang(self, role: str) -> None:
        """SIGSTOP, wait until the launcher calls it hung, let it restart, then SIGCONT the old one."""
        pids = role_pids(self.run_dir, role)
        assert pids, f"no process of {role}"
        t = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: any(e["role"] == role for e in self.events_since("role_hung", t)), 300, f"{role} hung")
        wait_until(lambda: set(role_pids(self.run_dir, role)) - set(pids), 300, f"{role} replaced", every=0.2)
        self.superseded.append({"role": role, "pids": pids, "successor_at": time.time()})
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        # Superseded, continued: it must end at once, without writing (not at the job's end).
        continued = time.monotonic()
        gone = lambda: not set(pids) & set(role_pids(self.run_dir, role))  # noqa: E731
        wait_until(gone, 30, f"the continued old {role} to end", every=0.1)
        self.superseded_ended_s.append(round(time.monotonic() - continued, 2))

    def kill(self, role: str) -> None:
        pids = role_pids(self.run_dir, role)
        assert pids, f"no process of {role}"
        os.kill(max(pids), signal.SIGKILL)  # a trainer: one rank (torchrun ends the other)


def _engine(chaos: Chaos) -> str:
    return f"engine-{chaos.rng.randint(0, 1)}"


def _preempt(chaos: Chaos) -> None:
    slurm("sbatch", "-p", "high", f"-N{chaos.nodes}", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 3")


def _node_crash(chaos: Chaos) -> None:
    slurm("scancel", "--full", "--signal=KILL", chaos.job)
    wait_until(lambda: job_state(chaos.job) not in ("RUNNING", "COMPLETING"), 60, "the killed job to end")
    slurm("scontrol", "requeue", chaos.job)


def _op(chaos: Chaos) -> str:
    """The elastic operation of the fault under way (named after its place in the schedule)."""
    return f"el{len(chaos.faults)}"


def _elastic_join(chaos: Chaos) -> None:
    """`scale out` one engine in a Slurm job of its own; wait until the driver uses it (a batch
    from more engines than the run's own), so that the cancel strikes an engine at work."""
    paths, asked = RunPaths(chaos.run_dir), time.time()
    argv = [sys.executable, "-m", "relax_hpc.scale", str(chaos.run_dir), "out", "--engines", "1", "--id", _op(chaos)]
    said = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
    chaos.elastic_job = said.split("job ")[1].split(";")[0]
    own = read_frozen(paths.config).rollout.num_engines
    used = lambda: any(r["time"] > asked and r.get("engines", 0) > own for r in read_jsonl(paths.rollout_metrics))  # noqa: E731
    wait_until(used, 300, f"the driver to use the elastic engine {_op(chaos)}-0", every=0.2)


def _elastic_cancel(chaos: Chaos) -> None:
    """scancel the elastic job mid-run: it ends, and so do its engine's processes."""
    job, op = chaos.elastic_job, _op(chaos)
    slurm("scancel", job)
    wait_until(lambda: finished(job), 60, f"the cancelled elastic job {job} to end", every=0.2)
    wait_until(lambda: not role_pids(chaos.run_dir, f"{op}-0"), 30, f"the engine of job {job} to end", every=0.2)


FAULTS: dict[str, Callable[[Chaos], object]] = {
    "kill -9 trainer rank": lambda c: c.kill("trainer"),
    "kill -9 driver": lambda c: c.kill("driver"),
    "kill -9 engine": lambda c: c.kill(_engine(c)),
    "SIGSTOP/SIGCONT engine": lambda c: c.hang(_engine(c)),
    "SIGSTOP/SIGCONT driver": lambda c: c.hang("driver"),
    "SIGSTOP/SIGCONT trainer": lambda c: c.hang("trainer"),
    "time limit notice (USR2)": lambda c: slurm("scancel", "--batch", "--signal=USR2", c.job),
    "scontrol requeue": lambda c: slurm("scontrol", "requeue", c.job),
    "partition preemption": _preempt,
    "node crash (kill -9 all, requeue)": _node_crash,
    "scancel elastic engine job": _elastic_cancel,
}
PREPARE: dict[str, Callable[[Chaos], None]] = {"scancel elastic engine job": _elastic_join}
# Faults after which the run starts again from its checkpoint (in the allocation or the next one).
RESTART_THE_RUN = {
    "kill -9 trainer rank", "SIGSTOP/SIGCONT trainer", "time limit notice (USR2)", "scontrol requeue",
    "partition preemption", "node crash (kill -9 all, requeue)",
}  # fmt: skip


def schedule(seed: int, count: int, kinds: list[str]) -> list[str]:
    """Every kind once, the rest drawn at random, in a random order: a pure function of the seed."""
    rng = random.Random(seed)
    chosen = [*kinds, *(rng.choice(kinds) for _ in range(max(0, count - len(kinds))))]
    rng.shuffle(chosen)
    return chosen


def total_steps(faults: list[str]) -> int:
    """Steps per fault: the wait before it (1-3), its recovery, and the training that goes on while
    a hung engine is detected and replaced (the other engine serves): the run must outlast them."""
    return STEPS_PER_FAULT * len(faults) + 4 + JOIN_STEPS * sum(kind in PREPARE for kind in faults)


def run_schedule(run_dir: Path, seed: int, faults: list[str], nodes: int = 4) -> Chaos:
    """Submit the run, inject every fault, wait for the end; returns what happened."""
    out = submit(run_dir, f"trainer.total_steps={total_steps(faults)}", *RUN, *HEALTH)
    assert out.returncode == 0, out.stdout + out.stderr
    chaos = Chaos(run_dir, random.Random(seed), nodes, job_id(run_dir))
    for kind in faults:
        chaos.strike(kind)
    wait_until(lambda: job_state(chaos.job).split()[0] not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED"),
               900, "the job to end", every=0.5)  # fmt: skip
    chaos.last_step()
    return chaos


def verify(chaos: Chaos) -> dict[str, Any]:
    """What must hold after any schedule; returns the counts the report shows."""
    run_dir, paths = chaos.run_dir, RunPaths(chaos.run_dir)
    cfg = read_frozen(paths.config)
    total = cfg.trainer.total_steps
    assert job_state(chaos.job).split()[0] == "COMPLETED", job_state(chaos.job)
    refused = refused_writes(run_dir)
    _only_superseded_refused(refused, read_lease(run_dir))
    for process in chaos.superseded:
        _wrote_nothing_after_its_successor(paths, process)
    steps = [r["step"] for r in chaos.steps()]
    assert steps == list(range(1, total + 1)), f"steps not exactly once: {steps}"
    assert chaos.latest_seen == sorted(chaos.latest_seen), f"checkpoints went back: {chaos.latest_seen}"
    _every_prompt_once(paths, cfg)
    left = role_pids(run_dir, "any")
    assert not left, f"processes of the run alive after its end: {left}"
    return {"steps": total, "refused_writes": len(refused), "superseded_ended_s": chaos.superseded_ended_s}


def _only_superseded_refused(refused: list[dict[str, Any]], lease: dict[str, Any]) -> None:
    """A refusal names a grant older than its role's last: a current process is never fenced."""
    last = lease.get("roles", {})
    wrong = [r for r in refused if r["serial"] >= last.get(r["role"], float("inf"))]
    assert not wrong, f"writes of current processes refused: {wrong}"


def _wrote_nothing_after_its_successor(paths: RunPaths, process: dict[str, Any]) -> None:
    """No batch anywhere in the spool and no heartbeat left by a superseded process was written
    after its successor was seen (its own refusals, in fence/refused/, are not writes)."""
    pids, since = set(process["pids"]), process["successor_at"]
    for path in paths.spool.rglob("*.h5"):
        with h5py.File(path, "r", locking=False) as f:
            pid, created = f.attrs.get("writer_pid"), float(f.attrs["created"])
        assert pid not in pids or created < since, f"{path.name}: written by superseded {process}"
    for beat in (paths.root / "health").glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(beat.read_text())
            assert record.get("pid") not in pids or record["time"] < since, f"{beat.name}: by superseded {process}"


def _every_prompt_once(paths: RunPaths, cfg: Any) -> None:
    """Dynamic sampling off: batch b holds positions b*P.. of the prompt order; every batch up to
    the last step's was trained whole by exactly one step, none skipped or set aside."""
    d = cfg.data
    plan = BatchPlan(cfg, load_prompts(d.path, d.prompt_key, d.answer_key, d.media))
    seen: list[int] = []
    for manifest in sorted(paths.spool.glob("claimed/step-*/*.json")):
        entry = json.loads(manifest.read_text())
        batch = read_batch(manifest.with_suffix(""))
        assert not entry["stale"], f"{manifest}: samples set aside (prompts skipped)"
        assert sorted(entry["trained"]) == list(range(batch.num_samples))
        prompts = batch.prompt_index[:: cfg.rollout.group_size].tolist()  # prompt-major groups
        assert prompts == plan.prompts(batch.seq, 0), f"batch {batch.seq}: not its prompts"
        seen.append(batch.seq)
    assert sorted(seen) == list(range(len(seen))), f"batches skipped or trained twice: {sorted(seen)}"


def summary(chaos: Chaos, counts: dict[str, Any], seconds: float) -> dict[str, Any]:
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for f in chaos.faults:
        by_kind.setdefault(f["kind"], []).append(f)
    return {
        "faults_injected": chaos.injected,
        "faults_survived": sum(f["recovered"] for f in chaos.faults),  # verify() passed too
        "steps_retrained": sum(f["retrained"] for f in chaos.faults),
        "time_lost_median_s": {k: statistics.median(f["time_lost_s"] for f in fs) for k, fs in sorted(by_kind.items())},
        "per_kind": {k: len(fs) for k, fs in sorted(by_kind.items())},
        "checkpoints_seen": chaos.latest_seen,
        "wall_s": round(seconds, 1),
        **counts,
        "faults": chaos.faults,
    }
