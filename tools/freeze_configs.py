"""Freeze every shipped job config as a run would (RUN_DIR/config.yaml: the resolved config), with
whichever relax_hpc is on the path: the configs a release froze are kept under tests/data/ so that
tests/unit/test_frozen_configs.py checks that later code still loads them (a run started by that
release resumes only if it does).

    git worktree add /tmp/relax-0.20.0 9195a18
    PYTHONPATH=/tmp/relax-0.20.0 .venv/bin/python tools/freeze_configs.py \
        --configs /tmp/relax-0.20.0/configs --out tests/data/frozen-0.20.0

Paths resolve against /relax_hpc (a stand-in for wherever the repository was), so the files hold
no machine's paths. Pipeline configs (stages of jobs, not a job) are left out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from relax_hpc.config.load import load_config, to_yaml

BASE = Path("/relax_hpc")  # where relative paths resolve: no real machine's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", type=Path, required=True, help="the release's configs/ folder")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for config in sorted(args.configs.glob("*.yaml")):
        if "stages" in (yaml.safe_load(config.read_text()) or {}):
            continue
        cfg = load_config(config, [f"run.dir=runs/{config.stem}"], base_dir=BASE)
        (args.out / config.name).write_text(to_yaml(cfg))
        print(config.name)


if __name__ == "__main__":
    main()
