"""The supervisor: starts every role (relax_hpc.launch.commands), watches them, and ends the run.

The same supervisor runs the `local` executor (roles are subprocesses of this machine) and the
inside of a Slurm allocation (roles are `srun` job steps). Each role's output goes to
RUN_DIR/logs/<start>/<role>.log. A dead engine is restarted (its prompts are re-issued by the
driver, and the trainer pushes the current weights to it); a dead driver is restarted (it resumes
from the spool). `request_stop()` asks the trainer to checkpoint and stop. Exit status: 0 when
training completed, 75 when it stopped early with a checkpoint (running again resumes), 1 on
failure.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import psutil

from relax_hpc.config.schema import JobConfig
from relax_hpc.fence import EXIT_FENCED, Lease, refused_writes
from relax_hpc.launch.badnodes import newly_bad, node_fault
from relax_hpc.launch.causes import exit_cause, no_space
from relax_hpc.launch.commands import step_name
from relax_hpc.launch.cputime import CountedPopen, self_cpu_s, tree_cpu_s
from relax_hpc.launch.forkserver import ForkedProcess, ForkServer, ForkServerError, StartAbandoned, forkable
from relax_hpc.launch.gpus import NO_GPU, span, visible_gpu_count
from relax_hpc.launch.health import HealthMonitor
from relax_hpc.launch.notify import Notifier
from relax_hpc.launch.recover import LAUNCHER_STOP, recover
from relax_hpc.launch.steps import PROCESS_WAIT_S, ROUND_S, JobStep, end_steps
from relax_hpc.metrics.heartbeat import Beating
from relax_hpc.metrics.jsonl import JsonlWriter, read_jsonl
from relax_hpc.metrics.progress import Progress
from relax_hpc.metrics.summary import completed_steps, run_summary
from relax_hpc.paths import RunPaths, write_atomic

EXIT_COMPLETED, EXIT_FAILED, EXIT_STOPPED = 0, 1, 75
EXIT_SUPERSEDED = EXIT_FENCED  # another launcher took the run over: this one stopped, writing nothing
TRAINER_EXIT_GRACE_S = 5.0  # after its stop record, for the trainer's own exit
LAUNCHER_BEAT_S = 5.0  # the launcher's heartbeat (status: a run whose heartbeats stopped has ended)


@dataclass(frozen=True)
class RoleKind:
    """How the supervisor treats the roles of one kind (a role is named KIND or KIND-...)."""

    restarts: Callable[[JobConfig], int]  # a crashed process is restarted this often, then the run gives up
    engine: bool = False  # an HTTP engine: health-checked, counted as serving once registered and answering
    pushed_to: bool = False  # it takes the trainer's weight pushes (the rollout engines)
    helper: bool = False  # failing too often leaves it behind, not the run; it stops after the usage record
    finishes: bool = False  # exit 0 is its end, not a failure (the driver, after the final evaluation)


ROLE_KINDS: dict[str, RoleKind] = {
    "trainer": RoleKind(lambda cfg: 3),  # its failures restart the whole run from the checkpoint
    # A driver resumes from the spool, so restarting it is cheap; a few tries cover a crash
    # without hiding a driver that cannot run at all.
    "driver": RoleKind(lambda cfg: 3, finishes=True),
    "engine": RoleKind(lambda cfg: cfg.rollout.max_engine_restarts, engine=True, pushed_to=True),
    "judge": RoleKind(lambda cfg: cfg.rollout.max_engine_restarts, engine=True),
    "teacher": RoleKind(lambda cfg: cfg.rollout.max_engine_restarts, engine=True),
    "metrics": RoleKind(lambda cfg: 3, helper=True),  # the metric sinks only copy the JSONL records
}


def kind_of(name: str) -> RoleKind:
    """A role's entry: its name up to the first '-' (engine-3 and engine-eval-0 are engines)."""
    return ROLE_KINDS[name.split("-", 1)[0]]


