"""The format warm-up's result against a baseline model, in the same run: what RL starts from.

    python tools/bench/format_warmup.py --model /tmp/assets/tiny-qwen3-addition [--baseline assets/tiny-qwen3-addition]

For each of the embedded default's 100 problems, `--samples` completions at temperature 1 (at
most 4 new tokens, as the default recipe samples): the share in the answer format (one or two
digits, then EOS), the share correct (the reward RL starts at; chance is about 1/19), the entropy
of the answers in bits (uniform over 0..18: log2 19 = 4.25) and greedy accuracy. Prints one JSON
object per model. The baseline defaults to the shipped asset (built by the former in-process
warm-up), so a rebuilt model (tools/make_tiny_policy.py, now an SFT run) can be compared with it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from relax_hpc.models.tiny import addition_problems

ANSWER = re.compile(r"\d{1,2}")


def measure(folder: Path, samples: int, seed: int) -> dict[str, float | str]:
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    problems = addition_problems()
    prompts = torch.tensor([tok.encode(p) for p, _ in problems])  # every prompt is 4 characters
    torch.manual_seed(seed)
    with torch.no_grad():
        kw = {"max_new_tokens": 4, "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}
        sampled = model.generate(prompts.repeat_interleave(samples, 0), do_sample=True, top_k=0, **kw)
        greedy = model.generate(prompts, do_sample=False, **kw)
    answers = [_answer(tok, row[4:].tolist()) for row in sampled]
    truth = [a for _, a in problems for _ in range(samples)]
    formatted = [a for a in answers if a is not None]
    counts = Counter(formatted)
    entropy = -sum(c / len(formatted) * math.log2(c / len(formatted)) for c in counts.values()) if formatted else 0.0
    greedy_answers = [_answer(tok, row[4:].tolist()) for row in greedy]
    return {
        "model": str(folder),
        "format_rate": len(formatted) / len(answers),
        "sampled_accuracy": sum(a == t for a, t in zip(answers, truth, strict=True)) / len(answers),
        "answer_entropy_bits": entropy,
        "greedy_accuracy": sum(a == t for a, (_, t) in zip(greedy_answers, problems, strict=True)) / len(problems),
    }


def _answer(tok: PreTrainedTokenizerBase, ids: list[int]) -> str | None:
    """The answer if the completion is in the format (digits, then EOS), else None."""
    if tok.eos_token_id not in ids:
        return None
    text = str(tok.decode(ids[: ids.index(tok.eos_token_id)]))
    return text if ANSWER.fullmatch(text) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the warm-up's result (an HF folder)")
    parser.add_argument("--baseline", type=Path, default=Path("assets/tiny-qwen3-addition"))
    parser.add_argument("--samples", type=int, default=64, help="completions per problem")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for folder in (args.baseline, args.model):
        print(json.dumps(measure(folder, args.samples, args.seed)))


if __name__ == "__main__":
    main()
