"""Evaluation as a job (kind=eval): models scored on held-out datasets with a run's engines and reward.

    python -m relax_hpc.submit --config configs/tiny-eval.yaml      (submit runs EvalJob)

With launch.executor=slurm, submit hands EvalRun to Slurm instead: the job's batch shell runs the
same EvalJob, its engines processes of the allocation's one node.

Each model of eval.models in turn is served by rollout.num_engines engines, started from the
launcher's own engine command lines (relax_hpc.launch.commands; logs in RUN_DIR/logs/N/). Every
dataset not yet scored on it goes through the run's environment and reward exactly as the driver's
evaluations do (relax_hpc.rollout: EnginePolicy over the engines, Rounds.evaluation_rewards), k
episodes per prompt; its figures (relax_hpc.metrics.evaluation) are appended to
RUN_DIR/eval/results.jsonl, and RUN_DIR/eval/table.md and RUN_DIR/plots/eval.png are
rewritten. results.jsonl is the record: the same command on an interrupted job starts at the
first model x dataset it lacks, and on a finished one does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from transformers import PreTrainedTokenizerFast

from relax_hpc.config.load import read_frozen
from relax_hpc.config.schema import EvalDatasetConfig, EvalModelConfig, JobConfig
from relax_hpc.data.processor import prompt_encoder
from relax_hpc.data.prompts import load_prompts
from relax_hpc.envs.base import EnvError
from relax_hpc.fence import Lease
from relax_hpc.launch.commands import local_commands
from relax_hpc.launch.gpus import place_local, visible_gpu_count
from relax_hpc.launch.supervisor import EXIT_STOPPED, Role, child_env
from relax_hpc.metrics.evaluation import figures, finished, table
from relax_hpc.metrics.jsonl import JsonlWriter, drop_records, read_jsonl
from relax_hpc.metrics.sinks import Sink, forward_eval_results, open_sinks
from relax_hpc.paths import RunPaths, write_atomic
from relax_hpc.plot import eval_figure
from relax_hpc.rewards import RewardError, make_scorer
from relax_hpc.rollout.engine_policy import EnginePolicy, EnginePool, Stopping
from relax_hpc.rollout.plan import sample_seed
from relax_hpc.rollout.rounds import Rounds, sampling_params

PROGRESS_PROMPTS = 256  # prompts per progress line (and per call into the engines)


class EvalError(Exception):
    """The job cannot go on (an engine died, the reward or the environment failed)."""


class EvalJob:
    """One start of an eval job: every model x dataset pair results.jsonl lacks, in order."""

    def __init__(self, cfg: JobConfig, paths: RunPaths, out: TextIO = sys.stdout) -> None:
        self.cfg, self.paths, self.out = cfg, paths, out
        self.interrupts = Interrupts()  # the engines, in sessions of their own, end with the job
        self.log: TextIO | None = None  # RUN_DIR/logs/N/eval.log, once this start has its folder
        self.sinks: list[Sink] = []  # TensorBoard, ClearML (metrics.*), while run() runs

    def say(self, line: str) -> None:
        """A line of progress, to the terminal and to this start's eval.log."""
        for out in (self.out, self.log):
            if out is not None:
                print(line, file=out, flush=True)

    def run(self) -> int:
        """0 when every pair is scored (at once, when results.jsonl holds them all), 1 on failure,
        75 when interrupted (SIGINT, SIGTERM), as a run's launcher; each start and end is an event
        (RUN_DIR/metrics/events.jsonl), which `status` reads."""
        drop_records(self.paths.eval_results, lambda _: False)  # the torn last line of a killed job, if any
        self.sinks = open_sinks(self.cfg.metrics, self.paths, self.cfg.model_dump(mode="json"), training=False)
        try:
            return self.score_what_is_left()
        except KeyboardInterrupt:  # only where nothing was left to score: score_all reports its own
            self.say("interrupted: run the same command to write the outputs")
            return EXIT_STOPPED
        finally:
            for sink in self.sinks:
                sink.close()

    def score_what_is_left(self) -> int:
        paths, ev = self.paths, self.cfg.eval
        done = finished(paths)
        todo = [(m, d) for m in ev.models for d in ev.datasets if (m.name, d.name) not in done]
        if not todo:
            self.say(f"{paths.root} is already complete: every model x dataset is scored; nothing to run.")
            self.say(self.write_outputs())
            return 0
        logs = paths.new_logs()
        self.log = (logs / "eval.log").open("a")
        pairs = len(ev.models) * len(ev.datasets)
        self.say(f"run dir: {paths.root}\nlogs:    {logs}/  (tail -F {logs}/eval.log)")
        self.say(f"{len(todo)} of {pairs} model x dataset pairs to score")
        results, events = JsonlWriter(paths.eval_results), JsonlWriter(paths.events_metrics)
        events.log({"event": "start", "logs": logs.name, "pairs_to_score": len(todo)})
        code = self.score_all(todo, results, logs)
        events.log({"event": "end", "exit": code})
        for writer in (results, events, self.log):
            writer.close()
        return code

    def score_all(self, todo: list[tuple[EvalModelConfig, EvalDatasetConfig]], results: JsonlWriter, logs: Path) -> int:
        """Every pair of `todo`, model after model; the exit status."""
        try:
            for model in self.cfg.eval.models:
                datasets = [d for m, d in todo if m is model]
                if not datasets:
                    continue
                folder = self.model_folder(model)
                with self.serving(model, folder, logs) as policy:
                    for dataset in datasets:
                        results.log(asyncio.run(self.score(model, folder, dataset, policy)))
                        self.write_outputs()
            self.say(f"every pair scored: {self.paths.eval_results}\n\n{self.write_outputs()}")
        except EvalError as e:
            self.say(f"eval failed: {e}")
            return 1
        except KeyboardInterrupt:
            self.say("interrupted: run the same command to resume at the first pair not scored")
            return EXIT_STOPPED
        return 0

    def write_outputs(self) -> str:
        """RUN_DIR/eval/table.md and RUN_DIR/plots/eval.png from the record as it is now, and its
        new figures to the metric sinks; returns the table. An interrupt waits for the end: one
        that lands in a C extension's import (matplotlib's Agg, on the first figure) surfaces as
        ImportError, not KeyboardInterrupt, and a sink's cursor must move with what it was sent."""
        with self.interrupts.held():
            text = table(read_jsonl(self.paths.eval_results))
            write_atomic(self.paths.eval_table, text.encode())
            eval_figure(self.paths, self.paths.plots)
            forward_eval_results(self.paths, self.sinks, [m.name for m in self.cfg.eval.models])
        return text

    def model_folder(self, model: EvalModelConfig) -> str:
        """The HF folder that serves a model: its path, or its checkpoint's export (made once, in
        RUN_DIR/eval/models/NAME, renamed into place when complete)."""
        if model.checkpoint is None:
            return str(model.path)
        out = self.paths.eval_models / model.name
        if not (out / "config.json").is_file():
            from relax_hpc.ckpt.export import ExportError, convert_into_place  # torch's checkpoint reader: only here

            checkpoint = Path(model.checkpoint)
            self.say(f"{model.name}: exporting {checkpoint} to {out}")
            try:
                convert_into_place(checkpoint.parent.parent, out, int(checkpoint.name.removeprefix("step-")), "merged")
            except ExportError as e:
                raise EvalError(f"{model.name}: {e}") from None
        return str(out)

    @contextlib.contextmanager
    def serving(self, model: EvalModelConfig, folder: str, logs: Path) -> Iterator[EnginePolicy]:
        """The engines of one model (served from `folder`), as a policy; they end with the block."""
        cfg, paths = self.cfg, self.paths
        served = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": folder})})
        for stale in paths.engines.glob("*.json"):  # an earlier start's engines, killed before their exit
            stale.unlink()
        lease = Lease(paths.root)
        lease.new_generation()  # an engine an earlier start left running writes nothing more
        env = child_env(cfg)
        commands = local_commands(served, paths, place_local(served, visible_gpu_count()))
        (logs / model.name).mkdir()
        roles = [Role(name, argv, logs / model.name / f"{name}.log", 0) for name, argv in commands.items()]
        dead = lambda: [r for r in roles if not r.alive()]  # noqa: E731
        decode = PreTrainedTokenizerFast.from_pretrained(folder).decode
        pool = EnginePool(paths, cfg.rollout.request_timeout_s)
        policy = EnginePolicy(pool, lambda ids: decode(ids, skip_special_tokens=True), stopping=lambda: bool(dead()))
        try:
            with self.interrupts.held():  # every started engine is known to the cleanup below
                for role in roles:
                    role.start({**env, **lease.grant(role.name)})
            while len(pool.engines) < len(roles):  # every engine up before the clock of a dataset starts
                if dead():
                    raise Stopping
                time.sleep(0.2)
                pool.refresh(force=True)
            self.say(f"{model.name}: {len(roles)} engine(s) serving {folder}")
            yield policy
        except Stopping:
            role = dead()[0]
            why = f"{role.name} serving {model.name} exited ({role.returncode}):\n{role.log_tail()}"
            raise EvalError(why) from None
        finally:
            with self.interrupts.held():
                for role in roles:
                    role.signal(signal.SIGTERM)
                for role in roles:
                    if role.proc is not None:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            role.proc.wait(timeout=10)
                    role.kill()  # a no-op once it exited

    async def score(
        self, model: EvalModelConfig, folder: str, dataset: EvalDatasetConfig, policy: EnginePolicy
    ) -> dict[str, Any]:
        """One model x dataset: a greedy episode per prompt (and k sampled ones when k > 1), their
        rewards, the figures."""
        cfg, ev = self.cfg, self.cfg.eval
        rows = load_prompts(dataset.path, dataset.prompt_key, dataset.answer_key)[: dataset.limit]
        encode = prompt_encoder(folder)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
        rounds = Rounds(cfg, rows, [encode(r) for r in rows], tokenizer, policy, make_scorer(cfg.reward))
        sampling = {**sampling_params(cfg.rollout), "max_new_tokens": ev.max_new_tokens, "temperature": ev.temperature}
        greedy_sampling = {**sampling, "temperature": 0.0}
        k = ev.k if ev.k > 1 else 0  # k = 1: the greedy completion alone
        started = time.monotonic()
        greedy: list[float] = []
        samples: list[list[float]] = []
        for first in range(0, len(rows), PROGRESS_PROMPTS):
            chunk = list(range(first, min(first + PROGRESS_PROMPTS, len(rows))))
            indices = [i for i in chunk for _ in range(k)]
            seeds = [sample_seed(cfg.run.seed, i, 0) + j for i in chunk for j in range(k)]  # a group's seeds (plan.py)
            try:  # together: the engines get the greedy and the sampled calls in the same batches
                chunk_greedy, flat = await asyncio.gather(
                    rounds.evaluation_rewards(chunk, [0] * len(chunk), greedy_sampling),
                    rounds.evaluation_rewards(indices, seeds, sampling),
                )
            except (RewardError, EnvError) as e:
                raise EvalError(f"{model.name} on {dataset.name}: {e}") from None
            greedy += chunk_greedy
            samples += [flat[j * k : (j + 1) * k] for j in range(len(chunk))] if k else []
            accuracy = sum(greedy) / len(greedy)
            self.say(f"{model.name} x {dataset.name}: {len(greedy)}/{len(rows)} prompts, greedy {accuracy:.3f}")
        seconds = time.monotonic() - started
        record = {
            "model": model.name, "dataset": dataset.name, "model_path": folder, "checkpoint": model.checkpoint,
            "dataset_path": dataset.path,
            "k": ev.k, "temperature": ev.temperature if k else 0.0, "max_new_tokens": ev.max_new_tokens,
            "problems": len(rows), "samples": len(rows) * (1 + k), "seconds": round(seconds, 3),
            **figures(greedy, samples, ev.pass_threshold),
        }  # fmt: skip
        shown = [f"{key} {record[key]:.3f}" for key in ("greedy_accuracy", "mean_at_k", "pass_at_k") if key in record]
        self.say(f"{model.name} x {dataset.name}: {', '.join(shown)} ({seconds:.1f} s)")
        return record


