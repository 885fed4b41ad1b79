"""Which engine answers which calls: a group's calls to one engine, a session's to the engine
that answered it before.

Groups. A round's calls come prompt-major: a GRPO group is a run of consecutive calls with the
same prompt and media, differing only in their seeds. On one engine, in one request, the engine
reads the prompt once (vLLM: one request with n = group size; SGLang: its radix cache; the
built-in engine: the shared prefill of relax_hpc.engines.sampling). So a round is cut into units,
each a group or a lone call, and a unit is not split across engines but in one case: when a round
has fewer units than engines, its largest units are halved until every engine has work (one
prompt of 16 samples on 2 engines: 8 each), because an idle engine costs more than a second
prefill. A long tail is not split: partial rollout's continuations go wherever is free.

Sessions. Every call of an episode carries its key (relax_hpc.envs.context). The engine that
answers a session's call holds the session, since its prefix cache has the conversation so far;
the session's later calls go there while that engine is eligible. When it dies (or lags behind
the version a batch needs), the session moves to whichever engine answers next.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from relax_hpc.envs.context import GenerateCall


def group_units(calls: Sequence[GenerateCall]) -> list[list[int]]:
    """Runs of consecutive calls with the same prompt and media: the groups of a round."""
    units: list[list[int]] = []
    for i, call in enumerate(calls):
        if units and _same_prompt(calls[units[-1][0]], call):
            units[-1].append(i)
        else:
            units.append([i])
    return units


def _same_prompt(a: GenerateCall, b: GenerateCall) -> bool:
    return a.token_ids == b.token_ids and a.media == b.media


class Affinity:
    """Session key -> the engine (instance) that holds it. The oldest keys are forgotten past
    `capacity`: a driver has far fewer episodes running than that."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._engine: OrderedDict[str, str] = OrderedDict()

    def engine_of(self, session: str | None) -> str | None:
        return None if session is None else self._engine.get(session)

    def hold(self, sessions: Sequence[str | None], engine: str) -> None:
        for session in sessions:
            if session is None:
                continue
            self._engine[session] = engine
            self._engine.move_to_end(session)
        while len(self._engine) > self.capacity:
            self._engine.popitem(last=False)


def assign(calls: Sequence[GenerateCall], engines: Sequence[str], affinity: Affinity) -> dict[str, list[int]]:
    """The calls each engine gets (indices into `calls`, in order), keyed by engine instance: a
    unit whose session an eligible engine holds goes there; the others, largest first, to the
    engine with the fewest calls so far."""
    work: dict[str, list[int]] = {engine: [] for engine in engines}
    free: list[list[int]] = []
    for unit in group_units(calls):
        held = next((e for i in unit if (e := affinity.engine_of(calls[i].session)) in work), None)
        if held is None:
            free.append(unit)
        else:
            work[held] += unit
    idle = sum(1 for indices in work.values() if not indices)
    for unit in sorted(_halved(free, idle), key=len, reverse=True):
        min(work.values(), key=len).extend(unit)
    return {engine: sorted(indices) for engine, indices in work.items() if indices}


def _halved(units: list[list[int]], engines: int) -> list[list[int]]:
    """`units`, the largest halved until there are at least `engines` of them (or none can be)."""
    units = list(units)
    while len(units) < engines:
        largest = max(units, key=len, default=[])
        if len(largest) < 2:
            break
        units.remove(largest)
        half = len(largest) // 2
        units += [largest[:half], largest[half:]]
    return units
