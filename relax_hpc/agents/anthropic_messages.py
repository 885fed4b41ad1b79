"""Anthropic's Messages API (`POST /v1/messages`) on the gateway's shared turn.

Blocks become chat messages: `system` a system message first, text blocks content, an assistant's
`tool_use` blocks its tool calls, a user's `tool_result` blocks tool messages (before the user's
text, as Anthropic places them). The Anthropic SDK takes the gateway's root as its base URL (it
adds /v1/messages itself): the episode's base URL without its /v1.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from relax_hpc.agents.api import ApiError, Done, Turn, refuse, stop_list

ONLY = {"thinking": None, "top_k": None, "service_tier": None}
KNOWN = {"model", "messages", "system", "max_tokens", "tools", "tool_choice", "stop_sequences", "temperature",
         "top_p", "stream", "metadata"}  # fmt: skip
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 429: "rate_limit_error"}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, Mapping) and b.get("type") == "text" for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise ApiError(400, f"{where}: text content only (a string or text blocks)", param="messages")


def _user(message: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out, texts = [], []
    for j, block in enumerate(content if isinstance(content, list) else [None]):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "tool_result":
            result = _text(block.get("content", ""), f"{where}.content[{j}]")
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
        elif kind == "text":
            texts.append(str(block.get("text", "")))
        else:
            raise ApiError(400, f"{where}.content[{j}]: blocks of type {kind!r} are not supported", param="messages")
    return out + ([{"role": "user", "content": "".join(texts)}] if texts else [])


def _assistant(message: Mapping[str, Any], where: str) -> dict[str, Any]:
    content = message.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            function = {"name": block.get("name"), "arguments": block.get("input") or {}}
            calls.append({"id": block.get("id"), "type": "function", "function": function})
        else:
            raise ApiError(400, f"{where}.content[{j}]: blocks of type {kind!r} are not supported", param="messages")
    message_out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message_out["tool_calls"] = calls
    return message_out


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise ApiError(400, "messages: field required", param="messages")
    out: list[dict[str, Any]] = []
    if body.get("system"):
        out.append({"role": "system", "content": _text(body["system"], "system")})
    for i, message in enumerate(body["messages"]):
        role = message.get("role") if isinstance(message, Mapping) else None
        if role == "user":
            out += _user(message, f"messages[{i}]")
        elif role == "assistant":
            out.append(_assistant(message, f"messages[{i}]"))
        else:
            raise ApiError(400, f"messages[{i}].role: 'user' or 'assistant', not {role!r}", param="messages")
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [
        {"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                          "parameters": t.get("input_schema", {})}}
        for t in tools
    ]  # fmt: skip


class Messages:
    route = "/v1/messages"

    def read(self, body: dict[str, Any]) -> Turn:
        refuse(body, KNOWN, ONLY)
        if not isinstance(body.get("max_tokens"), int):
            raise ApiError(400, "max_tokens: field required", param="max_tokens")
        choice = (body.get("tool_choice") or {"type": "auto"}).get("type")
        if choice not in ("auto", "none"):
            raise ApiError(400, f"tool_choice.type={choice!r} is not supported (auto or none)", param="tool_choice")
        return Turn(
            messages=_messages(body), tools=_tools(body.get("tools")), max_tokens=body["max_tokens"],
            stop=stop_list(body.get("stop_sequences")), temperature=body.get("temperature"),
            top_p=body.get("top_p"), parse_tools=choice != "none", stream=bool(body.get("stream")),
        )  # fmt: skip

    def answer(self, done: Done, body: Mapping[str, Any]) -> dict[str, Any]:
        return {**self._head(done), "content": self._blocks(done), "stop_reason": self._stop_reason(done),
                "usage": self._usage(done)}  # fmt: skip

    def events(self, done: Done, body: Mapping[str, Any]) -> list[tuple[str | None, dict[str, Any]]]:
        """message_start; per content block its start, delta and stop; message_delta (the stop
        reason and the output tokens); message_stop."""
        start = {**self._head(done), "content": [], "stop_reason": None,
                 "usage": {**self._usage(done), "output_tokens": 0}}  # fmt: skip
        events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
        for index, block in enumerate(self._blocks(done)):
            if block["type"] == "text":
                opening, delta = {**block, "text": ""}, {"type": "text_delta", "text": block["text"]}
            else:
                arguments = json.dumps(block["input"])
                opening, delta = {**block, "input": {}}, {"type": "input_json_delta", "partial_json": arguments}
            events += [
                {"type": "content_block_start", "index": index, "content_block": opening},
                {"type": "content_block_delta", "index": index, "delta": delta},
                {"type": "content_block_stop", "index": index},
            ]
        events += [
            {"type": "message_delta", "delta": {"stop_reason": self._stop_reason(done), "stop_sequence": None},
             "usage": {"output_tokens": done.completion_tokens}},
            {"type": "message_stop"},
        ]  # fmt: skip
        return [(e["type"], e) for e in events]

    def error(self, error: ApiError) -> tuple[int, dict[str, Any]]:
        kind = ERROR_TYPES.get(error.status, "api_error")
        return error.status, {"type": "error", "error": {"type": kind, "message": str(error)}}

    @staticmethod
    def _head(done: Done) -> dict[str, Any]:
        return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": done.model,
                "stop_sequence": None}  # fmt: skip

    @staticmethod
    def _blocks(done: Done) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = [{"type": "text", "text": done.parsed.content}] if done.parsed.content else []
        return blocks + [
            {"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in done.parsed.tool_calls
        ]

    @staticmethod
    def _stop_reason(done: Done) -> str:
        return "tool_use" if done.parsed.tool_calls else "max_tokens" if done.truncated else "end_turn"

    @staticmethod
    def _usage(done: Done) -> dict[str, int]:
        return {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}  # fmt: skip
