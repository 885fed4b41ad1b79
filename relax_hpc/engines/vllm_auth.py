"""The run token on every route of a vLLM server but /health (api_server --middleware).

vLLM's `--api-key` guards only paths under /v1, /v2, /inference and /cohere
(vllm/entrypoints/serve/middleware/authenticate.py: GUARDED_PREFIX); the RL routes the dev mode
serves (/pause, /init_weight_transfer_engine, /update_weights, /weight_checker, /collective_rpc)
would answer anyone who reaches the port. This middleware answers 401 to a request without
`Authorization: Bearer TOKEN`, TOKEN being VLLM_API_KEY (relax_hpc.engines.vllm_engine sets it
to the run token). Imported by the server, in vLLM's environment.
"""

from __future__ import annotations

import hmac
import os

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

OPEN = frozenset({"/health"})  # liveness only: the wrapper and load balancers probe it


class RequireToken:
    """A plain ASGI middleware (vLLM adds a class with app.add_middleware). A function middleware
    would be wrapped in Starlette's BaseHTTPMiddleware, which runs every request's answer through
    a task and a stream of its own: 9 % of a busy API server's CPU here (py-spy, 2026-12-05)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.expected = f"Bearer {os.environ['VLLM_API_KEY']}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
