"""Evaluation as a job (kind=eval): the pass@k estimator, the figures and tables, and the config's
validation at submit."""

from __future__ import annotations

import io
import itertools
import json
import os
import signal
from pathlib import Path

import pytest

from relax_hpc.config import ConfigError, load_config
from relax_hpc.metrics.evaluation import budgets, figures, pass_at_k, table
from relax_hpc.paths import RunPaths
from relax_hpc.submit import check_inputs, dry_run, slurm_function

REPO = Path(__file__).resolve().parents[2]
POLICY, TEACHER = "assets/tiny-qwen3-addition", "assets/tiny-qwen3-addition-teacher"
DATA = "assets/addition.jsonl"


def subsets_with_a_solution(n: int, c: int, k: int) -> float:
    """pass@k by its definition: the share of the k-subsets of n samples (c correct) holding one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(("n", "c", "k"), [(8, 0, 1), (8, 3, 1), (8, 3, 2), (8, 3, 5), (8, 3, 6), (8, 8, 4), (5, 1, 5)])
def test_pass_at_k_is_the_share_of_k_subsets_that_hold_a_solution(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(subsets_with_a_solution(n, c, k), abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_counts_outside_its_domain(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_budgets_are_the_powers_of_two_below_k_and_k():
    assert budgets(1) == [1]
    assert budgets(8) == [1, 2, 4, 8]
    assert budgets(6) == [1, 2, 4, 6]


def test_figures_of_greedy_and_sampled_rewards():
    greedy = [1.0, 0.0, 0.0]
    samples = [[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    out = figures(greedy, samples, threshold=1.0)
    assert out["greedy_accuracy"] == pytest.approx(1 / 3)
    assert out["mean_at_k"] == pytest.approx(4 / 12)
    assert out["pass_at"]["1"] == pytest.approx(out["mean_at_k"])  # binary rewards: pass@1 = mean
    assert out["pass_at_k"] == pytest.approx(2 / 3)  # two prompts of three solved at least once
    assert figures(greedy, [], threshold=1.0) == {"greedy_accuracy": pytest.approx(1 / 3)}


def test_a_reward_below_the_threshold_does_not_solve():
    out = figures([0.5], [[0.5, 0.9]], threshold=1.0)
    assert out["mean_at_k"] == pytest.approx(0.7)
    assert out["pass_at_k"] == 0.0


def test_table_has_one_section_per_dataset_and_a_row_per_model():
    common = {"k": 2, "problems": 3, "samples": 9, "seconds": 1.25, "mean_at_k": 0.5, "pass_at_k": 0.75}
    records = [
        {"model": "a", "dataset": "x", "greedy_accuracy": 0.5, **common},
        {"model": "a", "dataset": "y", "greedy_accuracy": 0.25, **common},
        {"model": "b", "dataset": "x", "greedy_accuracy": 1.0, **common},
    ]
    text = table(records)
    assert text.count("## ") == 2
    x = text.split("## y")[0]
    assert "| a | 0.500 | 0.500 | 0.750 | 9 | 1.2 |" in x and "| b | 1.000 |" in x
    assert "| model | greedy accuracy | mean@2 | pass@2 | samples | seconds |" in x


def eval_config(*overrides: str, datasets: str = f"[{DATA}]"):
    models = f"eval.models=[{POLICY}, {{path: {TEACHER}, name: teacher}}]"
    return load_config(None, ["kind=eval", models, f"eval.datasets={datasets}", *overrides], base_dir=REPO)


def test_an_eval_config_names_its_models_and_datasets():
    cfg = eval_config()
    assert [m.name for m in cfg.eval.models] == ["tiny-qwen3-addition", "teacher"]
    assert cfg.eval.models[1].path == str(REPO / TEACHER)
    assert [d.name for d in cfg.eval.datasets] == ["addition"]
    check_inputs(cfg)


def test_a_run_dir_stands_for_its_export_and_is_named_after_the_run(tmp_path):
    run = tmp_path / "grpo-run"
    run.mkdir()
    (run / "config.yaml").write_text("kind: rl\n")
    cfg = load_config(None, ["kind=eval", f"eval.models=[{run}]", f"eval.datasets=[{DATA}]"], base_dir=REPO)
    assert (cfg.eval.models[0].path, cfg.eval.models[0].name) == (str(run / "hf"), "grpo-run")
    with pytest.raises(ConfigError, match=r"eval.models.0.path: the run .* has exported no model yet"):
        check_inputs(cfg)


def test_a_checkpoint_is_named_after_its_run_and_step_and_must_be_one(tmp_path):
    step = tmp_path / "grpo-run" / "ckpt" / "step-00000200"
    step.mkdir(parents=True)
    models = f"eval.models=[{{checkpoint: {step}}}]"
    cfg = load_config(None, ["kind=eval", models, f"eval.datasets=[{DATA}]"], base_dir=REPO)
    assert (cfg.eval.models[0].name, cfg.eval.models[0].path) == ("grpo-run-step-200", None)
    with pytest.raises(ConfigError, match=r"eval.models.0.checkpoint: .*step-00000200 is not a run's checkpoint"):
        check_inputs(cfg)  # no RUN_DIR/config.yaml beside ckpt/
    (tmp_path / "grpo-run" / "config.yaml").write_text("kind: rl\n")
    check_inputs(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["eval.models=[]"], "kind=eval: eval.models is required"),
        (["eval.datasets=[]"], "eval.datasets is required"),
        ([f"eval.models=[{POLICY}, {POLICY}]"], r"eval.models names must differ .*\['tiny-qwen3-addition'\]"),
        (["eval.k=0"], r"eval.k: Input should be greater than or equal to 1 \(got 0\)"),
        (["eval.temperature=0"], r"eval.temperature: Input should be greater than 0"),
        (["eval.datasets=[{path: x.jsonl, limit: 0}]"], r"eval.datasets.0.limit: Input should be greater"),
        (["eval.models=[{pth: x}]"], "eval.models.0.pth: unknown key; did you mean 'path'"),
        ([f"eval.models=[{{path: {POLICY}, checkpoint: x}}]"], "names both a path and a checkpoint: keep one"),
        (["eval.models=[{name: x}]"], r"needs a path \(an HF folder or a RUN_DIR\) or a checkpoint"),
        (["rollout.engine=sglang"], "rollout.engine must be torch"),
        (["reward.name=judge"], "reward.name=judge needs judge engines"),
        (["launch.executor=slurm", "launch.slurm.rollout.nodes=1"], r"launch.slurm must ask for one node"),
        (["launch.executor=slurm", "launch.slurm.trainer.nodes=2"], r"launch.slurm must ask for one node"),
        (["data.path=x.jsonl"], "data: a kind=eval job trains nothing"),
        (["trainer.lr=0.1"], "trainer: a kind=eval job trains nothing"),
    ],
)
def test_a_bad_eval_config_is_refused_naming_the_option(overrides, message):
    with pytest.raises(ConfigError, match=message):
        eval_config(*overrides)


def test_an_rl_config_may_not_carry_an_eval_section():
    with pytest.raises(ConfigError, match="eval: a kind=rl job is not kind=sft or kind=eval"):
        load_config(None, ["eval.k=4"])


def test_missing_models_and_empty_datasets_are_refused_at_submit(tmp_path):
    with pytest.raises(ConfigError, match=r"eval.models.0.path: .*/nowhere is not an HF model folder"):
        check_inputs(load_config(None, ["kind=eval", f"eval.models=[{tmp_path}/nowhere]", f"eval.datasets=[{DATA}]"]))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"eval.datasets.0 \(empty\): .*holds no rows"):
        check_inputs(eval_config(datasets=f"[{tmp_path / 'empty.jsonl'}]"))


def test_an_eval_job_on_slurm_is_one_node_whose_batch_shell_runs_it(tmp_path, capsys):
    cfg = eval_config("launch.executor=slurm", f"run.dir={tmp_path / 'eval'}", "launch.slurm.trainer.gpus_per_node=1")
    assert dry_run(cfg, RunPaths(tmp_path / "eval"), slurm=True) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=1\n" in out and "#SBATCH --gpus-per-node=1\n" in out and "hetjob" not in out
    assert "tiny-qwen3-addition x addition: to score\nteacher x addition: to score" in out
    from relax_hpc.evaluate import EvalRun  # transformers: only this test

    assert isinstance(slurm_function(cfg.kind, RunPaths(tmp_path / "eval")), EvalRun)


def test_an_eval_job_s_figures_reach_tensorboard_once_at_each_model_s_position(tmp_path):
    """forward_eval_results: each figure under eval/DATASET at the model's place in eval.models;
    records already forwarded (sinks.json) are not sent again, and a later start keeps them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from relax_hpc.metrics.jsonl import JsonlWriter
    from relax_hpc.metrics.sinks import TensorBoardSink, forward_eval_results

    paths = RunPaths(tmp_path / "eval-run")
    paths.create()
    paths.eval_results.parent.mkdir(parents=True, exist_ok=True)
    results, models = JsonlWriter(paths.eval_results), ["base", "step-50", "step-100"]
    for i, model in enumerate(models[:2]):
        results.log({"model": model, "dataset": "sums", "greedy_accuracy": 0.1 * (i + 1), "mean_at_k": 0.05 * (i + 1),
                     "pass_at_k": 0.3 * (i + 1)})  # fmt: skip
    sink = TensorBoardSink(paths, training=False)
    assert forward_eval_results(paths, [sink], models) == 2
    assert forward_eval_results(paths, [sink], models) == 0  # nothing new
    sink.close()
    results.log({"model": "step-100", "dataset": "sums", "greedy_accuracy": 0.9})  # k = 1: greedy only
    sink = TensorBoardSink(paths, training=False)  # the job's next start: nothing it had is purged
    assert forward_eval_results(paths, [sink], models) == 1
    sink.close()
    accumulator = EventAccumulator(str(paths.tensorboard))
    accumulator.Reload()
    greedy = [(e.step, round(e.value, 6)) for e in accumulator.Scalars("eval/sums/greedy_accuracy")]
    assert greedy == [(0, 0.1), (1, 0.2), (2, 0.9)]
    assert [e.step for e in accumulator.Scalars("eval/sums/pass_at_k")] == [0, 1]


