"""The embedded tool-use task (relax_hpc.envs.calculator) as an agent on Anthropic's Messages API:
the same agent as calculator_openai.py, with the `anthropic` SDK's tool use (`tool_use` and
`tool_result` blocks). The SDK adds /v1/messages to its base URL, so it gets the gateway's root.

    rollout.env: {name: agent, settings: {agent: relax_hpc.agents.examples.calculator_anthropic:solve,
                                          parser: calculator}}
"""

from __future__ import annotations

import re
import ssl
from typing import Any

from anthropic import AsyncAnthropic, DefaultAsyncHttpxClient

TOOLS: list[Any] = [
    {
        "name": "calculator",
        "description": "Apply an operator to the question's two numbers.",
        "input_schema": {"type": "object", "properties": {"op": {"type": "string", "enum": ["+", "-", "*"]}}},
    }
]
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
MAX_TOOL_CALLS = 1  # as the built-in environment's max_tool_calls: a second call scores 0
# Each episode's client has a connection of its own (one pool shared by hundreds of episodes at once
# scans all its connections per request) and shares one TLS context: loading the certificates
# takes about 20 ms of CPU, more than a whole episode of this task.
TLS = ssl.create_default_context()


async def solve(base_url: str, api_key: str, row: dict[str, Any]) -> float | None:
    question = str(row["prompt"])  # "a<op>b="
    a, b = (int(n) for n in re.findall(r"\d+", question)[:2])
    client = AsyncAnthropic(
        base_url=base_url.removesuffix("/v1"),
        api_key=api_key,
        max_retries=0,
        http_client=DefaultAsyncHttpxClient(verify=TLS),
    )
    messages: list[Any] = [{"role": "user", "content": question}]
    for _ in range(MAX_TOOL_CALLS + 1):
        reply = await client.messages.create(model="policy", max_tokens=64, messages=messages, tools=TOOLS)
        calls = [block for block in reply.content if block.type == "tool_use"]
        if not calls:
            return None  # an answer: the run's reward scores it
        messages.append({"role": "assistant", "content": [block.model_dump() for block in reply.content]})
        results = [
            {"type": "tool_result", "tool_use_id": c.id, "content": f"{OPS[str(dict(c.input)['op'])](a, b)} "}
            for c in calls
        ]
        messages.append({"role": "user", "content": results})
    return 0.0  # more calls than the task allows
