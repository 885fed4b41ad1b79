"""Every path inside RUN_DIR, in one place. Roles never build RUN_DIR paths by hand.

RUN_DIR/
  config.yaml  token                    the frozen config; the run's API key (0600)
  registry/engines/ID.json              where each engine listens (relax_hpc.protocol.registry)
  registry/judge/ID.json                the judge engines (reward.name=judge)
  registry/teacher/ID.json              the teacher engines (algo.teacher.num_engines)
  spool/ready|claimed|quarantine|orphaned   sample batches (SpoolDirs, relax_hpc.exchange.spool)
  weights/version                       the policy version the engines hold, and how many
  weights/lora/vN                       the last versions' PEFT adapter folders (trainer.lora.sync adapter)
  weights/files/vN  vN-delta            a version's safetensors, whole or as a delta (weights.channel file)
  weights/quarantine/ID.json            engines out of service: their weights differ from the trainer's
  ckpt/step-N  ckpt/latest              checkpoints (CkptDirs, relax_hpc.ckpt)
  metrics/train|rollout|eval.jsonl      the record of the run (reward_failures.jsonl: failed rewards;
                                        startup.jsonl: each process's start-up, metrics/startup.py)
  logs/RESTART/ROLE.log                 one folder per start of the launcher
  eval/results.jsonl  eval/table.md     an eval job's record (kind=eval) and its tables
  eval/models/NAME                      the checkpoints it scores, exported as HF folders
  slurm/                                submitit's folder (submission file, job output), job_id,
                                        job_id.claim (a submission under way)
  control/stop                          asks the trainer to checkpoint and stop
  fence/lease.json  fence/refused/      fencing: the current generation and role processes; refused writes
  fence/launcher                        the live local launcher's pid (flocked while it runs)
  health/ROLE.json                      heartbeats: what each role is doing, since when
  scale/ops|drain|logs                  elastic rollout: scale operations, engines leaving, their logs
"""

from __future__ import annotations

