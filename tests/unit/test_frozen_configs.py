"""Every RUN_DIR/config.yaml that release 0.20.0 froze (one per shipped job config, made by
tools/freeze_configs.py with that release's code and kept under tests/data/frozen-0.20.0) still
loads: a run started by it resumes only if its frozen config does. Each loads to the settings it
froze; keys added since take their defaults. Since the weight channels became variants (issue 47),
the other channels' options a file froze at their defaults are dropped (they did nothing), and
only those."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from relax_hpc.config.load import read_frozen
from relax_hpc.config.schema import WEIGHT_CHANNELS, JobConfig

FROZEN = sorted((Path(__file__).resolve().parents[1] / "data" / "frozen-0.20.0").glob("*.yaml"))


def _leaves(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _leaves(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


def test_every_shipped_config_was_frozen():
    assert len(FROZEN) >= 30, FROZEN


def _other_channels_defaults(cfg: JobConfig) -> dict[str, object]:
    own = type(cfg.weights).model_fields
    return {
        f"weights.{name}": field.default
        for variant in WEIGHT_CHANNELS.values()
        for name, field in variant.model_fields.items()
        if name not in own
    }


@pytest.mark.parametrize("frozen", FROZEN, ids=[p.stem for p in FROZEN])
def test_a_config_frozen_by_0_20_0_loads_to_what_it_froze(frozen: Path):
    cfg = read_frozen(frozen)
    now = _leaves(cfg.model_dump(mode="json"))
    then = _leaves(yaml.safe_load(frozen.read_text()))
    differ = {key: value for key, value in then.items() if now.get(key, object()) != value}
    dropped = _other_channels_defaults(cfg)
    assert {key: value for key, value in differ.items() if dropped.get(key, object()) != value} == {}
    assert set(differ) <= set(dropped)
