"""One episode's conversation kept token for token (issue 49, item 3).

An agent sends the whole conversation with every request, and SDKs re-serialise what they got
back. The transcript keeps, for the episode's current segment, the messages the tokens stand for
(each judged by role, content, and tool calls' names and arguments as JSON values: `normalize`)
and the trajectory so far. A request whose leading messages equal those goes on from the tokens
as they were sampled: only its new messages (tool results, user turns) are rendered with the
model's chat template, as the text the template puts after the conversation so far, and are
tokenised as observations (not trained on). Nothing sampled is decoded and re-encoded.

A request that changes or drops an earlier message, or one that the template renders so that the
conversation so far is no longer a prefix of it (a template that rewrites earlier turns), starts a
new segment: a trajectory of its own, rendered whole. An episode returns all of its segments.

The text between the sampled tokens and the next message is the template's own: after the last
sampled token, what the template closes an assistant turn with (Qwen3: "<|im_end|>\\n", or only
"\\n" when the end-of-turn token was sampled), found by rendering the turn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from relax_hpc.agents.toolcalls import Parsed
from relax_hpc.envs.base import Sampled, Trajectory


class Tokenizer(Protocol):
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def __call__(self, text: str, **kwargs: Any) -> Any: ...

    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...


class BadMessages(ValueError):
    """The request's messages cannot be rendered (the message says why; the API's 400)."""


def _text(content: Any) -> Any:
    """A message's content as compared and rendered: text parts joined, other parts kept."""
    if content is None or content == "":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return content


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            raise BadMessages(f"a tool call's arguments are not JSON: {raw[:80]!r}") from None
    return raw


def _call(function: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": function["name"], "arguments": _arguments(function.get("arguments"))},
    }


def normalize(message: Mapping[str, Any]) -> dict[str, Any]:
    """The message as equality judges it and the template renders it."""
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise BadMessages(f"a message's role must be system, user, assistant or tool, not {role!r}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": _text(message.get("content"))}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [_call(c["function"]) for c in calls]
    if role == "tool":
        out["tool_call_id"] = message.get("tool_call_id", "")
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal as the transcript compares them: the tool-call ids an SDK echoes do not count."""
    strip = lambda m: {k: v for k, v in m.items() if k != "tool_call_id"}  # noqa: E731
    return strip(a) == strip(b)


def assistant_message(parsed: Parsed) -> dict[str, Any]:
    """The assistant message a parsed completion is, in normalized form."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content or ""}
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.tool_calls
        ]
    return message


class Transcript:
    """The segments of one episode (see the module's docstring)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.segments: list[Trajectory] = []  # the finished ones, then the current one last
        self._messages: list[dict[str, Any]] = []  # what the current segment's tokens stand for
        self._tools: Any = None
        self._tail = ""  # the template's text after the last sampled token
        self._rendered = ""  # the template's text of `_messages`
        self._pending: list[dict[str, Any]] | None = None  # the request being answered
        self._asked = ""  # the template's text of `_pending`, with the generation prompt

    @property
    def current(self) -> Trajectory | None:
        return self.segments[-1] if self.segments else None

    def prompt(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> list[int]:
        """The token ids that a request of these messages continues."""
        if not messages:
            raise BadMessages("messages must not be empty")
        normalized = [normalize(m) for m in messages]
        known = len(self._messages)
        goes_on = (
            self.current is not None and known < len(normalized) and tools == self._tools
            and all(_same(a, b) for a, b in zip(self._messages, normalized[:known], strict=False))
        )  # fmt: skip
        full = self._render(normalized, generation=True, tools=tools)
        self._pending, self._asked = normalized, full
        if goes_on and full.startswith(self._rendered):
            assert self.current is not None
            self.current.add_observation(self._encode(self._tail + full[len(self._rendered) :]))
            return self.current.ids
        self.segments.append(Trajectory(prompt_ids=self._encode(full)))
        self._tools = tools
        return self.segments[-1].ids

    def record(self, sampled: Sampled, parsed: Parsed) -> dict[str, Any]:
        """What was sampled for the pending request; returns its assistant message."""
        assert self.current is not None and self._pending is not None, "prompt() first"
        self.current.add_sampled(sampled)
        message = assistant_message(parsed)
        self._messages, self._pending = [*self._pending, message], None
        self._rendered = self._render(self._messages, generation=False)
        turn = self._rendered[len(self._asked) :] if self._rendered.startswith(self._asked) else ""
        self._tail = self._closing(turn, sampled)
        return message

    def _closing(self, turn: str, sampled: Sampled) -> str:
        """What the template writes after the sampled tokens: the rendered turn past the sampled
        text, or (a turn the template rewrites) its closing past what the sampling already ended
        with (an end-of-turn token)."""
        text = self.tokenizer.decode(sampled.token_ids, skip_special_tokens=False)
        if turn.startswith(text):
            return turn[len(text) :]
        probe = "\x00"
        asked = self._render(self._messages[:-1], generation=True)
        closing = self._render([*self._messages[:-1], {"role": "assistant", "content": probe}], False)
        closing = closing[len(asked) :].split(probe, 1)[-1]
        overlap = next((n for n in range(len(closing), 0, -1) if text.endswith(closing[:n])), 0)
        return closing[overlap:]

    def _render(self, messages: list[dict[str, Any]], generation: bool, tools: Any = None) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools if tools is not None else self._tools, tokenize=False,
                add_generation_prompt=generation,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001  # the template's own error (jinja) is the request's fault
            raise BadMessages(f"the chat template cannot render these messages: {e}") from None
        return str(text)

    def _encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids
