"""The trainer's loop (relax_hpc.trainer.main runs it on every torchrun rank).

Rank 0 owns everything outside the model (spool claims, weight-sync group, metrics, stop
requests) and drives the other ranks with one small broadcast command per iteration:

    wait   nothing to train yet            sync   push the current weights to the engines
    train  a claimed batch (path, ids)     stop   checkpoint and leave
    end    trained (and evaluated) to the end: checkpoint, export and leave

so every collective (FSDP gathers for weight sync, DCP saves) happens on all ranks in the same
order. The loop: claim -> train_step -> push weights (version + 1) -> checkpoint every N steps.
With ckpt.export_version=best, an eval point's version is checkpointed before it is pushed, and
the trainer waits until the driver has evaluated it (relax_hpc.ckpt.best): the engines hold
exactly that version while it is evaluated, so every evaluated version has a checkpoint.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from relax_hpc import fence
from relax_hpc.algos.stats import Stats
from relax_hpc.ckpt.best import choose_export, is_eval_version, write_record
from relax_hpc.ckpt.manager import Checkpointer
from relax_hpc.config.schema import JobConfig
from relax_hpc.data.processor import media_processor
from relax_hpc.exchange.spool import Spool
from relax_hpc.metrics.heartbeat import Heartbeat, StepClock
from relax_hpc.metrics.jsonl import JsonlWriter
from relax_hpc.metrics.poll import Poll
from relax_hpc.metrics.startup import StartupClock
from relax_hpc.metrics.summary import best_checkpoint, eval_scores
from relax_hpc.metrics.timing import PeakMemory, PhaseTimer
from relax_hpc.paths import RunPaths, write_atomic
from relax_hpc.trainer.backend import Backend
from relax_hpc.trainer.batching import share_of
from relax_hpc.trainer.build import build_backend, build_channel, build_check
from relax_hpc.trainer.claims import claim_next, read_claimed
from relax_hpc.trainer.offload import OptimizerOffload
from relax_hpc.weights.sender import WeightSyncError

log = logging.getLogger("relax_hpc.trainer")


@dataclass
class RunState:
    """Everything besides tensors that a resume needs; saved as trainer_state.json."""

    step: int = 0  # trainer steps done (rollout batches trained)
    version: int = 0  # policy version of the current weights (= step)
    claims: dict[str, list[str]] = field(default_factory=dict)  # step -> spool files it consumed
    trained_samples: int = 0
    stale_samples: int = 0
    quarantined_files: int = 0


class StopRequest:
    """SIGTERM/SIGUSR1 (torchrun forwards them) or RUN_DIR/control/stop ask for a clean stop."""

    def __init__(self, stop_file: Path) -> None:
        self.file = stop_file
        self.signalled = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        log.info("received %s: stopping at the next safe point", signal.Signals(signum).name)
        self.signalled = True

    def requested(self) -> bool:
        return self.signalled or self.file.exists()

    def served(self) -> None:
        """Rank 0, once the stop's checkpoint is written: the request is answered, so the next
        start trains. Until then it stays, through a restart or a requeue in between (a stop the
        user asked for must not be lost to a hung trainer's restart)."""
        self.file.unlink(missing_ok=True)


def step_line(record: dict[str, Any], total: int) -> str:
    """One step in the trainer's log: the numbers a user looks at, and where the time went."""
    return (
        f"step {record['step']}/{total} | loss {record['loss']:.4f} | reward {record['reward']:.3f} | "
        f"grad {record['grad_norm']:.3f} | {record['samples']} samples | staleness {record['staleness_mean']:.2f} | "
        f"step {record['time_step']:.2f}s: wait {record['time_wait']:.2f} fwd/bwd {record['time_fwd_bwd']:.2f} "
        f"opt {record['time_optimizer']:.2f} push {record['time_push']:.2f} ckpt {record['time_checkpoint']:.2f} | "
        f"generate {record['time_generate']:.2f}s | "
        f"overlap {record['overlap_gain']:.2f}x of {record['overlap_bound']:.2f}x"
    )


class Do(Enum):
    WAIT = "wait"
    SYNC = "sync"
    TRAIN = "train"
    STOP = "stop"
    END = "end"


@dataclass(frozen=True, slots=True)
class Command:
    """What rank 0 tells every rank to do next (see the module docstring)."""

    do: Do
    path: str = ""  # train: the claimed spool file
    trained: list[int] = field(default_factory=list)  # train: the indices of its samples to train


def broadcast_command(command: Command | None) -> Command:
    box = [command]
    dist.broadcast_object_list(box, src=0)
    received = box[0]
    assert received is not None, "rank 0 broadcasts a command"
    return received


def reduce_stats(stats: Stats, epochs: int) -> dict[str, float]:
    """The objective's statistics over all ranks: token means, extrema as NAME_max / NAME_min
    (left out when no rank had a loss token), and `tokens`, the loss tokens of the batch. Ranks
    that report nothing (megatron's tensor-parallel peers and earlier pipeline stages) send empty
    Stats: gathered as objects, so the names need not match across ranks."""
    everyone: list[Stats] = [Stats()] * dist.get_world_size()
    dist.all_gather_object(everyone, stats)
    total = Stats()
    for s in everyone:
        total.add(s)
    tokens_seen = total.sums.pop("tokens", 0.0)
    out = {name: value / max(tokens_seen, 1.0) for name, value in total.sums.items()}
    out.update({f"{n}_max": v for n, v in total.maxes.items() if v != -float("inf")})
    out.update({f"{n}_min": v for n, v in total.mins.items() if v != float("inf")})
    out["tokens"] = tokens_seen / epochs
    return out


# Counts each rank makes over its own share of a batch, summed over ranks for the step's record.
RANK_COUNTS = ("media_mismatched_groups", "stale_tokens_masked")


# How long a trainer that has trained every step keeps pushing the last version to engines that do
# not hold it (the launcher gives the driver's final evaluation as long: launch/supervisor.py).
FINAL_PUSH_S = 120.0


class Trainer:
    def __init__(self, cfg: JobConfig, paths: RunPaths, device: torch.device) -> None:
        self.cfg, self.paths = cfg, paths
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.backend = build_backend(cfg, device)
        self.pad_id = self.backend.pad_token_id
        self.processor = media_processor(cfg.model.path)  # rebuilds the model inputs of media batches
        # Partial rollout with stale tokens masked: a sample's age is its newest token's.
        self.per_token = cfg.rollout.partial and cfg.rollout.mask_stale_tokens
        self.best = cfg.ckpt.export_version == "best"
        metric = cfg.ckpt.export_metric
        self.ckpt = Checkpointer(
            paths.ckpt, cfg.ckpt.keep, (lambda: best_checkpoint(paths, metric)) if self.best else (lambda: None)
        )
        self.evaluated = -1  # with export_version=best: the newest version rank 0 saw evaluated
        self.channel = build_channel(cfg, paths, self.backend, device)  # weights to the engines
        # Rank 0: what the engines hold after a push, against what it pushed (weights.verify_every).
        self.check = build_check(
            cfg.weights, cfg.rollout.engine, cfg.lora_adapters, paths, self.backend, device,
            lambda record: log_event(paths, record), cfg.model.path,
        )  # fmt: skip
        # launch.colocate_offload: the optimizer state waits in host memory while the engines generate.
        self.offload = OptimizerOffload(
            self.backend.optimizers(), device, enabled=cfg.launch.colocate_offload == "optimizer"
        )
        self.state = RunState()
        self.stop = StopRequest(paths.stop_request)
        self.startup: StartupClock | None = None  # main's, until the first step (metrics/startup.jsonl)
        self.delivered = -1  # policy version the engines hold (rank 0's knowledge)
        self.last_engine_check = 0.0
        self.final_push_since = 0.0  # when every step was trained and no engine held the last version
        self.total = cfg.trainer.total_steps
        # Rank 0 says what it is doing (RUN_DIR/health/trainer.json): the launcher tells a hung
        # phase from a long one by the median step.
        self.clock = StepClock(Heartbeat(paths, "trainer")) if self.rank == 0 else None
        self.timer = PhaseTimer(self.clock.phase if self.clock else None)
        self.last_log_line = 0.0
        self.engines_served = 0  # by the last push (rank 0: over all ranks)
        self.device = device
        if self.rank == 0:
            self.spool = Spool(paths.spool)
            self.metrics = JsonlWriter(paths.train_metrics)

    # -- checkpoints ----------------------------------------------------------------------------

    def resume(self) -> None:
        trainer_state = load_checkpoint(self.ckpt, self.backend, self.cfg.model.path)
        if trainer_state is not None:
            self.state = RunState(**trainer_state)
            log.info("resumed from step %d (policy version %d)", self.state.step, self.state.version)

    def save(self) -> bool:
        return save_checkpoint(self.ckpt, self.backend, self.state.step, asdict(self.state))

    # -- the loop -------------------------------------------------------------------------------

    def held_for_eval(self, version: int) -> bool:
        """export_version=best: `version` is an eval point, checkpointed before it is pushed and
        trained past only once the driver has evaluated it."""
        return self.best and is_eval_version(version, self.total, self.cfg.rollout.eval_every)

    def awaiting_eval(self) -> bool:
        """Rank 0: the current version waits for the driver's evaluation (RUN_DIR/metrics/eval.jsonl)."""
        version = self.state.version
        if not self.held_for_eval(version) or self.evaluated >= version:
            return False
        if version in eval_scores(self.paths, self.cfg.ckpt.export_metric):
            self.evaluated = version
            return False
        return True

    def decide(self) -> Command:
        """Rank 0: what all ranks do next."""
        if self.stop.requested():
            return Command(Do.STOP)
        awaiting = self.awaiting_eval()
        finished = self.state.step >= self.total
        if finished and not awaiting and self.final_version_out():
            return Command(Do.END)
        # Push when the engines lack the current version or their set changed; at most every
        # 0.5 s while no engine takes it (none started yet, all restarting).
        if time.monotonic() - self.last_engine_check > 0.5 and (
            self.delivered != self.state.version
            or self.channel.engines_changed(self.delivered)
            or (self.check is not None and self.check.wants_push())  # an engine out of service: push again
        ):
            self.last_engine_check = time.monotonic()
            return Command(Do.SYNC)
        if awaiting or finished:
            return Command(Do.WAIT)
        ro = self.cfg.rollout
        claim = claim_next(self.spool, self.state.step, self.state.version, ro.max_staleness, self.per_token)
        if claim is None:
            return Command(Do.WAIT)
        self.state.quarantined_files += claim.quarantined
        self.state.stale_samples += sum(len(f["stale"]) for f in claim.files)
        self.state.claims.setdefault(str(self.state.step), []).extend(f["name"] for f in claim.files)
        if claim.trained_file is None:
            return Command(Do.WAIT)
        return Command(Do.TRAIN, claim.trained_file, claim.trained)

    def final_version_out(self) -> bool:
        """Rank 0, every step trained: an engine holds the last version, which the driver's final
        evaluation needs (the last step's push may have found none: a restarted engine still
        starting), or none took it within FINAL_PUSH_S, what the launcher allows that evaluation."""
        if self.delivered == self.state.version:
            return True
        self.final_push_since = self.final_push_since or time.monotonic()
        return time.monotonic() - self.final_push_since > FINAL_PUSH_S

    def sync(self) -> None:
        params = self.check.params(self.backend.full_parameters) if self.check else self.backend.full_parameters
        try:
            engines = self.channel.push(params, self.state.version)
        except WeightSyncError as e:
            log.warning("%s; retrying with the engines that answer", e)
            return
        if self.rank == 0 and engines:
            self.engines_served = engines
            self.delivered = self.state.version
            self.announce_version(engines)
            if self.check is not None:  # a due push's digests against the engines'
                self.check.pushed(self.state.version)

    def announce_version(self, engines: int) -> None:
        """Announce the delivered version in RUN_DIR/weights (a record for humans and tools)."""
        write_atomic(self.paths.weights_version, f"{self.state.version} {engines}\n".encode())

    def train(self, command: Command) -> dict[str, Any] | None:
        """Train one claimed batch and push the new weights; returns the step's record (rank 0;
        an empty one elsewhere), or None if the batch could not be read (it is quarantined and
        the step is not taken)."""
        with self.timer.phase("read"):
            step_claims = self.state.claims.get(str(self.state.step), [])
            batch = read_claimed(Path(command.path), self.spool if self.rank == 0 else None, step_claims)
        if batch is None:
            self.state.quarantined_files += 1
            return None
        b = self.backend
        with self.timer.phase("read"):  # and made into this rank's training tensors
            oldest = self.state.version - self.cfg.rollout.max_staleness if self.per_token else None
            share, stats = share_of(
                batch, command.trained, b.data_rank, b.data_world, self.pad_id, self.processor, oldest
            )
            counted = [k for k in RANK_COUNTS if k in stats] if len(batch.media_kind) or self.per_token else []
            if counted:  # each rank counted in its own groups
                everyone: list[dict[str, int]] = [{}] * self.world
                dist.all_gather_object(everyone, {k: stats[k] for k in counted})
                stats.update({k: sum(c[k] for c in everyone) for k in counted})
        self.channel.before_step(self.timer)
        self.offload.before_step(self.timer)
        peak = PeakMemory(self.device)
        with self.timer.phase("train"):
            result = self.backend.train_step(share, self.state.step)
        memory = {"mem_train_gb": peak.take()} if peak.on else {}
        objective = reduce_stats(result.stats, self.cfg.algo.epochs)
        trained_version = self.state.version
        self.state.step += 1
        self.state.version += 1
        self.state.trained_samples += stats["num_samples"]
        # An eval point's version is pushed only once run() has checkpointed it (a sync command).
        if not self.held_for_eval(self.state.version):
            with self.timer.phase("push"):
                self.sync()
        if peak.on:
            memory["mem_push_gb"] = peak.take()
        if self.rank != 0:
            return {}
        versions = stats["policy_versions"]
        return {
            "step": self.state.step,
            "version": self.state.version,
            "batch": stats["seq"],
            "loss": result.loss,
            **objective,
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "reward": stats["reward_sum"] / stats["num_samples"],
            "samples": stats["num_samples"],
            "staleness_mean": float((trained_version - versions).mean()),
            "staleness_max": int((trained_version - versions).max()),
            "stale_samples_total": self.state.stale_samples,
            "quarantined_files_total": self.state.quarantined_files,
            "engines": self.engines_served,
            **memory,
            **({"media_mismatched_groups": stats["media_mismatched_groups"]} if len(batch.media_kind) else {}),
            **({"stale_tokens_masked": stats["stale_tokens_masked"]} if self.per_token else {}),
            "time_generate": float(batch.attrs.get("generate_seconds", 0.0)),
            "time_optimizer": result.optimizer_s,
        }

    def finish_step(self, record: dict[str, Any], started: float) -> None:
        """Rank 0: where the step's time went, then its record and (throttled) its log line.

        time_wait is what the trainer spent waiting for samples (the rest of the step); the
        overlap bound (generate + train) / max(generate, train) is what asynchrony can gain at
        most with these phase times, overlap_gain what it did gain: (generate + train) / step."""
        phases = self.timer.take()
        if self.clock is not None:
            self.clock.stepped(self.state.step, sum(phases.values()))
        generate = record.pop("time_generate")
        record.update(step_times(phases, time.monotonic() - started, generate, record.pop("time_optimizer")))
        record.update(self.channel.record(phases, self.device))
        record.update(self.offload.record(phases))
        self.metrics.log(record)
        now = time.monotonic()
        if now - self.last_log_line >= self.cfg.metrics.progress_every_s or record["step"] in (1, self.total):
            self.last_log_line = now
            log.info(step_line(record, self.total))

    def save_and_prune(self) -> bool:
        """Checkpoint; once it is complete, delete the trained batches it covers (ckpt.keep_trained_batches)."""
        self.offload.restore()  # the checkpoint holds the state where the backend keeps it
        with self.timer.phase("checkpoint"):
            ok = self.save()
            if ok and self.rank == 0 and not self.cfg.ckpt.keep_trained_batches:
                self.spool.prune_trained(before_step=self.state.step)
        return ok

    def log_start(self) -> None:
        if self.rank == 0:
            log_start(self.metrics, self.state.step, self.world)

    def run(self) -> None:
        total = self.total
        poll = Poll()
        step_started = time.monotonic()
        while True:
            command = broadcast_command(self.decide() if self.rank == 0 else None)
            if command.do is Do.END:
                break
            if command.do is Do.STOP:
                log.info("stop requested at step %d", self.state.step)
                break
            if command.do is Do.SYNC:
                with self.timer.phase("push"):
                    self.sync()
                if self.startup and self.rank == 0 and self.delivered == self.state.version:
                    self.startup.mark("weight_sync")  # the group formed and the engines hold the weights
            elif command.do is Do.WAIT:
                time.sleep(poll.interval())
            elif command.do is Do.TRAIN:
                if self.startup:
                    self.startup.mark("first_batch")
                record = self.train(command)
                if self.startup:
                    self.startup.finish(self.paths.metrics, f"trainer-{self.rank}", "first_step")
                if record is None:
                    continue
                periodic = self.state.step % self.cfg.ckpt.every_steps == 0 and self.state.step < total
                if periodic or self.held_for_eval(self.state.step):
                    self.save_and_prune()
                record.update(self.offload.after_step(self.timer))  # parked until the next step
                if self.rank == 0:
                    self.finish_step(record, step_started)
                step_started = time.monotonic()
                poll.progressed()
        self.save_and_prune()
        completed = self.state.step >= total
        if completed and self.cfg.ckpt.export_hf:
            export(self.paths, self.cfg.ckpt.export_version, self.cfg.ckpt.export_metric, self.state.step)
        if self.rank == 0:
            self.stop.served()
            self.metrics.log({"event": "end", "step": self.state.step, "completed": completed})


# -- what every trainer loop (RL here, SFT in sft_loop) does the same way ------------------------


def step_times(phases: dict[str, float], step_s: float, generate: float, optimizer: float) -> dict[str, float]:
    """A step record's time fields from the phases the step's timer measured (see finish_step);
    a loop without rollout passes generate=0, and its overlap is 1x."""
    busy = sum(phases.values())
    return {
        "time_step": step_s,
        "time_wait": max(0.0, step_s - busy),
        "time_read": phases.get("read", 0.0),
        "time_fwd_bwd": phases.get("train", 0.0) - optimizer,
        "time_optimizer": optimizer,
        "time_push": phases.get("push", 0.0),
        "time_checkpoint": phases.get("checkpoint", 0.0),
        "time_generate": generate,
        "overlap_bound": (generate + busy) / max(generate, busy, 1e-9),
        "overlap_gain": (generate + busy) / max(step_s, 1e-9),
    }


def load_checkpoint(ckpt: Checkpointer, backend: Backend, model_path: str) -> dict[str, Any] | None:
    """Collective: restore the latest checkpoint's weights, optimizer, schedule and RNG states;
    returns the loop's own state (trainer_state.json), or None when there is no checkpoint."""
    loaded = ckpt.load(backend.load_checkpoint)
    if loaded is None:
        log.info("no checkpoint: starting from %s", model_path)
        return None
    rank_state, trainer_state = loaded
    backend.scheduler.load_state_dict(rank_state["scheduler"])
    torch.set_rng_state(rank_state["torch_rng"])
    np.random.set_state(rank_state["numpy_rng"])
    random.setstate(rank_state["python_rng"])
    return trainer_state


def save_checkpoint(ckpt: Checkpointer, backend: Backend, step: int, trainer_state: dict[str, Any]) -> bool:
    """Collective: weights and optimizer (the backend's), this rank's schedule and RNG states, and
    the loop's state; False when it failed (the previous checkpoint stays `latest`)."""
    rank_state = {
        "scheduler": backend.scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
    }
    ok = ckpt.save(step, backend.save_checkpoint, rank_state, trainer_state)
    if dist.get_rank() == 0:
        log.info("checkpoint step %d %s", step, "saved" if ok else "FAILED (previous kept)")
    return ok


def log_event(paths: RunPaths, record: dict[str, Any]) -> None:
    """A record in RUN_DIR/metrics/events.jsonl (rare: a writer of its own, closed at once)."""
    writer = JsonlWriter(paths.events_metrics)
    writer.log(record)
    writer.close()


def log_start(metrics: JsonlWriter, step: int, world: int) -> None:
    """Rank 0: one record per start: where the run resumed, and which Slurm job and restart this is."""
    metrics.log(
        {
            "event": "start",
            "step": step,
            "world": world,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        }
    )


def export(paths: RunPaths, export_version: str, metric: str, step: int) -> None:
    """Collective: the weights of the last step (export_version=last) or of the best evaluated one
    as an HF folder in RUN_DIR/hf, with EXPORT.json saying which version and why (rank 0 converts
    the checkpoint; the others wait, so that no rank leaves before it is done)."""
    if dist.get_rank() == 0:
        from relax_hpc.ckpt.export import convert

        fence.check("export")  # a superseded trainer writes no RUN_DIR/hf, as for its checkpoints
        started = time.monotonic()
        choice = choose_export(eval_scores(paths, metric), paths.ckpt, export_version, metric, step)
        convert(paths.root, paths.export, choice.version)
        write_record(paths.export, choice)
        log.info(
            "exported version %d to %s in %.1f s: %s",
            choice.version,
            paths.export,
            time.monotonic() - started,
            choice.why,
        )
    dist.barrier()
