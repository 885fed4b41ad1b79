"""Run a role inside the configured container image.

    apptainer exec --nv --bind RUN_DIR,MODEL,DATA,CWD IMAGE.sif COMMAND...      (launch.container_runtime: apptainer)
    ch-run --set-env --bind RUN_DIR:RUN_DIR ... --cd CWD IMAGE_DIR -- COMMAND...  (charliecloud)

Everything a role reads or writes is bound at the same path it has outside, so RUN_DIR paths in
records and configs mean the same thing on both sides. ch-run cannot create a bind target in a
read-only image: the image must hold those directories (tools/containers/make_test_image.sh).
"""

from __future__ import annotations

import os
from pathlib import Path

from relax_hpc.config.path_options import bind_sources
from relax_hpc.config.schema import JobConfig


def bind_paths(cfg: JobConfig) -> list[str]:
    """Host paths a role needs: every folder a path option names (RUN_DIR, models, the data's
    folder), the working directory, then launch.container_binds."""
    out = bind_sources(cfg)
    cwd = str(Path.cwd().resolve())
    return [*out, *([cwd] if cwd not in out else []), *cfg.launch.container_binds]


def wrap_in_container(cfg: JobConfig, argv: list[str]) -> list[str]:
    image = cfg.launch.container
    if image is None:
        return argv
    binds = bind_paths(cfg)
    if cfg.launch.container_runtime == "apptainer":
        return ["apptainer", "exec", "--nv", "--bind", ",".join(binds), "--pwd", os.getcwd(), image, *argv]
    flags = [f for b in binds for f in ("--bind", b if ":" in b else f"{b}:{b}")]
    # --set-env: the image's own environment (its PATH first), as apptainer applies %environment.
    return ["ch-run", "--set-env", *flags, "--cd", os.getcwd(), image, "--", *argv]
