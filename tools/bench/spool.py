"""Spool throughput: publish + claim + read of N samples of ~L tokens, against a raw sequential
write (with fsync) and read of the same bytes, measured in the same run.

    python tools/bench/spool.py [--samples 1024] [--tokens 1500] [--repeat 5]

Prints one JSON object; `ratio` is spool time / raw time (lower is better, 1.0 = no overhead).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from relax_hpc.exchange.spool import SampleBatch, Spool, read_batch


def make_batch(seq: int, samples: int, tokens: int, rng: np.random.Generator) -> SampleBatch:
    lengths = rng.integers(tokens // 2, tokens * 3 // 2, size=samples)
    sequences = [rng.integers(0, 150_000, size=int(n)).tolist() for n in lengths]
    return SampleBatch.from_samples(
        seq=seq,
        sequences=sequences,
        prompt_lens=[int(n) // 3 for n in lengths],
        logprobs=[(-rng.random(int(n) - int(n) // 3)).tolist() for n in lengths],
        rewards=rng.random(samples).tolist(),
        group_ids=[i // 16 for i in range(samples)],
        policy_version=[0] * samples,
        prompt_index=[i // 16 for i in range(samples)],
    )


def raw_round_trip(folder: Path, arrays: list[np.ndarray]) -> float:
    path = folder / "raw.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        for a in arrays:
            f.write(a.tobytes())
        f.flush()
        os.fsync(f.fileno())
    data = path.read_bytes()
    elapsed = time.perf_counter() - start
    assert len(data) == sum(a.nbytes for a in arrays)
    path.unlink()
    return elapsed


def spool_round_trip(folder: Path, batch: SampleBatch, step: int) -> float:
    spool = Spool(folder / "spool")
    start = time.perf_counter()
    published = spool.publish(batch, writer="bench")
    claimed = spool.claim(published, step)
    back = read_batch(claimed)
    elapsed = time.perf_counter() - start
    assert back.num_samples == batch.num_samples
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=1500, help="mean tokens per sample")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batch = make_batch(0, args.samples, args.tokens, rng)
    arrays = [
        batch.tokens,
        batch.offsets,
        batch.prompt_lens,
        batch.loss_mask,
        batch.rollout_logprobs,
        batch.rewards,
        batch.group_ids,
        batch.policy_version,
        batch.prompt_index,
    ]
    nbytes = sum(a.nbytes for a in arrays)
    spool_s, raw_s = [], []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        for i in range(args.repeat):  # interleaved, so both see the same machine state
            raw_s.append(raw_round_trip(Path(tmp), arrays))
            batch.seq = i
            spool_s.append(spool_round_trip(Path(tmp), batch, i))
    spool_med, raw_med = statistics.median(spool_s), statistics.median(raw_s)
    print(
        json.dumps(
            {
                "benchmark": "spool_write_claim_read",
                "samples": args.samples,
                "tokens": int(batch.tokens.size),
                "mib": round(nbytes / 2**20, 2),
                "spool_s_median": round(spool_med, 4),
                "raw_s_median": round(raw_med, 4),
                "ratio": round(spool_med / raw_med, 2),
                "spool_mib_per_s": round(nbytes / 2**20 / spool_med, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
