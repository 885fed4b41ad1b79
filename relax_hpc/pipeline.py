"""Pipelines: stages of jobs (sft, rl, eval, export), each naming an earlier stage's output.

    python -m relax_hpc.pipeline --config configs/tiny-pipeline.yaml [--dry-run] [--wait]
    python -m relax_hpc.status PIPELINE_DIR

A pipeline file (relax_hpc/config/pipeline.py; docs/config.md) lists stages: each a job config
with overrides, or an export of a run's checkpoint to an HF folder. A stage names an earlier
stage's output as `${stages.NAME.hf}` (also `.run_dir`, `.ckpt`). Every stage's RUN_DIR is
PIPELINE_DIR/NAME, and RUN_DIR decides whether it is finished (a complete run and its export,
an eval job's every pair scored, an export's folder), so submitting the same pipeline again
skips the finished stages and resumes the first unfinished one (a run resumes from its
checkpoint, an eval job from its record).

`local` runs the stages here, one after another (each `python -m relax_hpc.submit` on the
stage's resolved config, PIPELINE_DIR/stages/NAME.yaml; output in PIPELINE_DIR/logs/NAME.log).
`slurm` submits every unfinished stage at once, each its own job depending on the one before it
(`--dependency=afterok:JOB --kill-on-invalid-dep=yes`): a stage that fails cancels the rest.
Every input is checked before anything runs or is queued; an input a pending stage will write is
checked against a stand-in (a run's export has its base model's tokenizer and architecture).
A failed stage is reported in one line: the stage, its job and the cause.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from relax_hpc import cli
from relax_hpc.ckpt.layout import latest_dir
from relax_hpc.config.load import ConfigError, load_config, read_frozen, suggest, to_yaml
from relax_hpc.config.path_options import path_fields, python_command
from relax_hpc.config.pipeline import REFERENCE, PipelineConfig, StageConfig
from relax_hpc.config.schema import JobConfig, SlurmConfig
from relax_hpc.launch.follow import ACTIVE, ENDED, queue_state, run_facts, slurm_state
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.metrics.summary import completed_steps, guard_reason
from relax_hpc.paths import RunPaths, write_atomic
from relax_hpc.submit import check_inputs, eval_left, freeze, refused_changes, slurm_function

RECORD = "pipeline.json"
LoraFormat = Literal["merged", "adapter"] | None
# A stage's states that do not stop the pipeline (any other is its end without finishing).
UNFINISHED = {"done", "not", "running", "pending", *(state.lower() for state in ACTIVE)}
POLL_S = 2.0


@dataclass
class Stage:
    """One stage, resolved: a job (`cfg`) or an export of `source`'s checkpoint."""

    name: str
    kind: str  # sft, rl, eval or export
    run_dir: Path
    cfg: JobConfig | None = None
    source: Path | None = None
    step: int | None = None
    lora: LoraFormat = None
    slurm: SlurmConfig = field(default_factory=SlurmConfig)  # an export's job: the last job stage's

    @property
    def paths(self) -> RunPaths:
        return RunPaths(self.run_dir)

    def outputs(self) -> dict[str, Path]:
        """What later stages may name: `${stages.NAME.OUTPUT}`."""
        out = {"run_dir": self.run_dir}
        if self.kind in ("sft", "rl", "export"):
            out["hf"] = self.paths.export
        if self.cfg is not None and self.kind in ("sft", "rl"):
            out["ckpt"] = self.run_dir / "ckpt" / f"step-{self.cfg.trainer.total_steps:08d}"
        return out

    def done(self) -> bool:
        """Whether RUN_DIR says the stage is finished."""
        paths = self.paths
        if self.cfg is None:
            return (paths.export / "config.json").is_file()
        if not paths.config.is_file():
            return False
        if self.kind == "eval":
            return eval_left(self.cfg.eval, paths) == 0
        exported = not self.cfg.ckpt.export_hf or (paths.export / "config.json").is_file()
        return completed_steps(paths) >= self.cfg.trainer.total_steps and exported

    def progress(self) -> str:
        paths, cfg = self.paths, self.cfg
        if cfg is None:
            source = self.source or Path()
            shown = source.relative_to(self.run_dir.parent) if source.is_relative_to(self.run_dir.parent) else source
            checkpoint = "the latest checkpoint" if self.step is None else f"checkpoint {self.step}"
            return f"{checkpoint} of {shown} -> {self.name}/hf"
        if self.kind == "eval":
            pairs = len(cfg.eval.models) * len(cfg.eval.datasets)
            left = eval_left(cfg.eval, paths) if paths.config.is_file() else pairs
            return f"{pairs - left}/{pairs} model x dataset pairs scored"
        return f"step {completed_steps(paths)}/{cfg.trainer.total_steps}"


