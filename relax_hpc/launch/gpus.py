"""Which GPUs each role uses, and running a command on a slice of the GPUs a step sees:

    python -m relax_hpc.launch.gpus FIRST-LAST -- COMMAND...     (or `none`: no GPU, the CPU)

Slurm gives every step of a node the job's GPUs there; roles that share a node (trainer on GPUs
0-3, engines on 4-7) each take their slice. Indices count within the step's CUDA_VISIBLE_DEVICES.
On one machine (`place_local`), a role uses GPUs only when there are enough for it: a workstation
with one GPU runs the default two-rank trainer on the CPU instead of failing on a second GPU.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `python -m relax_hpc.launch.gpus` starts every role on a GPU slice: it stays light
    from relax_hpc.config.schema import JobConfig

NO_GPU = "none"  # a role that must not use any GPU


def select(visible: str | None, first_last: str) -> str:
    if first_last == NO_GPU:
        return ""
    first, last = (int(x) for x in first_last.split("-"))
    devices = visible.split(",") if visible else [str(i) for i in range(last + 1)]
    if last >= len(devices):
        raise SystemExit(
            f"relax_hpc.launch.gpus: GPUs {first_last} asked, the step sees only {len(devices)} ({visible})"
        )
    return ",".join(devices[first : last + 1])


def visible_gpu_count(env: Mapping[str, str] = os.environ) -> int:
    """CUDA GPUs this process may use, without importing torch: CUDA_VISIBLE_DEVICES when set
    (empty or -1: none), else the GPUs the NVIDIA driver knows."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [d.strip() for d in visible.split(",")]
        return 0 if not devices or devices[0] in ("", "-1") else len(devices)
    driver = Path("/proc/driver/nvidia/gpus")
    return len(list(driver.iterdir())) if driver.is_dir() else 0


def span(first_last: str) -> int:
    """How many GPUs a FIRST-LAST range names."""
    first, last = (int(x) for x in first_last.split("-"))
    return last - first + 1


@dataclass(frozen=True)
class LocalDevices:
    """The GPUs of each role on one machine: FIRST-LAST, NO_GPU, or None (what it sees)."""

    trainer: str | None
    engines: list[str | None]
    summary: str  # what was chosen, for the launcher's header
    engine_devices: list[str] | None = None  # each engine's --device (colocated: its rank's GPU)


def engine_pools(cfg: JobConfig) -> list[tuple[str, str, int]]:
    """(role prefix, registry pool, count) of the run's engine processes, in launch order: the
    rollout engines, the judge engines (reward.name=judge), the teacher engines
    (algo.teacher.num_engines), the evaluation engines (rollout.eval_engines: policy engines,
    pushed to like the rollout engines). An sft job has none."""
    from relax_hpc.protocol.registry import EVAL_ENGINE_PREFIX  # here: this module's own command stays light

    if cfg.kind == "sft":
        return []
    judges = cfg.reward.judge.num_engines if cfg.reward.name == "judge" else 0
    return [("engine", "policy", cfg.rollout.num_engines), ("judge", "judge", judges),
            ("teacher", "teacher", cfg.algo.teacher.num_engines),
            (EVAL_ENGINE_PREFIX.rstrip("-"), "policy", cfg.rollout.eval_engines)]  # fmt: skip


def engine_count(cfg: JobConfig) -> int:
    """Engine processes of the run: the rollout engines, then the judge and teacher engines if any."""
    return sum(n for _, _, n in engine_pools(cfg))


def sglang_sizes(cfg: JobConfig) -> list[int] | None:
    """Per engine process (engine_pools' order), the GPUs an SGLang engine takes: its
    tensor-parallel size, algo.teacher.tp_size for a teacher engine when set, else
    rollout.sglang.tp_size. None for the built-in engine, which takes a share of what there is."""
    if cfg.rollout.kind.gpus_per_engine(cfg.rollout) is None:
        return None
    own = {"teacher": cfg.algo.teacher.tp_size}
    return [own.get(pool) or cfg.rollout.sglang.tp_size for _, pool, n in engine_pools(cfg) for _ in range(n)]


def place_local(cfg: JobConfig, visible: int) -> LocalDevices:
    """The roles take GPUs only when there are enough for all of them: one per trainer rank, then
    one per engine (an SGLang engine its tensor-parallel size: sglang_sizes; judge and teacher
    engines after the rollout ones); otherwise everything runs on the CPU (a trainer on GPUs would push weights over
    NCCL, which an engine on the CPU cannot join).
    launch.local_trainer_gpus and launch.local_engine_gpus, when set, decide instead."""
    ranks = 0 if cfg.kind == "eval" else cfg.trainer.num_ranks  # an eval job has engines only
    count = engine_count(cfg)
    if cfg.launch.colocate:
        return _colocated(ranks, count, visible)
    sizes = sglang_sizes(cfg) or [1] * count
    enough = visible >= ranks + sum(sizes)
    trainer = cfg.launch.local_trainer_gpus or (f"0-{ranks - 1}" if enough and ranks else NO_GPU)
    if cfg.launch.local_engine_gpus:
        engines: list[str | None] = list(cfg.launch.local_engine_gpus)
    elif enough:
        starts = [ranks + sum(sizes[:i]) for i in range(count)]
        engines = [f"{first}-{first + size - 1}" for first, size in zip(starts, sizes, strict=True)]
    else:
        engines = [NO_GPU] * count
    return LocalDevices(trainer, engines, _describe(trainer, engines, visible, ranks))


def _colocated(ranks: int, count: int, visible: int) -> LocalDevices:
    """Engine i on trainer rank i's GPU (modulo the ranks); each engine sees the trainer's GPUs,
    so that the device index in a CUDA IPC handle means the same GPU to both."""
    if visible < ranks:
        return LocalDevices(
            NO_GPU, [NO_GPU] * count, "CPU only, colocated" + (f" ({visible} GPU(s) visible)" if visible else "")
        )
    gpus = f"0-{ranks - 1}"
    devices = [f"cuda:{i % ranks}" for i in range(count)]
    summary = f"colocated on GPUs {gpus}: trainer rank r and engines r, r+{ranks}, ... share GPU r"
    return LocalDevices(gpus, [gpus] * count, summary, devices)


def _describe(trainer: str, engines: list[str | None], visible: int, ranks: int) -> str:
    def where(gpus: str | None) -> str:
        if gpus == NO_GPU:
            return "CPU"
        return f"GPU {gpus.split('-')[0]}" if gpus and span(gpus) == 1 else f"GPUs {gpus or 'all'}"

    if trainer == NO_GPU and all(e == NO_GPU for e in engines):
        return "CPU only" + (f" ({visible} GPU(s) visible: fewer than the roles need)" if visible else "")
    engine_part = ", ".join(where(e) for e in engines)
    return f"trainer on {where(trainer)} ({ranks} rank(s)), engines on {engine_part} ({visible} GPU(s) visible)"


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        raise SystemExit(__doc__)
    os.environ["CUDA_VISIBLE_DEVICES"] = select(os.environ.get("CUDA_VISIBLE_DEVICES"), sys.argv[1])
    os.execvp(sys.argv[3], sys.argv[3:])


if __name__ == "__main__":
    main()
