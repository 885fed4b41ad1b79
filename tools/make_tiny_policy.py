"""Build the embedded text defaults' assets: tiny Qwen3 policies (after a format-only warm-up)
with their character tokenizer, and their datasets.

    python tools/make_tiny_policy.py --out assets

writes assets/tiny-qwen3-addition/ (an HF folder: config.json, model.safetensors, tokenizer files)
and assets/addition.jsonl (the embedded default), and assets/tiny-qwen3-calculator/ and
assets/calculator.jsonl (the calculator tool-use task, relax_hpc.envs.calculator).
`--task` builds one of the two. Deterministic for a given --seed on a given torch build (another
build rounds differently: a rebuilt addition model differs from the shipped one in the last bits).
Takes under a minute on a CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from relax_hpc.envs.calculator import write_task
from relax_hpc.models.tiny import (
    addition_problems,
    build_char_tokenizer,
    format_warmup,
    tiny_qwen3_config,
    tool_warmup,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("assets"), help="folder that receives the assets")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init and the warm-up data")
    parser.add_argument("--warmup-steps", type=int, default=300, help="format-only warm-up steps (batch 64)")
    parser.add_argument("--tool-warmup-steps", type=int, default=600, help="the calculator model's warm-up steps")
    parser.add_argument("--task", choices=("addition", "calculator", "both"), default="both")
    args = parser.parse_args()

    torch.set_num_threads(1)  # more threads than free cores makes tiny ops far slower, not faster
    tokenizer = build_char_tokenizer()
    if args.task in ("addition", "both"):
        torch.manual_seed(args.seed)
        model = Qwen3ForCausalLM(tiny_qwen3_config(tokenizer))
        start = time.perf_counter()
        loss = format_warmup(model, tokenizer, args.warmup_steps, args.seed)
        print(f"format warm-up: {args.warmup_steps} steps, final loss {loss:.3f}, {time.perf_counter() - start:.1f}s")
        save(model, tokenizer, args.out / "tiny-qwen3-addition")
        with (args.out / "addition.jsonl").open("w") as f:
            for prompt, answer in addition_problems():
                f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
        print(f"wrote {args.out / 'tiny-qwen3-addition'} and {args.out / 'addition.jsonl'}")
    if args.task in ("calculator", "both"):
        torch.manual_seed(args.seed)
        model = Qwen3ForCausalLM(tiny_qwen3_config(tokenizer))
        loss = tool_warmup(model, tokenizer, args.tool_warmup_steps, args.seed)
        print(f"calculator warm-up: {args.tool_warmup_steps} steps, final loss {loss:.3f}")
        save(model, tokenizer, args.out / "tiny-qwen3-calculator")
        data = write_task(args.out / "calculator.jsonl", size=300, seed=args.seed)
        print(f"wrote {args.out / 'tiny-qwen3-calculator'} and {data}")


def save(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for path in folder.iterdir():  # safetensors writes owner-only files; assets are for everyone
        path.chmod(0o644)


if __name__ == "__main__":
    main()
