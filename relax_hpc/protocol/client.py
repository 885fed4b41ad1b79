"""The HTTP client of one engine (the built-in torch engine or an SGLang server: same protocol).

Two ways to talk to an engine, one wire format and one mapping of answers to errors:

- `EngineClient`: one request, one answer, on a connection of its own (thread-safe; what the
  driver, the launcher and the sender's control calls use);
- `RequestPipeline`: many requests over one keep-alive HTTP/1.1 connection, sent without waiting
  for answers (HTTP pipelining), the answers read later in order. Servers answer pipelined
  requests one at a time, in order (uvicorn for SGLang, http.server for the built-in engine),
  which is what keeps an engine's receiving broadcasts in the order of the sender's.

An answer becomes a value or one of two errors: `EngineRequestError` (HTTP 4xx: the request is
wrong, retrying elsewhere won't help) or `EngineUnavailable` (no answer, a closed connection, a
5xx or an unparsable body: the engine may be dead, re-issue its work elsewhere).
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import socket
import time
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from relax_hpc.protocol import requests as P
from relax_hpc.protocol import routes as R
from relax_hpc.protocol.registry import read_records


class EngineUnavailable(RuntimeError):
    """The engine did not answer (refused, timed out, crashed): re-issue its work elsewhere."""


class EngineRequestError(RuntimeError):
    """The engine answered that the request is wrong (HTTP 4xx): retrying elsewhere won't help."""


class _Stream:
    """The buffered stream of a connection, as http.client reads answers from it: the same stream
    for every answer (bytes of the next pipelined answer read ahead into the buffer must not be
    lost between answers), and closed with the connection, not by http.client after each answer."""

    def __init__(self, reader: IO[bytes]) -> None:
        self._reader = reader

    def makefile(self, *_: object, **__: object) -> _Stream:
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)

    def close(self) -> None:
        """http.client closes its file once an answer is read; the connection lives on."""

    def close_stream(self) -> None:
        self._reader.close()


