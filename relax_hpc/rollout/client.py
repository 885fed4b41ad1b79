"""HTTP client for one engine (the built-in torch engine or an SGLang server: same protocol)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from relax_hpc.rollout import protocol as P


class EngineUnavailable(RuntimeError):
    """The engine did not answer (refused, timed out, crashed): re-issue its work elsewhere."""


class EngineRequestError(RuntimeError):
    """The engine answered that the request is wrong (HTTP 4xx): retrying elsewhere won't help."""


class EngineClient:
    def __init__(self, url: str, api_key: str, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s

    def _call(self, method: str, route: str, body: Any = None, timeout_s: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + route, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.api_key}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            if 400 <= e.code < 500:
                raise EngineRequestError(f"{self.url}{route}: HTTP {e.code}: {detail}") from None
            raise EngineUnavailable(f"{self.url}{route}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as e:
            raise EngineUnavailable(f"{self.url}{route}: {e}") from None

    def post(self, route: str, request: Any, timeout_s: float | None = None) -> Any:
        return self._call("POST", route, P.to_json(request), timeout_s)

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            self._call("GET", "/health", timeout_s=timeout_s)
            return True
        except (EngineUnavailable, EngineRequestError):
            return False

    def weight_version(self) -> str:
        return str(self._call("GET", "/model_info", timeout_s=5.0)["weight_version"])

    def generate(self, request: P.GenerateReqInput) -> Any:
        return self.post("/generate", request)
