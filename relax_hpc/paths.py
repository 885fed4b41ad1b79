"""Every path inside RUN_DIR, in one place. Roles never build RUN_DIR paths by hand."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def token(self) -> Path:
        return self.root / "token"

    @property
    def engines(self) -> Path:
        return self.root / "registry" / "engines"

    @property
    def spool(self) -> Path:
        return self.root / "spool"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    @property
    def control(self) -> Path:
        return self.root / "control"

    @property
    def stop_request(self) -> Path:
        """Its existence asks the trainer to checkpoint at the next safe point and stop."""
        return self.control / "stop"

    def logs(self, restart: int) -> Path:
        return self.root / "logs" / str(restart)

    def create(self) -> None:
        """Create RUN_DIR (0700: it holds the run's weight-sync token) and its subfolders."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        for d in (self.engines, self.spool, self.weights, self.ckpt, self.metrics, self.control):
            d.mkdir(parents=True, exist_ok=True)
        if not self.token.exists():
            write_atomic(self.token, secrets.token_hex(16).encode(), mode=0o600)

    def read_token(self) -> str:
        return self.token.read_text().strip()


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Make `path` hold `data`, visible to readers only once complete: tmp, fsync, rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Persist a rename: fsync the directory that holds the entry."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
