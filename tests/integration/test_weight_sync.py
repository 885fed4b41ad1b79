"""Weight sync round trip: two trainer ranks (FSDP2, gloo) -> two engine processes over HTTP + gloo."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.protocol import requests as P
from relax_hpc.protocol.client import EngineClient
from relax_hpc.protocol.registry import read_records
from relax_hpc.protocol.requests import adapter_name
from relax_hpc.weights.catchup import SNAPSHOT, SnapshotReq, decode
from tests.integration.conftest import REPO, make_run

pytestmark = pytest.mark.integration


# With modules trained whole (the final norm, the tied embedding): they travel beside the adapters.
LORA = (
    "trainer.lora.rank=4", "trainer.lora.target_modules=[q_proj,v_proj,down_proj]",
    "trainer.lora.modules_to_save=[model.norm,embed_tokens]",
)  # fmt: skip
FILE = ("weights.channel=file",)


@pytest.mark.parametrize(
    "path, overrides",
    [
        ("broadcast", ()),
        ("colocated", ()),
        ("broadcast", LORA),
        ("adapter", (*LORA, "trainer.lora.sync=adapter")),
        ("file", FILE),
        ("file", (*FILE, "weights.delta=true")),
        ("sharded", ("weights.channel=sharded",)),
        ("sharded", ("weights.channel=sharded", "weights.relay=true")),
        ("sharded-colocated", ("weights.channel=sharded", "launch.colocate=true", "rollout.max_staleness=0")),
    ],
    ids=[
        "broadcast",
        "colocated",
        "lora",
        "lora-adapter",
        "file",
        "file-delta",
        "sharded",
        "sharded-relay",
        "sharded-colocated",
    ],
)
def test_engines_hold_the_trainer_weights_after_a_push(tmp_path, engines, path, overrides):
    """Broadcast: rank 0 sends every engine each bucket over a gloo group. Colocated: each rank
    releases its own engine's memory (the engine then refuses to generate), then hands it the
    buckets by reference (shared memory on the CPU, CUDA IPC on a GPU). LoRA: only the adapters
    and the modules trained whole travel, and each engine's weights are then bit for bit the base
    with the trainer's adapters merged and the trainer's final norm and embedding. LoRA adapter
    sync: the engines load each version's PEFT folder and merge the adapter a request names (and
    set its modules), the newest or the one before (still loaded). File (and delta): four versions
    written by both ranks and loaded from disk; the second engine misses the third and then loads
    the whole fourth while the first loads its delta; killed and started again, it copies the
    version before the last from the first engine (catch-up) and then loads the last one's delta
    too; the folders of older versions are gone. Sharded: each rank broadcasts about half of the
    buckets over a group of its own; the first of four pushes cannot open (an engine unreachable
    to rank 0), which fails it on both ranks at once; the second engine is killed as the third
    push begins, which fails that push on both ranks, and started again it takes the fourth push,
    bit for bit, with the first engine. Sharded with relays (weights.relay), on four ranks: the
    same, every bucket passing through the three other ranks, in one order. Sharded and colocated:
    as colocated, each rank handing its half of the buckets to both engines by reference, rank 0
    reporting the version once both halves are in."""
    # 0.05 MiB buckets: the 1.2 MB model travels in many buckets, as a large model would.
    cfg, paths = make_run(tmp_path / "run", "weights.bucket_mb=0.05", *overrides)
    ranks = 4 if cfg.weights.relay else 2  # relays: three of them in every rank's group
    group = engines(cfg, paths, 2)
    out, log = tmp_path / "expected.json", tmp_path / "worker.log"
    # Output to a file, not a pipe: torch's shared-memory manager (CPU tensors shared by name)
    # outlives the workers and would hold a pipe open until the engines exit.
    for _ in range(2):
        with log.open("w") as sink:
            result = subprocess.run(
                [sys.executable, str(REPO / "tests" / "integration" / "sync_worker.py"), str(paths.root), str(out), "7",
                 path, str(ranks)],
                check=False, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, timeout=300,
            )  # fmt: skip
        # Rank 1 of this stand-in trainer has aborted inside C++ twice ("terminate called without
        # an active exception", SIGABRT) while rank 0 built its expected model, after the push, in
        # the LoRA case (CI at 4297e74; 2026-12-02): not understood yet. Then it runs once more (the
        # same push again); any other failure, or that one twice, fails the test.
        if result.returncode == 0 or "terminate called without an active exception" not in log.read_text():
            break
    assert result.returncode == 0, log.read_text()[-3000:]
    expected = json.loads(out.read_text())
    try:
        assert expected["engines"] == 2
        # LoRA sends the adapters and two small modules: a few percent of the model's 1.2 MB
        lora = "trainer.lora.rank=4" in overrides
        assert expected["bytes"] < 0.1 * 1.2e6 if lora else expected["buckets"] > 5
        if path == "file" and "weights.delta=true" in overrides:  # the second engine stopped, then killed
            assert expected["served"] == [2, 2, 1, 2, 1, 2]
            assert expected["folders"] == ["v7-delta"]  # the restarted engine copied v6: no whole v7
            copied = [e for e in read_jsonl(paths.events_metrics) if e["event"] == "catch_up" and "seed" in e]
            assert [(e["engine"], e["seed"], e["version"]) for e in copied] == [("engine-1", "engine-0", "6")]
        elif path == "file":
            assert expected["served"] == [2, 2]
            assert expected["folders"] == ["v7"]
        elif path == "sharded":  # the first push cannot open; the second engine killed as the third began
            assert expected["served"] == [-1, 2, -1, 2]
            assert expected["refused_s"] < 10  # on both ranks at once, not after weights.timeout_s (60 s)
            assert expected["killed_s"] < 30  # every rank watches the engines: seconds, not weights.timeout_s
            total, largest = expected["bytes"], expected["largest_tensor"]
            assert sum(expected["shares"]) == total and len(expected["shares"]) == ranks
            assert max(expected["shares"]) <= total / ranks + largest  # each rank its share, to within a tensor
            # weights.relay: rank 0 is in the other ranks' groups too, passing their buckets on
            assert expected["relayed_groups"] == (ranks - 1 if cfg.weights.relay else 0)
        elif path == "sharded-colocated":  # both ranks hand their halves to both engines, twice
            assert sum(expected["shares"]) == expected["bytes"]
            assert max(expected["shares"]) <= expected["bytes"] / 2 + expected["largest_tensor"]
        colocated = path in ("colocated", "sharded-colocated")
        assert expected["refused_while_released"] is (True if colocated else None)
        token, trainer = paths.read_token(), load_file(str(out.with_suffix(".safetensors")))
        prompts = [[int(t) for t in row] for row in _prompts()]
        greedy = {"max_new_tokens": 4, "temperature": 0.0}
        for record in group.wait_registered(2):
            client = EngineClient(record.url, token, 30)
            assert client.weight_version() == "7"
            named = adapter_name(7) if path == "adapter" else None  # the engines merge what a request names
            outputs = client.generate(P.GenerateReqInput(input_ids=prompts, sampling_params=greedy, lora_path=named))
            assert [o["output_ids"] for o in outputs] == expected["greedy"]
            assert all(o["meta_info"]["weight_version"] == "7" for o in outputs)
            _holds_exactly(client, trainer, record.engine_id)  # every tensor whole, bit for bit
            if path == "adapter":
                older = client.generate(P.GenerateReqInput(input_ids=prompts, sampling_params=greedy, lora_path="v6"))
                assert [o["output_ids"] for o in older] == expected["previous_greedy"] != expected["greedy"]
        if path == "adapter":
            assert sorted(p.name for p in paths.lora_adapters.iterdir()) == ["v6", "v7"]
        if path == "broadcast" and not lora:  # LoRA runs do not catch up (the weights hold the merged adapter)
            _restarted_engine_catches_up(group, paths, trainer)
    finally:  # the second engine, started again by the worker (file)
        if expected["restarted"]:
            os.kill(expected["restarted"], signal.SIGKILL)


def _holds_exactly(client: EngineClient, trainer: dict[str, torch.Tensor], engine: str) -> None:
    """The engine's weights (its catch-up snapshot route: every tensor it holds, whole; with LoRA,
    the base with the adapter merged) are the trainer's, bit for bit, at version 7."""
    held, stamp = decode(client.fetch(SNAPSHOT, SnapshotReq(0, 2**40, inspect=True)))
    assert stamp.version == "7" and sorted(held) == sorted(trainer), engine
    differ = [n for n, t in trainer.items() if not torch.equal(held[n].view(torch.uint8), t.view(torch.uint8))]
    assert not differ, f"{engine}: {differ}"


