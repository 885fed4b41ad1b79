"""Prompt datasets (JSONL) and a deterministic, resumable prompt order.

A row holds a prompt (a string, or a list of chat messages whose content is a string or a list of
parts: {"type": "text", "text": ...}, {"type": "image"}, {"type": "audio"}, {"type": "video"}), a
reference answer, and, in the fields `data.media` names, its media (relax_hpc.data.media). A
string prompt marks where each item goes with <image> / <audio> / <video>, or gets its items
before the text; every item needs a place and every place an item.

The order is a pure function of (seed, position): batch `seq` always holds the same prompts, so the
rollout driver's position is fully described by the sequence number of the last batch it
published, and a restart regenerates exactly what was lost, nothing more.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from relax_hpc.config.schema import MEDIA_KINDS as KINDS
from relax_hpc.config.schema import DataConfig
from relax_hpc.data.media import Kind, MediaError, MediaRef, check, resolve
from relax_hpc.data.video import VideoSpec


class DatasetError(ValueError):
    """A dataset file the user pointed at cannot be used as it is."""


Message = dict[str, Any]
# Where a string prompt puts each media item; without markers, a row's media come before its text.
MARKERS: dict[Kind, str] = {"image": "<image>", "audio": "<audio>", "video": "<video>"}
_KIND_OF_MARKER: dict[str, Kind] = {marker: kind for kind, marker in MARKERS.items()}
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS.values()))


@dataclass(frozen=True, slots=True)
class PromptRow:
    """One dataset row: its prompt (text, or chat messages with content parts), the reference
    answer, and its media in the order the prompt uses them."""

    index: int
    prompt: str | tuple[Message, ...]
    answer: str
    media: tuple[MediaRef, ...] = ()
    fields: Mapping[str, Any] = field(default_factory=dict, compare=False)  # the whole row as read

    @property
    def is_chat(self) -> bool:
        """Rows with messages or media go through the model's chat template; plain text does not."""
        return not isinstance(self.prompt, str) or bool(self.media)

    def messages(self) -> list[Message]:
        """Chat messages whose content parts place the media ({"type": "image"}, "audio", "video")."""
        if not isinstance(self.prompt, str):
            return [dict(m) for m in self.prompt]
        parts: list[Message] = []
        pieces = _MARKER.split(self.prompt)
        kinds = _MARKER.findall(self.prompt)
        if not kinds:  # no markers: every item before the text
            parts = [{"type": ref.kind} for ref in self.media]
            pieces, kinds = [self.prompt], []
        for i, piece in enumerate(pieces):
            if piece:
                parts.append({"type": "text", "text": piece})
            if i < len(kinds):
                parts.append({"type": _KIND_OF_MARKER[kinds[i]]})
        return [{"role": "user", "content": parts}]


