"""One owner per run: at most one live Slurm job, or one live local launcher, works a RUN_DIR.

Slurm: `submit` takes RUN_DIR/slurm/job_id.claim with an exclusive create (atomic on every shared
filesystem, where an flock may stay local to a login node), then asks Slurm about the run's job;
a queued or running one refuses the submission, naming the job, unless `--take-over` cancels it
and waits until it has left. The claim ends once the new job id is recorded, so a submission
started beside another waits for it and then finds its job. A claim whose process died (on this
host) or that is older than CLAIM_STALE_S is taken over.

Local: the launcher holds an flock on RUN_DIR/fence/launcher for its whole life (the kernel drops
it when the process ends, SIGKILL included); a second launcher on the same RUN_DIR is refused,
naming the live one's pid (stopping it is the user's: Ctrl-C there checkpoints).

A launcher that lost the run anyway (an sbatch recipe started twice) stops when its roles exit as
superseded: the supervisor checks the lease (relax_hpc/fence.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from relax_hpc.config.load import ConfigError
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.paths import RunPaths

# States a job is done in (squeue keeps showing them until MinJobAge); any other is live.
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
         "OUT_OF_MEMORY", "REVOKED"}  # fmt: skip
CLAIM_STALE_S = 600.0  # a submission holds its claim for an sbatch call (at most 120 s) and a few writes
CLAIM_WAIT_S = 300.0  # how long a submission waits for another's claim
LEAVE_WAIT_S = 300.0  # how long --take-over waits for a cancelled job to leave
POLL_S = 0.2


def job_states(job: str) -> list[str]:
    """Slurm's states of `job` (one per component of a heterogeneous job; [] once forgotten)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, check=False,
                             timeout=60)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ConfigError(f"squeue -j {job} did not answer in 60 s; submit again when the controller answers") from None
    if out.returncode == 0:
        return out.stdout.split()
    if "Invalid job id" in out.stderr:
        return []
    raise ConfigError(f"cannot ask Slurm whether job {job} still runs: {out.stderr.strip()}")


def live_state(job: str) -> str | None:
    """The state of `job` while it is queued or running (None: it has ended)."""
    return next((s for s in job_states(job) if s not in ENDED), None)


def recorded_jobs(paths: RunPaths) -> list[str]:
    """The run's jobs: the one `submit` recorded, and that of the launcher's last start (an sbatch recipe)."""
    jobs = [paths.slurm_job_id.read_text().strip()] if paths.slurm_job_id.is_file() else []
    starts = [e for e in read_jsonl(paths.events_metrics) if e.get("event") == "start" and e.get("slurm_job_id")]
    if starts and starts[-1]["slurm_job_id"] not in jobs:
        jobs.append(str(starts[-1]["slurm_job_id"]))
    return jobs


def live_job(paths: RunPaths) -> tuple[str, str] | None:
    """(job id, state) of the run's queued or running job, if any."""
    for job in recorded_jobs(paths):
        state = live_state(job)
        if state:
            return job, state
    return None


def _claim_stale(claim: Path) -> bool:
    try:
        owner = json.loads(claim.read_text())
    except (OSError, ValueError):
        return False  # being written (or just removed): not stale
    if owner.get("host") == socket.gethostname() and not psutil.pid_exists(int(owner.get("pid", 0))):
        return True
    return time.time() - float(owner.get("time", 0)) > CLAIM_STALE_S


def take_claim(claim: Path) -> bool:
    """Create `claim` exclusively; a stale one is first moved aside (one mover wins the rename)."""
    claim.parent.mkdir(parents=True, exist_ok=True)
    if claim.exists() and _claim_stale(claim):
        aside = claim.with_name(f"{claim.name}.stale-{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            claim.rename(aside)
            aside.unlink()
    try:
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}).encode())
    finally:
        os.close(fd)
    return True


@contextlib.contextmanager
def submission_claim(paths: RunPaths, take_over: bool) -> Iterator[None]:
    """Hold the run's submission claim with no live job left: refuse (ConfigError) when the run's
    job is queued or running, or cancel it first with `take_over`."""
    claim = paths.slurm_claim
    deadline = time.monotonic() + CLAIM_WAIT_S
    while not take_claim(claim):
        if time.monotonic() > deadline:
            raise ConfigError(f"another submission of {paths.root} holds {claim} since {CLAIM_WAIT_S:.0f} s; "
                              "remove it if no submission is under way")  # fmt: skip
        time.sleep(POLL_S)
    try:
        live = live_job(paths)
        if live and not take_over:
            job, state = live
            raise ConfigError(
                f"run.dir {paths.root} is run by job {job} ({state}); wait for it, `scancel {job}`, "
                "or submit with --take-over to cancel it and start this submission"
            )
        if live:
            cancel_and_wait(*live)
        yield
    finally:
        claim.unlink(missing_ok=True)


def cancel_and_wait(job: str, state: str) -> None:
    """`--take-over`: cancel `job` (SIGTERM: its trainer checkpoints) and wait until it has left."""
    print(f"taking over: cancelling job {job} ({state}) and waiting until it has left", flush=True)
    subprocess.run(["scancel", job], capture_output=True, text=True, check=False, timeout=60)
    deadline = time.monotonic() + LEAVE_WAIT_S
    while live_state(job) is not None:
        if time.monotonic() > deadline:
            raise ConfigError(f"job {job} was cancelled but Slurm still lists it after {LEAVE_WAIT_S:.0f} s; "
                              "submit again once it has left")  # fmt: skip
        time.sleep(1.0)


def hold_local_launcher(paths: RunPaths) -> int:
    """Make this process the run's only local launcher for its life: the flock's descriptor, kept
    open (closing it lets another launcher in); a live launcher refuses this one."""
    lock = paths.launcher_lock
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        held = _flock(fd)
    except OSError as e:  # a filesystem that takes no locks (some NFS mounts): the lease still fences
        print(f"warning: cannot lock {lock} ({e.strerror}): a second launcher on {paths.root} is not refused",
              file=sys.stderr)  # fmt: skip
        return fd
    if not held:
        os.close(fd)
        pid = _holder(lock)
        raise ConfigError(
            f"run.dir {paths.root} is run by a live launcher (pid {pid}); stop it first (Ctrl-C there, "
            f"or kill -INT {pid}), then start this one"
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def _holder(lock: Path) -> int:
    text = lock.read_text().strip()
    return int(text) if text.isdigit() else 0