@dataclass
class Role:
    name: str
    argv: list[str]
    log_path: Path
    max_restarts: int
    proc: CountedPopen | ForkedProcess | None = None
    forks: ForkServer | None = None  # local roles: forked by it (launch.forkserver), else fresh processes
    restarts: int = 0
    abandoned: bool = False  # a helper role that failed too often; the run went on without it
    started_at: float = 0.0  # wall time of the current process's start
    hung: str | None = None  # why the health monitor killed it, until its restart
    not_before: float = 0.0  # a restart waits until then (monotonic; the back-off)
    step: JobStep | None = None  # on Slurm: the role's job steps (ended with the role)
    ran_s: float = 0.0  # how long its processes ran, up to the last one's end (accounting)
    cpu_s: float = 0.0  # their CPU time, with every process below them (launch.cputime; local roles)
    accrued: bool = True  # the current process's time is in ran_s
    counted_alive: tuple[float, float] | None = None  # (when, CPU s): accrued while it ran; settle() adds its stop
    recorded: tuple[float, float] = (0.0, 0.0)  # the ran_s and cpu_s that usage records already hold
    ended: bool = False  # the current process was killed and its steps ended (or given up): once

    @property
    def kind(self) -> RoleKind:
        return kind_of(self.name)

    @property
    def nodes(self) -> list[str]:
        """The Slurm nodes its step runs on (none: this machine)."""
        return next((a.split("=", 1)[1].split(",") for a in self.argv if a.startswith("--nodelist=")), [])

    def accrue(self) -> None:
        """Count the current process's time, once (when it is found ended, or the run's start ends)."""
        if not self.accrued:
            now, cpu_s = time.time(), self._process_cpu_s()
            self.ran_s += now - self.started_at
            self.cpu_s += cpu_s
            self.accrued = True
            self.counted_alive = (now, cpu_s) if self.proc is not None and self.proc.poll() is None else None

    def settle(self) -> None:
        """Once the process counted while it ran has ended: add what its stop took since."""
        if self.counted_alive is not None and self.proc is not None and self.proc.poll() is not None:
            (then, cpu_s), self.counted_alive = self.counted_alive, None
            self.ran_s += time.time() - then
            self.cpu_s += max(0.0, self._process_cpu_s() - cpu_s)

    @property
    def measured(self) -> bool:
        """Whether cpu_s is its processes' CPU time: not on Slurm, where the process here is the
        srun client and the role's processes run in a job step on other nodes (sacct has their time)."""
        return self.step is None

    def _process_cpu_s(self) -> float:
        """The current process's CPU time with everything below it: its reaper's count once it has
        ended, else the living tree's counters."""
        if self.proc is None or not self.measured:
            return 0.0
        if self.proc.poll() is None:
            return tree_cpu_s(self.proc.pid)
        return self.proc.cpu_s or 0.0  # None: its status died with the fork server

    def start(self, env: dict[str, str], abandon: Callable[[], bool] | None = None) -> None:
        """Start the role's process. `abandon`: asked while the fork server imports; when it says
        so, nothing starts (StartAbandoned)."""
        self.accrue()
        self.proc = self._spawn(env, abandon)
        self.started_at, self.accrued, self.ended = time.time(), False, False

    def _spawn(self, env: dict[str, str], abandon: Callable[[], bool] | None) -> CountedPopen | ForkedProcess:
        if self.forks is not None and forkable(self.argv, self.forks.modules):
            try:
                return self.forks.start(self.argv, env, self.log_path, abandon)
            except ForkServerError as err:
                self.note(f"launcher: {err}; starting {self.name} as a fresh process")
        with self.log_path.open("ab") as out:
            # A new session: Ctrl-C in the terminal reaches the launcher only, which then asks
            # the trainer to checkpoint instead of every process dying at once.
            return CountedPopen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """Its exit status once it has exited (None while it runs, or before its start)."""
        return None if self.proc is None else self.proc.returncode

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill(self) -> list[str]:
        """End the role's processes: SIGKILL to its process and every process below it, and on
        Slurm its job step. torchrun starts each rank in a session of its own, so killing the
        role's process group would orphan the ranks: a hung (stopped, deadlocked) rank would then
        live on and keep its GPU memory from the restarted run. On Slurm the role's process is
        the `srun` client, and the step outlives it (steps.py). Returns the ids of the role's
        steps that Slurm still lists after the bound (empty: everything ended). Once per
        process: a role killed as hung is not ended again when it is restarted or the run ends
        (each end of a step Slurm cannot drop costs both rounds)."""
        if self.ended:
            return []
        self.ended = True
        if self.proc is not None and self.alive():
            deadline = time.monotonic() + PROCESS_WAIT_S  # a process in D state: the bound
            with contextlib.suppress(psutil.NoSuchProcess):
                below = psutil.Process(self.proc.pid).children(recursive=True)
                self.signal(signal.SIGKILL)
                for process in below:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.kill()
                psutil.wait_procs(below, timeout=PROCESS_WAIT_S)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        return self.step.end() if self.step is not None else []

    def note(self, line: str) -> None:
        """A line of the launcher's own at the end of the role's log."""
        with self.log_path.open("a") as out:
            out.write(line + "\n")

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def given(argv: list[str], threads: int) -> dict[str, float]:
    """The CPUs and GPUs a role's command line gives it: a job step's `--cpus-per-task` on each
    of its nodes, or `threads` per process here; its GPU slice (launch.gpus), else what it sees."""
    option = lambda name, default: next(  # noqa: E731
        (int(a.split("=", 1)[1]) for a in argv if a.startswith(f"--{name}=")), default
    )
    gpus = visible_gpu_count()
    if "relax_hpc.launch.gpus" in argv:
        gpu_slice = argv[argv.index("relax_hpc.launch.gpus") + 1]
        gpus = 0 if gpu_slice == NO_GPU else span(gpu_slice)
    processes = option("nproc-per-node", 0) or next(
        (int(argv[i + 1]) for i, a in enumerate(argv[:-1]) if a == "--nproc-per-node"), 1
    )
    cpus = option("cpus-per-task", 0) * option("nodes", 1) or threads * processes
    return {"cpus": float(cpus), "gpus": float(gpus * option("nodes", 1))}


