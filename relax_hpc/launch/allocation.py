"""The Slurm allocation this process runs in, and which of its nodes (and GPUs) each role gets.

A plain job is one group of nodes: the first `slurm.trainer.nodes` train, the next
`slurm.rollout.nodes` serve rollout (or, with rollout nodes 0, the engines share the trainer
nodes). A heterogeneous job has two groups: component 0 trains, component 1 serves rollout.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from relax_hpc.config.schema import JobConfig
from relax_hpc.launch.gpus import NO_GPU, engine_count, sglang_sizes


class AllocationError(RuntimeError):
    """The allocation does not match the config (wrong node count, not inside a job)."""


@dataclass(frozen=True)
class Allocation:
    job_id: str
    groups: list[list[str]]  # node names per heterogeneous component (one group for a plain job)
    cpus: dict[str, int]  # CPUs this job holds on each node
    addresses: dict[str, str] | None = None  # each node's NodeAddr (node names need not resolve)

    def address(self, node: str) -> str:
        return (self.addresses or {}).get(node, node)

    @property
    def heterogeneous(self) -> bool:
        return len(self.groups) > 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Allocation:
        if "SLURM_JOB_ID" not in env:
            raise AllocationError(
                "not inside a Slurm job (no SLURM_JOB_ID); submit with sbatch or launch.executor=slurm"
            )
        het_size = int(env.get("SLURM_HET_SIZE", "0"))
        suffixes = [f"_HET_GROUP_{g}" for g in range(het_size)] if het_size > 1 else [""]
        groups: list[list[str]] = []
        cpus: dict[str, int] = {}
        for suffix in suffixes:
            nodes = expand_hostlist(env[f"SLURM_JOB_NODELIST{suffix}"])
            groups.append(nodes)
            cpus.update(zip(nodes, expand_counts(env[f"SLURM_JOB_CPUS_PER_NODE{suffix}"]), strict=True))
        return cls(env["SLURM_JOB_ID"], groups, cpus, node_addresses(list(cpus)))


def expand_hostlist(hostlist: str) -> list[str]:
    """`n[1-3],gpu7` -> node names, by Slurm's own parser."""
    out = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def node_addresses(nodes: list[str]) -> dict[str, str]:
    """NodeName -> NodeAddr from slurmctld: where other nodes reach it (a rendezvous host)."""
    out = subprocess.run(
        ["scontrol", "-o", "show", "node", ",".join(nodes)], capture_output=True, text=True, check=True
    )
    fields = (dict(f.split("=", 1) for f in line.split() if "=" in f) for line in out.stdout.splitlines())
    return {f["NodeName"]: f.get("NodeAddr", f["NodeName"]) for f in fields if "NodeName" in f}


def expand_counts(spec: str) -> list[int]:
    """SLURM_JOB_CPUS_PER_NODE's compressed form, `4(x2),2` -> [4, 4, 2]."""
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise AllocationError(f"cannot parse SLURM_JOB_CPUS_PER_NODE {spec!r}")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts


@dataclass(frozen=True)
class Layout:
    trainer_group: int
    trainer_nodes: list[str]
    trainer_gpus: str | None  # a GPU slice such as "0-3" when rollout shares the node, else all
    engine_group: int
    engine_nodes: list[str]  # the node of each engine
    engine_gpus: list[str | None]
    engine_devices: list[str | None] | None = None  # colocated: each engine's --device (its rank's GPU)