# --- the file -----------------------------------------------------------------------------------


def _describe(error: ErrorDetails) -> str:
    loc = [str(p) for p in error["loc"]]
    key = ".".join(loc)
    if error["type"] == "extra_forbidden":
        model = StageConfig if loc[0] == "stages" else PipelineConfig
        return f"{key}: unknown key{suggest(loc[-1], list(model.model_fields))}"
    if error["type"] == "value_error":
        return (f"{key}: " if key else "") + str(error["ctx"]["error"])
    return f"{key}: {error['msg']} (got {error.get('input')!r})"


def read_pipeline(path: Path) -> PipelineConfig:
    if not path.is_file():
        raise ConfigError(f"pipeline file {path} does not exist")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(f"invalid pipeline {path}:\n  " + "\n  ".join(_describe(err) for err in e.errors())) from None


def _substitute(value: Any, outputs: dict[str, dict[str, Path]], stage: str) -> Any:
    """`value` with every `${stages.NAME.OUTPUT}` replaced by that path."""
    if isinstance(value, dict):
        return {_substitute(k, outputs, stage): _substitute(v, outputs, stage) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, outputs, stage) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: Any) -> str:
        _, name, output = match.group(1).split(".")  # the schema checked the form and the stage
        if output not in outputs[name]:
            raise ConfigError(
                f"stage {stage}: ${{stages.{name}.{output}}}: stage {name} has no {output} "
                f"(its outputs: {', '.join(outputs[name])})"
            )
        return str(outputs[name][output])

    return REFERENCE.sub(one, value)


def resolve(pc: PipelineConfig, base: Path) -> list[Stage]:
    """Every stage's job: its config loaded with the pipeline's and its own overrides, references
    replaced by paths."""
    root = (base / pc.dir).resolve()
    stages: list[Stage] = []
    outputs: dict[str, dict[str, Path]] = {}
    slurm = SlurmConfig()
    for sc in pc.stages:
        run_dir = root / sc.name
        if sc.config is not None:
            options = _substitute({**pc.overrides, **sc.overrides}, outputs, sc.name)
            options = {"launch.slurm.job_name": f"relax_hpc-{sc.name}", **options}  # each stage's job by name
            options |= {"run.dir": str(run_dir), "launch.executor": pc.executor}
            try:
                cfg = load_config(base / sc.config, base_dir=base, options=options)
            except ConfigError as e:
                raise ConfigError(f"stage {sc.name} ({sc.config}): {e}") from None
            stage = Stage(sc.name, cfg.kind, run_dir, cfg=cfg)
            slurm = cfg.launch.slurm
        else:
            source = (base / _substitute(sc.export, outputs, sc.name)).resolve()
            job_slurm = slurm.model_copy(update={"job_name": f"relax_hpc-{sc.name}"})
            stage = Stage(sc.name, "export", run_dir, source=source, step=sc.step, lora=sc.lora, slurm=job_slurm)
        outputs[sc.name] = stage.outputs()
        stages.append(stage)
    return stages


# --- checks before anything runs ----------------------------------------------------------------


