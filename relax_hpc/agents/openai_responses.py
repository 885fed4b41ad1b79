"""OpenAI's Responses API (`POST /v1/responses`) on the gateway's shared turn.

The input items become chat messages: text items by role, `function_call` items the assistant's
tool calls, `function_call_output` items tool messages, `instructions` a system message first.
Nothing is stored: `previous_response_id` and `store: true` are refused, so an agent sends the
whole conversation each time, as it does to Chat Completions.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

from relax_hpc.agents.api import ApiError, Done, Turn, openai_error, openai_tool_choice, refuse

ONLY = {"previous_response_id": None, "store": False, "reasoning": None, "background": False, "top_logprobs": 0,
        "parallel_tool_calls": True, "truncation": "disabled", "text": {"format": {"type": "text"}}}  # fmt: skip
KNOWN = {"model", "input", "instructions", "tools", "tool_choice", "stream", "max_output_tokens", "temperature",
         "top_p", "metadata", "user", "include"}  # fmt: skip


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") not in ("input_text", "output_text", "text"):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ApiError(400, f"{where}: content parts of type {kind!r} are not supported (text only)", "input")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ApiError(400, f"{where}: content must be a string or a list of parts", param="input")


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "'input' is a required property (a string or a list of items)", param="input")
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": str(body["instructions"])})
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, Mapping) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # a turn's text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        else:
            raise ApiError(400, f"input[{i}]: items of type {kind!r} are not supported", param="input")
    return messages


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for tool in tools:
        if tool.get("type") != "function":
            raise ApiError(400, f"tools of type {tool.get('type')!r} are not supported (function only)", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


class Responses:
    route = "/v1/responses"

    def read(self, body: dict[str, Any]) -> Turn:
        refuse(body, KNOWN, ONLY)
        return Turn(
            messages=_messages(body), tools=_tools(body.get("tools")), max_tokens=body.get("max_output_tokens"),
            temperature=body.get("temperature"), top_p=body.get("top_p"), parse_tools=openai_tool_choice(body),
            stream=bool(body.get("stream")),
        )  # fmt: skip

    def answer(self, done: Done, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._response(done, body, self._items(done))

    def events(self, done: Done, body: Mapping[str, Any]) -> list[tuple[str | None, dict[str, Any]]]:
        """response.created and .in_progress; per output item its added, delta, done events;
        response.completed (or .incomplete) with the whole response."""
        items = self._items(done)
        response = self._response(done, body, items)
        opening = {**response, "status": "in_progress", "output": [], "usage": None}
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": opening},
            {"type": "response.in_progress", "response": opening},
        ]
        for index, item in enumerate(items):
            events += self._item_events(index, item)
        events.append({"type": f"response.{response['status']}", "response": response})
        return [(e["type"], {**e, "sequence_number": n}) for n, e in enumerate(events)]

    def error(self, error: ApiError) -> tuple[int, dict[str, Any]]:
        return openai_error(error)

    @staticmethod
    def _items(done: Done) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if done.parsed.content:
            text = {"type": "output_text", "text": done.parsed.content, "annotations": [], "logprobs": []}
            items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed",
                          "role": "assistant", "content": [text]})  # fmt: skip
        items += [
            {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": c.id, "name": c.name,
             "arguments": json.dumps(c.arguments), "status": "completed"}
            for c in done.parsed.tool_calls
        ]  # fmt: skip
        return items

    @staticmethod
    def _response(done: Done, body: Mapping[str, Any], items: list[dict[str, Any]]) -> dict[str, Any]:
        incomplete = done.truncated and not done.parsed.tool_calls
        total = done.prompt_tokens + done.completion_tokens
        usage = {"input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": total}  # fmt: skip
        return {
            "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "status": "incomplete" if incomplete else "completed", "model": done.model, "output": items,
            "usage": usage, "parallel_tool_calls": True,
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
            "max_output_tokens": body.get("max_output_tokens"), "text": {"format": {"type": "text"}},
            "truncation": "disabled", "store": False,
        }  # fmt: skip

    @staticmethod
    def _item_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        at = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "function_call":
            arguments = item["arguments"]
            return [
                {"type": "response.output_item.added", "output_index": index, "item": {**item, "arguments": "",
                                                                                        "status": "in_progress"}},
                {"type": "response.function_call_arguments.delta", **at, "delta": arguments},
                {"type": "response.function_call_arguments.done", **at, "arguments": arguments, "name": item["name"]},
                {"type": "response.output_item.done", "output_index": index, "item": item},
            ]  # fmt: skip
        part = item["content"][0]
        empty = {**part, "text": ""}
        at_part = {**at, "content_index": 0}
        return [
            {"type": "response.output_item.added", "output_index": index,
             "item": {**item, "content": [], "status": "in_progress"}},
            {"type": "response.content_part.added", **at_part, "part": empty},
            {"type": "response.output_text.delta", **at_part, "delta": part["text"], "logprobs": []},
            {"type": "response.output_text.done", **at_part, "text": part["text"], "logprobs": []},
            {"type": "response.content_part.done", **at_part, "part": part},
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]  # fmt: skip
