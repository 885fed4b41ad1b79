"""Submit a relax_hpc job.

    python -m relax_hpc.submit --config configs/tiny-grpo.yaml [key=value ...] [--dry-run]

Validates the config and its inputs before anything starts, freezes the resolved config in
RUN_DIR/config.yaml, and runs the job with the configured executor. Running the same command on
an existing RUN_DIR resumes it from its latest checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

from relax_hpc.config.load import ConfigError, load_config, read_frozen, to_yaml
from relax_hpc.config.schema import RESUMABLE_CHANGES, JobConfig
from relax_hpc.data.prompts import DatasetError, load_prompts
from relax_hpc.paths import RunPaths, write_atomic



def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_inputs(cfg: JobConfig) -> None:
    """Fail before any process starts when an input is unusable."""
    if not (Path(cfg.model.path) / "config.json").is_file():
        raise ConfigError(
            f"model.path: {cfg.model.path} is not an HF model folder (no config.json); "
            "for the embedded default run `python tools/make_tiny_policy.py --out assets`"
        )
    try:
        load_prompts(cfg.data.path, cfg.data.prompt_key, cfg.data.answer_key)
    except DatasetError as e:
        raise ConfigError(str(e)) from None


def freeze(cfg: JobConfig, paths: RunPaths) -> None:
    """Write RUN_DIR/config.yaml, or check that a resume changes only what it may."""
    if paths.config.exists():
        old = _flatten(read_frozen(paths.config).model_dump(mode="json"))
        new = _flatten(cfg.model_dump(mode="json"))
        changed = [k for k in new if old.get(k) != new[k]]
        forbidden = [k for k in changed if not k.startswith(RESUMABLE_CHANGES)]
        if forbidden:
            details = "\n  ".join(f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in forbidden)
            raise ConfigError(
                f"{paths.root} holds a run with a different config:\n  {details}\n"
                "resume it with the same settings, or pick a new run.dir"
            )
    paths.create()
    write_atomic(paths.config, to_yaml(cfg).encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, help="YAML job config (default: built-in defaults)")
    parser.add_argument("--dry-run", action="store_true", help="validate, print the resolved config and commands, run nothing")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. trainer.lr=3e-4 rollout.num_engines=4")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        check_inputs(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    paths = RunPaths(Path(cfg.run.dir))
    from relax_hpc.launch.local import LocalLauncher, role_commands  # heavy imports after validation

    if args.dry_run:
        print(to_yaml(cfg))
        for name, argv_ in role_commands(cfg, paths).items():
            print(f"{name}: {shlex.join(argv_)}")
        return 0
    try:
        freeze(cfg, paths)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return LocalLauncher(cfg, paths).run()


if __name__ == "__main__":
    sys.exit(main())
