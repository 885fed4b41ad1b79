"""relax_hpc.rollout.routing: a round's groups go whole to one engine, a session's calls to the
engine that answered it before, and no engine stays idle while a group could be halved."""

from __future__ import annotations

from relax_hpc.envs.context import GenerateCall
from relax_hpc.rollout.routing import Affinity, assign, group_units


def calls(*prompts: list[int], sessions: list[str] | None = None) -> list[GenerateCall]:
    keys = sessions or [f"s{i}" for i in range(len(prompts))]
    return [
        GenerateCall(list(p), {"sampling_seed": i}, [], key)
        for i, (p, key) in enumerate(zip(prompts, keys, strict=True))
    ]


A, B, C = [1, 2], [3, 4], [5, 6]


def test_a_rounds_groups_are_runs_of_the_same_prompt() -> None:
    assert group_units(calls(A, A, A, B, B, A)) == [[0, 1, 2], [3, 4], [5]]


def test_groups_go_whole_to_one_engine_the_largest_first_to_the_least_busy() -> None:
    round_ = calls(A, A, A, A, B, B, C, C)
    work = assign(round_, ["e0", "e1"], Affinity())
    assert work == {"e0": [0, 1, 2, 3], "e1": [4, 5, 6, 7]}
    for chunk in work.values():  # no group is cut
        assert len({tuple(round_[i].token_ids) for i in chunk}) == len(group_units([round_[i] for i in chunk]))


def test_fewer_groups_than_engines_are_halved_so_that_no_engine_idles() -> None:
    work = assign(calls(*[A] * 16), ["e0", "e1"], Affinity())
    assert sorted(len(chunk) for chunk in work.values()) == [8, 8]
    assert assign(calls(A), ["e0", "e1"], Affinity()) == {"e0": [0]}


def test_a_session_stays_on_the_engine_that_holds_it_while_that_engine_is_eligible() -> None:
    affinity = Affinity()
    affinity.hold(["s0", "s1", "s2"], "e1")
    turn = calls(A, B, C, sessions=["s0", "s1", "new"])
    assert assign(turn, ["e0", "e1"], affinity) == {"e0": [2], "e1": [0, 1]}  # not balanced: held
    moved = assign(turn, ["e0", "e2"], affinity)  # e1 died: its sessions go elsewhere
    assert sorted(i for chunk in moved.values() for i in chunk) == [0, 1, 2] and "e1" not in moved
    affinity.hold(["s0"], "e2")
    assert affinity.engine_of("s0") == "e2" and affinity.engine_of(None) is None


def test_the_oldest_sessions_are_forgotten_past_the_capacity() -> None:
    affinity = Affinity(capacity=2)
    affinity.hold(["a", "b"], "e0")
    affinity.hold(["a"], "e1")  # a is fresh again
    affinity.hold(["c"], "e0")
    assert (affinity.engine_of("a"), affinity.engine_of("b"), affinity.engine_of("c")) == ("e1", None, "e0")
