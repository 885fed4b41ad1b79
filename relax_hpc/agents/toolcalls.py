"""Tool calls out of sampled text, one parser per model family (`rollout.env.settings.parser`).

A parser turns a completion's text into the assistant message an API returns (content and tool
calls) and back into the text the chat template renders for it; it may add sampling settings (the
tokens that end a turn). Text it cannot parse is returned as plain content and counted
(`Parsed.failed`): the gateway never raises on what a model writes.

- `hermes`: Qwen3's and Hermes' `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks,
  the format SGLang's hermes detector reads (sglang/srt/function_call/hermes_detector.py).
- `calculator`: the embedded tool-use task's "(+)" (relax_hpc.envs.calculator): an operator in
  parentheses is a call of the `calculator` tool with {"op": "+"}.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]  # as JSON values; the API's answer carries them serialised
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str | None
    tool_calls: list[ToolCall]
    failed: bool = False  # the text looked like a call but was not one: returned as content


class Parser(Protocol):
    def parse(self, text: str) -> Parsed: ...

    def sampling(self, encode: Callable[[str], list[int]]) -> dict[str, Any]:
        """Sampling settings the format needs (e.g. the token that ends a call)."""
        ...


class HermesParser:
    """`<tool_call>` blocks of JSON objects with `name` and `arguments`; the text before the first
    block is the content (as SGLang's detector reads it: text between or after blocks is dropped)."""

    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        if "<tool_call>" not in text:
            return Parsed(text, [])
        calls = []
        for body in self.BLOCK.findall(text):
            try:
                value = json.loads(body)
            except json.JSONDecodeError:
                return Parsed(text, [], failed=True)
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                return Parsed(text, [], failed=True)
            arguments = value.get("arguments", {})
            if not isinstance(arguments, dict):
                return Parsed(text, [], failed=True)
            calls.append(ToolCall(value["name"], arguments))
        if not calls or text.count("<tool_call>") != len(calls):  # a block cut off (max_tokens)
            return Parsed(text, [], failed=True)
        content = text[: text.index("<tool_call>")].strip()
        return Parsed(content or None, calls)

    def sampling(self, encode: Callable[[str], list[int]]) -> dict[str, Any]:
        return {}


class CalculatorParser:
    """The calculator task's call: an operator in parentheses, and nothing else in the turn."""

    CALL = re.compile(r"^\s*\(([-+*])\)\s*$")

    def parse(self, text: str) -> Parsed:
        match = self.CALL.match(text)
        if match is None:
            return Parsed(text, [], failed="(" in text and ")" in text)
        return Parsed(None, [ToolCall("calculator", {"op": match.group(1)})])

    def sampling(self, encode: Callable[[str], list[int]]) -> dict[str, Any]:
        return {"stop_token_ids": encode(")")}  # a turn ends at the end of an answer or of a call


PARSERS: dict[str, Callable[[], Parser]] = {"hermes": HermesParser, "calculator": CalculatorParser}


def parser(name: str) -> Parser:
    if name not in PARSERS:
        raise ValueError(f"tool-call parser {name!r}: one of {', '.join(PARSERS)}")
    return PARSERS[name]()
