"""The rollout engine kinds (`rollout.engine`), declared once: what starts an engine, which API it
speaks, how it takes weights and what it serves. Submit's checks, the launcher's commands, scale,
the driver's client and the trainer's channel choice read this table instead of comparing
`rollout.engine` with names, so a new kind is an entry here plus its own package (its server
under relax_hpc/engines/, a client in relax_hpc/protocol/ where its API is not SGLang's).

Torch-free, as the whole config layer is: submit and the driver import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Api = Literal["sglang", "vllm"]  # SGLang's native HTTP API, or vLLM's (relax_hpc.protocol.vllm)


@dataclass(frozen=True)
class EngineKind:
    name: str  # rollout.engine's value
    label: str  # how messages name it
    module: str  # `python -m MODULE` starts one engine role
    supervised: bool  # MODULE supervises a server it configures from RUN_DIR/config.yaml (else: by arguments)
    api: Api  # what the driver, the trainer and the weight check speak to it
    hf_layout: bool  # it loads the HF checkpoint's tensors (else the trainer's own in-memory layout)
    concurrent_updates: bool  # takes several weight updates at once (the sharded channel without relay)
    tp_size: Callable[[Any], int] | None  # GPUs per engine from the rollout section (None: a share of what is there)
    channels: frozenset[str]  # the weights.channel values it takes
    broadcast_delta: bool  # weights.delta over a collective channel (changed elements patched in place)
    reloads_whole: str | None  # what reloads the file channel's folder when that takes whole tensors only
    lora_sync: frozenset[str]  # the trainer.lora.sync values it serves
    lora_modules_to_save: bool  # serves modules trained whole beside the adapters
    lora_max_rank: int | None  # the highest LoRA rank it serves (None: any)
    media: bool  # serves prompts with images, audio or video (data.media)
    catch_up: bool  # a new engine copies the weights from a healthy one (rollout.catch_up engine)
    evaluates: bool  # serves evaluation engines (rollout.eval_engines) and eval jobs (kind=eval)
    elastic: bool  # `python -m relax_hpc.scale out` adds engines of it to a running training
    weight_checker: str  # the route that reports a digest of each tensor it holds (weights.verify_every)
    group_requests: bool = False  # one request samples a whole group (sampling n): not used yet
    chat: bool = False  # serves chat completions with tool calls to agents: not used yet
    score_route: bool = False  # a classify/score route for reward models: not used yet

    def gpus_per_engine(self, rollout: Any) -> int | None:
        """The GPUs one engine takes, or None where it takes a share of what there is."""
        return self.tp_size(rollout) if self.tp_size is not None else None


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices (vllm/config/lora.py)

ENGINE_KINDS: dict[str, EngineKind] = {
    kind.name: kind
    for kind in (
        EngineKind(
            "torch", "the built-in engine", "relax_hpc.engines.torch_engine", supervised=False, api="sglang",
            hf_layout=False, concurrent_updates=True, tp_size=None,
            channels=frozenset({"broadcast", "sharded", "file"}), broadcast_delta=False, reloads_whole=None,
            lora_sync=frozenset({"merge", "adapter"}), lora_modules_to_save=True, lora_max_rank=None, media=True,
            catch_up=True, evaluates=True, elastic=True, weight_checker="/weights_checker",
        ),
        EngineKind(
            "sglang", "SGLang", "relax_hpc.engines.sglang_engine", supervised=True, api="sglang",
            hf_layout=True, concurrent_updates=False, tp_size=lambda rollout: rollout.sglang.tp_size,
            channels=frozenset({"broadcast", "sharded", "file"}), broadcast_delta=False,
            reloads_whole="SGLang's update_weights_from_disk", lora_sync=frozenset({"adapter"}),
            lora_modules_to_save=False, lora_max_rank=None, media=True, catch_up=False, evaluates=False,
            elastic=True, weight_checker="/weights_checker",
        ),
        EngineKind(
            "vllm", "vLLM", "relax_hpc.engines.vllm_engine", supervised=True, api="vllm",
            hf_layout=True, concurrent_updates=False, tp_size=None,
            channels=frozenset({"broadcast", "file"}), broadcast_delta=True, reloads_whole="vLLM's reload_weights",
            lora_sync=frozenset({"adapter"}), lora_modules_to_save=False, lora_max_rank=max(VLLM_LORA_RANKS),
            media=False, catch_up=False, evaluates=False, elastic=False, weight_checker="/weight_checker",
        ),
    )
}  # fmt: skip


def engine_kind(name: str) -> EngineKind:
    """The kind `rollout.engine` names (validated at load: always one of ENGINE_KINDS)."""
    return ENGINE_KINDS[name]


def engine_choices() -> str:
    """The kinds as a message lists them: 'torch', 'sglang' or 'vllm'."""
    names = [repr(n) for n in ENGINE_KINDS]
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]
