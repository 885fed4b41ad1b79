"""Where each role runs inside an allocation, which GPUs it sees, and how it is wrapped."""

import re
import socket
from pathlib import Path

import pytest

from relax_hpc.config import load_config
from relax_hpc.engines.sglang_engine import server_args
from relax_hpc.inprocess import InProcessRun
from relax_hpc.launch.allocation import Allocation, AllocationError, expand_counts, plan_layout
from relax_hpc.launch.commands import local_commands, step_commands
from relax_hpc.launch.container import wrap_in_container
from relax_hpc.launch.gpus import NO_GPU, place_local, select
from relax_hpc.paths import RunPaths

SLURM = ["launch.executor=slurm"]


def cfg_with(*overrides):
    return load_config(None, [*SLURM, *overrides])


def test_cpus_per_node_spec():
    assert expand_counts("4(x2),2") == [4, 4, 2]
    assert expand_counts("64") == [64]
    with pytest.raises(AllocationError):
        expand_counts("4(x)")


def test_one_node_split_between_trainer_and_engines():
    cfg = cfg_with(
        "launch.slurm.trainer.gpus_per_node=4", "launch.slurm.rollout.nodes=0",
        "launch.slurm.rollout.gpus_per_node=4", "rollout.num_engines=2",
    )  # fmt: skip
    layout = plan_layout(cfg, Allocation("7", [["gpu1"]], {"gpu1": 64}))
    assert layout.trainer_nodes == ["gpu1"] and layout.trainer_gpus == "0-3"
    assert layout.engine_nodes == ["gpu1", "gpu1"]
    assert layout.engine_gpus == ["4-5", "6-7"]


@pytest.mark.parametrize("engine", ["torch", "sglang"])
def test_colocated_engines_sit_on_their_ranks_node_and_gpu(engine, tmp_path):
    """Two nodes of 2 ranks each, 4 engines: engine i beside rank i, seeing the same GPUs as the
    trainer (a CUDA IPC handle names a device index) and told which one is its rank's."""
    cfg = cfg_with(
        f"rollout.engine={engine}", "launch.colocate=true", "rollout.max_staleness=0", "launch.slurm.trainer.nodes=2",
        "trainer.num_ranks=4", "launch.slurm.trainer.gpus_per_node=2", "launch.slurm.rollout.nodes=0",
        "rollout.num_engines=4", f"run.dir={tmp_path}",
    )  # fmt: skip
    alloc = Allocation("7", [["a", "b"]], dict.fromkeys("ab", 8))
    layout = plan_layout(cfg, alloc)
    assert layout.engine_nodes == ["a", "a", "b", "b"] and layout.trainer_gpus == "0-1"
    assert layout.engine_gpus == ["0-1"] * 4 and layout.engine_devices == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    command = step_commands(cfg, RunPaths(tmp_path), alloc)["engine-3"]
    assert command[command.index("--device") + 1] == "cuda:1" and "--nodelist=b" in command
    with pytest.raises(ValueError, match=r"launch\.slurm\.rollout\.nodes=0"):
        cfg_with("launch.colocate=true", "rollout.max_staleness=0", "launch.slurm.rollout.nodes=1")
    with pytest.raises(ValueError, match=r"rollout\.max_staleness=0"):
        cfg_with("launch.colocate=true", "launch.slurm.rollout.nodes=0")
    with pytest.raises(ValueError, match=r"needs launch\.colocate=true"):
        cfg_with("launch.colocate_offload=optimizer")
    # Both backends park their optimizer state (tests/gpu/test_offload.py).
    torch_offload = cfg_with("launch.colocate=true", "rollout.max_staleness=0", "launch.colocate_offload=optimizer")
    assert torch_offload.trainer.backend == "torch" and torch_offload.launch.colocate_offload == "optimizer"
    # The megatron backend colocates on every rank too (export_hf every_rank: each rank holds every tensor).
    megatron = cfg_with(
        "launch.colocate=true", "rollout.max_staleness=0", "launch.slurm.rollout.nodes=0", "trainer.backend=megatron",
        "trainer.num_ranks=4", "trainer.megatron.pipeline_parallel=2", "launch.colocate_offload=optimizer",
    )  # fmt: skip
    assert megatron.trainer.num_ranks == 4 and megatron.launch.colocate


