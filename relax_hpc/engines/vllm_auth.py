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
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

OPEN = frozenset({"/health"})  # liveness only: the wrapper and load balancers probe it


async def require_token(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    expected = f"Bearer {os.environ['VLLM_API_KEY']}".encode()
    given = request.headers.get("authorization", "").encode()
    if request.url.path not in OPEN and not hmac.compare_digest(given, expected):
        return JSONResponse({"error": "Unauthorized"}, status_code=401)
    return await call_next(request)
