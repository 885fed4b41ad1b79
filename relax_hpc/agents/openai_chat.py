"""OpenAI's Chat Completions (`POST /v1/chat/completions`) on the gateway's shared turn."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from relax_hpc.agents.api import ApiError, Done, Turn, openai_error, openai_tool_choice, refuse, stop_list

ONLY = {"n": 1, "logit_bias": None, "parallel_tool_calls": True, "store": False, "top_logprobs": 0,
        "frequency_penalty": 0, "presence_penalty": 0, "response_format": {"type": "text"}}  # fmt: skip
KNOWN = {"model", "messages", "tools", "tool_choice", "stream", "stream_options", "temperature", "top_p", "max_tokens",
         "max_completion_tokens", "stop", "logprobs", "user", "metadata"}  # fmt: skip


def finish_reason(done: Done) -> str:
    return "tool_calls" if done.parsed.tool_calls else "length" if done.truncated else "stop"


def usage(done: Done) -> dict[str, int]:
    total = done.prompt_tokens + done.completion_tokens
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens, "total_tokens": total}


class ChatCompletions:
    route = "/v1/chat/completions"

    def read(self, body: dict[str, Any]) -> Turn:
        if not isinstance(body.get("messages"), list):
            raise ApiError(400, "'messages' is a required property", param="messages")
        refuse(body, KNOWN, ONLY)
        return Turn(
            messages=body["messages"], tools=body.get("tools"),
            max_tokens=body.get("max_completion_tokens") or body.get("max_tokens"), stop=stop_list(body.get("stop")),
            temperature=body.get("temperature"), top_p=body.get("top_p"), parse_tools=openai_tool_choice(body),
            stream=bool(body.get("stream")),
        )  # fmt: skip

    def answer(self, done: Done, body: Mapping[str, Any]) -> dict[str, Any]:
        choice = {"index": 0, "message": self._message(done), "finish_reason": finish_reason(done),
                  "logprobs": self._logprobs(done) if body.get("logprobs") else None}  # fmt: skip
        return {**self._head(done, "chat.completion"), "choices": [choice], "usage": usage(done)}

    def events(self, done: Done, body: Mapping[str, Any]) -> list[tuple[str | None, dict[str, Any]]]:
        """The role, the content, each tool call, the finish reason, then (include_usage) the usage."""
        head = self._head(done, "chat.completion.chunk")
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        if done.parsed.content:
            deltas.append({"content": done.parsed.content})
        deltas += [{"tool_calls": [{"index": i, **c.openai()}]} for i, c in enumerate(done.parsed.tool_calls)]
        chunk = lambda delta, finish: {**head, "choices": [  # noqa: E731
            {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}  # fmt: skip
        out: list[tuple[str | None, dict[str, Any]]] = [(None, chunk(d, None)) for d in deltas]
        out.append((None, chunk({}, finish_reason(done))))
        if (body.get("stream_options") or {}).get("include_usage"):
            out.append((None, {**head, "choices": [], "usage": usage(done)}))
        return out

    def error(self, error: ApiError) -> tuple[int, dict[str, Any]]:
        return openai_error(error)

    @staticmethod
    def _head(done: Done, kind: str) -> dict[str, Any]:
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": done.model}

    @staticmethod
    def _message(done: Done) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": done.parsed.content}
        if done.parsed.tool_calls:
            message["tool_calls"] = [c.openai() for c in done.parsed.tool_calls]
        return message

    @staticmethod
    def _logprobs(done: Done) -> dict[str, Any]:
        content = [
            {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
            for text, logprob in zip(done.token_text(), done.sampled.logprobs, strict=True)
        ]
        return {"content": content, "refusal": None}
