"""The command line of every role: on this machine (`local`), or as job steps of a Slurm allocation.

    engines   python -m relax_hpc.engines.torch_engine   (rollout.num_engines processes; with
              rollout.engine=sglang, python -m relax_hpc.engines.sglang_engine, which runs SGLang;
              rollout.engine=vllm, python -m relax_hpc.engines.vllm_engine, which runs vLLM)
    judges    the same, on reward.judge.model, registered in RUN_DIR/registry/judge (reward.name=judge)
    teachers  the same, on algo.teacher.path, registered in RUN_DIR/registry/teacher
              (algo.teacher.num_engines)
    driver    python -m relax_hpc.rollout.driver
    metrics   python -m relax_hpc.metrics.sinks              (only with metrics.tensorboard or metrics.clearml)

A kind=sft job runs the trainer (and the metrics role) only: no engines, no driver. A kind=eval
job's engines are started by the eval job itself, one model at a time (relax_hpc.evaluate).
    trainer   torchrun ... -m relax_hpc.trainer.main      (one torchrun per trainer node; a trainer
              on this machine's CPU: python -m relax_hpc.trainer.main --nproc-per-node N, which
              forks its ranks after importing torch and transformers once: relax_hpc.trainer.ranks)

Inside an allocation each role is `srun --overlap --nodelist=NODE ...` (steps share the nodes' CPUs,
memory and GPUs instead of queueing for them; the placement below keeps them apart), optionally
through a container runtime, optionally limited to a slice of the node's GPUs.
"""

from __future__ import annotations

import socket
import sys
import uuid

from relax_hpc.config.schema import JobConfig
from relax_hpc.launch.allocation import Allocation, Layout, plan_layout
from relax_hpc.launch.container import wrap_in_container
from relax_hpc.launch.gpus import NO_GPU, LocalDevices, engine_pools, place_local, visible_gpu_count
from relax_hpc.paths import RunPaths


def engine_name(cfg: JobConfig, index: int) -> tuple[str, str]:
    """(role name, pool) of engine process `index`: rollout engines first, then judge engines,
    then teacher engines."""
    for prefix, pool, count in engine_pools(cfg):
        if index < count:
            return f"{prefix}-{index}", pool
        index -= count
    raise IndexError("engine index past the run's engines")


def engine_args(
    cfg: JobConfig, paths: RunPaths, index: int, host: str, engine_id: str | None = None, device: str | None = None
) -> list[str]:
    """Engine process `index` of the run, or, with `engine_id`, an elastic engine (a port of its
    own); `device`: the engine's GPU (colocated engines share a trainer rank's)."""
    name, pool = engine_name(cfg, index) if engine_id is None else (engine_id, "policy")
    port = cfg.rollout.base_port + index if cfg.rollout.base_port and engine_id is None else 0
    kind = cfg.rollout.kind
    if kind.supervised:
        # A supervisor of one server (SGLang's, vLLM's); it builds the server's arguments from
        # RUN_DIR/config.yaml (vLLM's runs in rollout.vllm.python, the supervisor here).
        return [
            "-m", kind.module, "--run-dir", str(paths.root), "--engine-id", name,
            "--host", host, "--port", str(port), "--pool", pool, *(["--device", device] if device else []),
        ]  # fmt: skip
    model = cfg.served_model(pool)
    return [
        "-m", kind.module, "--run-dir", str(paths.root), "--engine-id", name,
        "--model-path", model, "--dtype", cfg.model.dtype, "--host", host,
        "--port", str(port), "--threads", str(cfg.launch.threads_per_process),
        "--weights-timeout-s", str(cfg.weights.timeout_s), "--pool", pool, *(["--device", device] if device else []),
        *(["--catch-up-bucket-mb", str(cfg.weights.bucket_mb)] if pool == "policy" and cfg.engine_catch_up else []),
    ]  # fmt: skip


def driver_args(paths: RunPaths) -> list[str]:
    return ["-m", "relax_hpc.rollout.driver", "--run-dir", str(paths.root)]


def sinks_args(paths: RunPaths) -> list[str]:
    return ["-m", "relax_hpc.metrics.sinks", "--run-dir", str(paths.root)]


def wants_sinks(cfg: JobConfig) -> bool:
    """Whether the run reports to TensorBoard or ClearML (then a `metrics` role feeds them)."""
    return cfg.metrics.tensorboard or cfg.metrics.clearml.enabled


def trainer_args(paths: RunPaths, torchrun: list[str]) -> list[str]:
    return ["-m", "torch.distributed.run", *torchrun, "-m", "relax_hpc.trainer.main", "--run-dir", str(paths.root)]


def python(cfg: JobConfig) -> str:
    """This interpreter, or the image's own: a host venv's python is not inside the container."""
    return "python" if cfg.launch.container else sys.executable


