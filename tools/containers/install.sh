#!/usr/bin/env bash
# System packages the container test needs (tests/slurm/test_container.py): mmdebstrap builds the
# test image's Debian root filesystem, charliecloud-runtime's ch-run runs it (the stand-in for
# Apptainer, which Debian 12 does not ship).
set -euo pipefail
if dpkg -s mmdebstrap charliecloud-runtime >/dev/null 2>&1; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq mmdebstrap charliecloud-runtime >/dev/null
