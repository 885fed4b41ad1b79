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
