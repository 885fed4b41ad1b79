"""Engine-to-engine catch-up (rollout.catch_up engine, relax_hpc.weights.catchup) against a real
engine process: an engine with no one to copy from waits for the trainer, a seed whose weights
are mid-update refuses, and pushes landing on the seed during copies never leave a copy that
mixes two versions. (A restarted engine's copy against the trainer's own weights:
test_weight_sync's broadcast case.)"""

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.protocol import requests as P
from relax_hpc.protocol.client import EngineClient, EngineUnavailable
from relax_hpc.protocol.registry import read_records
from relax_hpc.weights.catchup import SNAPSHOT, SnapshotReq, catch_up, decode
from relax_hpc.weights.layout import EngineLayout
from relax_hpc.weights.sender import BroadcastChannel, WeightSender
from tests.integration.conftest import make_run

pytestmark = pytest.mark.integration

SMALL = 20_000  # bytes per bucket: the 1.2 MB model in about 60 buckets, so pushes land between them


def _folder(root: Path, params: dict[str, torch.Tensor], shift: float) -> tuple[Path, dict[str, torch.Tensor]]:
    """A version folder (weights.channel file's layout) of `params` + `shift`."""
    weights = {n: t + shift for n, t in params.items()}
    root.mkdir()
    save_file(weights, str(root / "b0.safetensors"))
    return root, weights


def _load(client: EngineClient, folder: Path, version: str | None) -> None:
    client.post(
        "/update_weights_from_disk",
        P.UpdateWeightFromDiskReqInput(model_path=str(folder), abort_all_requests=False, weight_version=version),
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_copies_are_one_version_while_pushes_land(tmp_path, engines):
    cfg, paths = make_run(tmp_path / "run", "rollout.catch_up=engine")
    group = engines(cfg, paths, 1)
    [seed] = group.wait_registered(1)
    # The first engine of a run has no one to copy from: it waits for the trainer's push, and says so.
    [event] = [e for e in read_jsonl(paths.events_metrics) if e["event"] == "catch_up"]
    assert (event["engine"], event["outcome"], seed.weight_version) == ("engine-0", "fallback", "0")
    assert "no healthy engine past version 0" in event["why"]

    token = paths.read_token()
    client = EngineClient(seed.url, token, 30)
    params, _ = decode(client.fetch(SNAPSHOT, SnapshotReq(0, 2**40)))  # the seed's version 0, whole
    folders = [_folder(tmp_path / name, params, shift) for name, shift in (("a", 0.5), ("b", -0.25))]

    # Weights changed without a version (an update under way, or abandoned): the seed refuses.
    _load(client, folders[0][0], None)
    with pytest.raises(EngineUnavailable, match="503"):
        client.fetch(SNAPSHOT, SnapshotReq(0, SMALL))

    # Version 1 (a), then a push every 0.3 s (versions 2, 3, ...: folder b, a, ...) while copies
    # run: about as long as a copy, so some copies see a push land and take it again.
    _load(client, folders[0][0], "1")
    while read_records(paths.engines)[0].weight_version != "1":  # the record is rewritten off the answer's path
        time.sleep(0.05)
    stop, pushed = threading.Event(), [1]

    def push() -> None:
        while not stop.wait(0.3):
            pushed[0] += 1
            _load(client, folders[pushed[0] % 2 - 1][0], str(pushed[0]))

    pusher = threading.Thread(target=push)
    pusher.start()
    retried = 0
    try:
        for _ in range(60):  # until a push has landed mid-copy a few times (about 1 copy in 4)
            done, staged, why = catch_up(paths.engines, "engine-new", token, params, SMALL, 30.0, tries=20)
            assert done is not None, why
            assert (done.seed, done.nbytes) == ("engine-0", sum(t.numel() * t.element_size() for t in params.values()))
            expected = folders[int(done.version) % 2 - 1][1]
            assert all(torch.equal(_bits(t), _bits(expected[n])) for n, t in staged), done.version
            retried += done.attempts > 1
            if retried >= 2:
                break
    finally:
        stop.set()
        pusher.join()
    assert retried >= 2 and pushed[0] > 3

    # A seed whose parameters differ from the new engine's is refused: the engine waits for the trainer.
    done, staged, why = catch_up(
        paths.engines, "engine-new", token, {**params, "extra.weight": params[next(iter(params))]}, SMALL, 30.0
    )
    assert (done, staged) == (None, []) and "parameters differ" in why and "extra.weight" in why

    # The trainer's side: an engine at the delivered version (one that caught up) needs no push;
    # without catch-up, an engine set the group has not seen does.
    held = int(client.weight_version())
    sender = WeightSender(paths.engines, token, "gloo", 10.0)
    assert not BroadcastChannel(sender, EngineLayout([]), 1, catch_up=True).engines_changed(held)
    assert BroadcastChannel(sender, EngineLayout([]), 1, catch_up=True).engines_changed(held - 1)
    assert BroadcastChannel(sender, EngineLayout([]), 1, catch_up=False).engines_changed(held)
