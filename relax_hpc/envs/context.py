"""Running episodes: the Context an environment gets, and the batcher behind its generate calls.

Every episode of a sampling round runs as an asyncio task. Their generate calls are collected
while the others run and sent together once every episode waits (`Batcher`): a single-turn round
is one batch, as before; multi-turn episodes batch turn by turn. What sends a batch is a
`Policy`: the rollout driver's engines over HTTP, or the in-process sampler.

Seeds: episode k of a batch gets the seed the batch plan gives its sample; its n-th generate
call samples with a seed derived from (that seed, n), so a restarted batch replays exactly.

Sessions: every call of an episode carries the episode's session key, which the engine policy
routes by (relax_hpc.rollout.routing): an episode's turns go to one engine while it lives, whose
prefix cache holds the conversation so far.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from relax_hpc.data.media import Kind
from relax_hpc.data.prompts import PromptRow
from relax_hpc.envs.base import EnvError, Sampled, Trajectory


@dataclass(slots=True)
class GenerateCall:
    """One generate request of one episode."""

    token_ids: list[int]
    sampling: dict[str, Any]  # SGLang sampling params, sampling_seed included
    media: list[tuple[Kind, bytes]] = field(default_factory=list)
    session: str | None = None  # the episode's key: its calls go to one engine while it lives


# Session keys of this process's episodes: unique within the driver, which is all routing needs.
_EPISODES = itertools.count()


class Policy(Protocol):
    """Sends a batch of generate calls (blocking; run in a worker thread) and returns, in order,
    what was sampled for each."""

    def generate(self, calls: Sequence[GenerateCall]) -> list[Sampled]: ...


def call_seed(episode_seed: int, call: int) -> int:
    """The sampling seed of an episode's n-th generate call (the first keeps the episode's own
    seed, so a single-turn episode samples exactly as the plan says)."""
    if call == 0:
        return episode_seed
    digest = hashlib.blake2b(f"{episode_seed}:{call}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class Batcher:
    """Collects the generate calls of concurrently running episodes and sends them as one batch
    as soon as no episode can make progress without an answer."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._pending: list[tuple[GenerateCall, asyncio.Future[Sampled]]] = []
        self._flush_scheduled = False

    async def generate(self, call: GenerateCall) -> Sampled:
        future: asyncio.Future[Sampled] = asyncio.get_running_loop().create_future()
        self._pending.append((call, future))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        # Let every runnable episode reach its next generate call before sending: ready tasks run
        # in FIFO order, so a few yields let a whole round of episodes queue their calls.
        for _ in range(3):
            await asyncio.sleep(0)
        batch, self._pending, self._flush_scheduled = self._pending, [], False
        try:
            results = await asyncio.to_thread(self.policy.generate, [call for call, _ in batch])
        except BaseException as e:  # noqa: BLE001  # handed to every waiting episode, which re-raises it
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)


class EpisodeContext:
    """The Context of one episode (relax_hpc.envs.base.Context)."""

    def __init__(
        self,
        row: PromptRow,
        prompt_ids: list[int],
        seed: int,
        batcher: Batcher,
        sampling: Mapping[str, Any],
        tokenizer: Any,
        settings: Mapping[str, Any],
        evaluation: bool = False,
    ) -> None:
        self.row, self.prompt_ids, self.seed = row, prompt_ids, seed
        self.batcher, self.sampling, self.tokenizer = batcher, dict(sampling), tokenizer
        self.settings, self.evaluation = settings, evaluation
        self.media = [(ref.kind, ref.read()) for ref in row.media]
        self.calls = 0
        self.session = f"episode-{next(_EPISODES)}"
        self.expanded_prompt: list[int] | None = None  # the first call's prompt, media expanded

    async def generate(
        self, token_ids: list[int], sampling: Mapping[str, Any] | None = None, media: bool = False
    ) -> Sampled:
        if media and token_ids[: len(self.prompt_ids)] != self.prompt_ids:
            raise EnvError("generate(media=True) needs token_ids that start with the row's prompt")
        params = {**self.sampling, **(sampling or {}), "sampling_seed": call_seed(self.seed, self.calls)}
        self.calls += 1
        call = GenerateCall(list(token_ids), params, self.media if media else [], self.session)
        out = await self.batcher.generate(call)
        if media and self.expanded_prompt is None and out.prompt_ids is not None:
            # The engine expanded the placeholders: the trainer gets the prompt it conditioned on.
            self.expanded_prompt = out.prompt_ids[: len(out.prompt_ids) - (len(token_ids) - len(self.prompt_ids))]
        return out

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    def decode(self, token_ids: list[int]) -> str:
        text: str = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return text

    def trajectory(self) -> Trajectory:
        return Trajectory(prompt_ids=list(self.prompt_ids), media=list(self.media))

    def finalize(self, trajectory: Trajectory) -> Trajectory:
        """The trajectory as the spool stores it: the prompt as the engine expanded it."""
        trajectory.check()
        if self.expanded_prompt is not None and trajectory.prompt_ids == self.prompt_ids:
            trajectory.prompt_ids = self.expanded_prompt
        return trajectory


async def run_episodes(
    env: Callable[[PromptRow, Any], Any], contexts: Sequence[EpisodeContext]
) -> list[list[Trajectory]]:
    """Run one episode per context concurrently; each returns its trajectories (one or more)."""

    async def one(ctx: EpisodeContext) -> list[Trajectory]:
        result = await env(ctx.row, ctx)
        trajectories = result if isinstance(result, list) else [result]
        if not trajectories or not all(isinstance(t, Trajectory) for t in trajectories):
            raise EnvError(f"an environment returned {result!r}, not a Trajectory or a list of them")
        return [ctx.finalize(t) for t in trajectories]

    return list(await asyncio.gather(*(one(ctx) for ctx in contexts)))
