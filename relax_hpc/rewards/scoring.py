"""Scoring trajectories with the configured reward, and what happens when a reward fails.

`reward.name` picks the function: a built-in (`exact_match`, `boxed_match`, `remote`, `judge`)
or any `module:function` on the Python path. A function gets one `RewardInput` (or, with
`reward.batched`, the list of a whole sampling round) and `reward.settings` as keyword
arguments, and returns a number (a list of numbers when batched); it may be sync or async.

A reward that raises, times out (`reward.timeout_s`; a sync function's calls of a round run one
after another in a worker thread and share the limit: write an async function for a reward that
may hang) or returns something other than a finite number fails *that sample*: it is left out of
the batch, counted (`reward_failed` in rollout.jsonl) and written with the reason to
RUN_DIR/metrics/reward_failures.jsonl; the run goes on unless more than
`reward.max_failed_share` of a round fails, which stops the driver with the first failure's reason.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relax_hpc.config.references import BadReference, resolve_reference
from relax_hpc.data.prompts import PromptRow


class RewardError(RuntimeError):
    """The reward is unusable as configured, or failed for too many samples to go on."""


@dataclass(frozen=True, slots=True)
class RewardInput:
    """What a reward function sees of one sample."""

    response: str  # the text to score (a trajectory's `response`: its last sampled text by default)
    answer: str  # the row's reference answer
    row: PromptRow  # the whole row: prompt, media, every other field (row.fields)
    metrics: Mapping[str, float]  # the trajectory's own metrics (turns, tool calls, ...)


@dataclass(frozen=True, slots=True)
class Scored:
    """A reward, or why there is none."""

    reward: float | None
    error: str | None = None


RewardFn = Callable[..., Any]


def resolve_function(name: str, builtins: Mapping[str, RewardFn]) -> RewardFn:
    try:
        fn: RewardFn = resolve_reference(name, builtins, "function")
    except BadReference as e:
        raise RewardError(f"reward.name {name!r}: {e}") from None
    return fn


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"returned {value!r}, not a finite number")
    return float(value)


def _describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "timed out"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class Scorer:
    """Calls the reward function with its settings, a timeout, and the failure rules."""

    def __init__(self, fn: RewardFn, settings: Mapping[str, Any], batched: bool, timeout_s: float) -> None:
        self.fn, self.settings, self.batched, self.timeout_s = fn, dict(settings), batched, timeout_s

    @property
    def is_async(self) -> bool:
        # A function, or an instance whose class defines an async __call__ (RemoteReward).
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(type(self.fn).__call__)

    async def _call(self, arg: Any) -> Any:
        if self.is_async:
            return await asyncio.wait_for(self.fn(arg, **self.settings), self.timeout_s)
        return await asyncio.wait_for(asyncio.to_thread(self.fn, arg, **self.settings), self.timeout_s)

    async def score(self, inputs: Sequence[RewardInput]) -> list[Scored]:
        if not inputs:
            return []
        if not self.batched and not self.is_async:
            # One worker thread for the whole round, the calls one after another (a thread per call
            # costs more than a cheap reward): reward.timeout_s bounds the round's calls together.
            try:
                return await asyncio.wait_for(asyncio.to_thread(self._sync_round, inputs), self.timeout_s)
            except TimeoutError:
                return [Scored(None, f"the round's sync reward calls took over {self.timeout_s:.0f}s")] * len(inputs)
        if self.batched:
            try:
                values = await self._call(list(inputs))
                if not isinstance(values, list | tuple) or len(values) != len(inputs):
                    raise TypeError(f"a batched reward returned {type(values).__name__}, not {len(inputs)} numbers")
            except Exception as e:  # noqa: BLE001  # any failure of the user's function fails its samples
                return [Scored(None, _describe(e))] * len(inputs)
            return [self._checked(v) for v in values]
        return list(await asyncio.gather(*(self._one(i) for i in inputs)))

    def _sync_round(self, inputs: Sequence[RewardInput]) -> list[Scored]:
        out = []
        for item in inputs:
            try:
                out.append(self._checked(self.fn(item, **self.settings)))
            except Exception as e:  # noqa: BLE001  # any failure of the user's function fails the sample
                out.append(Scored(None, _describe(e)))
        return out

    async def _one(self, item: RewardInput) -> Scored:
        try:
            return self._checked(await self._call(item))
        except Exception as e:  # noqa: BLE001  # any failure of the user's function fails the sample
            return Scored(None, _describe(e))

    @staticmethod
    def _checked(value: Any) -> Scored:
        if isinstance(value, BaseException):  # a batched reward's failure of one sample
            return Scored(None, _describe(value))
        try:
            return Scored(_number(value))
        except TypeError as e:
            return Scored(None, str(e))


def text_reward(fn: Callable[[str, str], float]) -> Callable[[RewardInput], float]:
    """A (response, answer) -> float function as a reward function."""

    def reward(item: RewardInput) -> float:
        return fn(item.response, item.answer)

    reward.__name__ = getattr(fn, "__name__", "reward")
    return reward


AsyncReward = Callable[[RewardInput], Awaitable[float]]