def test_rollout_nodes_of_their_own_and_round_robin_engines():
    cfg = cfg_with("launch.slurm.rollout.nodes=2", "launch.slurm.rollout.gpus_per_node=8", "rollout.num_engines=4")
    layout = plan_layout(cfg, Allocation("7", [["a", "b", "c"]], dict.fromkeys("abc", 8)))
    # The trainer asked for no GPU (trainer.gpus_per_node 0): it gets none, whatever its node has.
    assert layout.trainer_nodes == ["a"] and layout.trainer_gpus == NO_GPU
    assert layout.engine_nodes == ["b", "c", "b", "c"]
    assert layout.engine_gpus == ["0-3", "0-3", "4-7", "4-7"]


def test_heterogeneous_components():
    cfg = cfg_with("launch.slurm.heterogeneous=true", "launch.slurm.rollout.nodes=1")
    alloc = Allocation("9", [["t1"], ["r1"]], {"t1": 4, "r1": 2})
    layout = plan_layout(cfg, alloc)
    assert (layout.trainer_group, layout.engine_group) == (0, 1)
    commands = step_commands(cfg, RunPaths(cfg.run.dir), alloc)
    assert "--het-group=1" in commands["engine-0"] and "--nodelist=r1" in commands["engine-0"]
    assert "--het-group=0" in commands["trainer"] and "--cpus-per-task=4" in commands["trainer"]

    def rendezvous() -> dict[str, str]:
        argv = step_commands(cfg, RunPaths(cfg.run.dir), alloc)["trainer"]
        return dict(a.split("=", 1) for a in argv if a.startswith("--rdzv-"))

    # Each start of the trainer meets at a port free at that start, under an id of its own: a
    # restarted torchrun must never join its predecessor's store.
    first = rendezvous()
    host, port = first["--rdzv-endpoint"].split(":")
    with socket.create_server(("", int(port))):  # the predecessor's store still listens
        again = rendezvous()
    assert host == "t1" and again["--rdzv-endpoint"] != first["--rdzv-endpoint"]
    assert first["--rdzv-id"].startswith("9-") and again["--rdzv-id"] != first["--rdzv-id"]


TEACHER = ("algo.advantage.estimator=distill", "algo.teacher.path=/models/teacher", "algo.teacher.num_engines=2")


def test_teacher_engines_are_job_steps_of_their_own_in_the_rollout_component(tmp_path):
    """algo.teacher.num_engines: `teacher-N` steps after the rollout engines, on the rollout
    component's nodes and GPUs, serving the teacher, registered in the teacher pool."""
    cfg = cfg_with(
        f"run.dir={tmp_path}", "launch.slurm.heterogeneous=true", "launch.slurm.rollout.nodes=1",
        "launch.slurm.rollout.gpus_per_node=4", "rollout.num_engines=2", *TEACHER,
    )  # fmt: skip
    alloc = Allocation("9", [["t1"], ["r1"]], {"t1": 4, "r1": 8})
    assert plan_layout(cfg, alloc).engine_gpus == ["0-0", "1-1", "2-2", "3-3"]
    commands = step_commands(cfg, RunPaths(tmp_path), alloc)
    assert [n for n in commands if n.startswith(("engine", "teacher"))] == [
        "engine-0", "engine-1", "teacher-0", "teacher-1",
    ]  # fmt: skip
    teacher = commands["teacher-1"]
    assert "--het-group=1" in teacher and "--nodelist=r1" in teacher and "--job-name=relax_hpc:teacher-1" in teacher
    assert teacher[teacher.index("relax_hpc.launch.gpus") + 1] == "3-3"
    assert teacher[teacher.index("--model-path") + 1] == "/models/teacher"
    assert teacher[teacher.index("--pool") + 1] == "teacher"
    assert commands["engine-1"][commands["engine-1"].index("--pool") + 1] == "policy"
    local = local_commands(cfg, RunPaths(tmp_path))
    assert local["teacher-0"][local["teacher-0"].index("--model-path") + 1] == "/models/teacher"


def test_evaluation_engines_are_policy_engine_steps_on_the_rollout_nodes(tmp_path):
    """rollout.eval_engines: `engine-eval-N` steps after the others, on the rollout nodes and GPUs,
    serving the policy from the policy pool (so they get every push), catching up like its engines."""
    cfg = cfg_with(
        f"run.dir={tmp_path}", "launch.slurm.rollout.nodes=1", "launch.slurm.rollout.gpus_per_node=4",
        "rollout.num_engines=2", "rollout.eval_engines=1",
    )  # fmt: skip
    alloc = Allocation("9", [["t1", "r1"]], {"t1": 4, "r1": 4})
    assert plan_layout(cfg, alloc).engine_gpus == ["0-0", "1-1", "2-2"]
    commands = step_commands(cfg, RunPaths(tmp_path), alloc)
    assert [n for n in commands if n.startswith("engine")] == ["engine-0", "engine-1", "engine-eval-0"]
    evaluator = commands["engine-eval-0"]
    assert "--nodelist=r1" in evaluator and "--job-name=relax_hpc:engine-eval-0" in evaluator
    assert evaluator[evaluator.index("--pool") + 1] == "policy" and "--catch-up-bucket-mb" in evaluator
    assert evaluator[evaluator.index("--engine-id") + 1] == "engine-eval-0"
    assert "engine-eval-0" in local_commands(cfg, RunPaths(tmp_path))


