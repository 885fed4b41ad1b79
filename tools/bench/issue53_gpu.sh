#!/usr/bin/env bash
# Issue 53's one-GPU figures in one call (BENCHMARKS.md, "Issue 53: one GPU"):
#   OUT=results [WHL=.whl] [DEADLINE=570] [PYTHON=python3] bash tools/bench/issue53_gpu.sh [tiny] [vision] [tests]
#   (default: all three, in that order)
# tiny:   configs/gpu-tiny-colocated.yaml, 3 runs of 40 steps, each from its own command: seconds from
#         the command to the first trained step, the median step and its phases (the host's share:
#         the step less its generate, train and push phases; colocated, they take turns on the GPU)
# vision: configs/gpu-tiny-vision-colocated.yaml, 100 steps: seconds from the command to the first
#         10-step mean reward of at least 0.7, and the last 10 steps' mean
# tests:  tests/gpu, one pytest process per file, so that one file's broken CUDA context or half-set
#         NCCL/megatron state cannot fail the files after it (on the H100 of 2026-12-05 one
#         qwen3-moe NCCL failure in a single process failed 11 later tests): a line per file with its
#         exit status, passed/failed/errors/skipped counts, seconds and its failures' short summaries
# Every run writes its line to results.jsonl, a failed one too: {"run", "exit", "error": the end of
# its log} (on 2026-12-05 every tiny/vision run died at import and results.jsonl held none of them).
# Each run gets at most the time left before DEADLINE seconds from the start (a tiny or vision run
# 240 s, a test file 300 s), so the call ends inside the device's 10 minutes; what is not reached is
# named in results.jsonl as skipped. All three do not fit one call: on the H100 of 2026-12-05 tiny
# and vision took about 365 s of a 480 s DEADLINE, the test files before it 117 s (and the whole of
# tests/gpu in one process 158 s the call before), so give `tiny vision` and `tests` a call each.
# $OUT: results.jsonl (one JSON per run), env.txt (card, torch, date), run.log, tiny1-3.log,
# vision.log, gpu_tests.log (every test file's output, one after another): 8 files at most.
# WHL: a folder of wheels installed first (megatron-core, pydantic and its parts, transformers, and
# setproctitle, soundfile, cffi, pycparser, which the device image lacks).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
DEADLINE=${DEADLINE:-570}
PY=${PYTHON:-python3}
if [ -n "${WHL:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHL"/*.whl >>"$OUT/run.log" 2>&1 || { echo "the wheels did not install (run.log)"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } >"$OUT/env.txt" 2>&1

skipped() {  # NAME: a run not reached before the deadline
  echo "{\"run\": \"$1\", \"skipped\": \"$((DEADLINE - SECONDS)) s left before the deadline\"}" >>"$OUT/results.jsonl"
}

# What a run's train.jsonl says, measured from START (the command's epoch seconds): the first
# step, the median step's phases, and when the 10-step mean reward first reached LEVEL. A run
# with no trained step gets a line with its exit status and the end of its log instead.
summarise() {  # NAME START RUN_DIR LEVEL EXIT LOG
  $PY - "$@" <<'PY' >>"$OUT/results.jsonl"
import json, statistics, sys
name, start, run, level, code, log = sys.argv[1], float(sys.argv[2]), sys.argv[3], float(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
try:
    steps = [json.loads(l) for l in open(f"{run}/metrics/train.jsonl") if '"loss"' in l]
except OSError as e:
    steps, missing = [], str(e)
else:
    missing = "no trained step in train.jsonl"
if not steps:
    try:
        tail = open(log, errors="replace").read()[-1500:]
    except OSError:
        tail = ""
    print(json.dumps({"run": name, "exit": code, "error": missing, "log_tail": tail}))
    sys.exit()
med = lambda k: round(statistics.median(s.get(k, 0.0) for s in steps[1:] or steps), 4)
means = [sum(s["reward"] for s in steps[i - 10:i]) / 10 for i in range(10, len(steps) + 1)]
reached = next((steps[i + 9]["time"] - start for i, m in enumerate(means) if m >= level), None)
step, gen, train, push = med("time_step"), med("time_generate"), med("time_fwd_bwd") + med("time_optimizer"), med("time_push")
print(json.dumps({"run": name, "exit": code, "steps": len(steps), "first_step_s": round(steps[0]["time"] - start, 2),
                  "step_s_median": step, "generate_s": gen, "train_s": round(train, 4), "push_s": push,
                  "host_share": round(max(0.0, step - gen - train - push) / step, 3) if step else None,
                  f"to_{level}_s": None if reached is None else round(reached, 1),
                  "last10_reward": round(sum(s["reward"] for s in steps[-10:]) / 10, 3)}))
PY
}

run() {  # NAME STEPS LEVEL CONFIG [key=value ...]
  local name=$1 steps=$2 level=$3 config=$4 start rc left=$((DEADLINE - SECONDS))
  shift 4
  if [ "$left" -lt 30 ]; then skipped "$name"; return; fi
  rm -rf "/tmp/$name"
  start=$(date +%s.%N)
  timeout $((left < 240 ? left : 240)) $PY -m relax_hpc.submit --config "$config" run.dir="/tmp/$name" \
    trainer.total_steps="$steps" rollout.eval_every=0 "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "# $name exit $rc" >>"$OUT/run.log"
  summarise "$name" "$start" "/tmp/$name" "$level" "$rc" "$OUT/$name.log" 2>>"$OUT/run.log" \
    || echo "{\"run\": \"$name\", \"exit\": $rc, \"error\": \"the summary failed (run.log)\"}" >>"$OUT/results.jsonl"
}

# One test file in its own pytest process: its counts, and each failure's short summary line.
test_file() {  # FILE
  local f=$1 t0=$SECONDS rc left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 30 ]; then skipped "$f"; return; fi
  echo "=== $f" >>"$OUT/gpu_tests.log"
  timeout $((left < 300 ? left : 300)) $PY -m pytest -q -p no:cacheprovider -rfEs "$f" >/tmp/issue53-test.log 2>&1
  rc=$?
  cat /tmp/issue53-test.log >>"$OUT/gpu_tests.log"
  $PY - "$f" "$rc" "$((SECONDS - t0))" /tmp/issue53-test.log <<'PY' >>"$OUT/results.jsonl" 2>>"$OUT/run.log" \
    || echo "{\"run\": \"$f\", \"exit\": $rc, \"error\": \"the summary failed (run.log)\"}" >>"$OUT/results.jsonl"
import json, re, sys
f, code, seconds, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
text = open(log, errors="replace").read()
lines = text.splitlines()
last = next((l for l in reversed(lines) if re.search(r"\d+ (passed|failed|error|skipped|deselected)|no tests ran", l)), "")
count = lambda k: sum(int(n) for n in re.findall(rf"(\d+) {k}", last))
if not last:  # cut (124) before pytest's summary: count its progress characters instead
    dots = "".join(l.split(" ")[0] for l in lines if re.fullmatch(r"[.FEsxX]+( +\[ *\d+%\])?", l))
    count = lambda k: {"passed": dots.count("."), "failed": dots.count("F"), "errors?": dots.count("E"),
                       "skipped": dots.count("s")}[k]
line = {"run": f, "exit": code, "seconds": seconds, "passed": count("passed"), "failed": count("failed"),
        "errors": count("errors?"), "skipped": count("skipped"), "summary": last.strip("= ")}
failures = [l[:400] for l in lines if l.startswith(("FAILED ", "ERROR "))]
if failures:
    line["failures"] = failures
if code not in (0, 5) and not failures:  # a crash, a timeout (124) or a collection error: the log's end
    line["log_tail"] = text[-1500:]
print(json.dumps(line))
PY
}

for part in ${@:-tiny vision tests}; do
  case $part in
    tiny) for i in 1 2 3; do run "tiny$i" 40 0.8 configs/gpu-tiny-colocated.yaml; done ;;
    vision) run vision 100 0.7 configs/gpu-tiny-vision-colocated.yaml ;;
    tests) : >"$OUT/gpu_tests.log"; for f in tests/gpu/test_*.py; do test_file "$f"; done ;;
    *) echo "unknown part $part (tiny, vision, tests)" >&2; exit 2 ;;
  esac
done
cat "$OUT/results.jsonl"
