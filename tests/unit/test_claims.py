"""Staleness: which samples a trainer step may use, decided per prompt group."""

from pathlib import Path

import h5py
import pytest

from relax_hpc.exchange.spool import BatchHeader, SampleBatch, Spool, SpoolFormatError
from relax_hpc.trainer.claims import claim_next, fresh_samples, read_claimed
from tests.unit.test_spool import make_batch


def _header(batch: SampleBatch) -> BatchHeader:
    """What read_header gives for the batch once written (its arrays, not copies)."""
    assert batch.newest_version is not None
    return BatchHeader(batch.seq, batch.group_ids, batch.policy_version, batch.rewards, batch.newest_version)


def test_groups_with_any_too_old_sample_are_set_aside():
    batch = make_batch(0, n_groups=3, group_size=2)
    batch.policy_version[:] = [5, 5, 3, 5, 4, 4]  # group 1 holds a version-3 sample
    trainable, stale = fresh_samples(_header(batch), version=6, max_staleness=2)
    assert trainable == [0, 1, 4, 5] and stale == [2, 3]
    trainable, stale = fresh_samples(_header(batch), version=6, max_staleness=0)
    assert trainable == [] and stale == [0, 1, 2, 3, 4, 5]


def test_samples_newer_than_the_trainer_are_rejected():
    with pytest.raises(SpoolFormatError, match="newer"):
        fresh_samples(_header(make_batch(0, version=3)), version=2, max_staleness=1)


def test_claim_skips_stale_and_corrupt_batches_and_records_them(tmp_path):
    spool = Spool(tmp_path)
    spool.publish(make_batch(0, version=0), writer="t")
    bad = spool.publish(make_batch(1, version=4), writer="t")
    bad.write_bytes(b"not hdf5")
    spool.publish(make_batch(2, version=4), writer="t")
    claim = claim_next(spool, step=4, version=4, max_staleness=1)
    assert claim is not None and claim.trained_file is not None
    assert claim.trained_file.endswith("b000000002.h5") and claim.quarantined == 1
    assert [f["name"] for f in claim.files] == ["b000000000.h5", "b000000002.h5"]
    assert claim.files[0]["stale"] == [0, 1, 2, 3] and claim.files[0]["trained"] == []
    assert (spool.claimed / "step-00000004" / "b000000000.h5.json").exists()
    assert claim_next(spool, step=5, version=5, max_staleness=1) is None


def test_a_batch_damaged_after_its_claim_is_quarantined_not_trained(tmp_path, one_rank):
    """The claim reads headers only; the full read where the batch is trained catches the rest."""
    spool = Spool(tmp_path / "spool")
    spool.publish(make_batch(0, version=0), writer="t")
    claim = claim_next(spool, step=0, version=0, max_staleness=0)
    assert claim is not None and claim.trained_file is not None
    path = Path(claim.trained_file)
    claims = {"0": [f["name"] for f in claim.files]}
    intact = read_claimed(path, spool, claims["0"])
    assert intact is not None and intact.seq == 0  # intact: read whole
    with h5py.File(path, "r+") as f:
        f["tokens"][0] = 99
    assert read_claimed(path, spool, claims["0"]) is None
    assert claims == {"0": []} and not path.exists() and not path.with_name(path.name + ".json").exists()
    assert "checksum" in (spool.quarantine_dir / "b000000000.h5.reason").read_text()
