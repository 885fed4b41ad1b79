"""Build the embedded text defaults' assets: tiny Qwen3 policies (after a format-only warm-up)
with their character tokenizer, and their datasets.

    python tools/make_tiny_policy.py --out assets

writes assets/tiny-qwen3-addition/ (an HF folder: config.json, model.safetensors, tokenizer files)
and assets/addition.jsonl (the embedded default), and assets/tiny-qwen3-calculator/ and
assets/calculator.jsonl (the calculator tool-use task, relax_hpc.envs.calculator).
`--task` builds one of the two.

The addition model's format warm-up is an SFT run (configs/tiny-sft-format.yaml, kind=sft): this
tool writes its initial model (random init) and its examples into --work, runs it with
`python -m relax_hpc.submit` (the trainer on the CPU, as any sft run), and copies the run's
exported model (WORK/sft/hf) to --out. Deterministic for a given --seed on a given torch build
(another build rounds differently: a rebuilt model differs from the shipped one in the last bits).
Takes about a minute on a CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from relax_hpc.envs.calculator import write_task
from relax_hpc.models.tiny import (
    CALCULATOR_CHAT_TEMPLATE,
    addition_problems,
    build_char_tokenizer,
    format_warmup_rows,
    tiny_qwen3_config,
    tool_warmup,
)

REPO = Path(__file__).resolve().parents[1]
FORMAT_CONFIG = REPO / "configs" / "tiny-sft-format.yaml"
BATCH = 64  # the config's sft.batch_size: the warm-up makes one pass over steps x BATCH examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("assets"), help="folder that receives the assets")
    parser.add_argument("--work", type=Path, default=Path("runs/tiny-format-warmup"),
                        help="the format warm-up's initial model, data and SFT run (RUN_DIR WORK/sft)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init and the warm-up data")
    parser.add_argument("--warmup-steps", type=int, default=300, help=f"format-only warm-up steps (batch {BATCH})")
    parser.add_argument("--tool-warmup-steps", type=int, default=600, help="the calculator model's warm-up steps")
    parser.add_argument("--task", choices=("addition", "calculator", "both"), default="both")
    args = parser.parse_args()

    torch.set_num_threads(1)  # more threads than free cores makes tiny ops far slower, not faster
    tokenizer = build_char_tokenizer()
    if args.task in ("addition", "both"):
        start = time.perf_counter()
        format_warmup(tokenizer, args.work, args.out / "tiny-qwen3-addition", args.warmup_steps, args.seed)
        print(f"format warm-up (sft): {args.warmup_steps} steps, {time.perf_counter() - start:.1f}s")
        with (args.out / "addition.jsonl").open("w") as f:
            for prompt, answer in addition_problems():
                f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
        print(f"wrote {args.out / 'tiny-qwen3-addition'} and {args.out / 'addition.jsonl'}")
    if args.task in ("calculator", "both"):
        torch.manual_seed(args.seed)
        model = Qwen3ForCausalLM(tiny_qwen3_config(tokenizer))
        loss = tool_warmup(model, tokenizer, args.tool_warmup_steps, args.seed)
        print(f"calculator warm-up: {args.tool_warmup_steps} steps, final loss {loss:.3f}")
        tokenizer.chat_template = CALCULATOR_CHAT_TEMPLATE  # its agents' conversations (relax_hpc.agents)
        save(model, tokenizer, args.out / "tiny-qwen3-calculator")
        tokenizer.chat_template = None
        data = write_task(args.out / "calculator.jsonl", size=300, seed=args.seed)
        print(f"wrote {args.out / 'tiny-qwen3-calculator'} and {data}")


def format_warmup(tokenizer: PreTrainedTokenizerFast, work: Path, out: Path, steps: int, seed: int) -> None:
    """The addition model: a random init, then configs/tiny-sft-format.yaml on the format-only
    examples (relax_hpc.models.tiny.format_warmup_rows), in a fresh run under `work`."""
    if work.exists():
        shutil.rmtree(work)  # a fresh run: an old one would resume, or refuse other settings
    work.mkdir(parents=True)
    torch.manual_seed(seed)
    save(Qwen3ForCausalLM(tiny_qwen3_config(tokenizer)), tokenizer, work / "init")
    with (work / "format-warmup.jsonl").open("w") as f:
        for row in format_warmup_rows(steps * BATCH, seed):
            f.write(json.dumps(row) + "\n")
    command = [
        sys.executable, "-m", "relax_hpc.submit", "--config", str(FORMAT_CONFIG), f"run.dir={work / 'sft'}",
        f"model.path={work / 'init'}", f"sft.data={work / 'format-warmup.jsonl'}", f"run.seed={seed}",
        f"trainer.total_steps={steps}",
    ]  # fmt: skip
    subprocess.run(command, check=True)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(work / "sft" / "hf", out)
    for path in out.iterdir():  # assets are for everyone
        path.chmod(0o644)


def save(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for path in folder.iterdir():  # safetensors writes owner-only files; assets are for everyone
        path.chmod(0o644)


if __name__ == "__main__":
    main()