def test_a_teacher_on_sglang_takes_its_own_tensor_parallel_size():
    """algo.teacher.tp_size: a teacher larger than the student gets more GPUs than a rollout
    engine, on Slurm and locally, and its server is started with that size."""
    sglang = ("rollout.engine=sglang", *TEACHER[:2], "algo.teacher.num_engines=1", "algo.teacher.tp_size=4")
    cfg = cfg_with(*sglang, "launch.slurm.rollout.nodes=1", "launch.slurm.rollout.gpus_per_node=8")
    assert plan_layout(cfg, Allocation("7", [["a", "b"]], dict.fromkeys("ab", 8))).engine_gpus == ["0-0", "1-1", "2-5"]
    assert place_local(cfg, 8).engines == ["2-2", "3-3", "4-7"]  # after the trainer's 2 ranks
    assert place_local(cfg, 7).engines == [NO_GPU] * 3  # 2 + 1 + 1 + 4 GPUs or none
    argv = server_args(cfg, "0.0.0.0", 30000, "token", pool="teacher")
    assert argv[argv.index("--tp-size") + 1] == "4" and argv[argv.index("--model-path") + 1] == "/models/teacher"
    assert server_args(cfg, "0.0.0.0", 30000, "token")[argv.index("--tp-size") + 1] == "1"
    big = cfg_with(*sglang[:-1], "algo.teacher.tp_size=7", "launch.slurm.rollout.nodes=1",
                   "launch.slurm.rollout.gpus_per_node=8")  # fmt: skip
    with pytest.raises(AllocationError, match=re.escape("(teachers: algo.teacher.tp_size=7) GPUs each on a node")):
        plan_layout(big, Allocation("7", [["a", "b"]], dict.fromkeys("ab", 8)))


def test_local_engine_gpus_name_every_engine_process_the_teacher_too(tmp_path):
    """One entry per engine process: with fewer, the teacher engine once went unstarted."""
    with pytest.raises(ValueError, match=r"has 2 entries for 3 engine processes \(2 engine, 1 teacher"):
        load_config(None, [*TEACHER[:2], "algo.teacher.num_engines=1", "launch.local_engine_gpus=[2-2, 3-3]"])
    cfg = load_config(
        None, [f"run.dir={tmp_path}", *TEACHER[:2], "algo.teacher.num_engines=1",
               "launch.local_engine_gpus=[2-2, 3-3, 4-5]", "launch.local_trainer_gpus=0-1"],
    )  # fmt: skip
    teacher = local_commands(cfg, RunPaths(tmp_path))["teacher-0"]
    assert teacher[teacher.index("relax_hpc.launch.gpus") + 1] == "4-5"


def test_teacher_engines_serve_only_what_they_can_score():
    with pytest.raises(ValueError, match=r"algo\.teacher\.num_engines serves the teacher of .*distill only"):
        cfg_with("algo.teacher.num_engines=1")
    with pytest.raises(ValueError, match=r"score token ids only, not media \(data.media\)"):
        cfg_with(*TEACHER, "data.media={image: images}")
    with pytest.raises(ValueError, match=r"rollout.temperature=0.7"):
        cfg_with(*TEACHER, "rollout.temperature=0.7")
    assert cfg_with(*TEACHER, "rollout.temperature=0").algo.teacher.num_engines == 2
    with pytest.raises(ValueError, match="the single-process loop has no engines"):
        InProcessRun(load_config(None, list(TEACHER)))


def test_allocation_that_does_not_match_the_config_is_refused():
    cfg = cfg_with("launch.slurm.rollout.nodes=1")
    with pytest.raises(AllocationError, match="has 1 node"):
        plan_layout(cfg, Allocation("7", [["a"]], {"a": 4}))
    with pytest.raises(AllocationError, match="3 engines on a node with 2"):
        plan_layout(
            cfg_with("launch.slurm.rollout.nodes=0", "launch.slurm.rollout.gpus_per_node=2", "rollout.num_engines=3"),
            Allocation("7", [["a"]], {"a": 4}),
        )


