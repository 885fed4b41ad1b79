"""Weight sync round trip: two trainer ranks (FSDP2, gloo) -> two engine processes over HTTP + gloo."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from relax_hpc.config.schema import ShardedWeights
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
    relay = isinstance(cfg.weights, ShardedWeights) and cfg.weights.relay
    ranks = 4 if relay else 2  # relays: three of them in every rank's group
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
            assert expected["relayed_groups"] == (ranks - 1 if relay else 0)
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


def test_an_engine_whose_weights_differ_is_held_out_until_a_push_matches(tmp_path, engines):
    """weights.verify_every (relax_hpc.weights.verify), as the trainer's rank 0 runs it around its
    channel's push, against two built-in engines. A push of version 2 reaches both, then a real
    push of version 2 with one element of one tensor changed reaches engine-1 alone (as a channel
    that left one engine wrong would): the check finds that tensor, and only on engine-1, with an
    error event; engine-1 reports version -1, the driver sends it nothing new, and a request in
    flight there comes back re-issued from engine-0; `status` says engine-1 is out of service. The
    next push matches it whole: it is back, the event says so, and so does `status`."""
    cfg, paths = make_run(tmp_path / "run", "weights.verify_every=1", "rollout.request_timeout_s=20")
    records = {r.engine_id: r for r in engines(cfg, paths, 2).wait_registered(2)}
    token = paths.read_token()
    from relax_hpc.config.load import read_frozen
    from relax_hpc.envs.context import GenerateCall
    from relax_hpc.rollout.driver import Driver
    from relax_hpc.status import collect, render
    from relax_hpc.trainer.loop import log_event
    from relax_hpc.weights.layout import EngineLayout
    from relax_hpc.weights.sender import BroadcastChannel, WeightSender
    from relax_hpc.weights.verify import WeightCheck

    # The weights as loaded (engine-0's, read through its inspection route: no model to load here).
    original, _ = decode(EngineClient(records["engine-0"].url, token, 30).fetch(SNAPSHOT, SnapshotReq(0, 2**40, True)))
    layout = EngineLayout([(n, t.shape, t.dtype) for n, t in original.items()])

    def channel(registry):
        return BroadcastChannel(WeightSender(registry, token, "gloo", 30.0), layout, 2**16)

    both = channel(paths.engines)
    alone = tmp_path / "engine-1-alone"  # a registry of engine-1 only: a push that reaches it alone
    alone.mkdir()
    (alone / "engine-1.json").write_bytes((paths.engines / "engine-1.json").read_bytes())
    check = WeightCheck("torch", 1, paths.engines, paths.weights_quarantine, lambda r: log_event(paths, r), token,
                        30.0, None, torch.device("cpu"))  # fmt: skip

    def push(version, params):
        assert both.push(check.params(lambda: iter(params.items())), version) == 2
        return {v.engine: v for v in check.pushed(version)}

    verdicts = push(1, original)
    assert all(v.matches and v.checked == len(original) for v in verdicts.values()) and len(verdicts) == 2

    second = {n: t + 0.01 for n, t in original.items()}
    assert both.push(check.params(lambda: iter(second.items())), 2) == 2
    corrupted = dict(second, **{"model.norm.weight": second["model.norm.weight"].clone()})
    corrupted["model.norm.weight"][3] += 1.0  # one element
    assert channel(alone).push(lambda: iter(corrupted.items()), 2) == 1
    # A request at engine-1 while it is found out: held there (generation paused), answered after.
    EngineClient(records["engine-1"].url, token, 10).post("/pause_generation", P.PauseGenerationReqInput("in_place"))
    driver = Driver(read_frozen(paths.config), paths)
    driver.pool.refresh(force=True)
    engine_1 = next(e for e in driver.pool.engines if e.record.engine_id == "engine-1")  # the chunk goes there
    calls = [GenerateCall(ids, {"max_new_tokens": 4, "sampling_seed": k})
             for k, ids in enumerate(driver.prompt_ids[:3])]  # fmt: skip
    answered: dict = {}
    thread = threading.Thread(
        target=lambda: answered.update(out=driver.policy._run_chunk(engine_1, calls)), daemon=True
    )
    thread.start()
    time.sleep(0.5)
    try:
        assert thread.is_alive()  # waiting at engine-1
        verdicts = {v.engine: v for v in check.pushed(2)}
        assert verdicts["engine-0"].matches
        assert (verdicts["engine-1"].differ, verdicts["engine-1"].checked) == (["model.norm.weight"], len(original))
        (mismatch,) = [e for e in read_jsonl(paths.events_metrics) if e["event"] == "weights_mismatch"]
        assert (mismatch["level"], mismatch["engine"], mismatch["version"]) == ("error", "engine-1", 2)
        assert mismatch["tensors"] == ["model.norm.weight"] and mismatch["instance"] == records["engine-1"].instance
        assert EngineClient(records["engine-1"].url, token, 10).weight_version() == "-1"  # no version of the trainer's
        time.sleep(0.5)  # the driver's pool reads the registry at most every 0.5 s
    finally:  # engine-1 answers the request it held (also when the check failed: no thread left waiting)
        EngineClient(records["engine-1"].url, token, 10).post("/continue_generation", P.ContinueGenerationReqInput())
    thread.join(timeout=60)
    assert not thread.is_alive() and len(answered["out"]) == 3
    assert driver.policy.reissued == 3  # engine-1's answer, sampled with its wrong weights, went again to engine-0
    driver.pool.refresh(force=True)
    assert [e.record.engine_id for e in driver.pool.engines] == ["engine-0"]
    line = f"engine engine-1 OUT OF SERVICE since v2: 1 of {len(original)} tensors differ from the trainer's"
    assert line in render(collect(paths.root))

    verdicts = push(3, {n: t + 0.02 for n, t in original.items()})  # the next push, whole: it matches engine-1
    assert all(v.matches for v in verdicts.values())
    recovered = [e for e in read_jsonl(paths.events_metrics) if e["event"] == "weights_recovered"]
    assert [(e["engine"], e["version"], e["why"]) for e in recovered] == [("engine-1", 3, "matched")]
    driver.pool.refresh(force=True)
    assert [e.record.engine_id for e in driver.pool.engines] == ["engine-0", "engine-1"]
    text = render(collect(paths.root))
    assert "weights:     no engine held out; 1 mismatch(es) so far, the last: engine engine-1 back at v3" in text
