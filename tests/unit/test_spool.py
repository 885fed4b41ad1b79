"""The spool's file format and claim protocol, on real HDF5 files."""

import threading
from pathlib import Path

import h5py
import numpy as np
import pytest

from relax_hpc.data.media import Kind
from relax_hpc.exchange.spool import SampleBatch, Spool, SpoolFormatError, read_batch, read_header

DATA = Path(__file__).resolve().parents[1] / "data"


def make_batch(seq: int, version: int = 0, n_groups: int = 2, group_size: int = 2) -> SampleBatch:
    n = n_groups * group_size
    rng = np.random.default_rng(seq)
    prompts = [[5, 12, 6, 15]] * n
    completions = [rng.integers(2, 12, size=int(rng.integers(1, 4))).tolist() for _ in range(n)]
    return SampleBatch.from_samples(
        seq=seq,
        sequences=[p + c for p, c in zip(prompts, completions, strict=True)],
        prompt_lens=[4] * n,
        logprobs=[[-0.5] * len(c) for c in completions],
        rewards=[float(i % 2) for i in range(n)],
        group_ids=[seq * 10 + i // group_size for i in range(n)],
        policy_version=[version] * n,
        prompt_index=[i // group_size for i in range(n)],
    )


def test_round_trip_keeps_every_array(tmp_path):
    spool = Spool(tmp_path)
    batch = make_batch(3, version=2)
    path = spool.publish(batch, writer="test")
    assert path.name == "b000000003.h5"
    back = read_batch(path)
    assert back.seq == 3 and back.attrs["writer"] == "test"
    for name in ("tokens", "offsets", "prompt_lens", "loss_mask", "rollout_logprobs", "rewards", "group_ids"):
        np.testing.assert_array_equal(getattr(back, name), getattr(batch, name))
    # The loss mask covers exactly the completion tokens, and their logprobs sit under the mask.
    for i in range(back.num_samples):
        mask = back.loss_mask[back.offsets[i] : back.offsets[i + 1]]
        assert mask[:4].sum() == 0 and mask[4:].all()


def test_reward_baselines_travel_per_sample_and_default_to_none(tmp_path):
    spool = Spool(tmp_path)
    plain = read_batch(spool.publish(make_batch(1), writer="t")).reward_baseline
    assert plain is not None and np.isnan(plain).all()
    batch = make_batch(2)
    with_baseline = SampleBatch.from_samples(
        seq=5,
        sequences=[[5, 6, 7], [5, 6, 8]],
        prompt_lens=[2, 2],
        logprobs=[[-0.1], [-0.2]],
        rewards=[1.0, 0.0],
        group_ids=[50, 50],
        policy_version=[0, 0],
        prompt_index=[0, 0],
        baselines=[0.5, None],
    )
    back = read_batch(spool.publish(with_baseline, writer="t")).reward_baseline
    assert back is not None and back[0] == 0.5 and np.isnan(back[1])
    assert batch.reward_baseline is not None and len(batch.reward_baseline) == batch.num_samples


def test_truncated_file_is_a_format_error(tmp_path):
    path = Spool(tmp_path).publish(make_batch(0), writer="test")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SpoolFormatError, match="unreadable"):
        read_batch(path)


def test_modified_data_fails_the_checksum(tmp_path):
    path = Spool(tmp_path).publish(make_batch(0), writer="test")
    with h5py.File(path, "r+") as f:
        f["rewards"][0] = 7.0
    with pytest.raises(SpoolFormatError, match="checksum"):
        read_batch(path)


def test_a_header_read_checks_the_per_sample_arrays_and_leaves_the_tokens_to_the_full_read(tmp_path):
    path = Spool(tmp_path).publish(make_batch(5, version=3), writer="test")
    header = read_header(path)
    assert header.seq == 5 and header.num_samples == 4 and header.policy_version.tolist() == [3] * 4
    with h5py.File(path, "r+") as f:
        f["tokens"][0] = 99  # damage the tokens only: the header read cannot see it, the full read can
    assert read_header(path).seq == 5
    with pytest.raises(SpoolFormatError, match="checksum"):
        read_batch(path)
    with h5py.File(path, "r+") as f:
        f["policy_version"][0] = 0
    with pytest.raises(SpoolFormatError, match="header checksum"):
        read_header(path)


def test_a_file_without_a_header_checksum_is_read_whole(tmp_path):
    """Files written before header checksums existed are still judged, by the full read."""
    path = Spool(tmp_path).publish(make_batch(1), writer="test")
    with h5py.File(path, "r+") as f:
        del f.attrs["header_checksum"]
    assert read_header(path).seq == 1
    with h5py.File(path, "r+") as f:
        f["tokens"][0] = 99
    with pytest.raises(SpoolFormatError, match="checksum"):
        read_header(path)


def test_foreign_files_are_quarantined_with_a_reason(tmp_path):
    spool = Spool(tmp_path)
    spool.publish(make_batch(0), writer="test")
    (spool.ready / "notes.txt").write_text("hello")
    (spool.ready / ".b000000001.123.tmp").write_bytes(b"partial")  # in-progress write: left alone
    ready = spool.list_ready()
    assert [p.name for p in ready] == ["b000000000.h5"]
    assert (spool.quarantine_dir / "notes.txt").read_text() == "hello"
    assert "foreign" in (spool.quarantine_dir / "notes.txt.reason").read_text()
    assert spool.remove_partial() == 1


def test_claim_rollback_and_next_seq(tmp_path):
    spool = Spool(tmp_path)
    for seq in range(4):
        spool.publish(make_batch(seq), writer="test")
    for step, path in enumerate(spool.list_ready()[:3]):
        claimed = spool.claim(path, step)
        spool.write_manifest(claimed, {"trained": [0, 1, 2, 3], "stale": []})
    assert [p.name for p in spool.list_ready()] == ["b000000003.h5"]
    assert spool.next_seq() == 4
    # A checkpoint after 1 step: the claims of steps 1 and 2 go back to ready, manifests vanish.
    assert spool.rollback_claims(from_step=1) == 2
    assert [p.name for p in spool.list_ready()] == ["b000000001.h5", "b000000002.h5", "b000000003.h5"]
    assert sorted(p.name for p in (spool.claimed / "step-00000000").iterdir()) == [
        "b000000000.h5",
        "b000000000.h5.json",
    ]
    assert not (spool.claimed / "step-00000001").exists()
    assert spool.next_seq() == 4


def test_batches_from_a_rolled_back_version_are_orphaned_and_regenerated(tmp_path):
    spool = Spool(tmp_path)
    spool.publish(make_batch(0, version=0), writer="test")
    spool.publish(make_batch(1, version=1), writer="test")
    spool.publish(make_batch(2, version=2), writer="test")
    assert len(spool.orphan_newer_than(version=1)) == 1
    assert [p.name for p in spool.orphaned.iterdir()] == ["b000000002.h5"]
    assert spool.next_seq() == 2  # batch 2 is generated again


def test_a_concurrent_reader_never_sees_a_partial_batch(tmp_path):
    spool = Spool(tmp_path)
    errors, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            for path in spool.list_ready():
                try:
                    read_batch(path)
                except FileNotFoundError:
                    pass
                except SpoolFormatError as e:  # pragma: no cover - the failure this test looks for
                    errors.append(str(e))

    thread = threading.Thread(target=reader)
    thread.start()
    for seq in range(40):
        spool.publish(make_batch(seq, n_groups=8), writer="test")
    stop.set()
    thread.join()
    assert errors == []
    assert len(spool.list_ready()) == 40


def test_trained_batches_covered_by_a_checkpoint_are_pruned_and_still_counted(tmp_path):
    spool = Spool(tmp_path)
    for step in range(3):
        claimed = spool.claim(spool.publish(make_batch(step), writer="t"), step)
        spool.write_manifest(claimed, {"trained": [0, 1, 2, 3], "stale": []})
    freed = spool.prune_trained(before_step=2)  # a checkpoint after 2 steps covers steps 0 and 1
    assert freed > 0
    assert sorted(p.name for p in (spool.claimed / "step-00000000").iterdir()) == ["b000000000.h5.json"]
    assert (spool.claimed / "step-00000002" / "b000000002.h5").exists()  # not covered yet
    assert spool.next_seq() == 3  # pruned batches still count: the driver never regenerates them
    assert spool.rollback_claims(from_step=2) == 1 and spool.next_seq() == 3


def test_a_batch_of_schema_1_written_by_release_0_1_is_still_read(tmp_path):
    batch = read_batch(DATA / "spool-v1.h5")  # written by relax_hpc 0.1.0's write_batch
    assert batch.seq == 3 and batch.sample_tokens(0).tolist() == [5, 6, 7, 8]
    assert batch.rollout_logprobs[batch.loss_mask == 1].tolist() == [-0.5, -0.25, -1.0]
    assert len(batch.media_kind) == 0 and batch.group_media(7) == []
    assert batch.teacher_logprobs is None  # the trainer's own teacher scores such a batch
    assert read_header(DATA / "spool-v1.h5").seq == 3


def test_teacher_logprobs_travel_per_token_and_are_checksummed(tmp_path):
    """Schema 5: a batch scored by teacher engines carries the teacher's log-probability of
    every token; a change to them after publishing is caught like any other array's."""
    spool = Spool(tmp_path)
    batch = make_batch(0)
    batch.teacher_logprobs = np.where(batch.loss_mask == 1, -np.arange(len(batch.tokens)) / 8, 0).astype(np.float32)
    path = spool.publish(batch, writer="t")
    back = read_batch(path)
    assert back.teacher_logprobs is not None and np.array_equal(back.teacher_logprobs, batch.teacher_logprobs)
    assert read_batch(spool.publish(make_batch(1), writer="t")).teacher_logprobs is None
    with h5py.File(path, "r+") as f:
        f["teacher_logprobs"][0] = 1.0
    with pytest.raises(SpoolFormatError, match="checksum mismatch"):
        read_batch(path)


def test_a_batch_of_schema_4_without_teacher_logprobs_is_still_read(tmp_path):
    path = Spool(tmp_path).publish(make_batch(2), writer="t")
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = 4  # schema 5 added only the optional teacher array
    batch = read_batch(path)
    assert batch.seq == 2 and batch.teacher_logprobs is None and read_header(path).seq == 2


def test_a_batch_of_an_unknown_schema_is_refused_naming_both_versions(tmp_path):
    spool = Spool(tmp_path)
    path = spool.publish(make_batch(0), writer="t")
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = 6
    with pytest.raises(SpoolFormatError, match=r"schema_version 6: this relax_hpc reads versions \[1, 2, 3, 4, 5\]"):
        read_batch(path)


def test_media_are_stored_once_per_group_in_prompt_order(tmp_path):
    batch = make_batch(0, n_groups=2, group_size=4)
    items: dict[int, list[tuple[Kind, bytes]]] = {
        0: [("image", b"\x89PNG-a"), ("audio", b"RIFF-b")],
        1: [("image", b"\x89PNG-c")],
    }
    batch = SampleBatch.from_samples(
        seq=0,
        sequences=[batch.sample_tokens(i).tolist() for i in range(batch.num_samples)],
        prompt_lens=batch.prompt_lens.tolist(),
        logprobs=[[-0.5] * (len(batch.sample_tokens(i)) - 4) for i in range(batch.num_samples)],
        rewards=batch.rewards.tolist(),
        group_ids=[i // 4 for i in range(batch.num_samples)],
        policy_version=batch.policy_version.tolist(),
        prompt_index=batch.prompt_index.tolist(),
        media=items,
    )
    path = Spool(tmp_path).publish(batch, writer="t")
    back = read_batch(path)
    assert back.media_bytes.tobytes() == b"\x89PNG-aRIFF-b\x89PNG-c"  # 8 samples, 3 items, each once
    assert back.group_media(0) == items[0] and back.group_media(1) == items[1]
    with h5py.File(path, "r+") as f:  # media are under the checksum like the tokens
        f["media_bytes"][0] ^= 1
    with pytest.raises(SpoolFormatError, match="checksum mismatch"):
        read_batch(path)
