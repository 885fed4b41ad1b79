"""The weight push's request pipeline against a peer that stops answering (a frozen engine)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from relax_hpc.protocol import requests as P
from relax_hpc.protocol.client import EngineUnavailable, RequestPipeline


def test_closing_a_pipeline_unblocks_a_read_from_a_silent_engine():
    """The push's watch closes the pipelines when a member stops answering /health: a thread
    waiting for that member's answer must return at once, not after the 60 s socket timeout."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True).start()
    pipeline = RequestPipeline(f"http://127.0.0.1:{server.getsockname()[1]}", "token", 60.0)
    pipeline.send("/pause_generation", P.PauseGenerationReqInput(mode="in_place"))  # never answered
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            pipeline.wait_answers()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001  # what the waiting thread ends with is the result
            outcome.append(e)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    time.sleep(0.5)  # blocked in the read
    started = time.monotonic()
    pipeline.close()
    waiter.join(timeout=5.0)
    assert not waiter.is_alive(), "the read is still blocked after close()"
    assert time.monotonic() - started < 2.0
    assert isinstance(outcome[0], EngineUnavailable)
    server.close()
    for conn in accepted:
        conn.close()


def test_a_pipeline_to_nothing_is_unavailable():
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    with pytest.raises(EngineUnavailable):
        RequestPipeline(f"http://127.0.0.1:{port}", "token", 5.0)