def _restarted_engine_catches_up(group, paths, trainer: dict[str, torch.Tensor]) -> None:
    """engine-0 killed (-9) and started again, as the launcher restarts it: with no trainer left to
    push, it holds version 7, copied from engine-1 (rollout.catch_up engine, the default), bit
    for bit the trainer's weights and engine-1's, and says so in the run's events."""
    killed = {r.engine_id: r for r in read_records(paths.engines)}["engine-0"]
    group.procs["engine-0"].kill()
    group.procs["engine-0"].wait()
    group.start("engine-0")
    deadline = time.monotonic() + 120
    while (record := _record(paths, "engine-0")) is None or record.instance == killed.instance:
        assert time.monotonic() < deadline and group.procs["engine-0"].poll() is None, "engine-0 did not come back"
        time.sleep(0.2)
    assert record.weight_version == "7"
    nbytes = sum(t.numel() * t.element_size() for t in trainer.values())
    copied = [e for e in read_jsonl(paths.events_metrics) if e["event"] == "catch_up" and e["outcome"] == "copied"]
    assert [(e["engine"], e["seed"], e["version"], e["bytes"]) for e in copied][-1:] == [
        ("engine-0", "engine-1", "7", nbytes)
    ]
    token = paths.read_token()
    for engine in read_records(paths.engines):
        _holds_exactly(EngineClient(engine.url, token, 30), trainer, engine.engine_id)


def _record(paths, engine_id: str):
    return {r.engine_id: r for r in read_records(paths.engines)}.get(engine_id)


def _prompts():
    from transformers import AutoTokenizer

    from relax_hpc.models.tiny import addition_problems

    tokenizer = AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-qwen3-addition")
    return [tokenizer(p)["input_ids"] for p, _ in addition_problems()]
