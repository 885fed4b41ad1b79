"""Where the latest complete checkpoint is, and its run state: readable without torch, so the
launcher (which recovers RUN_DIR before any role starts) stays light."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from relax_hpc.paths import CkptDirs

STATE_FILE = "trainer_state.json"


def latest_dir(ckpt_root: Path) -> Path | None:
    link = CkptDirs(ckpt_root).latest
    if not link.exists():
        return None
    target = ckpt_root / os.readlink(link)
    return target if (target / STATE_FILE).is_file() else None


def read_trainer_state(ckpt_root: Path) -> dict[str, Any] | None:
    """The run state of the latest complete checkpoint (None before the first one)."""
    target = latest_dir(ckpt_root)
    return json.loads((target / STATE_FILE).read_text()) if target else None