def test_sglang_engines_take_tp_size_gpus_each():
    sglang = ["rollout.engine=sglang", "rollout.sglang.tp_size=2"]
    cfg = cfg_with(
        *sglang, "launch.slurm.trainer.gpus_per_node=4", "launch.slurm.rollout.nodes=0",
        "launch.slurm.rollout.gpus_per_node=4", "rollout.num_engines=2",
    )  # fmt: skip
    assert plan_layout(cfg, Allocation("7", [["gpu1"]], {"gpu1": 64})).engine_gpus == ["4-5", "6-7"]
    # Not an even share of the node: tp_size GPUs each, whatever is left stays free.
    cfg = cfg_with(
        *sglang, "launch.slurm.rollout.nodes=2", "launch.slurm.rollout.gpus_per_node=8", "rollout.num_engines=4"
    )
    layout = plan_layout(cfg, Allocation("7", [["a", "b", "c"]], dict.fromkeys("abc", 8)))
    assert layout.engine_nodes == ["b", "c", "b", "c"]
    assert layout.engine_gpus == ["0-1", "0-1", "2-3", "2-3"]
    cfg = cfg_with(
        "rollout.engine=sglang", "launch.slurm.rollout.nodes=1", "launch.slurm.rollout.gpus_per_node=8",
        "rollout.num_engines=2",
    )  # fmt: skip
    assert plan_layout(cfg, Allocation("7", [["a", "b"]], dict.fromkeys("ab", 8))).engine_gpus == ["0-0", "1-1"]


def test_sglang_layouts_that_do_not_fit_are_refused():
    cfg = cfg_with(
        "rollout.engine=sglang", "rollout.sglang.tp_size=2", "launch.slurm.rollout.nodes=1",
        "launch.slurm.rollout.gpus_per_node=4", "rollout.num_engines=3",
    )  # fmt: skip
    with pytest.raises(AllocationError, match=re.escape("3 SGLang engines of rollout.sglang.tp_size=2 GPUs each")):
        plan_layout(cfg, Allocation("7", [["a", "b"]], dict.fromkeys("ab", 8)))
    cfg = cfg_with("rollout.engine=sglang", "launch.slurm.rollout.nodes=1")
    with pytest.raises(AllocationError, match=re.escape("rollout.engine=sglang needs GPUs")):
        plan_layout(cfg, Allocation("7", [["a", "b"]], {}))


def test_sglang_engine_commands_run_the_wrapper(tmp_path):
    cfg = cfg_with(
        f"run.dir={tmp_path / 'run'}", "rollout.engine=sglang", "rollout.sglang.tp_size=4",
        "launch.slurm.rollout.gpus_per_node=8", "rollout.num_engines=2", "rollout.base_port=30000",
    )  # fmt: skip
    paths = RunPaths(tmp_path / "run")
    engine = step_commands(cfg, paths, Allocation("7", [["a", "b"]], dict.fromkeys("ab", 8)))["engine-1"]
    wrapper = engine.index("relax_hpc.engines.sglang_engine")
    assert engine[wrapper - 5 : wrapper - 2] == ["relax_hpc.launch.gpus", "4-7", "--"]
    assert engine[wrapper + 1 :] == [
        "--run-dir", str(paths.root), "--engine-id", "engine-1", "--host", "0.0.0.0", "--port", "30001",
        "--pool", "policy",
    ]  # fmt: skip
    # The wrapper reads the run token itself: it is on no command line the launcher prints.
    local = local_commands(cfg, paths)["engine-0"]
    assert "relax_hpc.engines.sglang_engine" in local and "--api-key" not in local


def test_config_refuses_impossible_layouts():
    with pytest.raises(Exception, match="divide evenly"):
        cfg_with("launch.slurm.trainer.nodes=3", "trainer.num_ranks=2")
    with pytest.raises(Exception, match="heterogeneous needs"):
        cfg_with("launch.slurm.heterogeneous=true")


def test_gpu_slice_counts_within_the_steps_devices():
    assert select("4,5,6,7", "0-1") == "4,5"
    assert select(None, "2-3") == "2,3"
    with pytest.raises(SystemExit, match="sees only 2"):
        select("0,1", "0-3")