def child_env(cfg: JobConfig) -> dict[str, str]:
    threads = str(cfg.launch.threads_per_process)
    return {
        "USER": getpass.getuser(),  # ch-run and some Slurm tools refuse to run without it
        **os.environ,
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",  # every model is a local folder; never reach for a hub
    }


class Supervisor:
    """Messages go to `out` only (the terminal, or the Slurm output file, where stderr lands too:
    logging them as well would print every line twice); what happened is also recorded in
    RUN_DIR/metrics/events.jsonl for `status`."""

    def __init__(
        self,
        cfg: JobConfig,
        paths: RunPaths,
        commands: Callable[[], dict[str, list[str]]],
        out: TextIO = sys.stdout,
        devices: str | None = None,
        slurm_job: str | None = None,
        forks: ForkServer | None = None,
        step_round_s: float = ROUND_S,
    ) -> None:
        """`commands`: every role's command line, asked anew at each start of the run (a
        restarted trainer gets a fresh rendezvous endpoint); `slurm_job`: the job whose steps
        the roles are, which ending a role cancels (`step_round_s`: each of its two rounds at
        most, steps.py); `forks`: the fork server that starts the roles it can (launch.fork_roles)."""
        self.cfg, self.paths, self.commands, self.out = cfg, paths, commands, out
        self.devices = devices  # where the roles run, said once in the header
        self.slurm_job, self.forks, self.step_round_s = slurm_job, forks, step_round_s
        self.own_cpu_s = 0.0  # the launcher's and fork server's CPU time in the usage records so far
        self.stop_requested = False
        self.kill_requested = False
        self.events = JsonlWriter(paths.events_metrics)
        self.notifier = Notifier(cfg.notify, paths.root.name)
        self.lease = Lease(paths.root)  # fencing: every start of a role supersedes its last process
        self.new_owner: str | None = None  # the launcher that took the run over (fence.Lease.superseded)

    def say(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def request_stop(self, why: str) -> None:
        """Ask the trainer to checkpoint at its next step boundary; the run then ends with 75.
        Safe to call from a signal handler or another thread."""
        if not self.stop_requested:
            self.stop_requested = True
            self.say(f"\n{why}: asking the trainer to checkpoint and stop\n")
            self.events.log({"event": "stop_requested", "why": why})
            self.notifier.send("stopping", f"{why}: the trainer checkpoints and stops")
            write_atomic(self.paths.stop_request, LAUNCHER_STOP + why.encode() + b"\n")

    def request_kill(self) -> None:
        """End at once, without a checkpoint (the next start resumes from the previous one)."""
        self.kill_requested = True

    def run(self) -> int:
        """Start every role and watch them; after the trainer died or hung, start the run again
        from its checkpoint (launch.health.trainer_restarts times, with a back-off). The
        launcher's heartbeat (RUN_DIR/health/launcher.json) beats meanwhile: a launcher killed
        before it wrote its end (SIGKILL, a node's loss) is then seen gone by `status`."""
        beating = Beating(self.paths, "launcher", LAUNCHER_BEAT_S, slurm_job=self.slurm_job)
        try:
            return self._run()
        finally:
            beating.close()

    def _run(self) -> int:
        health = self.cfg.launch.health
        attempt = 0
        while True:
            code, trainer_failed = self._attempt()
            if code == EXIT_SUPERSEDED:
                self.notifier.close()  # the run's record and its notifications are the new owner's
                return code
            if not trainer_failed or attempt >= health.trainer_restarts or self.stop_requested:
                if trainer_failed and attempt >= health.trainer_restarts:
                    self.say(f"the trainer failed {attempt + 1} times; giving up (launch.health.trainer_restarts)\n")
                self._end(code)
                return code
            attempt += 1
            wait = min(60.0, health.restart_backoff_s * 2 ** (attempt - 1))
            self.say(
                f"restarting the run from its last checkpoint in {wait:.0f} s ({attempt}/{health.trainer_restarts})\n"
            )
            self.events.log({"event": "restart", "why": "trainer", "attempt": attempt})
            self.notifier.send("restarting", f"the trainer failed; restarting from the last checkpoint ({attempt})")
            time.sleep(wait)

    def _end(self, code: int) -> None:
        step = completed_steps(self.paths)
        refused = len(refused_writes(self.paths.root))  # by processes this run superseded (fencing)
        self.events.log({"event": "end", "exit": code, "step": step, "refused_writes": refused})
        summary = run_summary(self.paths, self.cfg.trainer.total_steps)
        if code != EXIT_FAILED:
            self.say(summary + "\n")
        title = {EXIT_COMPLETED: "completed", EXIT_STOPPED: "stopped with a checkpoint"}.get(code, "failed")
        self.notifier.send(title, f"at step {step}\n{summary}")
        self.notifier.close()

    def _attempt(self) -> tuple[int, bool]:
        """One start of every role, from the checkpoint: (exit status, whether the trainer failed)."""
        # Superseded before recovery rewrites the record: an older process writes nothing after it.
        generation = self.lease.new_generation()
        recovery = recover(self.paths)
        logs = self.paths.new_logs()
        env = child_env(self.cfg)
        ro = self.cfg.rollout
        roles = {
            name: Role(
                name,
                argv,
                logs / f"{name}.log",
                kind_of(name).restarts(self.cfg),
                step=JobStep(self.slurm_job, step_name(self.cfg, name), self.step_round_s) if self.slurm_job else None,
                forks=self.forks,
            )
            for name, argv in self.commands().items()
        }
        job = os.environ.get("SLURM_JOB_ID")
        restart_count = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        self.say(
            f"run dir: {self.paths.root}\nlogs:    {logs}/  (tail -F {logs}/trainer.log)\n"
            + (f"slurm job {job}, restart count {restart_count}\n" if job else "")
            + (f"devices: {self.devices}\n" if self.devices else "")
            + f"{'resuming at step ' + str(recovery.step) if recovery.step else 'starting'}: "
            + (
                f"{ro.num_engines} engine(s)"
                + (f" and {ro.eval_engines} evaluation engine(s)" if ro.eval_engines else "")
                + f", {self.cfg.trainer.num_ranks} trainer rank(s), "
                f"max_staleness {ro.max_staleness}\n"
                if self.cfg.kind == "rl"
                else f"sft, {self.cfg.trainer.num_ranks} trainer rank(s)\n"
            )
            # in the header, not a log line before it: the header is the first thing a start says
            + (f"{recovery.said()}\n" if recovery.said() else "")
        )
        self.events.log(
            {"event": "start", "logs": logs.name, "step": recovery.step, "slurm_job_id": job,
             "slurm_restart_count": restart_count, "generation": generation}
        )  # fmt: skip
        # A stop asked during the starts (the fork server's imports) starts no more roles.
        with contextlib.suppress(StartAbandoned):
            for role in roles.values():
                role.start({**env, **self.lease.grant(role.name)}, abandon=lambda: self.stop_requested)
        self.notifier.send("resumed" if recovery.step else "started", f"at step {recovery.step}; logs in {logs}")
        # A role the run does not have (an sft job's driver) started "in the future": never overdue.
        started = lambda name: roles[name].started_at if name in roles else float("inf")  # noqa: E731
        engines = [name for name, role in roles.items() if role.kind.engine]
        monitor = HealthMonitor(self.paths, self.cfg.launch.health, started, engines)
        try:
            return self._supervise(roles, env, monitor)
        finally:
            monitor.close()
            if self.new_owner is None:  # the record is the new owner's
                self._log_usage(roles.values())  # before the stop: the metric sinks forward it as they stop
            self._stop_all(roles.values())
            if self.new_owner is None:  # the stop's own time (5-13 % of a short run's CPU): the next start forwards it
                self._log_usage(roles.values(), stop=True)

    def _log_usage(self, roles: Iterable[Role], stop: bool = False) -> None:
        """How long each role ran in this start since the last record, what it was given, and the
        CPU time its processes used (local roles); the launcher's and the fork server's own CPU
        time since the last record (metrics.accounting sums the records). `stop`: the record of
        what the roles' stop took, after it; roles it cost nothing are left out."""
        threads = self.cfg.launch.threads_per_process
        usage = {}
        for role in roles:
            role.accrue()
            role.settle()
            s, cpu_s = role.ran_s - role.recorded[0], role.cpu_s - role.recorded[1]
            role.recorded = (role.ran_s, role.cpu_s)
            if stop and s <= 0:
                continue
            used = {"s": round(s, 3), **({"cpu_s": round(cpu_s, 3)} if role.measured else {})}
            usage[role.name] = used | given(role.argv, threads)
        own = self_cpu_s() + (self.forks.own_cpu_s() if self.forks is not None else 0.0)
        launcher_cpu_s, self.own_cpu_s = own - self.own_cpu_s, own
        stopped = {"stop": True} if stop else {}
        self.events.log({"event": "usage", **stopped, "roles": usage, "launcher_cpu_s": round(launcher_cpu_s, 3)})

    def _role_failed(self, role: Role, record: dict) -> None:
        """Log a role's exit; a node that this failure makes bad is said (launch.badnodes)."""
        # Roles ended by a stop asked of the run (a cancellation, a preemption, a requeue) are the run's.
        fault = None if self.stop_requested else node_fault(record["exit"], role.log_tail(20), role.nodes)
        self.events.log({"event": "role_exit", "role": role.name, **record, "nodes": role.nodes,
                         "cause": exit_cause(record["exit"], role.hung), "last_line": role.log_tail(1),
                         "hung": role.hung, "node_fault": fault})  # fmt: skip
        if fault is None:
            return
        threshold = self.cfg.launch.slurm.bad_node_failures
        for node in newly_bad(read_jsonl(self.paths.events_metrics), [fault["node"]], threshold):
            self.say(f"\nnode {node}: roles failed {threshold} times by its fault (last: {fault['cause']}); "
                     "the job's next requeue leaves it out\n")  # fmt: skip
            self.events.log({"event": "bad_node", "node": node, "failures": threshold})

    def _act_on_health(self, roles: dict[str, Role], monitor: HealthMonitor) -> None:
        """Kill what hangs: the next round of the loop handles it like a role that died."""
        for finding in monitor.findings():
            role = roles.get(finding.role)
            if role is None or not role.alive():
                continue
            self.say(f"\n{role.name}: {finding.cause}; killing it\n")
            self.notifier.send(f"{role.name} hung", f"{finding.cause}; killed and restarted")
            self.events.log({"event": "role_hung", "role": role.name, "cause": finding.cause})
            role.hung = finding.cause
            self._kill(role)

    def _supervise(self, roles: dict[str, Role], env: dict[str, str], monitor: HealthMonitor) -> tuple[int, bool]:
        """Watch the roles until the run ends: restart the ones that die, stop on request, end
        with the trainer. Returns the launcher's exit code and whether the whole run restarts."""
        progress = Progress(
            self.paths, self.cfg.trainer.total_steps, self.out, log_every_s=self.cfg.metrics.progress_every_s
        )
        trainer = roles["trainer"]
        engines = [r for r in roles.values() if r.kind.pushed_to]  # the rollout engines, which serve the driver
        others = [r for r in roles.values() if r is not trainer]
        serving = lambda: len({r.name for r in engines if r.alive()} & monitor.serving())  # noqa: E731
        started = time.monotonic()
        trainer_done_at: float | None = None
        health_checked = 0.0
        while True:
            time.sleep(0.2)
            if self.kill_requested:
                self.say("\nkilled\n")
                return EXIT_STOPPED, False
            if time.monotonic() - health_checked > 2.0 and trainer_done_at is None and not self.stop_requested:
                health_checked = time.monotonic()
                self._act_on_health(roles, monitor)
            wall = self.cfg.launch.max_wall_s
            if wall and time.monotonic() - started > wall:
                self.request_stop(f"launch.max_wall_s ({wall:.0f} s) reached")
            for role in others:
                if role.alive() or role.abandoned or trainer_done_at is not None or self.stop_requested:
                    continue
                if (ended := self._tend_dead(role, env, progress)) is not None:
                    return ended
            progress.show(serving(), len(engines))
            if self.stop_requested and (ended := self._stop_now(trainer, others, progress)) is not None:
                return ended
            if trainer.alive():
                continue
            if trainer.returncode != 0 and progress.trainer_end is None:
                return self._trainer_failed(trainer, progress)
            # A non-zero exit after its end record (which follows its last checkpoint) is a fault
            # of the teardown (gloo's threads at exit): nothing is lost.
            trainer_done_at = trainer_done_at or time.monotonic()
            completed = self._training_completed()
            # Training is over: give the roles that finish (the driver's final evaluation) time, then stop.
            finishing = any(r.kind.finishes and r.alive() for r in others)
            if not completed or not finishing or time.monotonic() - trainer_done_at > 120:
                progress.show(serving(), len(engines), force=True)
                progress.finish()
                return (EXIT_COMPLETED if completed else EXIT_STOPPED), False

    def _tend_dead(self, role: Role, env: dict[str, str], progress: Progress) -> tuple[int, bool] | None:
        """A role other than the trainer found dead: after its back-off, restart it, leave it behind
        (a helper out of restarts), or end the run (the launcher's exit code, and no restart)."""
        if role.not_before == 0.0:  # just found dead: the restart waits out the back-off
            role.accrue()
            backoff = self.cfg.launch.health.restart_backoff_s
            role.not_before = time.monotonic() + min(60.0, backoff * 2**role.restarts) * bool(role.restarts)
        if time.monotonic() < role.not_before:
            return None
        code = role.returncode
        if role.kind.finishes and code == 0:
            return None
        if code and (line := no_space(role.log_tail(5))):
            return self._stop_for_space(role, line, progress)
        if self._lost_run(progress):
            return EXIT_SUPERSEDED, False
        give_up = role.restarts >= role.max_restarts
        if give_up and role.kind.helper:  # reported and left behind; the run goes on
            role.abandoned = True
            self._role_failed(role, {"exit": code, "restarts": role.restarts, "action": "abandon"})
            self.say(f"\n{role.name} failed {role.restarts + 1} times (exit {code}); the run goes on "
                     f"without it (see {role.log_path})\n")  # fmt: skip
            return None
        action = "give_up" if give_up else "restart"
        self._role_failed(role, {"exit": code, "restarts": role.restarts, "action": action})
        cause = exit_cause(code, role.hung)
        if give_up:
            progress.finish()
            self.say(
                f"\n{role.name} failed {role.restarts + 1} times ({cause}); giving up.\n"
                f"last lines of {role.log_path}:\n{role.log_tail()}\n"
            )
            return EXIT_FAILED, False
        role.restarts += 1
        self.say(f"\n{role.name} ended ({cause}); restarting ({role.restarts}/{role.max_restarts})\n")
        role.hung, role.not_before = None, 0.0
        self._kill(role)  # what its process left behind: a Slurm step outlives its srun
        role.start({**env, **self.lease.grant(role.name)})
        return None

    def _stop_now(self, trainer: Role, others: list[Role], progress: Progress) -> tuple[int, bool] | None:
        """A stop was asked: end the run if the checkpoint it needs is written (or none is), else
        None (the trainer is still on its way to it)."""
        end = progress.trainer_end
        if end is None and not progress.steps_this_start:
            # Nothing trained since this start: the checkpoint it resumed from is what a stop
            # would write, so stop now instead of waiting out the trainer's start-up.
            progress.finish()
            self.say("no step trained since this start: stopping now; the next start resumes where this one did\n")
            started = trainer.proc is not None
            self._stop_all([trainer])
            how = (
                "ended (SIGTERM) with nothing to checkpoint; a SignalException above is torchrun's word for it"
                if started
                else "not started"
            )
            trainer.note(f"launcher: the run was asked to stop before this start trained a step; trainer {how}")
            return EXIT_STOPPED, False
        if end is not None and not end["completed"]:
            # The checkpoint is complete once the trainer writes its stop record: end soon
            # rather than wait for all of its teardown (seconds that a preempted job may not
            # have), but give torchrun a moment to leave by itself: one ended by SIGTERM
            # leaves a traceback in trainer.log that reads like a crash.
            progress.finish()
            for role in others:  # their teardown overlaps the trainer's
                if not role.kind.helper:  # the sinks stop after the usage event (_log_usage)
                    role.signal(signal.SIGTERM)
            if trainer.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    trainer.proc.wait(timeout=TRAINER_EXIT_GRACE_S)
            return EXIT_STOPPED, False
        return None

    def _trainer_failed(self, trainer: Role, progress: Progress) -> tuple[int, bool]:
        """The trainer exited non-zero before its end record."""
        if self.stop_requested:
            # Slurm's SIGTERM (a requeue, a cancel) reaches the job steps as well as the
            # launcher: a trainer that died of it before its stop record (in its start-up)
            # was stopped, not failed; the next start resumes from the last checkpoint.
            progress.finish()
            self.say(f"\ntrainer ended (exit {trainer.returncode}) before its checkpoint; stopping\n")
            return EXIT_STOPPED, False
        if self._lost_run(progress):
            return EXIT_SUPERSEDED, False
        if line := no_space(trainer.log_tail(5)):
            return self._stop_for_space(trainer, line, progress)
        progress.finish()
        cause = exit_cause(trainer.returncode, trainer.hung)
        self._role_failed(trainer, {"exit": trainer.returncode, "restarts": 0, "action": "restart_run"})
        self.say(f"\ntrainer failed ({cause}); last lines of {trainer.log_path}:\n{trainer.log_tail()}\n")
        return EXIT_FAILED, True

    def _stop_for_space(self, role: Role, line: str, progress: Progress) -> tuple[int, bool]:
        """A role could not write for lack of space: a restart would fail the same way, so the run
        stops, to resume once space is freed (the spool refuses a batch before the disk is full)."""
        progress.finish()
        self._role_failed(role, {"exit": role.returncode, "restarts": role.restarts, "action": "stop"})
        self.say(f"\n{role.name} found no space to write ({line}); the run is resumable: free space on the filesystem "
                 f"of {self.paths.root} and run the same command\n")  # fmt: skip
        return EXIT_STOPPED, False

    def _lost_run(self, progress: Progress) -> bool:
        """Before a role starts again: has another launcher taken the run over (its roles then
        exit as fenced, 76)? Then this one stops instead of restarting them against the new owner."""
        self.new_owner = self.lease.superseded()
        if self.new_owner is None:
            return False
        progress.finish()
        self.say(f"\nsuperseded: {self.new_owner} took {self.paths.root} over; this launcher stops without "
                 f"restarting its roles (exit {EXIT_SUPERSEDED})\n")  # fmt: skip
        return True

    def _training_completed(self) -> bool:
        """The trainer's own verdict: its last record says whether it reached total_steps."""
        ends = [r for r in read_jsonl(self.paths.train_metrics) if r.get("event") == "end"]
        return bool(ends and ends[-1]["completed"])

    def _stop_all(self, roles: Iterable[Role]) -> None:
        roles = list(roles)
        for role in roles:
            role.signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for role in roles:
            if role.proc is None:
                continue
            try:
                role.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._kill(role)
        # An srun that exited has seen its step end, unless it was killed: end what is left of
        # every role not ended yet at once (one squeue, 0.2 s), so that a restarted run starts
        # alone. After a stop the job ends or requeues now, and Slurm ends every step with it.
        if self.slurm_job and not self.stop_requested:
            left = [r for r in roles if r.step and not r.ended]
            for role in left:
                role.ended = True
            names = [r.step.name for r in left if r.step]
            self._report_left("roles", end_steps(self.slurm_job, names, self.step_round_s))

    def _kill(self, role: Role) -> None:
        """End the role's processes (Role.kill); say so when Slurm still lists a step of it."""
        self._report_left(role.name, role.kill())

    def _report_left(self, whose: str, steps: list[str]) -> None:
        if steps:
            self.say(f"\n{whose}: Slurm still lists step(s) {', '.join(steps)} after scancel and SIGKILL\n")
            self.events.log({"event": "step_not_ended", "role": whose, "steps": steps})
