"""Fencing (relax_hpc/fence.py): a process of an older generation of the run refuses every write at
the writing primitives themselves, records the refusal outside the run's record, and leaves what it
would have written untouched."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from relax_hpc import fence
from relax_hpc.ckpt.manager import Checkpointer
from relax_hpc.exchange.spool import Spool
from relax_hpc.fence import Fence, Fenced, Lease, read_lease, refused_writes
from relax_hpc.metrics.heartbeat import Heartbeat
from relax_hpc.metrics.jsonl import JsonlWriter, read_jsonl
from relax_hpc.paths import RunPaths
from relax_hpc.protocol.registry import EngineRecord, read_records, write_record
from relax_hpc.weights.adapters import AdapterPublisher
from relax_hpc.weights.colocated import ColocatedSender
from relax_hpc.weights.sender import WeightSender
from tests.unit.test_spool import make_batch


def _granted(run_dir: Path, role: str, lease: Lease) -> Fence:
    role_, _, serial = lease.grant(role)[fence.ENV].rpartition(":")
    return Fence(run_dir, role_, int(serial))


@pytest.fixture
def run(tmp_path):
    """A RUN_DIR whose trainer process (this one) holds a grant, and the launcher's lease."""
    paths = RunPaths(tmp_path / "run")
    paths.create()
    lease = Lease(paths.root)
    lease.new_generation()
    fence.configure(_granted(paths.root, "trainer", lease))
    yield paths, lease
    fence.configure(None)


def _supersede(lease: Lease) -> None:
    """What a restart does: a new generation, this process's role granted to a new process."""
    lease.new_generation()
    lease.grant("trainer")


def test_a_grant_is_current_until_its_role_is_granted_again_or_the_generation_advances(tmp_path):
    lease = Lease(tmp_path)
    lease.new_generation()
    trainer, driver = _granted(tmp_path, "trainer", lease), _granted(tmp_path, "driver", lease)
    assert trainer.current(fresh=True) and driver.current(fresh=True)
    _granted(tmp_path, "driver", lease)  # the driver restarted alone (hung, replaced)
    assert trainer.current(fresh=True) and not driver.current(fresh=True)
    lease.new_generation()  # a new attempt or a requeue supersedes every process
    assert not trainer.current(fresh=True)
    # The launcher of the next allocation continues the counts from the file.
    assert Lease(tmp_path).generation == 2 and read_lease(tmp_path)["roles"] == {}


def test_a_launcher_sees_that_another_took_the_lease_and_who(tmp_path):
    mine = Lease(tmp_path)
    assert mine.superseded() is None  # nothing written yet: nobody to be superseded by
    mine.new_generation()
    mine.grant("trainer")
    assert mine.superseded() is None
    other = Lease(tmp_path)  # a second launcher starts on the same RUN_DIR
    other.new_generation()
    assert mine.superseded() == other.state["owner"] and other.superseded() is None


def test_a_superseded_process_refuses_records_the_refusal_and_raises_past_except_exception(run):
    paths, lease = run
    _supersede(lease)
    time.sleep(fence.CACHE_S + 0.05)  # the cached read expires (monotonic: a SIGSTOP counts too)
    raised = None
    try:
        fence.check("a write")
    except Exception:  # noqa: BLE001  # what role code catches must not swallow a refusal
        raised = "Exception"
    except Fenced:
        raised = "Fenced"
    assert raised == "Fenced"  # refused: not recorded and let through
    writer = JsonlWriter(paths.events_metrics)  # a real writing primitive: it writes nothing
    with pytest.raises(Fenced):
        writer.log({"event": "from a superseded process"})
    writer.close()
    assert read_jsonl(paths.events_metrics) == []
    assert [(r["what"], r["role"]) for r in refused_writes(paths.root)] == [
        ("a write", "trainer"), ("metrics append to events.jsonl", "trainer"),
    ]  # fmt: skip


def test_the_cache_spares_reads_on_hot_paths_and_a_fresh_check_sees_through_it(run):
    paths, lease = run
    fence.check("warm the cache")
    _supersede(lease)
    fence.check("within the cache's life: still counted current")
    with pytest.raises(Fenced):
        fence.check("the checkpoint commit", fresh=True)
    assert [r["what"] for r in refused_writes(paths.root)] == ["the checkpoint commit"]