class _Connection:
    """One TCP connection to an engine: requests out, answers in, in order."""

    def __init__(self, url: str, api_key: str, timeout_s: float) -> None:
        parts = urlsplit(url)
        self.url = url.rstrip("/")
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        self._head = (
            f"Host: {parts.netloc}\r\nAuthorization: Bearer {api_key}\r\n"
            "Content-Type: application/json\r\nConnection: keep-alive\r\n"
        )
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as e:
            raise EngineUnavailable(f"{self.url}: {e}") from None
        # Small requests and answers: without this, Nagle's algorithm holds them up to 40 ms.
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._stream = _Stream(self._sock.makefile("rb"))

    def send(self, method: str, route: str, body: Any = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        head = f"{method} {route} HTTP/1.1\r\n{self._head}Content-Length: {len(data)}\r\n\r\n"
        try:
            self._sock.sendall(head.encode() + data)
        except OSError as e:
            raise EngineUnavailable(f"{self.url}{route}: {e}") from None

    def answer(self, route: str) -> Any:
        """The next answer on this connection, decoded, or the error it means."""
        return decode_answer(f"{self.url}{route}", *self.raw_answer(route))

    def raw_answer(self, route: str) -> tuple[int, bytearray]:
        """The next answer's status and body, as sent (read into one buffer, no copy: a binary
        answer's tensors are views of it)."""
        response = http.client.HTTPResponse(self._stream)  # type: ignore[arg-type]  # needs only makefile()
        try:
            response.begin()
            body = bytearray(response.length or 0)
            view, got = memoryview(body), 0
            while got < len(body):
                read = response.readinto(view[got:])
                if not read:
                    raise http.client.IncompleteRead(bytes(view[:got]), len(body) - got)
                got += read
            if response.length is None:  # no Content-Length: to the end of the stream
                body += response.read()
            return response.status, body
        except (OSError, ValueError, http.client.HTTPException) as e:
            raise EngineUnavailable(f"{self.url}{route}: {str(e) or type(e).__name__}") from None

    def close(self) -> None:
        """Safe from another thread while one reads: shutdown wakes that read with end-of-stream
        (closing the buffered reader first would wait for the reader's lock, and a close of the
        socket alone does not wake a blocked recv: a frozen engine would hold both for the whole
        socket timeout)."""
        with contextlib.suppress(OSError):  # the peer may have gone already
            self._sock.shutdown(socket.SHUT_RDWR)
        self._stream.close_stream()
        self._sock.close()


def check_status(where: str, status: int, body: bytes | bytearray) -> None:
    """Raise the error an answer's status means (the one place that decides)."""
    if 400 <= status < 500:
        raise EngineRequestError(f"{where}: HTTP {status}: {body[:500].decode(errors='replace')}")
    if status >= 300:
        raise EngineUnavailable(f"{where}: HTTP {status}: {body[:500].decode(errors='replace')}")


def decode_answer(where: str, status: int, body: bytes | bytearray) -> Any:
    """The JSON value of an answer, or the error its status means."""
    check_status(where, status, body)
    try:
        return json.loads(body or b"null")
    except json.JSONDecodeError as e:
        raise EngineUnavailable(f"{where}: not JSON ({e})") from None


class EngineClient:
    """Requests to one engine, each on a connection of its own."""

    def __init__(self, url: str, api_key: str, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s

    def call(self, method: str, route: str, body: Any = None, timeout_s: float | None = None) -> Any:
        connection = _Connection(self.url, self.api_key, timeout_s or self.timeout_s)
        try:
            connection.send(method, route, body)
            return connection.answer(route)
        finally:
            connection.close()

    def prefix_cache(self) -> tuple[float, float] | None:
        """The engine's prefix-cache counters so far, (tokens hit, tokens queried); None where
        the engine reports none (the built-in engine's, SGLang's without --enable-metrics)."""
        return None

    def post(self, route: str, request: object, timeout_s: float | None = None) -> Any:
        return self.call("POST", route, P.to_json(request), timeout_s)

    def fetch(self, route: str, request: object) -> bytearray:
        """POST `request` and return the answer's body as sent (a binary answer, not JSON)."""
        return self._raw("POST", route, P.to_json(request))

    def text(self, route: str) -> str:
        """GET `route`'s answer as text (not JSON: a Prometheus exposition)."""
        return self._raw("GET", route).decode(errors="replace")

    def _raw(self, method: str, route: str, body: Any = None) -> bytearray:
        connection = _Connection(self.url, self.api_key, self.timeout_s)
        try:
            connection.send(method, route, body)
            status, answer = connection.raw_answer(route)
        finally:
            connection.close()
        check_status(f"{self.url}{route}", status, answer)
        return answer

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            self.call("GET", R.HEALTH.path, timeout_s=timeout_s)
            return True
        except (EngineUnavailable, EngineRequestError):
            return False

    def weight_version(self) -> str:
        return str(self.call("GET", R.MODEL_INFO.path, timeout_s=5.0)["weight_version"])

    def generate(self, request: P.GenerateReqInput) -> Any:
        return self.post(R.GENERATE.path, request)

    def load_from_disk(self, request: P.UpdateWeightFromDiskReqInput) -> None:
        """Load a weight folder of the file channel (relax_hpc.weights.files), SGLang's way."""
        self.post(R.UPDATE_WEIGHTS_FROM_DISK.path, request)

    def load_adapter(self, name: str, folder: str) -> None:
        """Serve the PEFT adapter folder `folder` (a path on the engine's machine) as `name`; one of
        that name already loaded (by a trainer before a restart, which may have trained that
        version differently) is unloaded and loaded again from the new folder."""
        request = P.LoadLoRAAdapterReqInput(lora_name=name, lora_path=folder)
        try:
            self.post(R.LOAD_LORA_ADAPTER.path, request)
        except EngineRequestError as e:
            if "already loaded" not in str(e):
                raise
            self.unload_adapter(name)
            self.post(R.LOAD_LORA_ADAPTER.path, request)

    def unload_adapter(self, name: str) -> None:
        self.post(R.UNLOAD_LORA_ADAPTER.path, P.UnloadLoRAAdapterReqInput(name))


class RequestPipeline:
    """Requests to one engine over one keep-alive connection, sent without waiting for answers.
    Opened per weight push: SGLang closes idle connections after 5 s, sooner than the next push."""

    def __init__(self, url: str, api_key: str, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self._connection = _Connection(url, api_key, timeout_s)
        self._routes: list[str] = []  # sent, answer not read yet
        self.sent = 0  # requests sent on this connection

    def send(self, route: str, request: object) -> None:
        self._connection.send("POST", route, P.to_json(request))
        self._routes.append(route)
        self.sent += 1

    def wait_answers(self, leave: int = 0) -> None:
        """Read pending answers in order until `leave` are left; raises on the first failed request."""
        while len(self._routes) > leave:
            self._connection.answer(self._routes.pop(0))

    def wait_through(self, count: int) -> None:
        """Read answers until the first `count` requests sent are answered."""
        self.wait_answers(leave=max(0, self.sent - count))

    def close(self) -> None:
        self._connection.close()


class PoolUnavailable(RuntimeError):
    """No engine of a pool answered within the wait."""


class PoolClient:
    """/generate on any engine of a registry folder whose engines are never updated (the judge's,
    the teacher's): round-robin, a request re-issued to the next engine while engines fail (the
    launcher restarts them), waiting up to `wait_s` for one to register. `client`: the engines'
    API (relax_hpc.protocol.vllm.client_class). Thread-safe."""

    def __init__(
        self, folder: Path, api_key: str, timeout_s: float, wait_s: float, client: type[EngineClient] = EngineClient
    ) -> None:
        self.folder, self.api_key, self.timeout_s, self.wait_s = folder, api_key, timeout_s, wait_s
        self.client = client
        self._next = itertools.count()

    def generate(self, request: P.GenerateReqInput) -> list[dict]:
        deadline = time.monotonic() + self.wait_s
        while True:
            records = read_records(self.folder)
            for _ in range(len(records)):
                record = records[next(self._next) % len(records)]
                try:
                    answer: list[dict] = self.client(record.url, self.api_key, self.timeout_s).generate(request)
                    return answer
                except EngineUnavailable:
                    continue
            if time.monotonic() > deadline:
                raise PoolUnavailable(f"no engine of {self.folder} answered within {self.wait_s:.0f}s")
            time.sleep(1.0)
