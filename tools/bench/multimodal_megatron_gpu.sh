#!/usr/bin/env bash
# Issue 29 items 1 and 2's one-GPU proof (vision- and audio-language models in the megatron
# backend), in one go:
#   OUT=results [STEPS=120] [CONFIG=configs/gpu-tiny-audio-colocated.yaml] [WHL=dir] [CPU=1] \
#     bash tools/bench/multimodal_megatron_gpu.sh [equal] [learn] [throughput]
# (each part fits a 10-minute call: on the device machine run them one call each, same OUT)
# equal:      tests/gpu/test_megatron_multimodal_gpu.py: the tiny Qwen2.5-VL, Qwen3-VL and Qwen2-Audio, megatron against
#             the torch backend on CUDA in fp32 and bf16 (log-probabilities, one GRPO step, the export);
#             each test's MEASURED line, and the pytest outcome
# learn:      $CONFIG (default configs/gpu-tiny-vision-colocated.yaml; the audio task:
#             configs/gpu-tiny-audio-colocated.yaml: one built-in engine colocated with the trainer,
#             weights by CUDA IPC under the checkpoint's names) for $STEPS steps with
#             trainer.backend=megatron and then torch: last-10 mean reward of each, and the gap
#             (issue 29: within 0.1)
# throughput: tools/bench/train_throughput.py --sizes vl-2b: a Qwen3-VL-2B-shaped random model's
#             training step, megatron against torch in the same run (tokens/s, MFU)
# Each part runs under its own timeout; every result is one line appended to $OUT/results.jsonl
# (a part that fails or times out still writes a line, with its exit status), logs beside it.
# EQUAL_TIMEOUT, LEARN_TIMEOUT (each backend), THROUGHPUT_TIMEOUT: seconds (500, 280, 580).
# WHL: a folder of wheels (megatron-core, pydantic, ...) installed into /tmp/relax-whl first when
# megatron-core is not importable. CPU=1 checks the script on a machine without a GPU: `equal` runs
# the CPU form (tests/integration/test_megatron_multimodal.py), `learn` the torch backend alone for 3
# steps, `throughput` a toy vision-language shape on the torch backend.
set -uo pipefail
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
CPU=${CPU:-}
CONFIG=${CONFIG:-configs/gpu-tiny-vision-colocated.yaml}
STEPS=${STEPS:-$([ -n "$CPU" ] && echo 3 || echo 120)}
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${WHL:-}" ]; then
  export PYTHONPATH=$PYTHONPATH:/tmp/relax-whl
  $PY -c 'import megatron.core' 2>/dev/null ||
    $PY -m pip install --quiet --no-index --no-deps --target /tmp/relax-whl "$WHL"/*.whl >>"$OUT/whl.log" 2>&1
fi
record() { echo "$1" | tee -a "$OUT/results.jsonl"; }

equal() {
  local tests=tests/gpu/test_megatron_multimodal_gpu.py marker=gpu
  [ -n "$CPU" ] && tests=tests/integration/test_megatron_multimodal.py marker=integration
  timeout "${EQUAL_TIMEOUT:-500}" $PY -m pytest "$tests" -m $marker -s -q -p no:cacheprovider >"$OUT/equal.log" 2>&1
  local rc=$?
  grep '^MEASURED ' "$OUT/equal.log" | sed 's/^MEASURED //' | tee -a "$OUT/results.jsonl"
  local summary
  summary=$(grep -E '[0-9]+ (passed|failed|skipped|errors?)' "$OUT/equal.log" | tail -1 | tr -d '"=')
  record "{\"part\": \"equal\", \"rc\": $rc, \"summary\": \"$summary\"}"
}

learn() {
  local backends=(megatron torch)
  [ -n "$CPU" ] && backends=(torch)
  for b in "${backends[@]}"; do
    rm -rf "/tmp/vg-$b"
    local start=$SECONDS
    timeout "${LEARN_TIMEOUT:-280}" $PY -m relax_hpc.submit --config "$CONFIG" run.dir="/tmp/vg-$b" \
      trainer.backend="$b" trainer.total_steps="$STEPS" ckpt.every_steps=1000 >"$OUT/learn-$b.log" 2>&1
    echo "$? $((SECONDS - start))" >"$OUT/learn-$b.status"
    cp "/tmp/vg-$b/metrics/train.jsonl" "$OUT/learn-$b.jsonl" 2>/dev/null || : >"$OUT/learn-$b.jsonl"
  done
  record "$($PY - "$OUT" "$STEPS" "$CONFIG" "${backends[@]}" <<'EOF'
import json, os, statistics, sys
out, steps, config, backends = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
result = {"benchmark": os.path.basename(config).removesuffix(".yaml"), "steps": steps}
for b in backends:
    rc, wall = open(f"{out}/learn-{b}.status").read().split()
    rows = [r for r in map(json.loads, open(f"{out}/learn-{b}.jsonl")) if "reward" in r]
    result[b] = {"rc": int(rc), "wall_s": int(wall), "steps_done": len(rows),
                 "reward_first10": round(statistics.mean(r["reward"] for r in rows[:10]), 3) if rows else None,
                 "reward_last10": round(statistics.mean(r["reward"] for r in rows[-10:]), 3) if rows else None,
                 "median_step_s": round(statistics.median(r["time_step"] for r in rows[1:]), 3) if len(rows) > 1 else None}
last = [result[b]["reward_last10"] for b in backends]
if len(last) == 2 and None not in last:
    result["gap"] = round(abs(last[0] - last[1]), 3)
    result["within_0.1"] = result["gap"] <= 0.1
print(json.dumps(result))
EOF
)"
}

throughput() {
  local args=(--sizes vl-2b --seq 4096 --batch 4 --steps 5 --image-tokens 256)
  [ -n "$CPU" ] && args=(--cpu --sizes vl-tiny --backends torch --seq 64 --batch 2 --steps 1 --image-tokens 4)
  timeout "${THROUGHPUT_TIMEOUT:-580}" $PY tools/bench/train_throughput.py "${args[@]}" >"$OUT/throughput.log" 2>&1
  local rc=$?
  grep '^{' "$OUT/throughput.log" | tee -a "$OUT/results.jsonl"
  record "{\"part\": \"throughput\", \"rc\": $rc}"
}

for part in ${*:-equal learn throughput}; do
  case $part in
    equal | learn | throughput) $part ;;
    *) echo "unknown part $part (equal, learn, throughput)" >&2; exit 2 ;;
  esac
done
