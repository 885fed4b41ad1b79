"""docs/config.md is generated from the schema; it must not drift from it."""

from pathlib import Path

from relax_hpc.config.docs import list_section, render
from relax_hpc.config.pipeline import PipelineConfig
from relax_hpc.config.schema import JobConfig, Section


def test_config_reference_is_current():
    path = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert path.read_text() == render(), "docs/config.md is stale: python -m relax_hpc.config.docs > docs/config.md"


def test_every_option_is_documented():
    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, Section):
                yield from walk(field.annotation, f"{prefix}{name}.")
            else:
                if (item := list_section(field.annotation)) is not None:  # eval.models[].path, ...
                    yield from walk(item, f"{prefix}{name}[].")
                yield f"{prefix}{name}", field.description

    undocumented = [key for model in (JobConfig, PipelineConfig) for key, doc in walk(model) if not doc]
    assert undocumented == []
