"""Notifications of a run's events through Apprise (notify.urls, notify.config), off by default.

The launcher sends them from a thread of its own: a slow or failing service never holds the run
up, and a failure is logged without the URL. URLs keep their credentials in environment
variables (`${NAME}`), expanded only here, at send time, so they reach neither RUN_DIR (where the
config is saved) nor any log.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from relax_hpc.config.schema import NotifyConfig

log = logging.getLogger("relax_hpc.notify")
# Apprise's own messages may name a service's URL, credentials included: it stays silent, and a
# failure is said here, without the URL.
logging.getLogger("apprise").setLevel(logging.CRITICAL + 1)
VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class NotifyError(ValueError):
    """The notification settings cannot be used (the message names the setting, never a URL)."""


def expand(url: str) -> str:
    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise NotifyError(f"notify.urls: the environment variable {name} is not set")
        return os.environ[name]

    return VARIABLE.sub(value, url)


class Notifier:
    """Sends `title`/`body` to every configured service, in the background."""

    def __init__(self, cfg: NotifyConfig, run: str) -> None:
        self.enabled = bool(cfg.urls or cfg.config)
        self.run = run
        self._apprise: Any = None
        self._pool: ThreadPoolExecutor | None = None
        if not self.enabled:
            return
        try:
            import apprise
        except ImportError as e:
            raise NotifyError(
                "notify.urls: the `apprise` package is not installed (pip install 'relax_hpc[notify]')"
            ) from e
        self._apprise = apprise.Apprise()
        for k, url in enumerate(cfg.urls):
            if not self._apprise.add(expand(url)):
                raise NotifyError(
                    f"notify.urls[{k}]: Apprise does not take this URL (its scheme: {url.split(':', 1)[0]})"
                )
        if cfg.config:
            config = apprise.AppriseConfig()
            config.add(cfg.config)
            self._apprise.add(config)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="notify")

    def send(self, title: str, body: str) -> None:
        if self._pool is None:
            return
        self._pool.submit(self._send, f"relax_hpc {self.run}: {title}", f"{body}\n(host {socket.gethostname()})")

    def _send(self, title: str, body: str) -> None:
        try:
            if not self._apprise.notify(title=title, body=body):
                log.warning("a notification (%s) was not delivered to every service", title)
        except Exception as e:  # noqa: BLE001  # a notification never stops the run
            log.warning("a notification (%s) failed: %s", title, type(e).__name__)

    def close(self, wait: bool = True) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=wait)
