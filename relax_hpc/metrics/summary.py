"""What a run has to say for itself once it ends (or when asked again): reward, evaluation,
checkpoint, and where the model is. Reads RUN_DIR only."""

from __future__ import annotations

import statistics
from typing import Any

from relax_hpc.ckpt.best import best_version, complete_steps, read_record
from relax_hpc.ckpt.layout import latest_dir, read_trainer_state
from relax_hpc.config.path_options import python_command
from relax_hpc.config.schema import CheckpointConfig
from relax_hpc.metrics import accounting
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.paths import RunPaths


def step_records(paths: RunPaths) -> list[dict[str, Any]]:
    """The trainer's records of trained steps, in order."""
    return [r for r in read_jsonl(paths.train_metrics) if "loss" in r]


def completed_steps(paths: RunPaths) -> int:
    """Trainer steps the latest checkpoint holds (0 before the first)."""
    return int((read_trainer_state(paths.ckpt) or {"step": 0})["step"])


def eval_scores(paths: RunPaths, metric: str) -> dict[int, float]:
    """Per version the driver evaluated, its `metric` (a version evaluated twice: the later record)."""
    return {
        int(r["version"]): float(r[metric]) for r in read_jsonl(paths.eval_metrics) if metric in r and "version" in r
    }


def best_checkpoint(paths: RunPaths, metric: str) -> int | None:
    """The best evaluated version that has a complete checkpoint (ckpt.export_version=best)."""
    return best_version(eval_scores(paths, metric), complete_steps(paths.ckpt))


def guard_reason(paths: RunPaths) -> str | None:
    """Why the no-progress guard ended the job, if it did after the launcher's last start."""
    said = None
    for event in read_jsonl(paths.events_metrics):
        if event.get("event") in ("start", "no_progress"):
            said = event.get("why")
    return said


def run_summary(paths: RunPaths, total_steps: int) -> str:
    """A few lines: how far the run got, its recent reward, its last evaluation, its checkpoint,
    how to get the model out, and its GPU- and CPU-hours (metrics.accounting: sacct where the
    run's jobs have records, else its events)."""
    steps = step_records(paths)
    evals = [r for r in read_jsonl(paths.eval_metrics) if "greedy_accuracy" in r]
    done = completed_steps(paths)
    lines = [f"{'training complete' if done >= total_steps else 'stopped'} at step {done}/{total_steps}"]
    if steps:
        name = "reward" if "reward" in steps[-1] else "loss"  # an sft run's steps have a loss only
        recent = [r[name] for r in steps[-10:]]
        lines.append(f"{name} {statistics.fmean(recent):.3f} (mean of the last {len(recent)} steps)")
    if evals:
        last = evals[-1]
        lines.append(f"greedy accuracy {last['greedy_accuracy']:.3f} at version {last['version']}")
    checkpoint = latest_dir(paths.ckpt)
    if checkpoint is not None:
        lines.append(f"checkpoint: {checkpoint}")
    if holds_export(paths):
        lines.append(f"HF model:   {paths.export}{exported_version(paths)}")
    elif checkpoint is not None:
        lines.append(f"HF export:  {python_command()} tools/dcp_to_hf.py --run-dir {paths.root} --out FOLDER")
    lines.append(f"plots:      {python_command()} -m relax_hpc.plot {paths.root}")
    lines += accounting.render(accounting.accounting(paths))
    reason = guard_reason(paths)
    if reason:
        lines.append(reason)
    return "\n".join(lines)


def holds_export(paths: RunPaths) -> bool:
    """Whether RUN_DIR/hf holds an export: an HF model folder, or a LoRA run's PEFT adapter folder
    (ckpt.export_lora=adapter), which has an adapter_config.json instead of a config.json."""
    return any((paths.export / name).is_file() for name in ("config.json", "adapter_config.json"))


def finished_export_problem(paths: RunPaths, ck: CheckpointConfig) -> str | None:
    """Why a finished run submitted again cannot have the export `ck` asks for (None: RUN_DIR/hf
    holds it, or none is asked). The export is made once, by the trainer as training completes;
    a finished run starts no trainer, so a changed ckpt.export_version would be frozen into its
    config.yaml while RUN_DIR/hf still held the version the run ended with."""
    record = read_record(paths.export) if holds_export(paths) else None
    if not ck.export_hf or (record is not None and record["export_version"] == ck.export_version):
        return None
    steps = complete_steps(paths.ckpt)
    if ck.export_version == "best":
        version = best_version(eval_scores(paths, ck.export_metric), steps)
    else:
        version = steps[-1] if steps else None
    how = (
        f"export it with {python_command()} tools/dcp_to_hf.py --run-dir {paths.root} --step {version} --out FOLDER"
        if version is not None
        else "no evaluated version has a checkpoint left"
    )
    holds = "no export" if record is None else f"version {record['version']} ({record['export_version']})"
    return (
        f"ckpt.export_version={ck.export_version}: {paths.root} is complete and {paths.export} holds {holds}; "
        f"a finished run is not exported again: {how}"
    )


def exported_version(paths: RunPaths) -> str:
    """Which version RUN_DIR/hf holds and why (its EXPORT.json), for the summary's HF line."""
    record = read_record(paths.export)
    return "" if record is None else f" (version {record['version']}: {record['why']})"
