"""Ending a role that runs as a Slurm job step.

Killing a role's `srun` ends the client only: the step (its slurmstepd, and every process the
role started, stopped or not) lives on, and Slurm keeps listing it in `squeue -s`. A restarted
role beside its predecessor then shares its rendezvous, its GPUs and its RUN_DIR. So ending a
role on Slurm cancels the step itself by id (`scancel JOB.STEP`, which SIGKILLs every process
of the step on every node, SIGSTOPped ones too), waits until Slurm no longer lists it, and
escalates once (`scancel --signal=KILL`) before giving up, all within a bound: two rounds of
ROUND_S, after the launcher's at most PROCESS_WAIT_S for the role's own processes (Role.kill), so
a step Slurm never drops is given up within a minute.

Steps are found by name (`--job-name=<launch.slurm.job_name>:<role>`, commands.step_name) among
the steps of the job's components: a heterogeneous job's second component has an id of its own
(`squeue -h -j JOB -o %A` lists them), and its steps are listed under that id.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Collection
from dataclasses import dataclass

# How long each of the two rounds (cancel, then SIGKILL) waits for Slurm to drop the step: a
# cancelled step is gone in about 2 s; KillWait and an unkillable process (a stuck filesystem)
# are what the bound is for.
ROUND_S = 25.0
PROCESS_WAIT_S = 10.0  # for the role's own processes to be reaped after SIGKILL, before the rounds


def _squeue(*argv: str) -> list[str]:
    """squeue's lines; none when it fails (a job that ended has no steps to end)."""
    out = subprocess.run(["squeue", "-h", *argv], capture_output=True, text=True, check=False, timeout=60)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def components(job_id: str) -> str:
    """The ids of the job's components, comma-separated (a plain job: its own id)."""
    return ",".join(_squeue("-j", job_id, "-o", "%A")) or job_id


def step_ids(job_components: str, names: Collection[str]) -> list[str]:
    """`JOB.STEP` of every step of these names that Slurm lists among the components' steps."""
    lines = _squeue("-s", "-j", job_components, "-o", "%i|%j")
    return [step for step, _, name in (line.partition("|") for line in lines) if name in names]


def end_steps(job_id: str, names: Collection[str], round_s: float = ROUND_S) -> list[str]:
    """Cancel every step of job `job_id` named one of `names` and wait until Slurm drops them;
    returns the ids of steps still listed after both rounds (empty: all ended)."""
    if not names:
        return []
    job_components = components(job_id)
    left = step_ids(job_components, names)
    for signal_args in ([], ["--signal=KILL"]):
        if not left:
            break
        subprocess.run(["scancel", *signal_args, *left], capture_output=True, check=False, timeout=60)
        deadline = time.monotonic() + round_s
        while left and time.monotonic() < deadline:
            time.sleep(0.25)
            left = [step for step in step_ids(job_components, names) if step in left]
    return left


@dataclass(frozen=True)
class JobStep:
    """The job steps named `name` in Slurm job `job_id`: a role's current and leftover steps."""

    job_id: str
    name: str
    round_s: float = ROUND_S

    def end(self) -> list[str]:
        return end_steps(self.job_id, [self.name], self.round_s)