def stand_ins(stages: list[Stage]) -> dict[str, str | None]:
    """Each output of an unfinished stage: the HF folder to check its readers against (its run's
    base model), or None where there is none (a RUN_DIR, a checkpoint)."""
    pending: dict[str, str | None] = {}
    base_of: dict[str, str | None] = {}  # a run's base model, by RUN_DIR
    for stage in stages:
        if stage.cfg is not None:
            base_of[str(stage.run_dir)] = pending.get(stage.cfg.model.path, stage.cfg.model.path)
        if stage.done():
            continue
        model = base_of.get(str(stage.source if stage.cfg is None else stage.run_dir))
        for output, path in stage.outputs().items():
            pending[str(path)] = model if output == "hf" else None
    return pending


def stage_problems(stage: Stage, pending: dict[str, str | None]) -> list[str]:
    """What submit would refuse in this stage's inputs, an unfinished stage's output standing in."""
    if stage.cfg is None:
        if str(stage.source) in pending:
            return []
        paths = RunPaths(stage.source or Path())
        if not paths.config.is_file() or latest_dir(paths.ckpt) is None:
            return [f"stage {stage.name}: export {stage.source} is not a run with a checkpoint"]
        return []
    cfg = stage.cfg.model_copy(deep=True)
    ignored = []
    for f in path_fields(cfg):
        if f.value in pending:
            stand_in = pending[f.value]
            if stand_in is None:
                ignored.append(f.key)
            else:
                setattr(f.owner, f.name, stand_in)
    try:
        check_inputs(cfg, ignored=tuple(ignored))
        problems = []
    except ConfigError as e:
        problems = str(e).splitlines()
    changed = refused_changes(stage.cfg, stage.paths)
    return [f"stage {stage.name}: {p}" for p in [*problems, *([changed] if changed else [])]]


def check(stages: list[Stage]) -> None:
    pending = stand_ins(stages)
    problems = [p for stage in stages for p in stage_problems(stage, pending)]
    if problems:
        raise ConfigError("\n".join(problems))


# --- the record ---------------------------------------------------------------------------------


def read_record(root: Path) -> dict[str, Any]:
    path = root / RECORD
    return json.loads(path.read_text()) if path.is_file() else {"stages": {}}


