"""The `agent` environment (`rollout.env.name: agent`): each episode runs an agent written against
OpenAI's API, pointed at the run's gateway (relax_hpc.agents.gateway).

    rollout:
      env:
        name: agent
        settings:
          agent: my_package.my_agent:solve   # async (base_url, api_key, row) -> float | None
          parser: hermes                     # tool calls in the sampled text (relax_hpc.agents.toolcalls)

The agent is an async callable run in the driver: it gets the gateway's base URL, the episode's
key and the task row (as read from data.path), talks to the policy through any OpenAI client, and
returns a reward, or None to have `reward.name` score its last answer. Every segment of its
conversation is a trajectory of the prompt's group (relax_hpc.agents.transcript).

An agent that raises, exceeds `timeout_s` or `max_requests`, or whose requests the gateway refuses
ends its own episode as failed (reward 0, the cause counted in the trajectory's metrics); the run
goes on. Settings: `agent` (required), `parser` (`hermes`), `model` (the name the gateway answers
to, `policy`), `timeout_s` (300), `max_requests` (32).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from relax_hpc.agents.gateway import Gateway, Session
from relax_hpc.agents.toolcalls import PARSERS, parser
from relax_hpc.config.references import BadReference, resolve_reference
from relax_hpc.data.prompts import PromptRow
from relax_hpc.envs.base import Context, EnvError, Trajectory

log = logging.getLogger(__name__)

AgentFn = Callable[[str, str, dict[str, Any]], Awaitable[float | None]]


@dataclass(frozen=True)
class AgentSettings:
    agent: str
    parser: str = "hermes"
    model: str = "policy"
    timeout_s: float = 300.0
    max_requests: int = 32

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> AgentSettings:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise EnvError(f"rollout.env.settings: unknown agent settings {unknown}; known: {sorted(names)}")
        if "agent" not in settings:
            raise EnvError("rollout.env.settings.agent is required: the agent, module:function")
        if settings.get("parser", "hermes") not in PARSERS:
            raise EnvError(f"rollout.env.settings.parser: one of {', '.join(PARSERS)}, not {settings['parser']!r}")
        return cls(**settings)


class AgentEnv:
    """The environment (relax_hpc.envs); settings as in the module's docstring."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = AgentSettings.of(settings)
        try:
            agent = resolve_reference(self.settings.agent, {}, "function")
        except BadReference as e:
            raise EnvError(f"rollout.env.settings.agent {self.settings.agent!r}: {e}") from None
        if not inspect.iscoroutinefunction(agent):
            raise EnvError(
                f"rollout.env.settings.agent {self.settings.agent!r}: an async function (base_url, key, row)"
            )
        self.agent: AgentFn = agent
        self.parser = parser(self.settings.parser)
        self.gateway: Gateway | None = None

    async def rollout(self, row: PromptRow, ctx: Context) -> list[Trajectory]:
        gateway = await self._gateway(ctx)
        session, key = gateway.open(ctx, self.settings.max_requests)
        reward, cause = None, None
        try:
            reward = await asyncio.wait_for(
                self.agent(gateway.base_url, key, dict(row.fields)), self.settings.timeout_s
            )
        except TimeoutError:
            cause = "timeout"
        except Exception as e:  # noqa: BLE001  # the agent's own failure ends its episode, not the run
            cause = "error"
            log.warning("agent %s failed on row %d: %s: %s", self.settings.agent, row.index, type(e).__name__, e)
        finally:
            gateway.close(session)
        if cause is None and session.refused:
            cause = "refused"
        return self._trajectories(session, ctx, reward, cause)

    def _trajectories(
        self, session: Session, ctx: Context, reward: float | None, cause: str | None
    ) -> list[Trajectory]:
        segments = session.transcript.segments or [self._nothing(ctx)]
        counts = {"agent_requests": float(session.requests), "agent_segments": float(len(session.transcript.segments)),
                  "agent_parse_failures": float(session.parse_failures)}  # fmt: skip
        for trajectory in segments:
            trajectory.metrics.update(counts)
            if cause is not None:
                trajectory.finish(reward=0.0, status="failed")
                trajectory.metrics[f"agent_failed_{cause}"] = 1.0
            elif reward is not None:
                trajectory.finish(reward=float(reward))
        return segments

    @staticmethod
    def _nothing(ctx: Context) -> Trajectory:
        """An episode that sampled nothing (its agent failed first): the prompt and the end-of-text
        token as an observation, so that its group keeps its size and its reward of 0 counts."""
        return ctx.trajectory().add_observation([int(ctx.tokenizer.eos_token_id)])

    async def _gateway(self, ctx: Context) -> Gateway:
        if self.gateway is None:
            tokenizer = ctx.tokenizer
            if getattr(tokenizer, "chat_template", None) is None:
                raise EnvError("the agent environment renders conversations with the model's chat template, and the "
                               "model's tokenizer has none")  # fmt: skip
            self.gateway = Gateway(tokenizer, self.parser, self.settings.model)
        await self.gateway.start()
        return self.gateway
