"""Inside a Slurm allocation: every role as a job step, and a requeue on a time limit or preemption.

Two ways in, one behaviour:

    sbatch recipes    python -m relax_hpc.submit --config X.yaml --in-allocation   (run_in_allocation)
    submit, slurm     submitit runs SlurmRun(RUN_DIR) in the batch shell           (SlurmRun.__call__)

USR2 (or USR1) is the pre-timeout signal (`--signal=B:USR2@N`) or a preemption notice (Slurm's
preempt_send_user_signal): the trainer finishes its step and checkpoints, the roles stop, and the
job requeues itself; the next start recovers RUN_DIR and resumes. SIGTERM means Slurm is ending
the job now (scancel, `scontrol requeue`, a preemption's grace time over): the trainer
checkpoints if it has the time, and Slurm decides whether the job comes back. A job killed
without time to checkpoint resumes from its previous checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

from relax_hpc.config.load import read_frozen
from relax_hpc.config.schema import JobConfig
from relax_hpc.launch.allocation import Allocation, AllocationError
from relax_hpc.launch.badnodes import Exclusion, apply_exclusion, failed_nodes, job_fields, plan_exclusion, scontrol
from relax_hpc.launch.commands import step_commands
from relax_hpc.launch.guard import stop_requeueing
from relax_hpc.launch.supervisor import EXIT_COMPLETED, EXIT_STOPPED, EXIT_SUPERSEDED, Supervisor
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.paths import RunPaths

log = logging.getLogger("relax_hpc.launch")
NOTICE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def check_shared_run_dir(paths: RunPaths, alloc: Allocation) -> None:
    """Every node must see the same RUN_DIR: write a probe here, read it on every node."""
    nodes = [n for group in alloc.groups for n in group]
    if len(nodes) < 2:
        return
    probe = paths.probe(uuid.uuid4().hex)
    probe.write_text(f"{alloc.job_id}\n")
    try:
        for g, group in enumerate(alloc.groups):
            argv = ["srun", "--overlap", f"--nodes={len(group)}", f"--ntasks={len(group)}", "--ntasks-per-node=1",
                    f"--nodelist={','.join(group)}", "cat", str(probe)]  # fmt: skip
            if alloc.heterogeneous:
                argv.insert(1, f"--het-group={g}")
            out = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120)
            if out.returncode != 0 or out.stdout.split() != [alloc.job_id] * len(group):
                raise AllocationError(
                    f"run.dir {paths.root} is not shared by all nodes of job {alloc.job_id} (a node could not "
                    f"read {probe.name}; srun exit {out.returncode}: {(out.stdout + out.stderr).strip()[-300:]}); "
                    "put RUN_DIR on a shared filesystem"
                )
    finally:
        probe.unlink(missing_ok=True)


def requeue(job_id: str, supervisor: Supervisor, plan: Exclusion | None) -> None:
    """Requeue this job, then give it its exclude list. A requeued job stays COMPLETING, and
    cannot start again, until its batch script (this process) has exited, so the list lands
    before the next start (measured on the test cluster; docs/DESIGN.md, "Bad nodes"). A held
    requeue is no safer and worse on a kill: a launcher killed before its release leaves the job
    held for good."""
    requeued = scontrol("requeue", job_id)
    if requeued.returncode:
        raise RuntimeError(f"scontrol requeue {job_id} failed: {requeued.stderr.strip()}")
    print(f"requeued job {job_id}: the next start resumes from the checkpoint", flush=True)
    leave_out_bad_nodes(supervisor, plan)


def may_requeue(cfg: JobConfig, paths: RunPaths, supervisor: Supervisor) -> bool:
    """False (with the reason in events.jsonl and the job's output) once the no-progress guard
    says this job has spent enough allocations without a step."""
    why = stop_requeueing(cfg, paths, os.environ.get("SLURM_JOB_ID"))
    if why is None:
        return True
    supervisor.events.log({"event": "no_progress", "why": why})
    supervisor.say(f"{why}\n")
    return False


def preempting(job_id: str) -> bool:
    """Whether Slurm is preempting the job's allocation: its PreemptTime is set from the moment
    it picks the job to preempt (the notice, then GraceTime) until the job is requeued."""
    return job_fields(job_id).get("PreemptTime", "None") not in ("None", "Unknown")


def note_preemption(supervisor: Supervisor) -> None:
    """At a notice or a SIGTERM: record a preemption of this allocation (`preempted`), which the
    no-progress guard does not count (an allocation taken away is no sign the run cannot progress)."""
    job = os.environ.get("SLURM_JOB_ID")
    if job and preempting(job):
        restart_count = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        supervisor.events.log({"event": "preempted", "slurm_job_id": job, "slurm_restart_count": restart_count})


def plan_bad_nodes(supervisor: Supervisor) -> Exclusion | None:
    """Which bad nodes the job's next start leaves out, asked while the job still runs."""
    job, threshold = supervisor.slurm_job, supervisor.cfg.launch.slurm.bad_node_failures
    return plan_exclusion(supervisor.paths, job, threshold) if job else None


def leave_out_bad_nodes(supervisor: Supervisor, plan: Exclusion | None) -> None:
    """Once the job is requeued (pending again), its bad nodes become its exclude list."""
    if plan:
        apply_exclusion(plan, supervisor.events, lambda line: supervisor.say(line + "\n"))


def _supervisor(cfg: JobConfig, paths: RunPaths) -> Supervisor:
    alloc = Allocation.from_env()
    check_shared_run_dir(paths, alloc)
    supervisor = Supervisor(cfg, paths, lambda: step_commands(cfg, paths, alloc), slurm_job=alloc.job_id)
    note_failed_nodes(supervisor, alloc)
    return supervisor


def note_failed_nodes(supervisor: Supervisor, alloc: Allocation) -> None:
    """A NODE_FAIL ends the whole job, this launcher with it, before any role's exit is recorded:
    the next start records the previous allocation's nodes Slurm holds not responding (launch.badnodes)."""
    restart_count = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    nodes = [node for group in alloc.groups for node in group]
    for event in failed_nodes(read_jsonl(supervisor.paths.events_metrics), alloc.job_id, restart_count, nodes):
        if event["event"] == "node_failed":
            supervisor.say(f"node {event['node']} failed under the job's previous allocation ({event['cause']})\n")
        supervisor.events.log(event)


def run_in_allocation(cfg: JobConfig, paths: RunPaths) -> int:
    """The sbatch path: this process is the batch script (`exec python -m relax_hpc.submit ...`)."""
    supervisor = _supervisor(cfg, paths)
    notice = threading.Event()

    def on_notice(signum: int, _frame: object) -> None:
        notice.set()
        note_preemption(supervisor)
        supervisor.request_stop(f"{signal.Signals(signum).name} (time limit or preemption ahead)")

    for sig in NOTICE_SIGNALS:
        signal.signal(sig, on_notice)
    signal.signal(signal.SIGTERM, lambda *_: on_sigterm(supervisor))
    code = supervisor.run()
    plan = plan_bad_nodes(supervisor) if code == EXIT_STOPPED else None
    if code == EXIT_STOPPED and notice.is_set() and may_requeue(cfg, paths, supervisor):
        requeue(os.environ["SLURM_JOB_ID"], supervisor, plan)
    elif code == EXIT_STOPPED:  # requeued by Slurm (a preemption): pending now, or running again
        leave_out_bad_nodes(supervisor, plan)
    return code


def on_sigterm(supervisor: Supervisor) -> None:
    """Slurm ends the job now (scancel, a requeue, a preemption without notice or past its grace)."""
    note_preemption(supervisor)
    supervisor.request_stop("SIGTERM (Slurm is ending the job)")


def _one_copy_of_submitit_messages() -> None:
    """submitit logs to stdout (everything) and to stderr (warnings); its jobs here send stderr to
    the same file (stderr_to_stdout), where every warning would appear twice."""
    logger = logging.getLogger("submitit")
    for handler in list(logger.handlers):
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr:
            logger.removeHandler(handler)


class SlurmRun:
    """What `submit` hands to submitit: runs the supervisor in the allocation, and follows
    submitit's checkpoint protocol, so that submitit's USR2 handler stops the run with a
    checkpoint and requeues the job (its timeout accounting included)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self._supervisor: Supervisor | None = None
        self._thread: threading.Thread | None = None
        self._code = EXIT_STOPPED
        self._bad_nodes: Exclusion | None = None  # planned before submitit requeues the job

    def __call__(self) -> str:
        _one_copy_of_submitit_messages()
        paths = RunPaths(Path(self.run_dir))
        supervisor = self._supervisor = _supervisor(read_frozen(paths.config), paths)
        # submitit ignores SIGTERM; here it means Slurm ends the job now: checkpoint if possible.
        signal.signal(signal.SIGTERM, lambda *_: on_sigterm(supervisor))
        self._thread = threading.Thread(target=self._run, name="supervisor")
        self._thread.start()
        while self._thread.is_alive():
            self._thread.join(0.5)  # the main thread stays free to run submitit's signal handler
        if self._code == EXIT_COMPLETED:
            return f"completed: {self.run_dir}"
        if self._code == EXIT_SUPERSEDED:
            sys.exit(EXIT_SUPERSEDED)  # the run has a new owner: no requeue, no result of this job's
        if self._code == EXIT_STOPPED:
            # submitit's USR2 handler has requeued the job by now (after checkpoint() planned it)
            leave_out_bad_nodes(supervisor, self._bad_nodes or plan_bad_nodes(supervisor))
            # Slurm is cancelling or requeueing this job: leave no result file behind, so that
            # submitit reports the job's real state instead of a success.
            sys.exit(EXIT_STOPPED)
        raise RuntimeError(f"relax_hpc run failed; see {self.run_dir}/logs/")

    def _run(self) -> None:
        assert self._supervisor is not None, "__call__ builds the supervisor before starting this thread"
        self._code = self._supervisor.run()

    def checkpoint(self) -> object:
        """Called by submitit on USR2: stop with a checkpoint, then let submitit requeue."""
        import submitit

        if self._supervisor is not None and self._thread is not None:
            note_preemption(self._supervisor)
            self._supervisor.request_stop("USR2 (time limit or preemption ahead)")
            self._thread.join()
            supervisor = self._supervisor
            if self._code == EXIT_SUPERSEDED or not may_requeue(supervisor.cfg, supervisor.paths, supervisor):
                return None  # submitit then ends the job instead of requeueing it
            self._bad_nodes = plan_bad_nodes(supervisor)
        return submitit.helpers.DelayedSubmission(SlurmRun(self.run_dir))

    def __getstate__(self) -> dict:
        return {"run_dir": self.run_dir}

    def __setstate__(self, state: dict) -> None:
        SlurmRun.__init__(self, state["run_dir"])
