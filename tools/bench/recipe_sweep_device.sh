# tools/recipe_sweep.py on the device machine's CPU cores (16 there: one single-threaded run per
# core), with the wheels the device lacks carried in .whl/ (pydantic and its parts, transformers).
# Through the device tool, from the repository root, with carry [".whl"]:
#   GRID='{"trainer.lr": [7e-4], "algo.minibatches": [2]}' SEEDS='0 1 2' STEPS=220 bash tools/bench/recipe_sweep_device.sh
# Writes $OUT/sweep.jsonl (one line per setting and seed, as the script prints them).
set -u
export PYTHONPATH=$PWD:/tmp/relax-whl CUDA_VISIBLE_DEVICES=
python3 -m pip install --quiet --no-index --no-deps --target /tmp/relax-whl .whl/pydantic*.whl .whl/pydantic_core*.whl \
  .whl/annotated_types*.whl .whl/typing_inspection*.whl .whl/transformers*.whl >"$OUT/whl.log" 2>&1
timeout "${T:-560}" python3 tools/recipe_sweep.py --config configs/tiny-grpo.yaml --grid "$GRID" --seeds ${SEEDS:-0 1 2} \
  --steps "${STEPS:-220}" --workers "${W:-15}" >"$OUT/sweep.jsonl" 2>"$OUT/sweep.err"
echo "rc $?"
