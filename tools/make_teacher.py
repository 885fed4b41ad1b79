"""Build the distillation teacher of the embedded default: the tiny policy after supervised
training on correct sums.

    python tools/make_teacher.py --policy assets/tiny-qwen3-addition --out assets/tiny-qwen3-addition-teacher

Deterministic for a given --seed; about 10 s on a CPU. configs/tiny-distill.yaml uses it. The
teacher is only partly trained (150 steps, loss about 0.26): of the three teachers tried, it
taught the student fastest (docs/algorithms.md, "How it is tested").
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from relax_hpc.models.tiny import teach_addition


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", type=Path, default=Path("assets/tiny-qwen3-addition"), help="starting model")
    parser.add_argument("--out", type=Path, default=Path("assets/tiny-qwen3-addition-teacher"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=150, help="supervised steps (batch 64)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.policy)
    model = Qwen3ForCausalLM.from_pretrained(args.policy)
    start = time.perf_counter()
    loss = teach_addition(model, tokenizer, args.steps, args.seed)
    print(f"teacher: {args.steps} steps, final loss {loss:.3f}, {time.perf_counter() - start:.1f}s")
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
