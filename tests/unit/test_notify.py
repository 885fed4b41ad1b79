"""Notifications through Apprise, delivered to a real HTTP endpoint started by the test; their
credentials stay in the environment."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from relax_hpc.config import load_config
from relax_hpc.config.load import ConfigError
from relax_hpc.launch.notify import Notifier
from relax_hpc.submit import check_inputs


class Hook(BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, dict]]] = []

    def do_POST(self) -> None:  # http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).received.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def hook() -> Iterator[int]:
    Hook.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_notifications_reach_the_service_with_the_secret_from_the_environment(hook, monkeypatch):
    monkeypatch.setenv("HOOK_SECRET", "s3cr3t")
    cfg = load_config(None, [f"notify.urls=['json://127.0.0.1:{hook}/hook/${{HOOK_SECRET}}']"])
    assert "${HOOK_SECRET}" in cfg.notify.urls[0]  # the config (saved in RUN_DIR) keeps the reference
    notifier = Notifier(cfg.notify, "my-run")
    notifier.send("completed", "at step 6")
    notifier.close()
    ((path, body),) = Hook.received
    assert path == "/hook/s3cr3t" and body["title"] == "relax_hpc my-run: completed"
    assert body["message"].startswith("at step 6")


def test_a_failing_service_does_not_raise_and_bad_settings_are_refused_at_submit(monkeypatch, caplog):
    cfg = load_config(None, ["notify.urls=['json://127.0.0.1:9/closed/${HOOK_SECRET}']"])
    monkeypatch.setenv("HOOK_SECRET", "s3cr3t")
    notifier = Notifier(cfg.notify, "r")
    started = time.monotonic()
    notifier.send("failed", "x")  # nothing listens on port 9
    notifier.close()
    assert time.monotonic() - started < 30
    assert "s3cr3t" not in caplog.text and "a notification (relax_hpc r: failed)" in caplog.text
    monkeypatch.delenv("HOOK_SECRET")
    with pytest.raises(ConfigError, match=r"notify.urls: the environment variable HOOK_SECRET is not set"):
        check_inputs(cfg)
    with pytest.raises(ConfigError, match=r"notify.urls\[0\]: Apprise does not take this URL \(its scheme: nope\)"):
        check_inputs(load_config(None, ["notify.urls=['nope://x']"]))


def test_notifications_are_off_by_default():
    notifier = Notifier(load_config(None, []).notify, "r")
    assert not notifier.enabled
    notifier.send("started", "")  # nothing to do, nothing raised
