"""Checks on a finished run's RUN_DIR, shared by the local and the Slurm resume tests, and a
short checkpointed run for the export tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from relax_hpc.ckpt.manager import Checkpointer
from relax_hpc.config.load import to_yaml
from relax_hpc.config.schema import JobConfig
from relax_hpc.exchange.spool import read_batch
from relax_hpc.inprocess import InProcessRun
from relax_hpc.paths import RunPaths


def final_records(run_dir: Path) -> dict[int, list[dict]]:
    """Per step, the record of the timeline that survived (the last one written)."""
    records: dict[int, list[dict]] = {}
    for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            records.setdefault(r["step"], []).append(r)
    return records


def trained_samples(run_dir: Path) -> dict[int, list]:
    """Per step: (batch seq, tokens, reward) of every trained sample, from the claimed files."""
    out: dict[int, list] = {}
    for manifest in sorted((run_dir / "spool" / "claimed").glob("step-*/*.json")):
        entry = json.loads(manifest.read_text())
        batch = read_batch(manifest.with_suffix(""))
        step = int(manifest.parent.name[5:])
        out.setdefault(step, []).extend(
            (batch.seq, batch.sample_tokens(i).tolist(), float(batch.rewards[i])) for i in entry["trained"]
        )
    return out


def assert_reproduces(reference: Path, run_dir: Path, steps: int) -> None:
    """An interrupted on-policy run against its uninterrupted reference: every attempt at every
    step (also one an interruption threw away) computed the same loss bit for bit, and the same
    samples were trained at the same steps."""
    ref, got = final_records(reference), final_records(run_dir)
    assert sorted(got) == sorted(ref) == list(range(1, steps + 1))
    for step in ref:
        assert {r["loss"] for r in got[step]} == {ref[step][0]["loss"]}, step
        assert got[step][-1]["reward"] == ref[step][0]["reward"]
    assert trained_samples(run_dir) == trained_samples(reference)


def assert_nothing_lost_or_repeated(run_dir: Path, steps: int, regenerated: bool = True) -> None:
    """Every published sample was trained once, set aside as stale, or is still waiting; each
    batch was claimed by one step; the metrics agree with the spool. `regenerated`: a start has
    followed the last rollback, so the batches it set aside (orphaned) were generated again."""
    spool = run_dir / "spool"
    trained: set[tuple[int, int]] = set()
    stale: set[tuple[int, int]] = set()
    seen_files: list[int] = []
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
    waiting = {
        (read_batch(p).seq, i) for p in (spool / "ready").glob("b*.h5") for i in range(read_batch(p).num_samples)
    }
    orphaned = {int(p.name[1:10]) for p in (spool / "orphaned").iterdir()}
    published = set(range(max(set(seen_files) | {s for s, _ in waiting}) + 1))
    # Every batch number up to the newest is trained, set aside, or waiting: none is missing.
    assert published == set(seen_files) | {s for s, _ in waiting}
    assert not (trained | stale) & waiting
    records = {step: r for step, r in final_records(run_dir).items() if step <= steps}  # up to the checkpoint
    assert sorted(records) == list(range(1, steps + 1))
    final = max(records[steps], key=lambda r: r["time"])
    assert final["stale_samples_total"] == len(stale)
    assert sum(r[-1]["samples"] for r in records.values()) == len(trained)
    assert all(np.isfinite(r[-1]["loss"]) for r in records.values())
    # Batches from a policy version a kill rolled back were generated again under their numbers.
    assert not regenerated or orphaned <= set(seen_files) | {s for s, _ in waiting}


def vllm_processes(run_dir: Path) -> list[int]:
    """The run's vLLM processes: their environment holds the run token (the wrapper's VLLM_API_KEY)."""
    key = f"VLLM_API_KEY={RunPaths(run_dir).read_token()}".encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            title = (proc / "cmdline").read_bytes()
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        if (b"VLLM::" in title or b"vllm.entrypoints" in title) and key in env:
            found.append(int(proc.name))
    return found


def train_and_checkpoint(cfg: JobConfig, steps: int = 3) -> tuple[InProcessRun, RunPaths]:
    """`steps` GRPO steps of the single-process loop in cfg.run.dir, then a checkpoint at that
    step (what the export tests convert)."""
    paths = RunPaths(Path(cfg.run.dir))
    paths.create()
    paths.config.write_text(to_yaml(cfg))
    run = InProcessRun(cfg)
    for step in range(steps):
        run.train(step, step)
    state = {"step": steps, "version": steps}
    assert Checkpointer(paths.ckpt, keep=2).save(steps, run.backend.save_checkpoint, {}, state)
    return run, paths
