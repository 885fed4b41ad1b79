"""Build the embedded default's assets: the tiny Qwen3 policy (after a format-only warm-up), its
character tokenizer, and the addition dataset.

    python tools/make_tiny_policy.py --out assets

writes assets/tiny-qwen3-addition/ (an HF folder: config.json, model.safetensors, tokenizer files)
and assets/addition.jsonl. Deterministic for a given --seed; takes a few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM

from relax_hpc.models.tiny import addition_problems, build_char_tokenizer, format_warmup, tiny_qwen3_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("assets"), help="folder that receives the assets")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init and the warm-up data")
    parser.add_argument("--warmup-steps", type=int, default=300, help="format-only warm-up steps (batch 64)")
    args = parser.parse_args()

    torch.set_num_threads(1)  # more threads than free cores makes tiny ops far slower, not faster
    torch.manual_seed(args.seed)
    tokenizer = build_char_tokenizer()
    model = Qwen3ForCausalLM(tiny_qwen3_config(tokenizer))
    start = time.perf_counter()
    loss = format_warmup(model, tokenizer, args.warmup_steps, args.seed)
    print(f"format warm-up: {args.warmup_steps} steps, final loss {loss:.3f}, {time.perf_counter() - start:.1f}s")

    policy_dir = args.out / "tiny-qwen3-addition"
    model.save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)
    with (args.out / "addition.jsonl").open("w") as f:
        for prompt, answer in addition_problems():
            f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
    print(f"wrote {policy_dir} and {args.out / 'addition.jsonl'}")


if __name__ == "__main__":
    main()