def plan_layout(cfg: JobConfig, alloc: Allocation) -> Layout:
    sl = cfg.launch.slurm
    want_trainer, want_rollout = sl.trainer.nodes, sl.rollout.nodes
    if alloc.heterogeneous:
        trainer_nodes, rollout_nodes = alloc.groups[0], alloc.groups[1]
        if (len(trainer_nodes), len(rollout_nodes)) != (want_trainer, want_rollout):
            raise AllocationError(
                f"heterogeneous job {alloc.job_id} has {len(trainer_nodes)}+{len(rollout_nodes)} nodes; "
                f"the config asks for {want_trainer} trainer + {want_rollout} rollout"
            )
        groups = (0, 1)
    else:
        nodes = alloc.groups[0]
        if len(nodes) != want_trainer + want_rollout:
            raise AllocationError(
                f"job {alloc.job_id} has {len(nodes)} node(s) ({','.join(nodes)}); the config asks for "
                f"{want_trainer} trainer + {want_rollout} rollout (launch.slurm.trainer/rollout.nodes)"
            )
        trainer_nodes = nodes[:want_trainer]
        rollout_nodes = nodes[want_trainer:] or trainer_nodes
        groups = (0, 0)
    if cfg.launch.colocate:
        return _colocated_layout(cfg, groups[0], trainer_nodes)
    colocated = rollout_nodes == trainer_nodes
    # Judge and teacher engines come after the rollout engines, placed the same way.
    engine_nodes = [rollout_nodes[i % len(rollout_nodes)] for i in range(engine_count(cfg))]
    per_node = Counter(engine_nodes)
    used: Counter[str] = Counter()  # GPUs of each node given to engines so far
    engine_gpus: list[str | None] = []
    # An SGLang engine takes its tensor-parallel size in GPUs; built-in engines split the node's.
    fixed = sglang_sizes(cfg)
    sizes: list[int | None] = list(fixed) if fixed else [None] * len(engine_nodes)
    offset = sl.trainer.gpus_per_node if colocated else 0
    for node, size in zip(engine_nodes, sizes, strict=True):
        per_engine = _gpus_per_engine(sl.rollout.gpus_per_node, per_node[node], size)
        if per_engine is None:
            engine_gpus.append(NO_GPU)
            continue
        first = offset + used[node]
        engine_gpus.append(f"{first}-{first + per_engine - 1}")
        used[node] += per_engine
    if fixed and max(used.values(), default=0) > sl.rollout.gpus_per_node:
        raise AllocationError(_sglang_overflow(cfg, max(per_node.values())))
    trainer_gpus = f"0-{sl.trainer.gpus_per_node - 1}" if colocated and sl.trainer.gpus_per_node else None
    if sl.trainer.gpus_per_node == 0:
        trainer_gpus = NO_GPU  # a node's GPUs that the job did not ask for are not the trainer's
    return Layout(groups[0], trainer_nodes, trainer_gpus, groups[1], engine_nodes, engine_gpus)


def _colocated_layout(cfg: JobConfig, group: int, trainer_nodes: list[str]) -> Layout:
    """launch.colocate: engine i beside trainer rank i modulo the ranks, on that rank's node and
    GPU; every role on a node sees the same GPUs, so that a CUDA IPC handle means the same device
    to the rank that made it and to the engine that maps it."""
    per_node = cfg.trainer.num_ranks // len(trainer_nodes)
    gpus = cfg.launch.slurm.trainer.gpus_per_node
    if gpus and gpus < per_node:
        raise AllocationError(f"launch.colocate: {per_node} trainer ranks per node on {gpus} GPU(s)")
    ranks = [i % cfg.trainer.num_ranks for i in range(engine_count(cfg))]
    nodes = [trainer_nodes[r // per_node] for r in ranks]
    visible = f"0-{gpus - 1}" if gpus else NO_GPU
    devices: list[str | None] = [f"cuda:{r % per_node}" if gpus else None for r in ranks]
    return Layout(group, trainer_nodes, visible, group, nodes, [visible] * len(nodes), devices)


def _gpus_per_engine(gpus_per_node: int, engines_on_node: int, tp_size: int | None) -> int | None:
    """`tp_size` for an SGLang engine; an even share of the node's rollout GPUs for the built-in
    engine (tp_size None); None where there are no GPUs to slice."""
    if tp_size is None:
        if gpus_per_node == 0:
            return None
        if gpus_per_node < engines_on_node:
            raise AllocationError(f"{engines_on_node} engines on a node with {gpus_per_node} rollout GPU(s)")
        return gpus_per_node // engines_on_node
    if gpus_per_node == 0:
        raise AllocationError(
            "rollout.engine=sglang needs GPUs: set launch.slurm.rollout.gpus_per_node "
            f"(each engine takes rollout.sglang.tp_size={tp_size})"
        )
    return tp_size


def _sglang_overflow(cfg: JobConfig, engines_on_node: int) -> str:
    teacher = cfg.algo.teacher.tp_size if cfg.algo.teacher.num_engines else None
    sizes = f"rollout.sglang.tp_size={cfg.rollout.sglang.tp_size}"
    sizes += f" (teachers: algo.teacher.tp_size={teacher})" if teacher else ""
    return (
        f"{engines_on_node} SGLang engines of {sizes} GPUs each on a node with "
        f"{cfg.launch.slurm.rollout.gpus_per_node} rollout GPU(s): lower rollout.num_engines or tp_size, "
        "or add rollout nodes"
    )


def example_allocation(cfg: JobConfig) -> Allocation:
    """The allocation `--dry-run` shows the job steps for (real node names come from Slurm)."""
    sl = cfg.launch.slurm
    cpus = sl.cpus_per_node or 1
    trainer = [f"trainer-node{i}" for i in range(sl.trainer.nodes)]
    rollout = [f"rollout-node{i}" for i in range(sl.rollout.nodes)]
    groups = [trainer, rollout] if sl.heterogeneous else [trainer + rollout]
    return Allocation("JOBID", groups, dict.fromkeys(trainer + rollout, cpus))
