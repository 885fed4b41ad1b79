"""Run a command on a slice of the GPUs this job step sees:

    python -m relax_hpc.launch.gpus FIRST-LAST -- COMMAND...

Slurm gives every step of a node the job's GPUs there; roles that share a node (trainer on GPUs
0-3, engines on 4-7) each take their slice. Indices count within the step's CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path


def select(visible: str | None, first_last: str) -> str:
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


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        raise SystemExit(__doc__)
    os.environ["CUDA_VISIBLE_DEVICES"] = select(os.environ.get("CUDA_VISIBLE_DEVICES"), sys.argv[1])
    os.execvp(sys.argv[3], sys.argv[3:])


if __name__ == "__main__":
    main()
