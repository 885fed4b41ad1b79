"""A multi-turn tool-use task: arithmetic too hard for a tiny model to do in its head, with a
calculator it may call.

A row's prompt is "a<op>b=" (op one of + - *, a up to 999, b up to 99) and its answer the
result. The model may answer at once ("936" and the end of its answer), or call the calculator
by writing an operator in parentheses, "(+)": the environment then appends the tool's output,
the result of that operator on the question's two numbers followed by a space ("936 "), which
the model reads but is not trained on, and the model answers in a second turn. The reward is
the exact match of the final answer. So the calculator helps only if the model calls it with the
question's own operator and copies what it returns; in its head, a 2-layer model gets almost
none right.

Settings (`rollout.env.settings`): `max_tool_calls` (default 1): calls beyond it end the episode
as truncated, with reward 0.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

from relax_hpc.data.prompts import PromptRow
from relax_hpc.envs.base import Context, Trajectory

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
QUESTION = re.compile(r"^(\d+)([-+*])(\d+)=$")
CALL = re.compile(r"^\(([-+*])\)$")


def tool_output(question: str, op: str) -> str:
    """What the calculator returns for `op` on the question's two numbers."""
    match = QUESTION.match(question)
    if match is None:
        raise ValueError(f"not a calculator question: {question!r}")
    return f"{OPS[op](int(match.group(1)), int(match.group(3)))} "


class Calculator:
    """The environment (relax_hpc.envs); settings as in the module's docstring."""

    def __init__(self, settings: dict[str, Any]) -> None:
        unknown = set(settings) - {"max_tool_calls"}
        if unknown:
            raise ValueError(f"rollout.env.settings: unknown calculator settings {sorted(unknown)}")
        self.max_tool_calls = int(settings.get("max_tool_calls", 1))

    async def rollout(self, row: PromptRow, ctx: Context) -> Trajectory:
        question = str(row.prompt)
        trajectory = ctx.trajectory()
        # A turn ends at the end of an answer or at ")", the end of a call.
        turn = {"stop_token_ids": ctx.encode(")")}
        calls = 0
        while True:
            out = await ctx.generate(trajectory.ids, turn)
            trajectory.add_sampled(out)
            call = CALL.match(ctx.decode(out.token_ids).strip())  # the tokens, whatever the engine's text omits
            if call is None:  # an answer: scored by the configured reward
                break
            calls += 1
            if calls > self.max_tool_calls:
                trajectory.finish(reward=0.0, status="truncated")
                break
            trajectory.add_observation(ctx.encode(tool_output(question, call.group(1))))
        trajectory.metrics.update({"turns": float(calls + 1), "tool_calls": float(calls)})
        return trajectory


def write_task(path: Path, size: int, seed: int) -> Path:
    """A dataset of `size` calculator questions, the three operators in turn."""
    rng = random.Random(seed)
    rows = []
    for i in range(size):
        op = "+-*"[i % 3]
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        rows.append({"prompt": f"{a}{op}{b}=", "answer": str(OPS[op](a, b))})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
