"""Which checkpoint to export, and which ones pruning must keep (ckpt.export_version=best).

The driver measures an eval metric at the eval points (every rollout.eval_every versions and the
last one, RUN_DIR/metrics/eval.jsonl); with export_version=best the trainer checkpoints each of
those versions before the engines get it and waits for its evaluation before training on, so
every evaluated version has a checkpoint. The best is the evaluated version with a complete
checkpoint whose metric is highest; a tie goes to the later version (it trained on more data and
scored as well, and a run that never improves exports its last version, as export_version=last
would). Pure rules and file reads without torch; the evaluations are read in
relax_hpc.metrics.summary (a higher layer) and passed in as {version: score}.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from relax_hpc.ckpt.layout import STATE_FILE
from relax_hpc.paths import CkptDirs, write_atomic

EXPORT_RECORD = "EXPORT.json"  # in RUN_DIR/hf: which version was exported and why


def is_eval_version(version: int, total: int, every: int) -> bool:
    """A version the driver evaluates (its eval points, rollout.eval_every; 0 = the last only).
    Version 0, the base model, is evaluated too but never checkpointed: it is model.path."""
    return version > 0 and (version == total or (every > 0 and version % every == 0))


def complete_steps(ckpt_root: Path) -> list[int]:
    """The steps of the complete checkpoints, oldest first."""
    return [int(p.name.split("-")[1]) for p in CkptDirs(ckpt_root).steps() if (p / STATE_FILE).is_file()]


def best_version(scored: dict[int, float], checkpointed: list[int]) -> int | None:
    """The checkpointed version with the highest score; a tie goes to the later version."""
    candidates = [v for v in checkpointed if v in scored]
    return max(candidates, key=lambda v: (scored[v], v), default=None)


def prunable(steps: list[int], keep: int, best: int | None) -> list[int]:
    """The checkpoints (steps, oldest first) pruning deletes: all but the newest `keep` and the best."""
    return [s for s in sorted(steps)[:-keep] if s != best]


@dataclass(frozen=True)
class ExportChoice:
    version: int
    export_version: str  # ckpt.export_version
    metric: str
    value: float | None  # the exported version's metric (None: not evaluated)
    last_version: int
    last_value: float | None
    why: str


def choose_export(
    scored: dict[int, float], ckpt_root: Path, export_version: str, metric: str, last: int
) -> ExportChoice:
    """The version to export at the end of a run whose last version is `last`, by the evaluations
    `scored` ({version: metric})."""
    best = best_version(scored, complete_steps(ckpt_root)) if export_version == "best" else None
    version = last if best is None else best
    if export_version == "last":
        why = "ckpt.export_version=last"
    elif best is None:
        why = f"no evaluated version has a checkpoint: the last version, {last}"
    elif best == last:
        why = f"the last version has the best {metric} ({scored[best]:.4f}; ties go to the later version)"
    else:
        against = f"{scored[last]:.4f} at the last, {last}" if last in scored else f"the last, {last}, not evaluated"
        why = f"best {metric} {scored[best]:.4f} at version {best}, against {against}"
    return ExportChoice(version, export_version, metric, scored.get(version), last, scored.get(last), why)


def write_record(folder: Path, choice: ExportChoice) -> None:
    write_atomic(folder / EXPORT_RECORD, (json.dumps(asdict(choice), indent=2) + "\n").encode())


def read_record(folder: Path) -> dict[str, Any] | None:
    path = folder / EXPORT_RECORD
    return json.loads(path.read_text()) if path.is_file() else None
