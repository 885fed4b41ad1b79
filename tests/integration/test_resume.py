"""kill -9 of every process at random moments, then the same command again: nothing lost, nothing
trained twice; on-policy runs reproduce the uninterrupted run's samples and losses exactly."""

import json
import random
from pathlib import Path

import numpy as np
import pytest

from relax_hpc.exchange.spool import read_batch
from tests.integration.conftest import Job

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 14
COMMON = (f"trainer.total_steps={STEPS}", "ckpt.every_steps=3", "rollout.prompts_per_step=8", "rollout.eval_every=0")


def final_records(run_dir: Path) -> dict[int, dict]:
    """Per step, the record of the timeline that survived (the last one written)."""
    records = {}
    for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            records.setdefault(r["step"], []).append(r)
    return records


def trained_samples(run_dir: Path) -> dict[int, list]:
    """Per step: (batch seq, tokens, reward) of every trained sample, from the claimed files."""
    out = {}
    for manifest in sorted((run_dir / "spool" / "claimed").glob("step-*/*.json")):
        entry = json.loads(manifest.read_text())
        batch = read_batch(manifest.with_suffix(""))
        step = int(manifest.parent.name[5:])
        out.setdefault(step, []).extend(
            (batch.seq, batch.sample_tokens(i).tolist(), float(batch.rewards[i])) for i in entry["trained"]
        )
    return out


def run_with_kills(run_dir: Path, kills: int, rng: random.Random, *overrides: str) -> None:
    for attempt in range(kills):
        job = Job(run_dir, *COMMON, *overrides).start()
        job.wait_for_step(min(STEPS - 1, 3 * attempt + rng.randint(2, 4)), timeout_s=300)
        job.kill_all()  # no checkpoint, no clean stop: every process gets SIGKILL
    assert Job(run_dir, *COMMON, *overrides).run(timeout_s=400) == 0


def test_on_policy_resume_reproduces_the_uninterrupted_run(tmp_path):
    rng = random.Random(1234)
    reference = tmp_path / "reference"
    assert Job(reference, *COMMON, "rollout.max_staleness=0").run(timeout_s=400) == 0
    resumed = tmp_path / "resumed"
    run_with_kills(resumed, 3, rng, "rollout.max_staleness=0")

    ref, got = final_records(reference), final_records(resumed)
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        # Every attempt at a step (also those a kill threw away) computed the same loss, bit for bit.
        assert {r["loss"] for r in got[step]} == {ref[step][0]["loss"]}, step
        assert got[step][-1]["reward"] == ref[step][0]["reward"]
    assert trained_samples(resumed) == trained_samples(reference)
    assert len(list((resumed / "logs").iterdir())) == 4  # one log folder per start


def test_async_resume_loses_and_repeats_nothing(tmp_path):
    rng = random.Random(99)
    run_dir = tmp_path / "async"
    run_with_kills(run_dir, 3, rng, "rollout.max_staleness=2")
    spool = run_dir / "spool"
    trained, stale, seen_files = set(), set(), []
    for manifest in (spool / "claimed").glob("step-*/*.json"):
        entry = json.loads(manifest.read_text())
        batch = read_batch(manifest.with_suffix(""))
        ids = {(batch.seq, i) for i in range(batch.num_samples)}
        assert set(entry["trained"]) | set(entry["stale"]) == set(range(batch.num_samples))
        trained_here = {(batch.seq, i) for i in entry["trained"]}
        assert not trained_here & trained, "a sample was trained twice"
        trained |= trained_here
        stale |= ids - trained_here
        seen_files.append(batch.seq)
    assert len(seen_files) == len(set(seen_files))  # each batch claimed by exactly one step
    waiting = {(read_batch(p).seq, i) for p in (spool / "ready").glob("b*.h5") for i in range(read_batch(p).num_samples)}
    orphaned = {int(p.name[1:10]) for p in (spool / "orphaned").iterdir()}
    published = set(range(max(set(seen_files) | {s for s, _ in waiting}) + 1))
    # Every batch number up to the newest is trained, set aside, or waiting: none is missing.
    assert published == set(seen_files) | {s for s, _ in waiting}
    assert not (trained | stale) & waiting
    records = final_records(run_dir)
    assert sorted(records) == list(range(1, STEPS + 1))
    final = max(records[STEPS], key=lambda r: r["time"])
    assert final["stale_samples_total"] == len(stale)
    assert sum(r[-1]["samples"] for r in records.values()) == len(trained)
    assert all(np.isfinite(r[-1]["loss"]) for r in records.values())
    # Batches from a policy version a kill rolled back were generated again under their numbers.
    assert orphaned <= set(seen_files) | {s for s, _ in waiting}