class Interrupts:
    """SIGINT and SIGTERM raise KeyboardInterrupt where the job is, except within `held()`, whose
    end raises it (an interrupt in the middle of starting or ending engines would lose some). A
    flag, not a signal mask: a mask is per thread (the policy's threads would take the signal) and
    is inherited by the engines started within."""

    def __init__(self) -> None:
        self.holding = self.pending = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, *_: object) -> None:
        if not self.holding:
            raise KeyboardInterrupt
        self.pending = True

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


class EvalRun:
    """What `submit` hands to submitit for an eval job on Slurm: EvalJob in the batch shell, on the
    frozen config. A time limit or a preemption notice requeues the job (submitit's checkpoint
    protocol), and the next start scores the pairs results.jsonl lacks."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def __call__(self) -> str:
        paths = RunPaths(Path(self.run_dir))
        code = EvalJob(read_frozen(paths.config), paths).run()
        if code == 0:
            return f"completed: {self.run_dir}"
        if code == EXIT_STOPPED:
            sys.exit(EXIT_STOPPED)  # no result file: submitit reports the job's real state (see SlurmRun)
        raise RuntimeError(f"relax_hpc eval job failed; see {self.run_dir}/logs/")

    def checkpoint(self) -> object:
        """Called by submitit on USR2: results.jsonl is the checkpoint, so a fresh start resumes."""
        import submitit

        return submitit.helpers.DelayedSubmission(EvalRun(self.run_dir))
