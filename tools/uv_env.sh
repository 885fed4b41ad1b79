# Sourced by tools/install.sh and tools/install_vllm.sh: the machine's pip settings that uv does not
# read from pip.conf, passed as uv's own variables. A wheel folder (PIP_FIND_LINKS: here it holds
# torch's CPU build) and pip's machine-wide constraints file, if the machine has them.
if [ -n "${PIP_FIND_LINKS:-}" ]; then
  export UV_FIND_LINKS="${UV_FIND_LINKS:-$PIP_FIND_LINKS}"
fi
machine_constraints=$(python3 -m pip config get global.constraint 2>/dev/null || true)
if [ -n "$machine_constraints" ] && [ -f "$machine_constraints" ]; then
  export UV_CONSTRAINT="${UV_CONSTRAINT:-$machine_constraints}"
fi
# Bytecode at install, as pip writes it and uv by default does not: where Python may not write it
# at import (PYTHONDONTWRITEBYTECODE=1, as on this machine, or a venv read-only to the jobs) every
# process would compile torch, transformers and vLLM from source at each start: 19 CPU-s instead
# of 6 for an engine's imports, 18 instead of 8 for vLLM's server (BENCHMARKS.md, "Start-up").
export UV_COMPILE_BYTECODE=1
