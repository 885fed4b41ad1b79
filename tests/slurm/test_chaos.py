"""Chaos, the short schedule: one run on the test cluster takes three faults, drawn by the commit
from a cycle that covers all 11 kinds in any 4 consecutive commits (tests/slurm/chaos_cycle.py;
the full schedule is tools/bench/chaos.py), and stays exact: every step once, every prompt of the
data order trained once and none skipped, checkpoints monotone, every process superseded by a
restart ends once it is continued and wrote nothing after its successor started, and only
superseded processes had writes refused."""

from __future__ import annotations

import pytest

from tests.slurm.chaos import FAULTS, RESTART_THE_RUN, run_schedule, schedule, total_steps, verify
from tests.slurm.chaos_cycle import WHOLE_RUN, ci_kinds, commit_seed

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SEED = 23  # the schedule's own test


def test_the_schedule_is_a_pure_function_of_its_seed_and_has_every_kind():
    kinds = sorted(FAULTS)
    assert schedule(SEED, 14, kinds) == schedule(SEED, 14, kinds) != schedule(SEED + 1, 14, kinds)
    assert set(schedule(SEED, 14, kinds)) == set(kinds) and len(schedule(SEED, 14, kinds)) == 14


def test_any_four_consecutive_ci_draws_cover_every_kind_with_one_whole_run_restart_each():
    assert set(WHOLE_RUN) <= RESTART_THE_RUN
    for first in range(40):
        draws = [ci_kinds(seed) for seed in range(first, first + 4)]
        assert {kind for draw in draws for kind in draw} == set(FAULTS)
        assert all(len(draw) == 3 and sum(kind in WHOLE_RUN for kind in draw) <= 1 for draw in draws)


def test_a_seeded_schedule_of_faults_leaves_the_run_exact(slurm_cluster, tmp_path):
    """The draw of this commit (pytest's header prints it; $RELAX_CHAOS_SEED replays another)."""
    seed = commit_seed()
    faults = ci_kinds(seed)
    chaos = run_schedule(tmp_path / "run", seed, faults, nodes=len(slurm_cluster.nodes))
    counts = verify(chaos)
    assert [f["kind"] for f in chaos.faults] == faults and chaos.injected == len(faults), seed
    assert all(f["recovered"] for f in chaos.faults), chaos.faults
    assert counts["steps"] == total_steps(faults)
    hangs = sum(kind.startswith("SIGSTOP") for kind in faults)
    assert len(counts["superseded_ended_s"]) == len(chaos.superseded) == hangs  # each continued one ended
