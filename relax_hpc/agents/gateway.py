"""The agent gateway: an HTTP server of OpenAI's and Anthropic's APIs on the rollout driver's event
loop (docs/agents.md).

Each episode of the `agent` environment opens a session and hands its agent the gateway's base
URL and the session's key. Whatever the API (relax_hpc.agents.api: one `Turn` read from the body),
a request samples through the episode's Context, the driver's own engine policy (routing by
session, re-issue after an engine failure, per-token versions), so the gateway builds no engine
client of its own and imports no torch. Its tokens are kept exactly as sampled
(relax_hpc.agents.transcript), and tool calls are read out of the text (relax_hpc.agents.toolcalls).

Keys: `rk-<session>-<HMAC-SHA256 of the session under a secret drawn at the gateway's start>`, as
a bearer token (OpenAI) or `x-api-key` (Anthropic); the gateway keeps no table of keys, and a key
stops working when its episode ends. The gateway listens on 127.0.0.1 (an ephemeral port) and
caps request bodies (`MAX_BODY`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import secrets
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from relax_hpc.agents.anthropic_messages import Messages
from relax_hpc.agents.api import Api, ApiError, Done, Turn, sse
from relax_hpc.agents.openai_chat import ChatCompletions
from relax_hpc.agents.openai_responses import Responses
from relax_hpc.agents.toolcalls import Parsed, Parser
from relax_hpc.agents.transcript import BadMessages, Tokenizer, Transcript

MAX_BODY = 8 * 2**20  # bytes of one request body
BACKLOG = 1024  # connections waiting to be accepted: a round's episodes connect at once
APIS: tuple[Api, ...] = (ChatCompletions(), Responses(), Messages())


@dataclass
class Session:
    """One episode's side of the gateway."""

    id: str
    context: Any  # the episode's relax_hpc.envs.base.Context
    transcript: Transcript
    max_requests: int
    requests: int = 0
    parse_failures: int = 0
    refused: list[str] = field(default_factory=list)  # what its 4xx answers said


class Gateway:
    """Sessions and the HTTP server (started on the running loop by `start`)."""

    def __init__(self, tokenizer: Tokenizer, parser: Parser, model: str) -> None:
        self.tokenizer, self.parser, self.model = tokenizer, parser, model
        self._secret = secrets.token_bytes(32)
        self._sessions: dict[str, Session] = {}
        self._starting: asyncio.Task[None] | None = None  # the server's start on `_loop`
        self._loop: asyncio.AbstractEventLoop | None = None
        self.base_url = ""

    async def start(self) -> None:
        """Serve on this event loop (again, if an earlier one served on another loop). Every
        episode of a round calls it at once: they all wait for the one start."""
        loop = asyncio.get_running_loop()
        if self._starting is None or self._loop is not loop:
            self._loop, self._starting = loop, loop.create_task(self._listen())
        await self._starting

    async def _listen(self) -> None:
        app = web.Application(client_max_size=MAX_BODY)
        for api in APIS:
            app.router.add_post(api.route, functools.partial(self._serve, api=api))
        app.router.add_get("/v1/models", self._models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=BACKLOG)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # aiohttp keeps the bound socket there
        self.base_url = f"http://127.0.0.1:{port}/v1"

    def open(self, context: Any, max_requests: int) -> tuple[Session, str]:
        session = Session(uuid.uuid4().hex, context, Transcript(self.tokenizer), max_requests)
        self._sessions[session.id] = session
        return session, f"rk-{session.id}-{self._mac(session.id)}"

    def close(self, session: Session) -> None:
        self._sessions.pop(session.id, None)

    def _mac(self, session_id: str) -> str:
        return hmac.new(self._secret, session_id.encode(), hashlib.sha256).hexdigest()

    def _session(self, request: web.Request) -> Session:
        _, _, bearer = request.headers.get("Authorization", "").partition("Bearer ")
        parts = (bearer.strip() or request.headers.get("x-api-key", "")).split("-")
        if len(parts) == 3 and parts[0] == "rk" and hmac.compare_digest(self._mac(parts[1]), parts[2]):
            session = self._sessions.get(parts[1])
            if session is not None:
                return session
        raise ApiError(401, "Incorrect API key provided (unknown, or its episode has ended)", code="invalid_api_key")

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except ApiError as e:
            status, body = ChatCompletions().error(e)
            return web.json_response(body, status=status)
        model = {"id": self.model, "object": "model", "created": 0, "owned_by": "relax_hpc"}
        return web.json_response({"object": "list", "data": [model]})

    async def _serve(self, request: web.Request, *, api: Api) -> web.StreamResponse:
        session = None
        try:
            session = self._session(request)
            body = await self._body(request)
            turn = api.read(body)
            done = await self._turn(session, turn, str(body.get("model") or self.model))
        except (ApiError, BadMessages) as e:
            error = e if isinstance(e, ApiError) else ApiError(400, str(e), param="messages")
            if session is not None:
                session.refused.append(str(error))
            status, payload = api.error(error)
            return web.json_response(payload, status=status)
        if not turn.stream:
            return web.json_response(api.answer(done, body))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(sse(api.events(done, body), done_marker=isinstance(api, ChatCompletions)))
        await response.write_eof()
        return response

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "We could not parse the JSON body of your request.") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    async def _turn(self, session: Session, turn: Turn, model: str) -> Done:
        """Render, sample, parse and record one turn of the session's episode."""
        session.requests += 1
        if session.requests > session.max_requests:
            raise ApiError(429, f"this episode's request limit ({session.max_requests}) is reached", code="rate_limit")
        prompt = session.transcript.prompt(turn.messages, turn.tools)
        sampled = await session.context.generate(prompt, self._sampling(turn, session))
        text = session.context.decode(sampled.token_ids)  # the tokens, whatever the engine's text omits
        parsed = self.parser.parse(text) if turn.parse_tools else Parsed(text, [])
        session.parse_failures += parsed.failed
        session.transcript.record(sampled, parsed)
        return Done(
            model, len(prompt), sampled, parsed, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)
        )

    def _sampling(self, turn: Turn, session: Session) -> dict[str, Any]:
        """The request's sampling settings within the episode's: the run samples at its own
        temperature and top_p (the trainer's log-probabilities are taken at them; an evaluation
        greedily), and at most rollout.max_new_tokens per request."""
        run: Mapping[str, Any] = session.context.sampling
        for name, asked in (("temperature", turn.temperature), ("top_p", turn.top_p)):
            if asked is not None and float(asked) != float(run[name]):
                why = f"{name}={asked}: this run samples at {run[name]} (rollout.{name}; leave it unset)"
                raise ApiError(400, why, param=name)
        most = int(run["max_new_tokens"])
        params: dict[str, Any] = {"max_new_tokens": min(int(turn.max_tokens or most), most)}
        if turn.stop:
            params["stop"] = turn.stop
        return {**params, **self.parser.sampling(session.context.encode)}