def test_a_process_without_a_grant_is_never_fenced(tmp_path, monkeypatch):
    monkeypatch.delenv(fence.ENV, raising=False)
    assert fence.from_env(tmp_path) is None
    monkeypatch.setenv(fence.ENV, "engine-0")
    with pytest.raises(ValueError, match="ROLE:SERIAL"):
        fence.from_env(tmp_path)


def _stale(lease: Lease) -> None:
    """Superseded, and the cached read of the lease expired (as after a SIGSTOP)."""
    _supersede(lease)
    time.sleep(fence.CACHE_S + 0.05)


def test_metrics_append_is_refused_and_the_file_keeps_only_current_records(run):
    paths, lease = run
    writer = JsonlWriter(paths.train_metrics)
    writer.log({"step": 1})
    _stale(lease)
    with pytest.raises(Fenced):
        writer.log({"step": 2})
    writer.close()
    assert [r["step"] for r in read_jsonl(paths.train_metrics)] == [1]


def test_spool_publish_and_claim_are_refused(run):
    paths, lease = run
    spool = Spool(paths.spool)
    ready = spool.publish(make_batch(0), "driver")
    _stale(lease)
    with pytest.raises(Fenced):
        spool.publish(make_batch(1), "driver")
    with pytest.raises(Fenced):
        spool.claim(ready, step=1)
    assert [p.name for p in spool.ready.iterdir()] == [ready.name]  # no batch, no partial file
    assert list(spool.claimed.iterdir()) == []


def test_registry_writes_and_heartbeats_are_refused(run):
    paths, lease = run
    _stale(lease)
    with pytest.raises(Fenced):
        write_record(paths.engines, EngineRecord("engine-0", "127.0.0.1", 1, 1, "i", "0"))
    with pytest.raises(Fenced):
        Heartbeat(paths, "trainer").beat(phase="train")
    assert read_records(paths.engines) == [] and not paths.health("trainer").exists()


def _model(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({}, folder / "m.pt")


def test_a_checkpoint_is_refused_before_any_rank_writes_and_latest_stays(run, one_rank):
    paths, lease = run
    ckpt = Checkpointer(paths.ckpt, keep=2)
    assert ckpt.save(1, _model, {}, {"step": 1})
    _stale(lease)
    with pytest.raises(Fenced):
        ckpt.save(2, _model, {}, {"step": 2})
    assert sorted(p.name for p in paths.ckpt.iterdir()) == ["latest", "step-00000001"]
    assert paths.ckpt.joinpath("latest").resolve().name == "step-00000001"


def test_the_commit_is_refused_when_the_lease_is_lost_while_the_shards_were_written(run, one_rank):
    """The commit reads the lease fresh: a process stopped mid-save never renames its folder."""
    paths, lease = run
    ckpt = Checkpointer(paths.ckpt, keep=2)

    def model_then_superseded(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        _supersede(lease)  # what a SIGSTOP across a restart does, within the cache's life

    with pytest.raises(Fenced):
        ckpt.save(3, model_then_superseded, {}, {"step": 3})
    assert not paths.ckpt.joinpath("step-00000003").exists() and not paths.ckpt.joinpath("latest").exists()


def test_every_weight_push_entry_point_is_refused_before_it_reaches_an_engine(run):
    paths, lease = run
    write_record(paths.engines, EngineRecord("engine-0", "127.0.0.1", 9, 1, "i", "0"))  # nobody listens
    _stale(lease)
    sender = WeightSender(paths.engines, "key", "gloo", timeout_s=1.0)
    with pytest.raises(Fenced):
        sender.begin()
    colocated = ColocatedSender(paths.engines, "key", 1.0, rank=0, world=1)
    with pytest.raises(Fenced):
        colocated.push([], [], version=1)
    publisher = AdapterPublisher(paths.engines, paths.lora_adapters, lambda *_: None, "key", 1.0)
    with pytest.raises(Fenced):
        publisher.publish(1, {})
    assert not paths.lora_adapters.exists()
    assert [r["what"] for r in refused_writes(paths.root)] == [
        "weight push",
        "weight push (colocated)",
        "weight push (adapter)",
    ]


def test_refusals_are_one_file_each_and_readable_while_one_is_being_written(run):
    paths, lease = run
    _stale(lease)
    for what in ("a", "b"):
        with pytest.raises(Fenced):
            fence.check(what)
    (fence.refused_dir(paths.root) / "torn.json").write_text('{"what": ')
    assert [r["what"] for r in refused_writes(paths.root)] == ["a", "b"]
    assert json.loads(fence.lease_path(paths.root).read_text())["generation"] == 2
