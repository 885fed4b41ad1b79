"""Submit a relax_hpc job.

    python -m relax_hpc.submit --config configs/tiny-grpo.yaml [key=value ...] [--dry-run]

Validates the config and its inputs before anything starts, freezes the resolved config in
RUN_DIR/config.yaml, and runs the job with the configured executor: `local` runs every role here;
`slurm` submits one job through submitit and returns (`--wait` follows it to the end). Inside a
Slurm allocation (sbatch recipes), `--in-allocation` runs the roles as its job steps. Running the
same command on an existing RUN_DIR resumes it from its latest checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from relax_hpc import cli
from relax_hpc.config.load import ConfigError, load_config, read_frozen, to_yaml
from relax_hpc.config.path_options import path_problems, python_command
from relax_hpc.config.schema import RESUMABLE_CHANGES, EvalConfig, JobConfig, MediaKind, SftConfig
from relax_hpc.data.processor import is_multimodal, media_kinds, sampling_rate, video_spec
from relax_hpc.data.prompts import DatasetError, load_data, load_prompts
from relax_hpc.launch import owner
from relax_hpc.launch.allocation import AllocationError
from relax_hpc.launch.gpus import NO_GPU, place_local, span, visible_gpu_count
from relax_hpc.metrics.evaluation import finished as finished_evaluations
from relax_hpc.metrics.startup import StartupClock
from relax_hpc.metrics.summary import completed_steps, finished_export_problem, run_summary
from relax_hpc.models.arch import check_megatron_job
from relax_hpc.paths import RunPaths, write_atomic

if TYPE_CHECKING:
    import submitit

# relax_hpc.launch.supervisor.EXIT_STOPPED (stopped, resumable), not imported from there: a Ctrl-C
# during that module's imports is what it answers.
STOPPED_BEFORE_START = 75


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_inputs(cfg: JobConfig, in_allocation: bool = False, ignored: tuple[str, ...] = ()) -> None:
    """Fail before any process starts (and before anything is queued) when an input is unusable:
    every path option, the dataset's rows, and what the trainer backend needs of the model and
    the machines; one problem a line, each starting with its option's key, except the options
    `ignored` names (a pipeline's inputs that an earlier stage will write)."""
    problems = [p for p in path_problems(cfg) if not p.startswith(tuple(f"{key}:" for key in ignored))]
    if not problems:
        if cfg.kind == "rl":
            problems += dataset_problems(cfg)
            problems += critic_problems(cfg.algo.advantage.estimator, cfg.trainer.backend, cfg.model.path)
        elif cfg.kind == "sft":
            problems += sft_data_problems(cfg.sft, cfg.model.path)
        else:
            problems += eval_data_problems(cfg.eval)
        if cfg.trainer.backend == "megatron":
            engine = cfg.rollout.engine if cfg.kind == "rl" else None
            problems += check_megatron_job(cfg.model.path, cfg.trainer.megatron, engine)
            problems += megatron_gpu_problems(cfg, in_allocation)
        problems += missing_sinks(cfg)
        problems += notify_problems(cfg)
    if problems:
        raise ConfigError("\n".join(problems))


def dataset_problems(cfg: JobConfig) -> list[str]:
    """The datasets' rows (data.path and data.eval_path), and their media against the model: every
    item is read and decoded as the engines will decode it (images; audio at the model's sampling
    rate; videos sampled as the model samples them)."""
    d, model = cfg.data, cfg.model.path
    kinds = media_kinds(model)
    problems = [_missing_encoder(model, kind, kinds) for kind in d.media if kind not in kinds]
    if problems:
        return problems
    video, rate = video_spec(model), sampling_rate(model)
    for held_out in [False, True] if d.eval_path else [False]:
        try:
            load_data(d, video, held_out, sampling_rate=rate, check_media=True)
        except DatasetError as e:
            problems.append(str(e))
    return problems


def critic_problems(estimator: str, backend: str, model: str) -> list[str]:
    """gae's critic on the torch backend is transformers' token-classification model of the
    folder's architecture, which the multimodal models do not have (megatron's critic is the
    policy's own model with a value head, towers included)."""
    if estimator != "gae" or backend != "torch" or not is_multimodal(model):
        return []
    problem = (
        f"algo.advantage.estimator=gae: the torch backend's critic is transformers' token-classification "
        f"model, which {model} (a multimodal model) does not have; trainer.backend=megatron trains "
        "its critic with media"
    )
    return [problem]


def _missing_encoder(model: str, kind: str, kinds: set[MediaKind]) -> str:
    if kind == "video" and "image" in kinds:
        return (
            f"data.media.video: {model} is not a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model; relax_hpc samples "
            "and patches videos as those models' processors do (an Omni model's video, with its audio track "
            "and its own timing: not supported yet)"
        )
    return f"data.media.{kind}: {model} has no {kind} encoder (its config.json names none)"


def eval_data_problems(ev: EvalConfig) -> list[str]:
    """kind=eval: every dataset's rows read as rollout reads them (an empty file is refused)."""
    problems = []
    for i, d in enumerate(ev.datasets):
        try:
            load_prompts(d.path, d.prompt_key, d.answer_key)
        except DatasetError as e:
            problems.append(f"eval.datasets.{i} ({d.name}): {e}")
    return problems


def sft_data_problems(sft: SftConfig, model: str) -> list[str]:
    """kind=sft: every row tokenizes into an example, with the model's tokenizer (and chat
    template), as the trainer will make it; the first bad row is named."""
    from transformers import AutoTokenizer

    from relax_hpc.data.sft import configured_examples

    try:
        configured_examples(sft, AutoTokenizer.from_pretrained(model))
    except DatasetError as e:
        return [f"sft.data: {e}"]
    return []


def notify_problems(cfg: JobConfig) -> list[str]:
    """Notification URLs Apprise takes, their ${NAME} variables set (checked where submit runs:
    the job inherits this environment)."""
    from relax_hpc.launch.notify import Notifier, NotifyError

    try:
        Notifier(cfg.notify, "check").close()
    except NotifyError as e:
        return [str(e)]
    return []


def missing_sinks(cfg: JobConfig) -> list[str]:
    """The metric sinks a config asks for must be installed where the job runs (checked here unless
    the job runs in a container, whose packages this process does not see)."""
    wanted = {"metrics.tensorboard": ("tensorboard", cfg.metrics.tensorboard),
              "metrics.clearml.enabled": ("clearml", cfg.metrics.clearml.enabled)}  # fmt: skip
    return [
        f"{key}: the `{module}` package is not installed (pip install 'relax_hpc[sinks]')"
        for key, (module, on) in wanted.items()
        if on and not cfg.launch.container and importlib.util.find_spec(module) is None
    ]


def megatron_gpu_problems(cfg: JobConfig, in_allocation: bool) -> list[str]:
    """The megatron backend runs one rank per GPU: are there that many where the trainer will run?"""
    ranks = cfg.trainer.num_ranks
    if cfg.launch.executor == "slurm" or in_allocation:
        role = cfg.launch.slurm.trainer
        if role.gpus_per_node * role.nodes < ranks:
            return [
                (
                    f"trainer.backend=megatron runs one rank per GPU: launch.slurm.trainer.gpus_per_node "
                    f"({role.gpus_per_node}) x launch.slurm.trainer.nodes ({role.nodes}) is less than "
                    f"trainer.num_ranks ({ranks})"
                )
            ]
        return []
    if cfg.launch.container:
        return []  # the image's view of the GPUs is not this process's
    visible = visible_gpu_count()
    trainer = place_local(cfg, visible).trainer
    if trainer in (None, NO_GPU) or span(trainer) < ranks or int(trainer.split("-")[1]) >= visible:
        engines = (
            "engines share their GPUs (launch.colocate)"
            if cfg.launch.colocate
            else f"{cfg.rollout.num_engines} engine(s) take one each unless launch.local_trainer_gpus / "
            "launch.local_engine_gpus say otherwise"
        )
        return [
            (
                f"trainer.backend=megatron runs one rank per GPU: this machine shows {visible} GPU(s), for the "
                f"trainer's {ranks} rank(s), and its {engines}; use trainer.backend=torch here, or fewer ranks"
            )
        ]
    return []


def refused_changes(cfg: JobConfig, paths: RunPaths) -> str | None:
    """Why RUN_DIR's run cannot be resumed with `cfg` (None: it can, or RUN_DIR holds no run)."""
    if not paths.config.exists():
        return None
    old = _flatten(read_frozen(paths.config).model_dump(mode="json"))
    new = _flatten(cfg.model_dump(mode="json"))
    forbidden = [k for k in new if old.get(k) != new[k] and not k.startswith(RESUMABLE_CHANGES)]
    if not forbidden:
        return None
    details = "\n  ".join(f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in forbidden)
    return (
        f"{paths.root} holds a run with a different config:\n  {details}\n"
        "resume it with the same settings, or pick a new run.dir"
    )


def freeze(cfg: JobConfig, paths: RunPaths) -> None:
    """Write RUN_DIR/config.yaml, or check that a resume changes only what it may."""
    problem = refused_changes(cfg, paths)
    if problem:
        raise ConfigError(problem)
    paths.create()
    write_atomic(paths.config, to_yaml(cfg).encode())


def main(argv: list[str] | None = None) -> int:
    startup = StartupClock()
    parser = argparse.ArgumentParser(
        prog="python -m relax_hpc.submit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, help="YAML job config (default: built-in defaults)")
    parser.add_argument(
        "--dry-run", action="store_true", help="validate, print the resolved config and commands, run nothing"
    )
    parser.add_argument("--wait", action="store_true", help="slurm: wait for the job to finish (through every requeue)")
    parser.add_argument(
        "--take-over",
        action="store_true",
        help="slurm: when the run's job is queued or running, cancel it, wait until it has left, then submit",
    )
    parser.add_argument(
        "--in-allocation",
        action="store_true",
        help="run the roles as job steps of the Slurm allocation this command runs in (what sbatch recipes use)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. trainer.lr=3e-4 rollout.num_engines=4")
    args = parser.parse_intermixed_args(argv)  # overrides before or after the flags
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        check_inputs(cfg, args.in_allocation)
        paths = RunPaths(Path(cfg.run.dir))
        slurm = cfg.launch.executor == "slurm" and not args.in_allocation
        if slurm:
            from relax_hpc.launch import submission  # imports submitit: only for this executor

            submission.preflight(cfg, paths)
        if args.dry_run:
            return dry_run(cfg, paths, slurm)
        with contextlib.ExitStack() as owned:
            # Before anything is written: one live job, or one live launcher, per run (launch.owner).
            if slurm:
                owned.enter_context(owner.submission_claim(paths, args.take_over))
            elif not args.in_allocation:
                owner.hold_local_launcher(paths)  # held until this process ends
            if cfg.kind == "eval" and not (slurm and eval_left(cfg.eval, paths)):
                # results.jsonl says what is left to score: nothing, once it is complete
                freeze(cfg, paths)  # refuses a changed job as any resume would
                from relax_hpc.evaluate import EvalJob  # heavy imports after validation

                return EvalJob(cfg, paths).run()
            if paths.config.exists() and completed_steps(paths) >= cfg.trainer.total_steps:
                if problem := finished_export_problem(paths, cfg.ckpt):
                    raise ConfigError(problem)  # before freeze() records an export that is not there
                freeze(cfg, paths)  # refuses a changed experiment as any resume would
                print(f"{paths.root} is already complete at step {completed_steps(paths)}; nothing to run.")
                print(run_summary(paths, cfg.trainer.total_steps))
                return 0
            freeze(cfg, paths)
            if not args.in_allocation and paths.stop_request.exists():
                # A new submission means "train": a stop request no trainer served is withdrawn
                # (a start inside an allocation may be a requeue, which keeps it).
                paths.stop_request.unlink()
                print(f"withdrew {paths.stop_request}, a stop request no trainer served: this submission trains")
            if args.in_allocation:
                from relax_hpc.launch.slurm import run_in_allocation

                return run_in_allocation(cfg, paths)
            job = submit_to_slurm(cfg, paths) if slurm else None
        if job is not None:  # the claim is released: the job id is recorded
            return follow_job(job, cfg.launch.slurm.job_name, paths, args.wait)
    except (ConfigError, AllocationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        from relax_hpc.launch.local import run_local  # heavy imports after validation
    except KeyboardInterrupt:  # Ctrl-C (SIGINT) during them: no role started, nothing to checkpoint
        print("stopped before any role started; run the same command again to start", file=sys.stderr)
        return STOPPED_BEFORE_START

    startup.finish(paths.metrics, "launcher", "checks")  # config, inputs and RUN_DIR; then the roles start
    return run_local(cfg, paths)


def eval_left(ev: EvalConfig, paths: RunPaths) -> int:
    """kind=eval: how many model x dataset pairs results.jsonl lacks."""
    done = finished_evaluations(paths)
    return len([1 for m in ev.models for d in ev.datasets if (m.name, d.name) not in done])


def dry_run(cfg: JobConfig, paths: RunPaths, slurm: bool) -> int:
    print(to_yaml(cfg))
    if slurm:
        from relax_hpc.launch import submission

        print("# submission file (sbatch)\n" + submission.submission_text(submission.make_executor(cfg, paths)))
    if cfg.kind == "eval":  # its engines serve each model in turn: their commands are made then
        done = finished_evaluations(paths)
        for m in cfg.eval.models:
            for d in cfg.eval.datasets:
                print(f"{m.name} x {d.name}: {'scored' if (m.name, d.name) in done else 'to score'}")
        return 0
    if slurm:
        from relax_hpc.launch.allocation import example_allocation
        from relax_hpc.launch.commands import step_commands

        alloc = example_allocation(cfg)
        print(f"# job steps, for an allocation on nodes {alloc.groups}")
        commands = step_commands(cfg, paths, alloc)
    else:
        from relax_hpc.launch.commands import local_commands

        commands = local_commands(cfg, paths)
    for name, argv in commands.items():
        print(f"{name}: {shlex.join(argv)}")
    return 0


def slurm_function(kind: str, paths: RunPaths) -> Callable[[], object]:
    """What the Slurm job's batch shell runs: the supervisor of a run's roles, or an eval job."""
    run_dir = str(paths.root.resolve())
    if kind == "eval":
        from relax_hpc.evaluate import EvalRun

        return EvalRun(run_dir)
    from relax_hpc.launch.slurm import SlurmRun

    return SlurmRun(run_dir)


def submit_to_slurm(cfg: JobConfig, paths: RunPaths) -> submitit.Job:
    """Submit the run's job and record its id (the run's owner from now on)."""
    from relax_hpc.launch import submission

    job = submission.submit(cfg, paths, slurm_function(cfg.kind, paths))
    write_atomic(paths.slurm_job_id, f"{job.job_id}\n".encode())
    return job


def follow_job(job: submitit.Job, job_name: str, paths: RunPaths, wait: bool) -> int:
    """Say where the job's output goes and how to stop it; with `wait`, follow it to its end."""
    root = paths.root.resolve()
    print(
        f"submitted job {job.job_id} ({job_name})\n"
        f"run dir: {root}\n"
        f"follow:  tail -F {job.paths.stdout}   (progress; each role's log in {root}/logs/)\n"
        f"status:  {python_command()} -m relax_hpc.status {root}   (squeue -j {job.job_id}; sacct -j {job.job_id})\n"
        f"stop:    scancel --batch --signal=USR2 {job.job_id}   (checkpoint and requeue); scancel {job.job_id} (end)"
    )
    if not wait:
        return 0
    from relax_hpc.launch.follow import follow

    result = follow(job.job_id, paths)
    if result.code:
        print(
            f"{result.message}\noutput: {job.paths.stdout}\nroles' logs: {root}/logs/\n"
            f"status: {python_command()} -m relax_hpc.status {root}",
            file=sys.stderr,
        )
    else:
        print(result.message)
    return result.code


if __name__ == "__main__":
    cli.run(main)
