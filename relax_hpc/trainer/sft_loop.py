"""The trainer's loop for kind=sft (relax_hpc.trainer.main runs it instead of loop.Trainer).

No engines, no spool, no weight sync: every rank reads the examples (relax_hpc/data/sft.py),
and each step every rank trains its share of the step's batch, a pure function of (run.seed,
step), so the checkpoint's step is the data position and a resume continues exactly. Rank 0
decides only whether to go on or stop (a stop request), broadcast so that every rank takes the
same number of steps. Checkpoints, their restore, the start record and the final HF export are
the RL loop's own (loop.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import AutoTokenizer

from relax_hpc.algos.stats import Stats
from relax_hpc.ckpt.manager import Checkpointer
from relax_hpc.config.schema import JobConfig
from relax_hpc.data.sft import Example, batch_indices, configured_examples
from relax_hpc.metrics.heartbeat import Heartbeat, StepClock
from relax_hpc.metrics.jsonl import JsonlWriter
from relax_hpc.metrics.timing import PhaseTimer
from relax_hpc.paths import RunPaths
from relax_hpc.trainer.batching import TrainBatch, pad_samples
from relax_hpc.trainer.build import build_backend
from relax_hpc.trainer.loop import (
    Command,
    Do,
    StopRequest,
    broadcast_command,
    export,
    load_checkpoint,
    log_start,
    reduce_stats,
    save_checkpoint,
    step_times,
)

log = logging.getLogger("relax_hpc.trainer")


@dataclass
class SftState:
    """What a resume needs besides tensors; saved as trainer_state.json."""

    step: int = 0  # optimizer steps done; the next batch is batch_indices(..., step, seed)
    examples: int = 0  # examples trained (step x sft.batch_size)


def examples_batch(examples: list[Example], rows: list[int], pad_id: int) -> TrainBatch:
    """Training tensors of the examples `rows`, the loss on their response tokens (every rank has
    some: the config keeps sft.batch_size at least trainer.num_ranks)."""
    picked = [examples[i] for i in rows]
    return pad_samples(
        [e.ids for e in picked],
        [e.loss_mask for e in picked],
        [[0.0] * len(e.ids) for e in picked],  # no rollout: the RL-only tensors stay zero
        [0.0] * len(picked),
        rows,
        pad_id,
    )


class SftTrainer:
    def __init__(self, cfg: JobConfig, paths: RunPaths, device: torch.device) -> None:
        self.cfg, self.paths, self.sft = cfg, paths, cfg.sft
        self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.backend = build_backend(cfg, device)
        self.examples = configured_examples(self.sft, AutoTokenizer.from_pretrained(cfg.model.path))
        self.ckpt = Checkpointer(paths.ckpt, cfg.ckpt.keep)
        self.state = SftState()
        self.stop = StopRequest(paths.stop_request)
        self.total = cfg.trainer.total_steps
        self.clock = StepClock(Heartbeat(paths, "trainer")) if self.rank == 0 else None
        self.timer = PhaseTimer(self.clock.phase if self.clock else None)
        self.metrics = JsonlWriter(paths.train_metrics) if self.rank == 0 else None
        self.last_log_line = 0.0

    def resume(self) -> None:
        trainer_state = load_checkpoint(self.ckpt, self.backend, self.cfg.model.path)
        if trainer_state is not None:
            self.state = SftState(**trainer_state)
            log.info("resumed from step %d (%d examples trained)", self.state.step, self.state.examples)

    def save(self) -> bool:
        with self.timer.phase("checkpoint"):
            return save_checkpoint(self.ckpt, self.backend, self.state.step, asdict(self.state))

    def log_start(self) -> None:
        if self.metrics is not None:
            log_start(self.metrics, self.state.step, self.world)

    def train(self) -> dict[str, Any]:
        """One step: this rank's share of the step's examples, one optimizer step; the record."""
        b = self.backend
        with self.timer.phase("read"):
            rows = batch_indices(len(self.examples), self.sft.batch_size, self.state.step, self.cfg.run.seed)
            batch = examples_batch(self.examples, rows[b.data_rank :: b.data_world], b.pad_token_id)
        with self.timer.phase("train"):
            result = b.sft_step(batch, self.state.step, self.sft.aggregation)
        stats: Stats = result.stats
        self.state.step += 1
        self.state.examples += len(rows)
        return {
            "step": self.state.step,
            "loss": result.loss,
            **reduce_stats(stats, 1),
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "samples": len(rows),
            "epoch": self.state.examples / len(self.examples),
            "time_optimizer": result.optimizer_s,
        }

    def finish_step(self, record: dict[str, Any], started: float) -> None:
        """Rank 0: where the step's time went (the RL step's fields: no rollout, nothing to push),
        the record, and (throttled) a log line."""
        assert self.metrics is not None and self.clock is not None, "rank 0 writes the record"
        phases = self.timer.take()
        record.update(step_times(phases, time.monotonic() - started, 0.0, record.pop("time_optimizer")))
        self.clock.stepped(self.state.step, sum(phases.values()))
        self.metrics.log(record)
        now = time.monotonic()
        if now - self.last_log_line >= self.cfg.metrics.progress_every_s or record["step"] in (1, self.total):
            self.last_log_line = now
            log.info(
                "step %d/%d | loss %.4f | grad %.3f | %d examples | epoch %.2f | step %.2fs",
                record["step"], self.total, record["loss"], record["grad_norm"], record["samples"],
                record["epoch"], record["time_step"],
            )  # fmt: skip

    def _go_on(self) -> bool:
        """Rank 0 decides (a stop request) and tells every rank, so that all take the same steps."""
        command = Command(Do.STOP if self.stop.requested() else Do.TRAIN) if self.rank == 0 else None
        return broadcast_command(command).do is Do.TRAIN

    def run(self) -> None:
        while self.state.step < self.total:
            started = time.monotonic()
            if not self._go_on():
                log.info("stop requested at step %d", self.state.step)
                break
            record = self.train()
            if self.state.step % self.cfg.ckpt.every_steps == 0 and self.state.step < self.total:
                self.save()
            if self.rank == 0:
                self.finish_step(record, started)
        self.save()
        completed = self.state.step >= self.total
        if completed and self.cfg.ckpt.export_hf:
            export(self.paths, self.cfg.ckpt.export_version, self.cfg.ckpt.export_metric, self.state.step)
        if self.rank == 0:
            self.stop.served()
        if self.metrics is not None:
            self.metrics.log({"event": "end", "step": self.state.step, "completed": completed})
