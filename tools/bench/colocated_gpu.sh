#!/usr/bin/env bash
# Issue 17's one-GPU measurements, in one go (what BENCHMARKS.md "Colocated on one H200" quotes):
#   OUT=results bash tools/bench/colocated_gpu.sh [tiny|update|0.6b ...]   (default: all three)
# tiny:   the embedded task colocated on one GPU (megatron trainer + torch engine), reward per step
# update: tools/bench/colocated_update.py for the 0.6B and 1.7B shapes (keeps the models in /tmp)
# 0.6b:   a Qwen3-0.6B-shaped model colocated, each step's time split by phase (needs `update` first)
# offload: the same with launch.colocate_offload=optimizer (Adam's moments in host memory while
#          the engine generates): mem_held_gb and time_offload/time_restore against `0.6b`'s
set -uo pipefail
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
models=/tmp/relax-colocated-models
for part in "${@:-tiny update 0.6b offload}"; do
  for p in $part; do
    case $p in
      tiny)
        rm -rf /tmp/gc && timeout 250 python3 -m relax_hpc.submit --config configs/gpu-tiny-colocated.yaml run.dir=/tmp/gc \
          trainer.total_steps=100 >"$OUT/tiny.log" 2>&1
        cp /tmp/gc/metrics/train.jsonl "$OUT/tiny_train.jsonl" ;;
      update)
        timeout 300 python3 tools/bench/colocated_update.py --size 0.6b --size 1.7b --repeat 5 --models $models \
          | tee "$OUT/update.jsonl" ;;
      0.6b|offload)  # 64 prompts (the greedy evaluation reads them all; random weights never stop early)
        extra=(); [ "$p" = offload ] && extra=(launch.colocate_offload=optimizer)
        head -64 assets/addition.jsonl >/tmp/addition-64.jsonl && rm -rf /tmp/g06
        timeout 200 python3 -m relax_hpc.submit --config configs/gpu-tiny-colocated.yaml run.dir=/tmp/g06 \
          model.path=$models/0.6b model.dtype=bfloat16 data.path=/tmp/addition-64.jsonl trainer.total_steps=5 \
          rollout.prompts_per_step=16 rollout.group_size=8 rollout.max_new_tokens=16 ckpt.every_steps=1000 \
          "${extra[@]}" >"$OUT/$p.log" 2>&1
        cp /tmp/g06/metrics/train.jsonl "$OUT/${p}_train.jsonl"; cp /tmp/g06/logs/0/trainer.log "$OUT/${p}_trainer.log" ;;
    esac
  done
done