import errno
import os
import secrets
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def token(self) -> Path:
        return self.root / "token"

    @property
    def engines(self) -> Path:
        return self.root / "registry" / "engines"

    @property
    def spool(self) -> Path:
        return self.root / "spool"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def weights_version(self) -> Path:
        """`VERSION ENGINES`: the policy version the engines hold (a record for humans and tools)."""
        return self.weights / "version"

    @property
    def lora_adapters(self) -> Path:
        """The PEFT adapter folders the engines load (trainer.lora.sync adapter), vN per version."""
        return self.weights / "lora"

    @property
    def weight_files(self) -> Path:
        """Each version's safetensors the engines load from disk (weights.channel file)."""
        return self.weights / "files"

    @property
    def weights_quarantine(self) -> Path:
        """ID.json per engine process whose weights differ from the trainer's (weights.verify_every):
        out of service until a push matches it (relax_hpc.protocol.registry.Quarantine)."""
        return self.weights / "quarantine"

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    @property
    def train_metrics(self) -> Path:
        """One record per trainer step, plus `start` and `end` events (the trainer's rank 0)."""
        return self.metrics / "train.jsonl"

    @property
    def rollout_metrics(self) -> Path:
        """One record per published batch (the driver)."""
        return self.metrics / "rollout.jsonl"

    @property
    def eval_metrics(self) -> Path:
        """One record per evaluation of a policy version (the driver)."""
        return self.metrics / "eval.jsonl"

    @property
    def reward_failures(self) -> Path:
        """One record per sample whose reward failed (the driver): batch, prompt, response, reason."""
        return self.metrics / "reward_failures.jsonl"

    @property
    def judge_engines(self) -> Path:
        """The judge engines' registry (reward.name=judge): never part of weight sync."""
        return self.root / "registry" / "judge"

    @property
    def teacher_engines(self) -> Path:
        """The teacher engines' registry (algo.teacher.num_engines): never part of weight sync."""
        return self.root / "registry" / "teacher"

    def health(self, role: str) -> Path:
        """A role's heartbeat (relax_hpc.launch.health): what it is doing, since when."""
        return self.root / "health" / f"{role}.json"

    @property
    def scale(self) -> Path:
        """Elastic rollout (relax_hpc.launch.elastic): ops/ID.json, drain/ENGINE, logs/ID/."""
        return self.root / "scale"

    def drain_marker(self, engine_id: str) -> Path:
        """Exists while an elastic engine drains: the driver sends it nothing new."""
        return self.scale / "drain" / engine_id

    @property
    def registries(self) -> list[Path]:
        """Every engine pool's registry: the rollout engines', the judge's, the teacher's."""
        return [self.engines, self.judge_engines, self.teacher_engines]

    def registry(self, pool: str) -> Path:
        """The registry of an engine pool: `policy` (the rollout engines), `judge` or `teacher`."""
        return {"policy": self.engines, "judge": self.judge_engines, "teacher": self.teacher_engines}[pool]

    @property
    def events_metrics(self) -> Path:
        """The launcher's events: each start, role exits and restarts with their cause, stop
        requests, each end with its exit status."""
        return self.metrics / "events.jsonl"

    @property
    def sinks_cursor(self) -> Path:
        """How far the metric sinks (TensorBoard, ClearML) have read each JSONL file."""
        return self.metrics / "sinks.json"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files (metrics.tensorboard), one run across restarts."""
        return self.root / "tensorboard"

    @property
    def clearml(self) -> Path:
        """ClearML: the task id (clearml/task_id) and, offline, the sessions to import."""
        return self.root / "clearml"

    @property
    def plots(self) -> Path:
        """Figures written by `python -m relax_hpc.plot`."""
        return self.root / "plots"

    @property
    def export(self) -> Path:
        """The final model as an HF folder (ckpt.export_hf)."""
        return self.root / "hf"

    @property
    def logs_root(self) -> Path:
        return self.root / "logs"

    @property
    def slurm(self) -> Path:
        """submitit's folder: the submission file, each job's output and result."""
        return self.root / "slurm"

    @property
    def slurm_job_id(self) -> Path:
        """The id of the Slurm job `submit` handed the run to."""
        return self.slurm / "job_id"

    @property
    def slurm_claim(self) -> Path:
        """Held (created exclusively) by the one submission that may record a new job (launch.owner)."""
        return self.slurm / "job_id.claim"

    @property
    def launcher_lock(self) -> Path:
        """flocked by the run's live local launcher, which writes its pid in it (launch.owner)."""
        return self.root / "fence" / "launcher"

    @property
    def control(self) -> Path:
        return self.root / "control"

    @property
    def stop_request(self) -> Path:
        """Its existence asks the trainer to checkpoint at the next safe point and stop."""
        return self.control / "stop"

    def logs(self, restart: int) -> Path:
        return self.logs_root / str(restart)

    def new_logs(self) -> Path:
        """The log folder of a new start of the launcher (created): logs/0, logs/1, ..."""
        self.logs_root.mkdir(exist_ok=True)
        path = self.logs(len([p for p in self.logs_root.iterdir() if p.name.isdigit()]))
        path.mkdir(parents=True)
        return path

    @property
    def eval_results(self) -> Path:
        """An eval job's record (kind=eval): one line per model x dataset scored."""
        return self.root / "eval" / "results.jsonl"

    @property
    def eval_models(self) -> Path:
        """An eval job's checkpoints exported as HF folders, one per model name."""
        return self.root / "eval" / "models"

    @property
    def eval_table(self) -> Path:
        """An eval job's results as markdown tables, one per dataset (made from eval_results)."""
        return self.root / "eval" / "table.md"

    def probe(self, name: str) -> Path:
        """A file every node of an allocation must be able to read (is RUN_DIR shared?)."""
        return self.control / f"probe-{name}"

    def create(self) -> None:
        """Create RUN_DIR (0700: it holds the run's weight-sync token) and its subfolders."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        for d in (*self.registries, self.spool, self.weights, self.ckpt, self.metrics, self.control):
            d.mkdir(parents=True, exist_ok=True)
        if not self.token.exists():
            write_atomic(self.token, secrets.token_hex(16).encode(), mode=0o600)

    def read_token(self) -> str:
        return self.token.read_text().strip()


def draining(paths: RunPaths) -> set[str]:
    """The engines asked to leave (elastic rollout's scale in)."""
    folder = paths.scale / "drain"
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Make `path` hold `data`, visible to readers only once complete: tmp, fsync, rename. A
    failed write leaves no tmp file and names `path` (os.write's error names no file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from e
    fsync_dir(path.parent)


# Space a writer leaves free on RUN_DIR's filesystem for the small records (events, heartbeats,
# manifests) that report a full disk and let the run stop cleanly.
RESERVE_BYTES = 256 * 1024


def require_space(path: Path, nbytes: int) -> None:
    """Raise ENOSPC, naming `path`, when writing about `nbytes` there would leave less than
    RESERVE_BYTES free: for writers that a full disk would crash rather than fail (HDF5 segfaults
    when a write fails)."""
    stat = os.statvfs(path.parent)
    if stat.f_bavail * stat.f_frsize < nbytes + RESERVE_BYTES:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def fsync_dir(path: Path) -> None:
    """Persist a rename: fsync the directory that holds the entry."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class SpoolDirs:
    """The folders of the spool (relax_hpc.exchange.spool has the rules of each)."""

    root: Path

    @property
    def ready(self) -> Path:
        return self.root / "ready"

    @property
    def claimed(self) -> Path:
        return self.root / "claimed"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    @property
    def orphaned(self) -> Path:
        return self.root / "orphaned"

    def claimed_by(self, step: int) -> Path:
        return self.claimed / f"step-{step:08d}"

    @staticmethod
    def step_of(claimed_dir: Path) -> int | None:
        """The step a claimed/ subfolder belongs to (None: not a step's folder)."""
        name = claimed_dir.name
        return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


@dataclass(frozen=True)
class CkptDirs:
    """The checkpoint folders (relax_hpc.ckpt has the rules: a step's folder counts once complete)."""

    root: Path

    def step(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def partial(self, step: int) -> Path:
        """Where a step's checkpoint is written before it is renamed into place."""
        return self.root / f".step-{step:08d}.tmp"

    @property
    def latest(self) -> Path:
        """A symbolic link to the latest complete step folder, moved atomically."""
        return self.root / "latest"

    @property
    def latest_partial(self) -> Path:
        return self.root / ".latest.tmp"

    def steps(self) -> list[Path]:
        """Every step folder, complete or not, oldest first."""
        return sorted(self.root.glob("step-*"))
