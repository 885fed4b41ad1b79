"""A pipeline file: stages of jobs, each naming an earlier stage's output (`python -m relax_hpc.pipeline`).

Field docstrings are the documentation (docs/config.md's pipeline part is generated from them).
A reference is `${stages.NAME.OUTPUT}` anywhere in a stage's override values or its `export`;
OUTPUT is one of REFERENCE_OUTPUTS.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field, model_validator

from relax_hpc.config.schema import Section

REFERENCE = re.compile(r"\$\{([^}]*)\}")
# What a stage's output is called in a reference, and the path it stands for (relative to the
# stage's RUN_DIR; `ckpt` is the final checkpoint, RUN_DIR/ckpt/step-<trainer.total_steps>).
REFERENCE_OUTPUTS = {"run_dir": "", "hf": "hf", "ckpt": "ckpt"}
# Options a stage may not set: the pipeline owns them.
PIPELINE_OWNED = {
    "run.dir": "a stage's RUN_DIR is PIPELINE_DIR/NAME",
    "launch.executor": "set the pipeline's `executor`",
}


class StageConfig(Section):
    name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_-]*$")
    """The stage's name: its RUN_DIR is PIPELINE_DIR/NAME, and later stages name its outputs as
    `${stages.NAME.run_dir}` (its RUN_DIR), `${stages.NAME.hf}` (the HF folder it exports:
    RUN_DIR/hf) or `${stages.NAME.ckpt}` (its final checkpoint, RUN_DIR/ckpt/step-N)."""
    config: str | None = None
    """A job config file (kind sft, rl or eval; relative to the working directory, as submit's
    --config) that this stage runs as one job."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Options set on top of `config`, dotted keys as on submit's command line, values as YAML,
    e.g. `trainer.total_steps: 20` and `model.path: ${stages.sft.hf}` (within a flow mapping
    `{...}` quote a reference: `"${stages.sft.hf}"`). A stage may not set run.dir or
    launch.executor (the pipeline does)."""
    export: str | None = None
    """Instead of `config`: an export stage, a job that turns a run's checkpoint into an HF folder
    (what tools/dcp_to_hf.py does) in PIPELINE_DIR/NAME/hf. The run: `${stages.rl.run_dir}` or
    any RUN_DIR."""
    step: int | None = Field(default=None, ge=0)
    """An export stage's checkpoint: the one after this many steps (default: the latest). Checked
    when the export runs (the run may not have reached it when the pipeline is submitted)."""
    lora: Literal["merged", "adapter"] | None = None
    """An export stage of a LoRA run: its adapters merged into the base, or a PEFT adapter
    folder (default: the run's ckpt.export_lora)."""

    @model_validator(mode="after")
    def _one_job(self) -> StageConfig:
        if (self.config is None) == (self.export is None):
            raise ValueError(f"stage {self.name} needs exactly one of `config` (a job) and `export` (a run to export)")
        if self.export is not None and self.overrides:
            raise ValueError(f"stage {self.name}: an export stage takes no overrides (it runs no job config)")
        if self.config is not None and (self.step is not None or self.lora is not None):
            raise ValueError(f"stage {self.name}: step and lora are an export stage's options")
        for key, why in PIPELINE_OWNED.items():
            if key in self.overrides:
                raise ValueError(f"stage {self.name}: overrides may not set {key} ({why})")
        return self

    def references(self) -> Iterator[tuple[str, str]]:
        """(stage, output) of every `${stages.STAGE.OUTPUT}` this stage names; a malformed one raises."""
        for text in _strings([self.export, self.overrides]):
            for inner in REFERENCE.findall(text):
                parts = inner.split(".")
                if len(parts) != 3 or parts[0] != "stages":
                    raise ValueError(
                        f"stage {self.name}: ${{{inner}}} is not a reference; write ${{stages.NAME.OUTPUT}} "
                        f"(OUTPUT: {', '.join(REFERENCE_OUTPUTS)})"
                    )
                yield parts[1], parts[2]


def _strings(value: Any) -> Iterator[str]:
    """Every string within nested lists and dicts (keys included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


class PipelineConfig(Section):
    dir: str
    """PIPELINE_DIR: the pipeline's record (pipeline.json: each stage's job), each stage's resolved
    config (stages/NAME.yaml) and each stage's RUN_DIR (PIPELINE_DIR/NAME). Submitting the same
    pipeline again skips the stages whose RUN_DIR says they are finished and resumes the first
    that is not."""
    executor: Literal["local", "slurm"] = "local"
    """`local`: the stages run one after another here, each as `python -m relax_hpc.submit`.
    `slurm`: every stage is its own Slurm job, submitted at once, each starting when the one
    before it completed (`--dependency=afterok:JOB`); a stage that fails cancels the rest."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Options set on every job stage before its own overrides (e.g. `{launch.slurm.partition:
    gpu, launch.slurm.time_min: 120}`). An export stage takes its Slurm options (partition,
    account, time, CPUs) from the last job stage before it."""
    stages: list[StageConfig]
    """The stages, in order: each a job of a config file (`config`) or an export (`export`), each
    starting when the one before it finished."""

    @model_validator(mode="after")
    def _references(self) -> PipelineConfig:
        for key, why in PIPELINE_OWNED.items():
            if key in self.overrides:
                raise ValueError(f"overrides may not set {key} ({why})")
        if not self.stages:
            raise ValueError("stages: a pipeline needs at least one stage")
        seen: list[str] = []
        for stage in self.stages:
            if stage.name in seen:
                raise ValueError(f"stage names must differ: {stage.name} appears twice")
            for name, output in stage.references():
                if name not in seen:
                    later = any(s.name == name for s in self.stages)
                    why = "a later stage (or itself): a stage can use only what ran before it" if later else "no stage"
                    raise ValueError(f"stage {stage.name}: ${{stages.{name}.{output}}} names {why}")
                if output not in REFERENCE_OUTPUTS:
                    raise ValueError(
                        f"stage {stage.name}: ${{stages.{name}.{output}}}: a stage's outputs are "
                        f"{', '.join(REFERENCE_OUTPUTS)}"
                    )
            seen.append(stage.name)
        return self
