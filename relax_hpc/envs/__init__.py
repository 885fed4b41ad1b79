"""Environments: how one episode of a rollout goes (relax_hpc.envs.base has the interface).

`rollout.env.name` picks one: a built-in by name, or any `module:attribute` on the Python path:
an async function `(row, ctx) -> Trajectory | list[Trajectory]`, or a class whose constructor
takes the env's settings (`rollout.env.settings`, a mapping) and whose async `rollout(row, ctx)`
is that function.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from relax_hpc.config.references import BadReference, resolve_reference
from relax_hpc.envs.base import EnvError, EnvFn
from relax_hpc.envs.calculator import Calculator
from relax_hpc.envs.long_tail import LongTail
from relax_hpc.envs.single_turn import single_turn

BUILTIN: dict[str, Any] = {"single_turn": single_turn, "calculator": Calculator, "long_tail": LongTail}
# Built-ins of packages above this one, imported when named: `agent` runs an OpenAI-API agent
# through the gateway (relax_hpc.agents.env), which a run of another environment never imports.
BUILTIN_ELSEWHERE = {"agent": "relax_hpc.agents.env:AgentEnv"}


def resolve(name: str) -> Any:
    """The object `name` designates: a built-in, or `module:attribute` (imported)."""
    try:
        return resolve_reference(BUILTIN_ELSEWHERE.get(name, name), BUILTIN)
    except BadReference as e:
        raise EnvError(f"rollout.env.name {name!r}: {e}") from None


def load_env(name: str, settings: Mapping[str, Any]) -> EnvFn:
    """The episode function of the configured environment."""
    target: Any = resolve(name)
    if inspect.isclass(target):
        make: Callable[[dict[str, Any]], Any] = target
        instance = make(dict(settings))
        rollout = getattr(instance, "rollout", None)
        if rollout is None or not inspect.iscoroutinefunction(rollout):
            raise EnvError(f"rollout.env.name {name!r}: the class needs an async method rollout(row, ctx)")
        env: EnvFn = rollout
        return env
    if not inspect.iscoroutinefunction(target):
        raise EnvError(f"rollout.env.name {name!r}: an environment is an async function (row, ctx) or a class")
    if settings:
        raise EnvError(f"rollout.env.settings: {name} is a function and takes no settings")
    fn: EnvFn = target
    return fn