class SignallingSink:
    """A metric sink that interrupts its own job (SIGTERM to this process) when sent a figure."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, str, float, int]] = []

    def scalar(self, title: str, name: str, value: float, iteration: int) -> None:
        self.scalars.append((title, name, value, iteration))
        os.kill(os.getpid(), signal.SIGTERM)

    def flush(self) -> None:
        pass

    def finished(self, paths: RunPaths) -> None:
        pass

    def close(self) -> None:
        pass


def test_an_interrupt_while_the_outputs_are_written_waits_for_their_end(tmp_path):
    """An eval job interrupted inside write_outputs finishes the table, the figure and the sinks'
    cursor, then stops: CI saw one land in matplotlib's import of its Agg module, which turned it
    into ImportError and ended the job with a traceback instead of exit 75."""
    from relax_hpc.evaluate import EvalJob  # transformers: only this test
    from relax_hpc.metrics.jsonl import JsonlWriter

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        cfg = eval_config(f"run.dir={tmp_path / 'eval'}")
        paths = RunPaths(tmp_path / "eval")
        paths.create()
        paths.eval_results.parent.mkdir(parents=True, exist_ok=True)
        JsonlWriter(paths.eval_results).log({"model": "teacher", "dataset": "addition", "greedy_accuracy": 0.5, "k": 1,
                                             "problems": 4, "samples": 4, "seconds": 1.0})  # fmt: skip
        job, sink = EvalJob(cfg, paths, out=io.StringIO()), SignallingSink()
        job.sinks = [sink]
        with pytest.raises(KeyboardInterrupt):
            job.write_outputs()
        assert sink.scalars == [("eval/addition", "greedy_accuracy", 0.5, 1)]
        assert json.loads(paths.sinks_cursor.read_text())["eval_results"] > 0  # the cursor moved with the figure
        assert "| teacher | 0.500 |" in paths.eval_table.read_text()
        assert (paths.plots / "eval.png").is_file()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
