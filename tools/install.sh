#!/usr/bin/env bash
# Create .venv and install relax_hpc with the exact versions in constraints.txt.
#   bash tools/install.sh          # the package, megatron-core, the metric sinks, the test, lint and type-check tools
#   bash tools/install.sh --vllm   # and .venv-vllm, vLLM's CPU build as a rollout engine (tools/install_vllm.sh)
# torch is pinned to a CPU build (2.13.0); an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  --vllm) WITH_VLLM=1 ;;
  "") WITH_VLLM=0 ;;
  *) echo "usage: bash tools/install.sh [--vllm]" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
export PIP_CONSTRAINT="$PWD/constraints.txt" PIP_DISABLE_PIP_VERSION_CHECK=1
# uv installs; pip only bootstraps it, at the version constraints.txt pins. It fetches and unpacks
# in parallel: vLLM's environment took 17 s from a cold cache, against about 120 with pip
# (BENCHMARKS.md, "CI"). tools/uv_env.sh hands it the machine's pip settings.
.venv/bin/python -m pip install --quiet uv
source tools/uv_env.sh
install() { .venv/bin/uv pip install --python .venv/bin/python --quiet -c constraints.txt "$@"; }
install torch==2.13.0
install -e ".[test,megatron,dev,sinks,notify,agents]"
# SGLang without its dependencies (they pin torch 2.14.1 and GPU kernels), plus the light packages
# its request classes and argument parser import: the section of constraints.txt between the
# sglang markers, which also pins them. The contract and launcher tests import it; nothing runs it.
SGLANG_PKGS=$(sed -n '/^# >>> sglang/,/^# <<< sglang/p' constraints.txt | grep -v '^#' | sed 's/==.*//')
install --no-deps $SGLANG_PKGS
# relax_hpc itself is installed editable: its bytecode too (tools/uv_env.sh says why).
.venv/bin/python -m compileall -q relax_hpc > /dev/null
.venv/bin/python -c "import relax_hpc, torch, transformers, h5py; print(f'relax_hpc {relax_hpc.__version__} ready (torch {torch.__version__}, transformers {transformers.__version__}, h5py {h5py.__version__})')"
if [ "$WITH_VLLM" = 1 ]; then
  bash tools/install_vllm.sh
fi