def jsonl_objects(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """The JSON objects of a JSONL file, each with where it stands ("FILE:LINE", for errors);
    blank lines are skipped, a line that is not a JSON object raises DatasetError."""
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise DatasetError(f"{where}: a row must be a JSON object, got {type(record).__name__}")
            yield where, record


def load_prompts(
    path: str | Path,
    prompt_key: str,
    answer_key: str,
    media: Mapping[Kind, str] | None = None,
    sampling_rate: int | None = None,
    check_media: bool = False,
    video: VideoSpec | None = None,
    option: str = "data.path",
) -> list[PromptRow]:
    """Read a JSONL file of prompts; every defect raises DatasetError naming the line and the reason.

    `media` names the row fields that hold each kind of media; `check_media` reads and decodes every
    item (as the engines will; audio at `sampling_rate`), which submit does before a job starts;
    `video` says how the model samples videos (a video then reads as its canonical clip); `option`
    names the config option the errors point at."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{option}: {path} does not exist or is not a file")
    rows: list[PromptRow] = []
    for where, record in jsonl_objects(path):
        row = _row(record, len(rows), where, prompt_key, answer_key, media or {}, path.parent, video)
        if check_media:
            for ref in row.media:
                try:
                    check(ref, sampling_rate)
                except MediaError as e:
                    raise DatasetError(f"{where}: {ref.describe()}: {e}") from None
        rows.append(row)
    if not rows:
        raise DatasetError(f"{option}: {path} holds no rows")
    return rows


def load_data(d: DataConfig, video: VideoSpec | None, held_out: bool = False, **checks: Any) -> list[PromptRow]:
    """The configured training prompts (data.path), or with `held_out` the evaluation's
    (data.eval_path, whose rows take the same keys and media fields); `checks`: load_prompts'
    sampling_rate and check_media."""
    path, option = (d.eval_path, "data.eval_path") if held_out else (d.path, "data.path")
    if path is None:
        raise DatasetError("data.eval_path is not set")
    return load_prompts(path, d.prompt_key, d.answer_key, d.media, video=video, option=option, **checks)


def _row(
    record: dict[str, Any],
    index: int,
    where: str,
    prompt_key: str,
    answer_key: str,
    media: Mapping[Kind, str],
    base: Path,
    video: VideoSpec | None = None,
) -> PromptRow:
    for key, option in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
        if key not in record:
            raise DatasetError(
                f"{where}: row has no field {key!r} (it has {sorted(record)}); "
                f"fix the row or set {option} to the field that holds it"
            )
    answer = record[answer_key]
    if not isinstance(answer, str | int | float):
        raise DatasetError(f"{where}: field {answer_key!r} must be a string, got {answer!r}")
    prompt = _prompt(record[prompt_key], where, prompt_key)
    refs = tuple(ref for kind, field in media.items() for ref in _items(record, kind, field, where, base, video))
    media_in_order = _in_prompt_order(PromptRow(index, prompt, "", refs), where)
    return PromptRow(index, prompt, str(answer), media_in_order, record)


def _prompt(value: Any, where: str, key: str) -> str | tuple[Message, ...]:
    if isinstance(value, str | int | float):
        return str(value)
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: field {key!r} must be a string or a list of chat messages, got {value!r}")
    for message in value:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or content is None:
            raise DatasetError(f"{where}: a chat message needs a 'role' and a 'content', got {message!r}")
        if not isinstance(content, str) and not all(_is_part(p) for p in content):
            raise DatasetError(
                f"{where}: a message's content is a string or a list of parts "
                f'({{"type": "text", "text": ...}}, {{"type": "image"}}, {{"type": "audio"}}), got {content!r}'
            )
    return tuple(value)


def _is_part(part: Any) -> bool:
    if not isinstance(part, dict):
        return False
    if part.get("type") == "text":
        return isinstance(part.get("text"), str)
    return part.get("type") in KINDS


def _items(
    record: dict[str, Any], kind: Kind, field: str, where: str, base: Path, video: VideoSpec | None
) -> list[MediaRef]:
    value = record.get(field, [])
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise DatasetError(f"{where}: field {field!r} (data.media.{kind}) must hold a path or a list of paths")
    refs = [resolve(kind, v, base, video) for v in values]
    for ref in refs:
        if not ref.source.startswith("data:") and not Path(ref.source).is_file():
            raise DatasetError(f"{where}: {kind} file {ref.source} does not exist")
    return refs


def _in_prompt_order(row: PromptRow, where: str) -> tuple[MediaRef, ...]:
    """The row's items in the order its prompt places them; each item needs a place and each
    place an item."""
    places = [p["type"] for m in row.messages() if not isinstance(m["content"], str) for p in m["content"]]
    places = [p for p in places if p in KINDS]
    for kind in KINDS:
        have, want = sum(r.kind == kind for r in row.media), places.count(kind)
        if have != want:
            raise DatasetError(
                f"{where}: the prompt has {want} {kind} placeholder(s) but the row gives {have} {kind}(s)"
            )
    queues = {kind: [r for r in row.media if r.kind == kind] for kind in KINDS}
    return tuple(queues[kind].pop(0) for kind in places)


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
