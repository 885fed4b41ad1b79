"""The objective on CUDA tensors computes what it computes on the CPU: advantages, loss, gradient
and statistics of every estimator, loss, aggregation and correction, and the trainer's
mini-batch split. Catches tensors created on the wrong device before a GPU backend meets them.
Run on the GPU machine: `python -m pytest tests/gpu -m gpu`."""

from typing import Any

import pytest
import torch

from relax_hpc.algos.aggregation import Normalizer, local_counts
from relax_hpc.algos.objective import Objective
from relax_hpc.config.schema import JobConfig
from relax_hpc.trainer.batching import pad_samples

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CONFIGS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "dr-grpo": {"advantage": {"normalize_std": False}, "policy_loss": {"aggregation": "seq_mean_token_sum_norm"}},
    "rloo": {"advantage": {"estimator": "rloo"}, "policy_loss": {"kind": "reinforce"}},
    "reinforce-pp": {
        "advantage": {"estimator": "reinforce_pp"},
        "kl": {"coef": 0.1, "estimator": "k1", "placement": "reward"},
    },
    "reinforce-pp-baseline": {
        "advantage": {"estimator": "reinforce_pp_baseline"},
        "kl": {"coef": 0.1, "estimator": "k2"},
    },
    "gae": {"advantage": {"estimator": "gae", "lam": 0.9, "gamma": 0.99}},
    "distill": {"advantage": {"estimator": "distill"}, "teacher": {"path": "/unused"}},
    "dual-clip": {"policy_loss": {"dual_clip": 3.0, "clip_high": 0.28, "aggregation": "seq_mean_token_mean"}},
    "gspo": {"policy_loss": {"kind": "gspo", "clip_low": 3e-4, "clip_high": 4e-4}},
    "sapo": {"policy_loss": {"kind": "sapo"}, "kl": {"coef": 0.05}},
    "cispo": {"policy_loss": {"kind": "cispo", "clip_low": 1.0, "clip_high": 0.5, "aggregation": "seq_mean_token_sum"}},
    "m2po": {"policy_loss": {"kind": "m2po", "m2po_tau": 0.01}},
    "tis": {"off_policy": {"old_logprobs": "recompute", "correction": "tis", "is_cap": 1.2}},
    "icepop": {
        "off_policy": {"old_logprobs": "recompute", "correction": "icepop", "icepop_low": 0.8, "icepop_high": 1.25}
    },
    "decoupled": {"off_policy": {"old_logprobs": "recompute", "correction": "decoupled", "is_cap": 1.5}},
    "gmpo-seq-mis": {
        "policy_loss": {"kind": "gmpo", "clip_low": 0.4, "clip_high": 0.4, "aggregation": "token_sum"},
        "off_policy": {"old_logprobs": "recompute", "correction": "seq_mis", "icepop_low": 0.1, "icepop_high": 10.0},
    },
    "remax-seq-tis": {
        "advantage": {"estimator": "remax"},
        "off_policy": {"old_logprobs": "recompute", "correction": "seq_tis"},
        "kl": {"coef": 0.1, "estimator": "k3_grad_k2"},
    },
}


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n, t = 12, 7
    mask = (torch.rand(n, t, generator=g) > 0.25).float()
    mask[3] = 0  # an empty completion
    return {
        "mask": mask,
        "rewards": torch.randint(0, 2, (n,), generator=g).float(),
        "group_ids": torch.arange(n) // 4,
        "logprobs": -torch.rand(n, t, generator=g) * 2,
        "old": -torch.rand(n, t, generator=g) * 2,
        "rollout": -torch.rand(n, t, generator=g) * 2,
        "ref": -torch.rand(n, t, generator=g) * 2,
        "teacher": -torch.rand(n, t, generator=g) * 2,
        "entropy": torch.rand(n, t, generator=g),
        "values": torch.randn(n, t, generator=g),
        "baselines": torch.where(torch.arange(n) % 5 == 0, torch.nan, torch.rand(n, generator=g)),
        "new_values": torch.randn(n, t, generator=g),
    }


def evaluate(cfg: dict, device: str) -> dict:
    x = {k: v.to(device) for k, v in inputs().items()}
    # A plain policy gradient has no ratio to correct stale samples with: on-policy (the config refuses it otherwise).
    staleness = 0 if cfg.get("policy_loss", {}).get("kind") == "reinforce" else 1
    job = JobConfig.model_validate({"algo": cfg, "rollout": {"max_new_tokens": 7, "max_staleness": staleness}})
    objective = Objective(job.algo)
    tokens, seqs = local_counts(x["mask"])
    norm = Normalizer(tokens, seqs)
    adv = objective.advantages(
        x["rewards"], x["group_ids"], x["mask"], x["old"], x["ref"], x["teacher"], x["values"], x["baselines"]
    )
    logprobs = x["logprobs"].clone().requires_grad_(True)
    loss, stats = objective.policy_loss(
        logprobs, x["entropy"], x["old"], x["rollout"], adv.advantages, x["mask"], norm, x["ref"]
    )
    loss.backward()
    out = {"advantages": adv.advantages, "loss": loss.detach(), "grad": logprobs.grad, **stats.sums}
    out.update({f"{k}_max": v for k, v in stats.maxes.items()})
    if adv.returns is not None:
        values = x["new_values"].clone().requires_grad_(True)
        critic_loss, _ = objective.critic_loss(values, x["values"], adv.returns, x["mask"], norm)
        critic_loss.backward()
        out.update(returns=adv.returns, critic_loss=critic_loss.detach(), critic_grad=values.grad)
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else torch.tensor(v)) for k, v in out.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_matches_cpu(name):
    cpu, cuda = evaluate(CONFIGS[name], "cpu"), evaluate(CONFIGS[name], "cuda")
    assert cpu.keys() == cuda.keys()
    for key in cpu:
        torch.testing.assert_close(cuda[key].double(), cpu[key].double(), rtol=1e-5, atol=1e-6, msg=key)
    assert cpu["grad"].abs().sum() > 0  # a real gradient was compared


def test_minibatch_split_on_cuda():
    batch = pad_samples([[5, 6, 7]] * 6, [[0, 1, 1]] * 6, [[0.0] * 3] * 6, [0.0] * 6, [3, 3, 9, 9, 1, 1], 0)
    parts = batch.to(torch.device("cuda")).minibatches(2)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5]]
    assert batch.to(torch.device("cuda")).select(parts[1]).group_ids.tolist() == [1, 1]