def local_commands(cfg: JobConfig, paths: RunPaths, devices: LocalDevices | None = None) -> dict[str, list[str]]:
    """Every role as a subprocess of this machine (the `local` executor), on the GPUs `devices`
    gives it (default: placed for the GPUs this machine shows)."""
    devices = devices or place_local(cfg, visible_gpu_count())
    py = python(cfg)
    device: list[str | None] = [*devices.engine_devices] if devices.engine_devices else [None] * len(devices.engines)
    commands = {
        engine_name(cfg, i)[0]: _on_gpus(gpus, [py, *engine_args(cfg, paths, i, cfg.rollout.host, device=device[i])])
        for i, gpus in enumerate(devices.engines)
    }
    if cfg.kind == "rl":  # an sft job is the trainer alone
        commands["driver"] = [py, *driver_args(paths)]
    if cfg.kind == "eval":  # the engines alone (the eval job feeds the metric sinks itself)
        return {name: wrap_in_container(cfg, argv) for name, argv in commands.items()}
    if wants_sinks(cfg):
        commands["metrics"] = [py, *sinks_args(paths)]
    ranks = cfg.trainer.num_ranks
    if devices.trainer == NO_GPU:  # ranks forked after one import (torchrun's ranks import everything again)
        trainer = ["-m", "relax_hpc.trainer.main", "--run-dir", str(paths.root), "--nproc-per-node", str(ranks)]
    else:
        trainer = trainer_args(paths, ["--standalone", f"--nproc-per-node={ranks}"])
    commands["trainer"] = _on_gpus(devices.trainer, [py, *trainer])
    return {name: wrap_in_container(cfg, argv) for name, argv in commands.items()}


def step_commands(cfg: JobConfig, paths: RunPaths, alloc: Allocation) -> dict[str, list[str]]:
    """Every role as a job step of the allocation this process runs in."""
    layout = plan_layout(cfg, alloc)
    py = python(cfg)
    commands = {}
    devices = layout.engine_devices or [None] * len(layout.engine_nodes)
    for i, (node, gpus) in enumerate(zip(layout.engine_nodes, layout.engine_gpus, strict=True)):
        # Engines listen on every interface and announce the node's name: the trainer and the
        # driver may run on other nodes.
        argv = _on_gpus(gpus, [py, *engine_args(cfg, paths, i, "0.0.0.0", device=devices[i])])
        name = engine_name(cfg, i)[0]
        commands[name] = _srun(cfg, alloc, layout.engine_group, [node], name) + wrap_in_container(cfg, argv)
    first_trainer_node = layout.trainer_nodes[:1]
    for name, args in (("driver", driver_args(paths)), ("metrics", sinks_args(paths))):
        if (name == "metrics" and not wants_sinks(cfg)) or (name == "driver" and cfg.kind == "sft"):
            continue
        step = _srun(cfg, alloc, layout.trainer_group, first_trainer_node, name)
        commands[name] = step + wrap_in_container(cfg, [py, *args])
    commands["trainer"] = _srun(cfg, alloc, layout.trainer_group, layout.trainer_nodes, "trainer") + wrap_in_container(
        cfg, _on_gpus(layout.trainer_gpus, [py, *trainer_args(paths, _torchrun_args(cfg, alloc, layout))])
    )
    return commands


def _torchrun_args(cfg: JobConfig, alloc: Allocation, layout: Layout) -> list[str]:
    """A fresh rendezvous at every start: a port free now and an id of its own. A restarted
    torchrun that found its predecessor's store on the same port would join it and wait there
    silently; the c10d store's port is bound on the first trainer node, where the launcher (the
    batch shell) runs."""
    nodes = len(layout.trainer_nodes)
    port = cfg.launch.slurm.rdzv_port or free_port()
    return [
        f"--nnodes={nodes}", f"--nproc-per-node={cfg.trainer.num_ranks // nodes}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={alloc.address(layout.trainer_nodes[0])}:{port}",
        f"--rdzv-id={alloc.job_id}-{uuid.uuid4().hex[:8]}",
    ]  # fmt: skip


def free_port() -> int:
    """A TCP port that no process on this host listens on now."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def step_name(cfg: JobConfig, role: str) -> str:
    """The job step name of a role (`--job-name`): how the launcher finds its steps to end them."""
    return f"{cfg.launch.slurm.job_name}:{role}"


def _srun(cfg: JobConfig, alloc: Allocation, group: int, nodes: list[str], name: str) -> list[str]:
    argv = [
        "srun", "--overlap", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}", f"--cpus-per-task={min(alloc.cpus[n] for n in nodes)}",
        f"--job-name={step_name(cfg, name)}", "--kill-on-bad-exit=1", "--unbuffered",
    ]  # fmt: skip
    if alloc.heterogeneous:
        argv.append(f"--het-group={group}")
    return argv


def _on_gpus(gpus: str | None, argv: list[str]) -> list[str]:
    """Limit a process to a slice of the GPUs its step sees (roles that share a node)."""
    if gpus is None:
        return argv
    return [argv[0], "-m", "relax_hpc.launch.gpus", gpus, "--", *argv]