def test_container_wrapping_binds_what_roles_use(tmp_path):
    image = tmp_path / "relax.sif"
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"launch.container={image}"])
    argv = wrap_in_container(cfg, ["python", "-m", "x"])
    assert argv[:4] == ["apptainer", "exec", "--nv", "--bind"]
    binds = argv[4].split(",")
    assert str(tmp_path / "run") in binds and cfg.model.path in binds
    assert str(Path(cfg.data.path).parent) in binds and str(tmp_path) not in binds  # the image is not bound
    assert argv[-4:] == [str(image), "python", "-m", "x"]
    cfg = load_config(
        None, [f"run.dir={tmp_path / 'run'}", f"launch.container={tmp_path}", "launch.container_runtime=charliecloud"]
    )
    argv = wrap_in_container(cfg, ["python", "-m", "x"])
    assert argv[:2] == ["ch-run", "--set-env"] and argv[-5:] == [str(tmp_path), "--", "python", "-m", "x"]
    assert f"{tmp_path / 'run'}:{tmp_path / 'run'}" in argv


@pytest.mark.parametrize(
    ("visible", "overrides", "trainer", "engines", "summary"),
    [
        (0, [], NO_GPU, [NO_GPU, NO_GPU], "CPU only"),
        # A workstation with one GPU: two trainer ranks cannot have one each, so the default runs on
        # the CPU instead of rank 1 asking for a second GPU.
        (1, [], NO_GPU, [NO_GPU, NO_GPU], "CPU only (1 GPU(s) visible: fewer than the roles need)"),
        # Not enough for the engines too: a trainer on GPUs could not push weights to engines on the CPU.
        (3, [], NO_GPU, [NO_GPU, NO_GPU], "CPU only (3 GPU(s) visible: fewer than the roles need)"),
        (4, [], "0-1", ["2-2", "3-3"], "trainer on GPUs 0-1 (2 rank(s)), engines on GPU 2, GPU 3"),
        (
            2,
            ["trainer.num_ranks=1", "rollout.num_engines=1"],
            "0-0",
            ["1-1"],
            "trainer on GPU 0 (1 rank(s)), engines on GPU 1",
        ),
        (
            2,
            ["launch.local_trainer_gpus=0-0", "launch.local_engine_gpus=[1-1, 1-1]"],
            "0-0",
            ["1-1", "1-1"],
            "trainer on GPU 0 (2 rank(s)), engines on GPU 1, GPU 1",
        ),
    ],
)
def test_local_roles_use_gpus_only_when_there_are_enough(visible, overrides, trainer, engines, summary):
    devices = place_local(load_config(None, overrides), visible)
    assert (devices.trainer, devices.engines) == (trainer, engines)
    assert devices.summary.startswith(summary)


def test_a_role_without_a_gpu_sees_none(tmp_path):
    """The placement reaches the processes: a CPU role's CUDA_VISIBLE_DEVICES is empty."""
    cfg = load_config(None, [f"run.dir={tmp_path}"])
    commands = local_commands(cfg, RunPaths(tmp_path), place_local(cfg, visible=1))
    assert commands["trainer"][1:5] == ["-m", "relax_hpc.launch.gpus", NO_GPU, "--"]
    assert select("0", NO_GPU) == "" and select(None, NO_GPU) == ""


def test_container_binds_the_teacher_too(tmp_path):
    """Every path option reaches the bind list: the teacher's folder once was resolved but not bound."""
    teacher = tmp_path / "teacher"
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"algo.teacher.path={teacher}", "launch.container=img.sif"])
    binds = wrap_in_container(cfg, ["python"])[4].split(",")
    assert str(teacher) in binds


@pytest.mark.parametrize(
    "config, trainer_gpus, engine_gpus, heterogeneous",
    [
        ("qwen3-4b-grpo", "0-3", ["4-4", "5-5", "6-6", "7-7"], False),
        ("qwen3-vl-4b-grpo", "0-3", ["4-4", "5-5", "6-6", "7-7"], False),
        ("qwen3-omni-grpo", None, ["0-3", "4-7"], True),
    ],
)
def test_gpu_recipes_lay_out_as_their_headers_say(config, trainer_gpus, engine_gpus, heterogeneous):
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(repo / "configs" / f"{config}.yaml")
    groups = [["gpu1"], ["gpu2"]] if heterogeneous else [["gpu1"]]
    layout = plan_layout(cfg, Allocation("1", groups, {"gpu1": 64, "gpu2": 64}))
    assert layout.trainer_gpus == trainer_gpus and layout.engine_gpus == engine_gpus
    assert cfg.launch.slurm.heterogeneous == heterogeneous
    recipe = (repo / "sbatch" / f"{config}.sbatch").read_text()
    assert "#SBATCH --requeue" in recipe and "#SBATCH --signal=B:USR2@" in recipe and "--in-allocation" in recipe
    assert ("#SBATCH hetjob" in recipe) == heterogeneous
