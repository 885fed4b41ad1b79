"""The environment interface: how a rollout is written.

An environment is an async function (or a class with an async `rollout` method) that gets one
dataset row and a Context, talks to the policy through `ctx.generate`, and returns one
trajectory (or several: branches of one episode). relax_hpc runs it `group_size` times per
prompt, each run with its own sampling seeds, and the trajectories of a prompt form its group.

    async def my_env(row: PromptRow, ctx: Context) -> Trajectory:
        traj = ctx.trajectory()                        # starts from the row's prompt ids
        out = await ctx.generate(traj.ids)             # tokens, logprobs, versions, finish
        traj.add_sampled(out)                          # trained on (loss mask 1)
        traj.add_observation(ctx.encode("result: 4\\n"))  # read by the model, not trained on
        ...
        return traj.finish(reward=None)                # None: the configured reward scores it

Token in, token out: a trajectory is the prompt's ids followed by sampled tokens and observation
tokens exactly as they were produced; nothing is decoded and re-encoded (a chat template is not
append-only: Qwen3's drops earlier thinking blocks). `ctx.generate` hides engines, batching,
re-issue after an engine failure, and (with partial rollout) continuation across weight updates:
each returned token carries the policy version that sampled it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from relax_hpc.data.media import Kind
from relax_hpc.data.prompts import PromptRow

Status = Literal["completed", "truncated", "failed"]


class EnvError(RuntimeError):
    """An environment broke its contract (the message says how); the run stops with it."""


@dataclass(slots=True)
class Sampled:
    """What one generate call returned: the new tokens only."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # the policy version that sampled each token
    finish_reason: Literal["stop", "length"]
    text: str  # the tokens decoded (for parsing tool calls; never re-encoded)
    prompt_ids: list[int] | None = None  # the prompt as the engine conditioned on it (media expanded)
    # MoE routing replay: the routers' choices for every input position of this call (its prompt
    # and its new tokens but the last), [positions, layers * top_k].
    routed: np.ndarray | None = None


@dataclass(slots=True)
class Trajectory:
    """One episode as the trainer sees it: `prompt_ids`, then `tokens` (sampled and observation
    tokens in order) with a loss mask (1: sampled by the policy, trained on), the engine's
    log-probability and policy version per token (0 and -1 for observation tokens)."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float | None = None  # None: the configured reward function scores `response`
    turn_rewards: list[float] = field(default_factory=list)  # logged; summed into `reward` if that is None
    status: Status = "completed"
    response: str = ""  # the text the reward function scores (default: the last sampled text)
    metrics: dict[str, float] = field(default_factory=dict)  # per trajectory; means per step are logged
    media: list[tuple[Kind, bytes]] = field(default_factory=list)  # the prompt's items
    routed: np.ndarray | None = None  # the last call's routing (it covers every earlier position)

    @property
    def ids(self) -> list[int]:
        """Everything so far: what the next generate call continues."""
        return self.prompt_ids + self.tokens

    def add_sampled(self, out: Sampled) -> Trajectory:
        self.tokens += out.token_ids
        self.loss_mask += [1] * len(out.token_ids)
        self.logprobs += out.logprobs
        self.versions += out.versions
        self.response = out.text
        if out.routed is not None:
            self.routed = out.routed
        if out.finish_reason == "length":
            self.status = "truncated"
        return self

    def add_observation(self, token_ids: list[int]) -> Trajectory:
        """Environment tokens (a tool's output, a user turn): conditioned on, never trained on."""
        self.tokens += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)
        return self

    def finish(self, reward: float | None = None, status: Status | None = None) -> Trajectory:
        if reward is not None:
            self.reward = reward
        if status is not None:
            self.status = status
        return self

    def check(self) -> None:
        """The invariants the spool and the trainer rely on (an env's own code may break them)."""
        n = len(self.tokens)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise EnvError(
                f"trajectory arrays differ in length: tokens {n}, loss_mask {len(self.loss_mask)}, "
                f"logprobs {len(self.logprobs)}, versions {len(self.versions)}"
            )
        if not self.prompt_ids:
            raise EnvError("a trajectory needs its prompt ids")


class Context(Protocol):
    """What an environment may use: the policy, the tokenizer, its own settings."""

    row: PromptRow
    settings: Mapping[str, Any]
    evaluation: bool  # greedy scoring of the dataset, not training
    seed: int  # the episode's seed (its first generate call samples with it)
    sampling: Mapping[str, Any]  # the episode's sampling settings (rollout.*; greedy in evaluations)
    tokenizer: Any  # the model's tokenizer: its chat template and special tokens

    async def generate(
        self, token_ids: list[int], sampling: Mapping[str, Any] | None = None, media: bool = False
    ) -> Sampled:
        """Sample a continuation of `token_ids` (rollout.* sampling settings, overridden by
        `sampling`, e.g. {"max_new_tokens": 8, "stop": ...}); `media`: send the row's items with
        it (only valid while `token_ids` starts with the row's prompt)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Text as token ids, without special tokens (for observations)."""
        ...

    def decode(self, token_ids: list[int]) -> str: ...

    def trajectory(self) -> Trajectory:
        """A trajectory that starts from the row's prompt (its media attached)."""
        ...


EnvFn = Callable[[PromptRow, Context], Awaitable["Trajectory | list[Trajectory]"]]
