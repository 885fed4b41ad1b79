"""Turn a run's checkpoint into an HF model folder that transformers, SGLang and vLLM load.

    python tools/dcp_to_hf.py --run-dir RUN_DIR --out FOLDER [--step N] [--lora merged|adapter]

Either backend's checkpoint (torch DCP, or megatron's distributed checkpoint), the latest or the
one after step N; the conversion is relax_hpc.ckpt.export, which a completed run also runs on its
own (ckpt.export_hf, into RUN_DIR/hf). A LoRA run (trainer.lora) exports the base with its adapters
merged, or a PEFT adapter folder (--lora adapter; default: the run's ckpt.export_lora). Needs no
GPU and no process group.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from relax_hpc import cli
from relax_hpc.ckpt.export import ExportError, convert


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/dcp_to_hf.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--step", type=int, help="the checkpoint after this many steps (default: the latest)")
    parser.add_argument(
        "--lora", choices=["merged", "adapter"], help="a LoRA run's export (default: its ckpt.export_lora)"
    )
    args = parser.parse_args()
    try:
        folder = convert(args.run_dir, args.out, args.step, args.lora)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{folder} -> {args.out}")
    return 0


if __name__ == "__main__":
    cli.run(main)
