#!/usr/bin/env bash
# Issue 52's figures on one GPU in one call (BENCHMARKS.md, "Issue 52: the next lease"):
#   OUT=results [WHL=.whl] [DEADLINE=570] bash tools/bench/issue52_gpu.sh [0.6b] [1.7b] [4b]
# tools/bench/train_throughput.py at each size, in this order (the default: all three), each
# (size, backend) 3 times in fresh processes (the JSON's figures are the median run's, `runs` and
# `mfu_spread` the rest), the first run of each also profiled over 2 steps
# (tools/bench/kernel_profile.py: time by kind of kernel, idle, the share accounted, the verdict):
#   0.6b  megatron
#   1.7b  megatron and torch, and their ratio (a card under 100 GiB: megatron alone, since the
#         torch backend needs about 105 GiB there)
#   4b    megatron with --recompute, 3 timed steps (a card under 100 GiB: batch 2, in the JSON)
# Each size gets the time left before DEADLINE seconds from the start, so the call ends inside the
# device's 10 minutes; a size cut short still leaves its finished runs' `# run` lines in run.log,
# and the sizes not reached are named in results.jsonl, for a second call.
# $OUT: results.jsonl (each size's JSON, then a line per size with its exit status and seconds;
# rc 1 and `error` where some backend of the size has no finished run, its JSON naming it under
# `failed`, rc 124 where the deadline cut it: on the H100 of 2026-12-05 every 1.7B and 4B run ran out
# of memory and the lines still said rc 0),
# run.log (everything else), env.txt (card, versions, date), traces.tar (the gzipped Chrome traces;
# in 15 MiB pieces traces.tar.part-* if larger, since the device returns files of 16 MiB at most).
# WHL: a folder of wheels installed first (megatron-core, pydantic and its parts, transformers, and
# setproctitle, soundfile, cffi, pycparser, which the device image lacks).
# CPU=1 checks the script itself on a machine without a GPU: each part runs a toy size
# (vl-tiny) on the torch backend instead, PYTHON naming the interpreter (default python3).
set -uo pipefail
# NVLink multicast stays off in every process (KINDS.md): torchrun's workers inherit these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT/traces"
OUT=$(cd "$OUT" && pwd)
DEADLINE=${DEADLINE:-570}
PY=${PYTHON:-python3}
CPU=${CPU:-}
log=$OUT/run.log
if [ -n "${WHL:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHL"/*.whl >>"$log" 2>&1 || { echo "the wheels did not install (run.log)"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
{
  date -u
  [ -n "$CPU" ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c 'import torch, transformers, megatron.core as m; print("torch", torch.__version__, "cuda", torch.version.cuda,
    "transformers", transformers.__version__, "megatron-core", m.__version__)'
  $PY -c 'import relax_hpc.trainer.megatron_backend' && echo "relax_hpc imports"
} >"$OUT/env.txt" 2>>"$log" || { cat "$OUT/env.txt"; echo "the environment is not ready (run.log)"; exit 1; }
gib=0
[ -n "$CPU" ] || gib=$($PY -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)')
if [ "$gib" -ge 100 ]; then
  backends17=megatron,torch batch4b=4
else  # an H100: the torch backend at 1.7B (about 105 GiB) left out, the 4B shape (about 80 GiB) at batch 2
  backends17=megatron batch4b=2
fi

size() {  # NAME, then train_throughput.py's arguments for it
  local name=$1 start=$SECONDS left=$((DEADLINE - SECONDS))
  shift
  if [ "$left" -lt 90 ]; then
    echo "{\"part\": \"$name\", \"skipped\": \"$left s left before the deadline\"}" >>"$OUT/results.jsonl"
    return
  fi
  [ -z "$CPU" ] || set -- --cpu --sizes vl-tiny --backends torch --seq 64 --batch 2 --steps 1 --image-tokens 4
  echo "=== $name: $* (${left} s left)" >>"$log"
  timeout "$left" $PY tools/bench/train_throughput.py --repeats 3 --profile 2 --profile-dir "$OUT/traces" "$@" \
    >/tmp/issue52-size.out 2>>"$log"
  local rc=$? error=
  grep '^{' /tmp/issue52-size.out >>"$OUT/results.jsonl"
  case $rc in
    0) ;;
    124) error=', "error": "cut at the deadline: its finished runs are the # run lines in run.log"' ;;
    1) error=', "error": "no finished run for a backend (the JSON names it under failed; run.log)"' ;;
    *) error=', "error": "train_throughput.py failed (run.log)"' ;;
  esac
  echo "{\"part\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start)), \"gpu_gib\": $gib$error}" >>"$OUT/results.jsonl"
}

for part in ${*:-0.6b 1.7b 4b}; do
  case $part in
    0.6b) size 0.6b --sizes 0.6b --backends megatron ;;
    1.7b) size 1.7b --sizes 1.7b --backends $backends17 ;;
    4b) size 4b --sizes 4b --backends megatron --recompute --steps 3 --batch $batch4b ;;
    *) echo "unknown part $part (0.6b, 1.7b, 4b)" >&2; exit 2 ;;
  esac
done
tar -cf "$OUT/traces.tar" -C "$OUT" traces && rm -r "$OUT/traces"
if [ "$(stat -c %s "$OUT/traces.tar")" -gt $((15 << 20)) ]; then
  split -b 15m "$OUT/traces.tar" "$OUT/traces.tar.part-" && rm "$OUT/traces.tar"
fi
cat "$OUT/results.jsonl"
