"""The embedded tool-use task (relax_hpc.envs.calculator) as an agent on OpenAI's Chat Completions
API with tool calling: it offers a `calculator` tool, runs the calls the model makes on the
question's two numbers, and returns None so that the run's reward scores the model's last answer.

    rollout.env: {name: agent, settings: {agent: relax_hpc.agents.examples.calculator_openai:solve,
                                          parser: calculator}}
"""

from __future__ import annotations

import json
import re
import ssl
from typing import Any

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Apply an operator to the question's two numbers.",
            "parameters": {"type": "object", "properties": {"op": {"type": "string", "enum": ["+", "-", "*"]}}},
        },
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
    client = AsyncOpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, http_client=DefaultAsyncHttpxClient(verify=TLS)
    )
    messages: list[Any] = [{"role": "user", "content": question}]
    for _ in range(MAX_TOOL_CALLS + 1):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        if not message.tool_calls:
            return None  # an answer: the run's reward scores it
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            if call.type == "function":
                op = json.loads(call.function.arguments)["op"]
                messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{OPS[op](a, b)} "})
    return 0.0  # more calls than the task allows
