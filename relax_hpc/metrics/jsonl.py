"""Append-only JSONL metric files; readers follow them with JsonlFollower."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax_hpc import fence
from relax_hpc.paths import write_atomic


class JsonlWriter:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.name = path.name
        self._file = path.open("a", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        fence.check(f"metrics append to {self.name}")
        # Microseconds: consumers order records by time (the metric sinks' cursor).
        self._file.write(json.dumps({"time": round(time.time(), 6), **record}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a JSONL file (a torn last line from a killed writer is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def drop_records(path: Path, drop: Callable[[dict[str, Any]], bool]) -> int:
    """Rewrite a JSONL file without the records `drop` selects and without a torn last line (a
    killed writer's: the next append would continue it); atomic, so a reader sees the old file or
    the new one. Returns how many were dropped."""
    if not path.exists():
        return 0
    records = read_jsonl(path)
    kept = [r for r in records if not drop(r)]
    if (len(kept) == len(records) and path.read_bytes().endswith(b"\n")) or not records:
        return 0
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
    return len(records) - len(kept)


class JsonlFollower:
    """Reads the records appended to a JSONL file since the last call (like `tail -F`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def new_records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # keep a partly written last line for the next call
        self._offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out