def write_record(root: Path, record: dict[str, Any]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(root / RECORD, json.dumps(record, indent=1).encode())


def note(root: Path, record: dict[str, Any], stage: Stage, **facts: Any) -> None:
    """Record a stage's job (its id, exit) in PIPELINE_DIR/pipeline.json."""
    entry = record["stages"].setdefault(stage.name, {})
    entry.update({"kind": stage.kind, "run_dir": str(stage.run_dir), **facts})
    write_record(root, record)


# --- where a stage stands, and why one failed ---------------------------------------------------


def stage_state(stage: Stage, entry: dict[str, Any], executor: str) -> str:
    """done, running, pending (REASON), failed, stopped, not started."""
    job = entry.get("job")
    state = queue_state(job) if executor == "slurm" and job is not None else None
    live = state is not None and state.split()[0] in ACTIVE | {"UNKNOWN"}
    if stage.done():  # RUN_DIR is complete before its job has ended (an eval job's last writes, the exit)
        return "done (job ending)" if live else "done"
    if executor == "slurm":
        if job is None:
            return "not started"
        if state is None or not live:
            ended = slurm_state(job)  # a job cancelled for its dependency: "cancelled"
            return ENDED.get(ended.split()[0], "failed") if ended else "failed"
        if state == "PENDING":
            return f"pending ({_pending_reason(job)})"
        return state.lower()
    if entry.get("exit") is None:
        alive = entry.get("pid") is not None and _alive(entry["pid"])
        return "running" if alive else "not started" if "pid" not in entry else "failed"
    return "stopped" if entry["exit"] == 75 else "failed"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pending_reason(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%r"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or "queued"


def cause(stage: Stage, root: Path) -> str:
    """Why a stage failed, in a line: the eval job's or a role's last word, the no-progress guard,
    else the last line of the job's output and what RUN_DIR shows."""
    paths = stage.paths
    logs = sorted((p for p in paths.logs_root.glob("*") if p.name.isdigit()), key=lambda p: int(p.name))
    said = [line for line in _lines(logs[-1] / "eval.log") if line.startswith("eval failed:")] if logs else []
    if said:
        return said[-1]
    exits = [e for e in read_jsonl(paths.events_metrics) if e.get("event") == "role_exit" and e["action"] != "restart"]
    if exits:
        e = exits[-1]
        return f"{e['role']} exited {e['exit']}: {str(e['last_line']).strip()}"
    reason = guard_reason(paths)
    if reason:
        return reason
    outputs = [root / "logs" / f"{stage.name}.log", *sorted(paths.slurm.glob("*_log.out"))]
    lines = [line for out in outputs for line in _lines(out)]
    last = f"output: {lines[-1]}" if lines else "no output"
    return last if stage.cfg is None else f"{run_facts(paths)}; {last}"


def _lines(path: Path) -> list[str]:
    """A log's non-empty lines, without submitit's own logging."""
    if not path.is_file():
        return []
    text = path.read_text(errors="replace").splitlines()
    return [line.strip() for line in text if line.strip() and "submitit " not in line]


def failure(stage: Stage, entry: dict[str, Any], root: Path, executor: str) -> str:
    """The one line a failed stage is reported in."""
    job = entry.get("job")
    if executor == "slurm" and job is not None:
        state = slurm_state(job)
        how = f"job {job} {ENDED.get(state.split()[0], state) if state else 'ended'}"
    else:
        how = "ended without a word (killed)" if entry.get("exit") is None else f"exit {entry['exit']}"
    return f"pipeline stopped at stage {stage.name} ({stage.kind}): {how}: {cause(stage, root)}"


def facts(root: Path, stages: list[Stage], executor: str) -> dict[str, Any]:
    """Every stage's state, job and progress; the failure, if one stopped the pipeline."""
    record = read_record(root)
    rows, stopped = [], None
    for stage in stages:
        entry = record["stages"].get(stage.name, {})
        state = stage_state(stage, entry, executor)
        if state.split()[0] not in UNFINISHED and stopped is None:
            stopped = failure(stage, entry, root, executor)
        rows.append({"stage": stage.name, "kind": stage.kind, "state": state, "job": entry.get("job"),
                     "progress": stage.progress(), "run_dir": str(stage.run_dir)})  # fmt: skip
    return {"pipeline": str(root), "executor": executor, "stages": rows, "stopped": stopped}


def render(f: dict[str, Any]) -> str:
    lines = [f"pipeline:  {f['pipeline']} ({f['executor']})"]
    width = max(len(r["stage"]) for r in f["stages"])
    for r in f["stages"]:
        job = f"job {r['job']}" if r["job"] else "-"
        lines.append(f"  {r['stage']:<{width}}  {r['kind']:<6}  {r['state']:<24}  {job:<10}  {r['progress']}")
    details = f"{python_command()} -m relax_hpc.status PIPELINE_DIR/NAME: its details"
    lines.append(f"each stage's RUN_DIR: PIPELINE_DIR/NAME ({details})")
    if f["stopped"]:
        lines.append(f["stopped"])
    return "\n".join(lines)


# --- running ------------------------------------------------------------------------------------


def stage_file(root: Path, stage: Stage) -> Path:
    return root / "stages" / f"{stage.name}.yaml"


def local_argv(root: Path, stage: Stage) -> list[str]:
    """How the local executor runs a job stage: submit, on the stage's resolved config."""
    return [sys.executable, "-m", "relax_hpc.submit", "--config", str(stage_file(root, stage))]


class ExportRun:
    """An export stage's job (tools/dcp_to_hf.py's conversion): the run's checkpoint as an HF
    folder, RUN_DIR/hf, which exists only once whole. Picklable for submitit."""

    def __init__(self, source: str, out: str, step: int | None, lora: LoraFormat) -> None:
        self.source, self.out, self.step, self.lora = source, out, step, lora

    def __call__(self) -> str:
        from relax_hpc.ckpt.export import convert_into_place  # torch: only in the job

        folder = convert_into_place(Path(self.source), Path(self.out), self.step, self.lora)
        print(f"{folder} -> {self.out}", flush=True)
        return self.out


def export_run(stage: Stage) -> ExportRun:
    return ExportRun(str(stage.source), str(stage.paths.export), stage.step, stage.lora)


def export_here(stage: Stage, out: TextIO) -> int:
    """The local executor's export stage, in this process; its exit status."""
    from relax_hpc.ckpt.export import ExportError

    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            export_run(stage)()
    except ExportError as e:
        print(f"error: {e}", file=out, flush=True)
        return 1
    return 0


def run_local(root: Path, stages: list[Stage], record: dict[str, Any]) -> int:
    """Each unfinished stage here, in order, until one does not finish."""
    for stage in stages:
        if stage.done():
            print(f"stage {stage.name} ({stage.kind}): finished; skipped", flush=True)
            continue
        log = root / "logs" / f"{stage.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"stage {stage.name} ({stage.kind}): running (tail -F {log})", flush=True)
        with log.open("a") as out:
            if stage.cfg is None:
                note(root, record, stage, pid=os.getpid(), exit=None)
                code = export_here(stage, out)
            else:
                proc = subprocess.Popen(local_argv(root, stage), stdout=out, stderr=subprocess.STDOUT)
                note(root, record, stage, pid=proc.pid, exit=None)
                code = proc.wait()
        note(root, record, stage, exit=code)
        if code != 0 or not stage.done():
            print(failure(stage, record["stages"][stage.name], root, "local"), file=sys.stderr)
            return code or 1
        print(f"stage {stage.name} ({stage.kind}): done ({stage.progress()})", flush=True)
    print(f"pipeline complete: {python_command()} -m relax_hpc.status {root}")
    return 0


def submit_stage(stage: Stage, after: list[str]) -> str:
    """One stage as a Slurm job that starts once the jobs of `after` completed; its job id."""
    from relax_hpc.launch import submission

    paths = stage.paths
    if stage.cfg is None:
        paths.slurm.mkdir(parents=True, exist_ok=True)
        executor = submission.make_single_executor(stage.slurm, paths.slurm, after)
        job = submission.submit_with(executor, export_run(stage))
    else:
        freeze(stage.cfg, paths)
        job = submission.submit(stage.cfg, paths, slurm_function(stage.kind, paths), after)
    write_atomic(paths.slurm_job_id, f"{job.job_id}\n".encode())
    return str(job.job_id)


def submit_slurm(root: Path, stages: list[Stage], record: dict[str, Any]) -> None:
    """Every unfinished stage as a job, each after the one before it; a stage whose job is still
    queued or running keeps it."""
    from relax_hpc.launch import submission

    for stage in stages:  # Slurm's verdict on every job before the first is queued
        if stage.cfg is not None and not stage.done():
            submission.preflight(stage.cfg, stage.paths)
    before: list[str] = []
    renewed = False  # a stage was submitted anew: the later stages' old jobs wait for its old job
    for stage in stages:
        if stage.done():
            print(f"stage {stage.name} ({stage.kind}): finished; skipped")
            continue
        job = record["stages"].get(stage.name, {}).get("job")
        state = queue_state(job) if job else None
        if state is not None and state.split()[0] in ACTIVE and not renewed:
            print(f"stage {stage.name} ({stage.kind}): job {job} is {state.lower()}; kept")
        else:
            if state is not None and state.split()[0] in ACTIVE:
                subprocess.run(["scancel", str(job)], check=False, timeout=60)
                print(f"stage {stage.name} ({stage.kind}): cancelled job {job}, which waited for a job that ended")
            renewed = True
            job = submit_stage(stage, before)
            note(root, record, stage, job=job)
            after = f", after job {before[0]}" if before else ""
            print(f"stage {stage.name} ({stage.kind}): submitted job {job}{after}")
        before = [job]


def wait_slurm(root: Path, stages: list[Stage]) -> int:
    """Until every stage is done (0) or one failed (1, with its line)."""
    while True:
        f = facts(root, stages, "slurm")
        if f["stopped"]:
            print(f["stopped"], file=sys.stderr)
            return 1
        if all(r["state"] == "done" for r in f["stages"]):
            print(render(f))
            return 0
        time.sleep(POLL_S)


def dry_run(root: Path, stages: list[Stage], executor: str) -> int:
    before: list[str] = []
    for stage in stages:
        state = "finished; skipped" if stage.done() else "to run"
        print(f"# ---- stage {stage.name} ({stage.kind}): {state}")
        if stage.cfg is not None:
            print(to_yaml(stage.cfg))
        else:
            step = "latest" if stage.step is None else stage.step
            print(f"export {stage.source} (checkpoint: {step}) -> {stage.paths.export}\n")
        if executor == "local":
            job = " ".join(local_argv(root, stage)) if stage.cfg else f"in-process export (logs/{stage.name}.log)"
            print(f"# job: {job}")
        else:
            print("# submission file (sbatch)\n" + _sbatch(stage, before))
        if not stage.done():
            before = [f"<job of {stage.name}>"]
    return 0


def _sbatch(stage: Stage, after: list[str]) -> str:
    from relax_hpc.launch import submission

    if stage.cfg is None:
        executor = submission.make_single_executor(stage.slurm, stage.paths.slurm, after)
    else:
        executor = submission.make_executor(stage.cfg, stage.paths, after)
    return submission.submission_text(executor)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m relax_hpc.pipeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, required=True, help="the pipeline file (YAML)")
    parser.add_argument("--dry-run", action="store_true", help="print every stage's job; run and submit nothing")
    parser.add_argument("--wait", action="store_true", help="slurm: wait until every stage is done or one failed")
    args = parser.parse_args(argv)
    try:
        pc = read_pipeline(args.config)
        root, stages = (Path.cwd() / pc.dir).resolve(), resolve(pc, Path.cwd())
        check(stages)
        if args.dry_run:
            return dry_run(root, stages, pc.executor)
        record = start_record(root, stages, pc.executor)
        if pc.executor == "local":
            return run_local(root, stages, record)
        submit_slurm(root, stages, record)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.wait:
        return wait_slurm(root, stages)
    print(f"status: {python_command()} -m relax_hpc.status {root}")
    return 0


def start_record(root: Path, stages: list[Stage], executor: str) -> dict[str, Any]:
    """PIPELINE_DIR/pipeline.json with this submission's stages (their jobs kept from earlier
    submissions), and each job stage's resolved config in PIPELINE_DIR/stages/NAME.yaml: what
    `status` reads."""
    record = read_record(root)
    record.update({"executor": executor, "order": [s.name for s in stages]})
    for stage in stages:
        if stage.cfg is not None:
            stage_file(root, stage).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(stage_file(root, stage), to_yaml(stage.cfg).encode())
        else:
            export = {"source": str(stage.source), "step": stage.step, "lora": stage.lora}
            record["stages"].setdefault(stage.name, {}).update(export)
        note(root, record, stage)
    return record


def recorded_stages(root: Path, record: dict[str, Any]) -> list[Stage]:
    """The stages of the last submission, from PIPELINE_DIR alone."""
    stages = []
    for name in record["order"]:
        entry = record["stages"][name]
        if entry["kind"] == "export":
            stages.append(Stage(name, "export", Path(entry["run_dir"]), source=Path(entry["source"]),
                                step=entry["step"], lora=entry["lora"]))  # fmt: skip
        else:
            cfg = read_frozen(stage_file(root, Stage(name, entry["kind"], Path(entry["run_dir"]))))
            stages.append(Stage(name, cfg.kind, Path(entry["run_dir"]), cfg=cfg))
    return stages


def is_pipeline(path: Path) -> bool:
    return (path / RECORD).is_file()


def status(root: Path) -> dict[str, Any]:
    """`python -m relax_hpc.status PIPELINE_DIR`: every stage's state, job and progress."""
    record = read_record(root)
    return facts(root.resolve(), recorded_stages(root, record), record["executor"])


if __name__ == "__main__":
    cli.run(main)
