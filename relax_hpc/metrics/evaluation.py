"""The figures of an evaluation job (kind=eval) and its record: RUN_DIR/eval/results.jsonl, one
record per model x dataset, and RUN_DIR/eval/table.md, one table per dataset, made from it.

Greedy accuracy is the mean reward of one greedy completion per prompt; with k > 1 samples per
prompt besides, mean@k is the mean reward over every sample, and pass@j the chance that at least
one of j samples drawn from a prompt's k solves it, by the unbiased estimator of Chen et al. 2021
(Evaluating Large Language Models Trained on Code, eq. 1), averaged over the prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb
from typing import Any

from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.paths import RunPaths


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def budgets(k: int) -> list[int]:
    """The sample budgets pass@j is reported at: every power of two below k, and k."""
    return sorted({2**i for i in range(k.bit_length()) if 2**i < k} | {k})


def figures(greedy: Sequence[float], samples: Sequence[Sequence[float]], threshold: float) -> dict[str, Any]:
    """A dataset's figures: greedy accuracy from each prompt's greedy reward, and from its k > 1
    sampled rewards (none when k = 1) mean@k, pass@k and pass@j at the smaller budgets (a reward
    >= threshold solves the prompt)."""
    out: dict[str, Any] = {"greedy_accuracy": sum(greedy) / len(greedy)}
    if not samples:
        return out
    k, problems = len(samples[0]), len(samples)
    solved = [sum(x >= threshold for x in r) for r in samples]
    pass_at = {str(j): sum(pass_at_k(k, c, j) for c in solved) / problems for j in budgets(k)}
    mean = sum(map(sum, samples)) / (problems * k)
    return {**out, "mean_at_k": mean, "pass_at_k": pass_at[str(k)], "pass_at": pass_at}


def finished(paths: RunPaths) -> set[tuple[str, str]]:
    """The (model, dataset) pairs results.jsonl already holds."""
    return {(r["model"], r["dataset"]) for r in read_jsonl(paths.eval_results)}


def table(records: list[dict[str, Any]]) -> str:
    """Markdown, one table per dataset (in the records' order), one row per model."""
    out = []
    for dataset in dict.fromkeys(r["dataset"] for r in records):
        rows = [r for r in records if r["dataset"] == dataset]
        k = rows[0]["k"]
        head = ["greedy accuracy"] + ([f"mean@{k}", f"pass@{k}"] if k > 1 else [])
        out += [f"## {dataset} ({rows[0]['problems']} problems, k={k})", ""]
        out += ["| model | " + " | ".join(head) + " | samples | seconds |", "|---|" + "---:|" * (len(head) + 2)]
        for r in rows:
            values = [r["greedy_accuracy"]] + ([r["mean_at_k"], r["pass_at_k"]] if k > 1 else [])
            cells = [f"{v:.3f}" for v in values] + [str(r["samples"]), f"{r['seconds']:.1f}"]
            out.append(f"| {r['model']} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)
