"""What every API the gateway serves shares: a request read into one `Turn` (chat-format messages
and tools, sampling limits), the `Done` turn it answers with, and the `Api` interface each of
OpenAI's Chat Completions and Responses and Anthropic's Messages implements: read a body, write an
answer whole or as server-sent events, and write an error in the API's own shape."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from relax_hpc.agents.toolcalls import Parsed
from relax_hpc.envs.base import Sampled


class ApiError(Exception):
    """A refusal: HTTP status, message, the parameter at fault and a code, in the API's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


@dataclass
class Turn:
    """One request, whatever its API: what the transcript renders and the engines sample."""

    messages: list[dict[str, Any]]  # Chat Completions' shape: role, content, tool_calls, tool_call_id
    tools: list[dict[str, Any]] | None  # Chat Completions' shape: {"type": "function", "function": {...}}
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    parse_tools: bool = True  # tool_choice none: the answer's text is content
    stream: bool = False


@dataclass
class Done:
    """A turn answered: what was sampled and what it parsed to."""

    model: str
    prompt_tokens: int
    sampled: Sampled
    parsed: Parsed
    decode: Callable[[list[int]], str]  # token ids to text, special tokens kept

    def token_text(self) -> list[str]:
        """Each sampled token's text (logprobs' `token`): decoded only for an answer that asks."""
        return [self.decode([t]) for t in self.sampled.token_ids]

    @property
    def completion_tokens(self) -> int:
        return len(self.sampled.token_ids)

    @property
    def truncated(self) -> bool:
        return self.sampled.finish_reason == "length"


class Api(Protocol):
    route: str  # the POST path under the gateway's root, e.g. /v1/chat/completions

    def read(self, body: dict[str, Any]) -> Turn: ...

    def answer(self, done: Done, body: Mapping[str, Any]) -> dict[str, Any]: ...

    def events(self, done: Done, body: Mapping[str, Any]) -> list[tuple[str | None, dict[str, Any]]]:
        """The answer as server-sent events: (event name or None, data), in order."""
        ...

    def error(self, error: ApiError) -> tuple[int, dict[str, Any]]: ...


def refuse(body: Mapping[str, Any], known: set[str], only: Mapping[str, Any]) -> None:
    """A parameter the API does not have, or one the gateway takes at one value (the API's
    default) only, set to another: refused, naming it (never silently ignored)."""
    for name in body:
        if name not in known and name not in only:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", param=name)
    for name, value in only.items():
        if name in body and body[name] is not None and body[name] != value:
            raise ApiError(400, f"{name}={body[name]!r} is not supported by this gateway (only {value!r})", param=name)


def openai_tool_choice(body: Mapping[str, Any]) -> bool:
    """OpenAI's `tool_choice`: `auto` or `none` (whether tool calls are read out of the answer)."""
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise ApiError(400, f"tool_choice={choice!r} is not supported (auto or none)", param="tool_choice")
    return choice != "none"


def openai_error(error: ApiError) -> tuple[int, dict[str, Any]]:
    """OpenAI's error shape (Chat Completions and Responses alike)."""
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return error.status, {"error": {"message": str(error), "type": kind, "param": error.param, "code": error.code}}


def stop_list(stop: Any) -> list[str]:
    return [] if not stop else [stop] if isinstance(stop, str) else [str(s) for s in stop]


def sse(events: list[tuple[str | None, dict[str, Any]]], done_marker: bool) -> bytes:
    """Server-sent events; `done_marker`: OpenAI Chat Completions' closing `data: [DONE]`."""
    lines = [(f"event: {name}\n" if name else "") + f"data: {json.dumps(data)}\n\n" for name, data in events]
    return "".join(lines).encode() + (b"data: [DONE]\n\n" if done_marker else b"")
