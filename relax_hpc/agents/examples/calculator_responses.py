"""The embedded tool-use task (relax_hpc.envs.calculator) as an agent on OpenAI's Responses API:
the same agent as calculator_openai.py, with `client.responses.create`, function tools and
`function_call_output` items. It sends the whole conversation each time (the gateway stores
nothing: no previous_response_id).

    rollout.env: {name: agent, settings: {agent: relax_hpc.agents.examples.calculator_responses:solve,
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
        "name": "calculator",
        "description": "Apply an operator to the question's two numbers.",
        "parameters": {"type": "object", "properties": {"op": {"type": "string", "enum": ["+", "-", "*"]}}},
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
    items: list[Any] = [{"role": "user", "content": question}]
    for _ in range(MAX_TOOL_CALLS + 1):
        response = await client.responses.create(model="policy", input=items, tools=TOOLS)
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return None  # an answer: the run's reward scores it
        items += [item.model_dump(exclude_none=True) for item in response.output]
        for call in calls:
            op = json.loads(call.arguments)["op"]
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": f"{OPS[op](a, b)} "})
    return 0.0  # more calls than the task allows
