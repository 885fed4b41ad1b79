"""Media in datasets: images, audio clips and videos that rows refer to, read, checked and handed on.

A row's media are given in the row fields that `data.media` names (`{image: images, audio:
audios, video: videos}`), one item or a list per field; an item is a file path (relative to the
dataset file, or absolute) or a `data:` URI (`data:image/png;base64,...`). What travels: an image's
or a clip's encoded bytes as they are (PNG, JPEG, WAV, FLAC, ...), and a video's canonical clip
(its sampled, sized frames, lossless: relax_hpc.data.video), as a data URI over HTTP to the engines
(the form SGLang 0.5.23 accepts for all three) and as raw bytes in the spool; every consumer
decodes them with the same functions here, so the engine and the trainer see the same pixels and
samples.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image

from relax_hpc.config.schema import MediaKind as Kind
from relax_hpc.data.video import VideoError, VideoSpec, canonical, decode


class MediaError(ValueError):
    """A media item cannot be read or decoded; the message says which and why."""


@dataclass(frozen=True, slots=True)
class MediaRef:
    """One image, audio clip or video of a row: a file path, or a data: URI. A video read for a
    model (`video` set: the driver's rows) reads as its canonical clip."""

    kind: Kind
    source: str
    video: VideoSpec | None = None

    def read(self) -> bytes:
        """The item's encoded bytes (a video's canonical clip where `video` says how to sample it)."""
        if self.kind == "video" and self.video is not None:
            return _canonical_video(self, self.video)
        return self.read_raw()

    def read_raw(self) -> bytes:
        """The bytes of the file or data URI, as they are."""
        if self.source.startswith("data:"):
            return parse_data_uri(self.source)[1]
        try:
            return Path(self.source).read_bytes()
        except OSError as e:
            raise MediaError(f"{self.kind} {self.source}: {e.strerror or e}") from None

    def describe(self) -> str:
        return f"{self.kind} {self.source[:40] + '...' if self.source.startswith('data:') else self.source}"


@lru_cache(maxsize=8)
def _canonical_video(ref: MediaRef, spec: VideoSpec) -> bytes:
    """Cached by item: the episodes of a prompt group read their row's video in turn."""
    try:
        return canonical(ref.read_raw(), spec)
    except VideoError as e:
        raise MediaError(str(e)) from None


def resolve(kind: Kind, value: str, base: Path, video: VideoSpec | None = None) -> MediaRef:
    """A dataset's item: data URIs as they are, paths made absolute against the dataset's folder;
    videos sampled as `video` says."""
    if value.startswith("data:"):
        return MediaRef(kind, value, video)
    path = Path(value)
    return MediaRef(kind, str(path if path.is_absolute() else (base / path).resolve()), video)


def parse_data_uri(uri: str) -> tuple[str, bytes]:
    """(mime type, bytes) of a base64 data URI."""
    head, sep, payload = uri.partition(",")
    if not sep or not head.endswith(";base64"):
        raise MediaError(f"not a base64 data URI: {uri[:40]}...")
    try:
        return head[5:-7], base64.b64decode(payload, validate=True)
    except binascii.Error as e:
        raise MediaError(f"a data URI whose base64 does not decode ({e})") from None


def data_uri(kind: Kind, data: bytes) -> str:
    """The bytes as a data URI (what engines get over HTTP)."""
    return f"data:{sniff_mime(kind, data)};base64,{base64.b64encode(data).decode()}"


def sniff_mime(kind: Kind, data: bytes) -> str:
    if kind == "image":
        try:
            with Image.open(io.BytesIO(data)) as image:
                return Image.MIME.get(image.format or "", "image/png")
        except OSError:
            return "image/png"
    if kind == "video":
        return "video/x-msvideo" if data[8:12] == b"AVI " else "video/mp4"
    if data[:4] == b"fLaC":
        return "audio/flac"
    if data[:4] == b"OggS":
        return "audio/ogg"
    return "audio/wav"


def decode_image(data: bytes) -> Image.Image:
    """An RGB image."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (OSError, ValueError) as e:
        raise MediaError(f"unreadable image ({e})") from None


def decode_audio(data: bytes, sampling_rate: int) -> np.ndarray:
    """A mono float32 waveform at `sampling_rate`; a clip recorded at another rate is refused
    (resample it first: the processor's features assume its rate)."""
    import soundfile

    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        raise MediaError(f"unreadable audio ({e})") from None
    if rate != sampling_rate:
        raise MediaError(f"audio at {rate} Hz; the model's processor takes {sampling_rate} Hz (resample it)")
    return samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]


def check(ref: MediaRef, sampling_rate: int | None) -> None:
    """Read and decode an item as the engines and the trainer will (raises MediaError)."""
    data = ref.read()
    if ref.kind == "image":
        decode_image(data)
    elif ref.kind == "video" and ref.video is None:  # with a spec, read() decoded and sampled it already
        decode_video(data)
    elif sampling_rate is not None:
        decode_audio(data, sampling_rate)


def decode_video(data: bytes) -> None:
    """Decode a video (raises MediaError): a canonical clip's frames are the model's."""
    try:
        decode(data)
    except VideoError as e:
        raise MediaError(str(e)) from None
