"""Prompt datasets (JSONL) and a deterministic, resumable prompt order.

The order is a pure function of (seed, position): batch `seq` always holds the same prompts, so the
rollout driver's position is fully described by the sequence number of the last batch it
published, and a restart regenerates exactly what was lost, nothing more.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class DatasetError(ValueError):
    """A dataset file the user pointed at cannot be used as it is."""


@dataclass(frozen=True, slots=True)
class PromptRow:
    index: int
    prompt: str
    answer: str


def load_prompts(path: str | Path, prompt_key: str, answer_key: str) -> list[PromptRow]:
    """Read a JSONL file of prompts; every row must hold both keys as strings (or numbers)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"data.path: {path} does not exist or is not a file")
    rows: list[PromptRow] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise DatasetError(f"{path}:{line_no}: a row must be a JSON object, got {type(record).__name__}")
            for key, option in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
                if key not in record:
                    raise DatasetError(
                        f"{path}:{line_no}: row has no field {key!r} (it has {sorted(record)}); "
                        f"fix the row or set {option} to the field that holds it"
                    )
                if not isinstance(record[key], (str, int, float)):
                    raise DatasetError(f"{path}:{line_no}: field {key!r} must be a string, got {record[key]!r}")
            rows.append(PromptRow(len(rows), str(record[prompt_key]), str(record[answer_key])))
    if not rows:
        raise DatasetError(f"data.path: {path} holds no rows")
    return rows


class PromptOrder:
    """An endless stream of dataset indices, reshuffled every epoch from `seed`."""

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True, stream: int = 0) -> None:
        """`stream` > 0 gives another order from the same seed (dynamic sampling's extra prompts)."""
        self.num_rows = num_rows
        self.seed = seed
        self.shuffle = shuffle
        self.stream = stream

    def _epoch(self, epoch: int) -> np.ndarray:
        if not self.shuffle and not self.stream:
            return np.arange(self.num_rows)
        key = [self.seed, epoch] if not self.stream else [self.seed, epoch, self.stream]
        return np.random.default_rng(key).permutation(self.num_rows)

    def batch(self, seq: int, batch_size: int) -> list[int]:
        """Dataset indices of batch `seq` (positions seq*batch_size ... +batch_size-1 of the stream)."""
        start = seq * batch_size
        out: list[int] = []
        epoch, offset = divmod(start, self.num_rows)
        while len(out) < batch_size:
            perm = self._epoch(epoch)
            take = perm[offset : offset + batch_size - len(out)]
            out.extend(int(i) for i in take)
            epoch, offset = epoch + 1, 0
        return out
