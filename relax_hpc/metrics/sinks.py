"""The metric sinks: TensorBoard and ClearML, fed from the JSONL records by a process of their own.

    python -m relax_hpc.metrics.sinks --run-dir RUN_DIR      (the launcher runs it as role `metrics`)

JSONL (RUN_DIR/metrics) is the record; the sinks only copy it: every numeric field of the
trainer's step records (at the step), the driver's batch records (at the batch number) and the
evaluations (at the policy version). Being a process of their own keeps them off the training
step's path (a ClearML report can stall for seconds) and keeps their failures away from the run:
a sink that fails is reported and the run goes on. An eval job (kind=eval), which trains
nothing, feeds them itself after each model x dataset it scores (`forward_eval_results`). The
sinks remember the last record time they forwarded from each file (RUN_DIR/metrics/sinks.json),
so a restart neither repeats nor skips a record; records a restart rolled back
(launch/recover.py drops them from the files) were already forwarded: TensorBoard discards them
(the writer is reopened with purge_step past the checkpoint), ClearML keeps both points of such
a step.

- TensorBoard (metrics.tensorboard): event files in RUN_DIR/tensorboard, one run across restarts.
- ClearML (metrics.clearml): one task per run, its id in RUN_DIR/clearml/task_id (task_id.offline
  offline), reopened by every restart and every Slurm requeue; the resolved config as
  hyperparameters; the final HF export (RUN_DIR/hf) as an artifact once training completes.
  Offline, the session lives in RUN_DIR/clearml/offline/ID (a zip beside it after each close):
  import it with `clearml-task --import-offline-session` or `Task.import_offline_session(PATH)`.
  Online, the server and credentials come from the user's clearml.conf or CLEARML_* variables,
  never from relax_hpc's config, and are written nowhere by relax_hpc.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from relax_hpc import fence
from relax_hpc.config.load import read_frozen
from relax_hpc.config.schema import ClearMLConfig, MetricsConfig
from relax_hpc.metrics.accounting import accounting
from relax_hpc.metrics.jsonl import JsonlFollower, read_jsonl
from relax_hpc.metrics.summary import completed_steps
from relax_hpc.paths import RunPaths, write_atomic

log = logging.getLogger("relax_hpc.metrics")
FLUSH_EVERY_S = 10.0  # the cursor and the sinks' buffers go to disk at least this often
# Fields that say where a record sits, not what was measured.
NOT_METRICS = {"time", "step", "version", "batch", "event"}
# Which file feeds which series, and the field that orders its records.
SOURCES = {"train": "step", "rollout": "batch", "eval": "version"}


class Sink(Protocol):
    def scalar(self, title: str, name: str, value: float, iteration: int) -> None: ...

    def flush(self) -> None: ...

    def finished(self, paths: RunPaths) -> None:
        """Training completed: register what the run produced."""
        ...

    def close(self) -> None: ...


class TensorBoardSink:
    def __init__(self, paths: RunPaths, training: bool = True) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A run's events of steps past the checkpoint were trained again after a restart: purge
        # them. An eval job (training=False) rolls nothing back.
        purge_step = completed_steps(paths) + 1 if training else None
        self.writer = SummaryWriter(log_dir=str(paths.tensorboard), purge_step=purge_step)

    def scalar(self, title: str, name: str, value: float, iteration: int) -> None:
        self.writer.add_scalar(f"{title}/{name}", value, iteration)

    def flush(self) -> None:
        self.writer.flush()

    def finished(self, paths: RunPaths) -> None:
        pass

    def close(self) -> None:
        self.writer.close()


# Every framework ClearML would hook, listed: a key left out of the dict counts as on.
NO_FRAMEWORKS = dict.fromkeys(
    ("matplotlib", "tensorflow", "tensorboard", "tfdefines", "pytorch", "xgboost", "scikit", "joblib", "fastai",
     "lightgbm", "hydra", "megengine", "catboost", "gradio", "jsonargparse", "detect_repository"),
    False,
)  # fmt: skip


class ClearMLSink:
    """One task per run, reopened by id on every start (clearml 2.1: `reuse_last_task_id=ID`,
    `continue_last_task=0` reopens it without shifting iterations, offline too)."""

    def __init__(self, paths: RunPaths, settings: ClearMLConfig, config: dict[str, Any]) -> None:
        state = paths.clearml
        state.mkdir(parents=True, exist_ok=True)
        # Offline sessions, ClearML's cache and its session file go into RUN_DIR, not ~/.clearml.
        os.environ["CLEARML_CACHE_DIR"] = str(state)
        from clearml import Task
        from clearml.binding.environ_bind import PatchOsFork
        from clearml.config import config_obj
        from clearml.config.cache import SessionCache

        SessionCache.SESSION_CACHE_FOLDER = str(state)
        # Threads instead of a reporter process (1.5 ms per scalar and a 5-11 s close with the process).
        Task._report_subprocess_enabled = False  # type: ignore[assignment]  # a private switch, read as a bool
        Task.set_random_seed(None)  # Task.init would reseed random, numpy and torch
        # An unreachable server must not hold the sink for minutes (ClearML retries 240 times by default).
        config_obj.set_overrides(
            {"api": {"http": {"wait_on_maintenance_forever": False,
                              "retries": {"total": 3, "connect": 3, "read": 3, "redirect": 3, "status": 3,
                                          "backoff_factor": 0.5, "backoff_max": 5}}}}
        )  # fmt: skip
        offline = settings.offline
        if not offline and not _server_answers():
            log.warning("ClearML: the server does not answer; writing an offline session to import later")
            offline = True
        Task.set_offline(offline)
        id_file = state / ("task_id.offline" if offline else "task_id")
        previous = id_file.read_text().strip() if id_file.is_file() else None
        if previous and offline and not (state / "offline" / previous / "task.json").is_file():
            previous = None
        self.task: Any = Task.init(
            project_name=settings.project,
            task_name=settings.task_name or paths.root.name,
            tags=list(settings.tags) or None,
            reuse_last_task_id=previous or False,
            continue_last_task=0 if previous else False,
            auto_connect_frameworks=NO_FRAMEWORKS,
            auto_connect_arg_parser=False,
            auto_connect_streams=False,
            auto_resource_monitoring=False,
            output_uri=None,
        )
        write_atomic(id_file, f"{self.task.id}\n".encode())
        Task._remove_signal_hooks()  # its SIGTERM hook swallows the signal: this process stops on its own terms
        PatchOsFork._current_task = None
        self.task.connect(config, name="config")
        self.logger: Any = self.task.get_logger()
        log.info("ClearML task %s (%s)", self.task.id, "offline" if offline else "online")

    def scalar(self, title: str, name: str, value: float, iteration: int) -> None:
        self.logger.report_scalar(title, name, value, iteration=iteration)

    def flush(self) -> None:
        self.task.flush(wait_for_uploads=True)

    def finished(self, paths: RunPaths) -> None:
        if (paths.export / "config.json").is_file():
            self.task.upload_artifact("hf_model", artifact_object=paths.export, wait_on_upload=True)

    def close(self) -> None:
        self.task.close()


def _server_answers(timeout_s: float = 3.0) -> bool:
    """Whether the configured ClearML server answers its ping (no credentials are sent)."""
    from clearml.backend_api import Session

    try:
        urllib.request.urlopen(f"{Session.get_api_server_host()}/debug.ping", timeout=timeout_s).read()
    except urllib.error.HTTPError as e:
        return e.code < 500
    except (OSError, ValueError):
        return False
    return True


def open_sinks(metrics: MetricsConfig, paths: RunPaths, config: dict[str, Any], training: bool = True) -> list[Sink]:
    """The sinks `metrics` enables; `config`: the run's whole config as JSON, which ClearML records;
    `training`: False for an eval job."""
    sinks: list[Sink] = []
    if metrics.tensorboard:
        sinks.append(TensorBoardSink(paths, training))
    if metrics.clearml.enabled:
        sinks.append(ClearMLSink(paths, metrics.clearml, config))
    return sinks


def scalars(source: str, record: dict[str, Any]) -> Iterator[tuple[str, str, float, int]]:
    """(title, name, value, iteration) of every number in a record (events are not metrics)."""
    if "event" in record:
        return
    iteration = int(record[SOURCES[source]])
    for name, value in record.items():
        if name not in NOT_METRICS and isinstance(value, int | float) and not isinstance(value, bool):
            yield source, name, float(value), iteration


class Forwarder:
    """Copies new records from the JSONL files into the sinks, remembering how far it got: the
    time of the last record forwarded from each file (a file rewritten by a restart's recovery
    keeps its records' times, so the cursor stays valid where a byte offset would not)."""

    def __init__(self, paths: RunPaths, sinks: list[Sink]) -> None:
        self.paths, self.sinks = paths, sinks
        files = {"train": paths.train_metrics, "rollout": paths.rollout_metrics, "eval": paths.eval_metrics}
        self.followers = {source: JsonlFollower(path) for source, path in files.items()}
        cursor = json.loads(paths.sinks_cursor.read_text()) if paths.sinks_cursor.is_file() else {}
        self.done: dict[str, float] = {source: float(cursor.get(source, 0.0)) for source in files}
        self.finished = False

    def forward(self) -> int:
        """Forward what is new; returns how many records."""
        count = 0
        for source, follower in self.followers.items():
            for record in follower.new_records():
                if record["time"] <= self.done[source]:
                    continue  # forwarded before a restart
                for sink in self.sinks:
                    for title, name, value, iteration in scalars(source, record):
                        sink.scalar(title, name, value, iteration)
                self.done[source] = record["time"]
                count += 1
                if record.get("event") == "end" and record.get("completed") and not self.finished:
                    self.finished = True
                    for sink in self.sinks:
                        sink.finished(self.paths)
        return count

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()
        write_atomic(self.paths.sinks_cursor, json.dumps(self.done).encode())


def forward_eval_results(paths: RunPaths, sinks: list[Sink], models: list[str]) -> int:
    """An eval job's records (RUN_DIR/eval/results.jsonl) the sinks have not had yet: each figure
    under `eval/DATASET` at the model's position in eval.models (a run's checkpoints, listed in
    order, read left to right); how far it got is kept in sinks.json. Returns how many records.
    With no sink configured nothing is read and no cursor written."""
    if not sinks:
        return 0
    cursor = json.loads(paths.sinks_cursor.read_text()) if paths.sinks_cursor.is_file() else {}
    done, count = float(cursor.get("eval_results", 0.0)), 0
    for record in read_jsonl(paths.eval_results):
        if record["time"] <= done:
            continue
        for name in ("greedy_accuracy", "mean_at_k", "pass_at_k"):
            if name in record:
                for sink in sinks:
                    sink.scalar(f"eval/{record['dataset']}", name, float(record[name]), models.index(record["model"]))
        done, count = record["time"], count + 1
    for sink in sinks:
        sink.flush()
    write_atomic(paths.sinks_cursor, json.dumps(cursor | {"eval_results": done}).encode())
    return count


def forward_usage(paths: RunPaths, sinks: list[Sink]) -> None:
    """GPU- and CPU-hours per role so far, at the checkpointed step, as the sinks stop (the end
    of each start of the run): from the launcher's usage events, which it writes before stopping
    this role; no sacct here."""
    facts = accounting(paths, slurm=False)
    step = completed_steps(paths)
    values = {f"{kind}_{unit}": used[unit] for kind, used in facts["roles"].items() for unit in ("gpu_h", "cpu_h")}
    values |= {f"total_{unit}": facts["total"][unit] for unit in ("gpu_h", "cpu_h")}
    values |= {k: v for k, v in facts.items() if k.startswith("samples_per_")}
    for sink in sinks:
        for name, value in values.items():
            sink.scalar("usage", name, float(value), step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relax_hpc.metrics.sinks", description="relax_hpc metric sinks")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--poll-s", type=float, default=1.0, help="seconds between looks at the JSONL files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s metrics %(name)s %(levelname)s %(message)s")
    paths = RunPaths(args.run_dir)
    fence.install(paths.root)
    cfg = read_frozen(paths.config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    forwarder = Forwarder(paths, open_sinks(cfg.metrics, paths, cfg.model_dump(mode="json")))
    flushed = time.monotonic()
    while True:
        forwarder.forward()
        if stop.is_set():
            break
        if time.monotonic() - flushed > FLUSH_EVERY_S:
            forwarder.flush()
            flushed = time.monotonic()
        stop.wait(args.poll_s)
    forward_usage(paths, forwarder.sinks)
    forwarder.flush()
    for sink in forwarder.sinks:
        sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
