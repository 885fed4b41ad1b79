#!/usr/bin/env bash
# Issue 27 target 3's one-GPU measurements (what BENCHMARKS.md "The GPU step's host work" quotes):
#   OUT=results [BEFORE=other/checkout] bash tools/bench/gpu_host.sh [tiny] [host] [big]
# tiny: configs/gpu-tiny-colocated.yaml for $STEPS steps (default 30): step time by phase, first step
# host: tools/bench/train_host.py on the embedded task's tiny model, 1,024 samples of 10 tokens
#       (the config's batch), with a CPU + CUDA timeline of one step
# big:  tools/bench/train_host.py at a Qwen3-0.6B shape, 8,192 samples of 512 tokens, one step
#       timed and one profiled (CUDA kernels only): 3-4 minutes per tree
# With BEFORE, each part runs against that checkout's relax_hpc first (the same scripts), so a
# before/after pair comes from one machine in one call. Results: $OUT/results.jsonl, one line each.
set -uo pipefail
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
here=$(pwd)
site=${PYTHONPATH:-}  # carried wheels, if any
trees=("after:$here")
[ -n "${BEFORE:-}" ] && trees=("before:$(cd "$BEFORE" && pwd)" "after:$here")
summary() {  # one line of a colocated run's medians (steps 3 on) and its first step
  python3 - "$1" "$2" <<'EOF'
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[2])) if "time_step" in r]
keys = ("time_step", "time_fwd_bwd", "time_generate", "time_wait", "time_read", "time_push", "time_release")
out = {k: round(statistics.median(r.get(k, 0.0) for r in rows[2:]), 4) for k in keys}
print(json.dumps({"benchmark": "tiny_colocated", "tree": sys.argv[1], "steps": len(rows), **out,
                  "first_step": {k: round(rows[0].get(k, 0.0), 3) for k in keys}}))
EOF
}
for part in ${*:-tiny host big}; do
  for t in "${trees[@]}"; do
    name=${t%%:*} tree=${t#*:}
    export PYTHONPATH=$tree${site:+:$site}
    case $part in
      tiny)
        rm -rf "/tmp/gh-$name"
        (cd "$tree" && timeout 240 python3 -m relax_hpc.submit --config configs/gpu-tiny-colocated.yaml \
          run.dir="/tmp/gh-$name" trainer.total_steps="${STEPS:-30}" ckpt.every_steps=1000 >"$OUT/tiny-$name.log" 2>&1)
        cp "/tmp/gh-$name/metrics/train.jsonl" "$OUT/tiny-$name.jsonl"
        summary "$name" "$OUT/tiny-$name.jsonl" | tee -a "$OUT/results.jsonl" ;;
      host)
        timeout 200 python3 tools/bench/train_host.py --model assets/tiny-qwen3-addition --dtype float32 \
          --samples 1024 --prompt 6 --completion 4 --steps 20 --out "$OUT/host-$name" --trace \
          | sed "s/^{/{\"tree\": \"$name\", /" | tee -a "$OUT/results.jsonl" ;;
      big)
        timeout 400 python3 tools/bench/train_host.py --size 0.6b --samples 8192 --prompt 256 --completion 256 \
          --steps 1 --out "$OUT/big-$name" | sed "s/^{/{\"tree\": \"$name\", /" | tee -a "$OUT/results.jsonl" ;;
    esac
  done
done
