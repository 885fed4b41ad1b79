"""Dynamic sampling and reward shaping in BatchPlan, with stand-in sampling rounds."""

import asyncio
from pathlib import Path

from relax_hpc.config import load_config
from relax_hpc.data.prompts import load_prompts
from relax_hpc.envs.base import Trajectory
from relax_hpc.rollout.plan import BatchPlan, Group

REPO = Path(__file__).resolve().parents[2]


def plan(*overrides):
    cfg = load_config(REPO / "configs" / "tiny-grpo.yaml", ["rollout.prompts_per_step=3", *overrides], base_dir=REPO)
    return BatchPlan(cfg, load_prompts(cfg.data.path, "prompt", "answer"))


def rounds_with(rewards_per_round):
    """A sampling function whose round r returns groups with the given rewards, and the rounds asked."""
    asked = []

    async def sample_round(r):
        asked.append(r)
        groups = []
        for j, rewards in enumerate(rewards_per_round[r]):
            trajectories = [Trajectory([1], [2], [1], [0.0], [0]) for _ in rewards]
            groups.append(Group(10 * r + j, j, trajectories, rewards))
        return groups

    return sample_round, asked


def select(p, sample_round):
    return asyncio.run(p.select(sample_round))


def test_without_dynamic_sampling_the_first_round_is_the_batch():
    sample_round, asked = rounds_with([[[1, 1], [0, 0], [0, 1]]])
    sel = select(plan(), sample_round)
    assert asked == [0] and [g.group_id for g in sel.groups] == [0, 1, 2] and sel.dropped == 0


def test_uninformative_groups_are_replaced_from_later_rounds():
    sample_round, asked = rounds_with([[[1, 1], [0, 1], [0, 0]], [[0, 0], [1, 0], [1, 0]]])
    sel = select(plan("algo.dynamic_sampling.enabled=true"), sample_round)
    assert asked == [0, 1]
    assert [g.group_id for g in sel.groups] == [1, 11, 12]  # round 0's informative one, then round 1's
    assert (sel.rounds, sel.dropped, sel.topped_up) == (2, 3, 0)


def test_the_sampled_reward_is_the_first_rounds_before_any_group_is_dropped():
    sample_round, _ = rounds_with([[[1, 1], [0, 1], [1, 1]], [[0, 0], [1, 0], [1, 0]]])
    sel = select(plan("algo.dynamic_sampling.enabled=true"), sample_round)
    kept = [r for g in sel.groups for r in g.rewards]
    assert sel.sampled_reward == 5 / 6 and sum(kept) / len(kept) == 0.5  # the kept groups' mean is not the policy's
    sample_round, _ = rounds_with([[[1, 1], [0, 1], [0, 0]]])
    assert select(plan(), sample_round).sampled_reward == 0.5


def test_a_batch_still_short_after_max_rounds_is_topped_up_with_dropped_groups():
    sample_round, asked = rounds_with([[[1, 1], [0, 1], [0, 0]], [[0, 0], [0, 0], [1, 1]]])
    sel = select(plan("algo.dynamic_sampling.enabled=true", "algo.dynamic_sampling.max_rounds=2"), sample_round)
    assert asked == [0, 1] and len(sel.groups) == 3
    assert [g.group_id for g in sel.groups] == [1, 0, 2]  # the informative group, then the first dropped
    assert (sel.dropped, sel.topped_up) == (5, 2)


def test_rounds_are_a_pure_function_of_the_batch_and_round():
    p = plan("algo.dynamic_sampling.enabled=true")
    assert p.prompts(7, 0) == plan().prompts(7, 0)  # round 0 is the batch's own prompts
    assert p.prompts(7, 1) == p.prompts(7, 1) and p.prompts(7, 1) != p.prompts(7, 2)
    ids = {p.group_id(s, r, j) for s in range(4) for r in range(3) for j in range(3)}
    assert len(ids) == 4 * 3 * 3  # unique across batches, rounds and prompts


def test_a_groups_seeds_run_on_from_its_first_and_no_two_samples_share_one():
    """What lets a group be one request with n samples (vLLM seeds sample i with seed + i)."""
    p = plan("algo.dynamic_sampling.enabled=true")
    g = p.cfg.rollout.group_size
    seeds = p.seeds(5, 1, 3 * g)
    for j in range(3):
        group = seeds[j * g : (j + 1) * g]
        assert group == list(range(group[0], group[0] + g))
    everything = [s for seq in range(4) for r in range(3) for s in p.seeds(seq, r, 3 * g)]
    assert len(set(everything)) == len(everything)  # across batches, rounds and groups
    assert p.seeds(5, 1, 3 * g) == seeds and all(0 <= s < 2**63 for s in everything)


def test_overlong_completions_lose_reward_linearly_in_the_buffer():
    p = plan("algo.overlong.buffer=2", "algo.overlong.penalty=0.5")  # limit 4 tokens: penalty from 3

    def sampled(n: int, observed: int = 0) -> Trajectory:
        t = Trajectory([1], [2] * n, [1] * n, [0.0] * n, [0] * n)
        return t.add_observation([3] * observed)

    assert [p.shaped(1.0, sampled(n)) for n in (1, 2, 3, 4)] == [1.0, 1.0, 0.75, 0.5]
    assert p.shaped(0.0, sampled(4)) == -0.5
    assert p.shaped(1.0, sampled(2, observed=5)) == 1.0  # environment tokens are not the model's length
