#!/usr/bin/env bash
# Issue 53's one-GPU figures in one call (BENCHMARKS.md, "Issue 53: one GPU"):
#   OUT=results [WHL=.whl] bash tools/bench/issue53_gpu.sh [tiny] [vision] [tests]   (default: all)
# tiny:   configs/gpu-tiny-colocated.yaml, 3 runs of 40 steps, each from its own command: seconds from
#         the command to the first trained step, the median step and its phases (the host's share:
#         the step less its generate, train and push phases; colocated, they take turns on the GPU)
# vision: configs/gpu-tiny-vision-colocated.yaml, 100 steps: seconds from the command to the first
#         10-step mean reward of at least 0.7, and the last 10 steps' mean
# tests:  the whole of tests/gpu
# $OUT: results.jsonl (one JSON per run), env.txt (card, torch, date), *.log (each run's output).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT"
if [ -n "${WHL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHL"/*.whl >>"$OUT/run.log" 2>&1 || { echo "the wheels did not install (run.log)"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } >"$OUT/env.txt" 2>&1

# What a run's train.jsonl says, measured from START (the command's epoch seconds): the first
# step, the median step's phases, and when the 10-step mean reward first reached LEVEL.
summarise() {  # NAME START RUN_DIR LEVEL
  python3 - "$@" <<'PY' >>"$OUT/results.jsonl"
import json, statistics, sys
name, start, run, level = sys.argv[1], float(sys.argv[2]), sys.argv[3], float(sys.argv[4])
steps = [json.loads(l) for l in open(f"{run}/metrics/train.jsonl") if '"loss"' in l]
med = lambda k: round(statistics.median(s.get(k, 0.0) for s in steps[1:] or steps), 4)
means = [sum(s["reward"] for s in steps[i - 10:i]) / 10 for i in range(10, len(steps) + 1)]
reached = next((steps[i + 9]["time"] - start for i, m in enumerate(means) if m >= level), None)
step, gen, train, push = med("time_step"), med("time_generate"), med("time_fwd_bwd") + med("time_optimizer"), med("time_push")
print(json.dumps({"run": name, "steps": len(steps), "first_step_s": round(steps[0]["time"] - start, 2),
                  "step_s_median": step, "generate_s": gen, "train_s": round(train, 4), "push_s": push,
                  "host_share": round(max(0.0, step - gen - train - push) / step, 3) if step else None,
                  f"to_{level}_s": None if reached is None else round(reached, 1),
                  "last10_reward": round(sum(s["reward"] for s in steps[-10:]) / 10, 3)}))
PY
}

run() {  # NAME STEPS LEVEL CONFIG [key=value ...]
  local name=$1 steps=$2 level=$3 config=$4 start
  shift 4
  rm -rf "/tmp/$name"
  start=$(date +%s.%N)
  timeout 240 python3 -m relax_hpc.submit --config "$config" run.dir="/tmp/$name" trainer.total_steps="$steps" \
    rollout.eval_every=0 "$@" >"$OUT/$name.log" 2>&1
  echo "# $name exit $?" >>"$OUT/run.log"
  summarise "$name" "$start" "/tmp/$name" "$level" 2>>"$OUT/run.log"
}

for part in ${@:-tiny vision tests}; do
  case $part in
    tiny) for i in 1 2 3; do run "tiny$i" 40 0.8 configs/gpu-tiny-colocated.yaml; done ;;
    vision) run vision 100 0.7 configs/gpu-tiny-vision-colocated.yaml ;;
    tests) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu >"$OUT/gpu_tests.log" 2>&1
           echo "{\"run\": \"tests/gpu\", \"exit\": $?, \"summary\": \"$(tail -1 "$OUT/gpu_tests.log" | tr -d '"')\"}" \
             >>"$OUT/results.jsonl" ;;
  esac
done
cat "$OUT/results.jsonl"
