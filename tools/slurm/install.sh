#!/usr/bin/env bash
# Install a one-host Slurm (22.05 on Debian 12) with munge and accounting (slurmdbd + MariaDB)
# for tools/slurm/cluster.sh and tests/slurm. Runs as root (CI) or through sudo.
#   bash tools/slurm/install.sh     # ~25 s on a fresh machine; a no-op (0.1 s) when installed
# Nothing is started here (no systemd; policy-rc.d blocks the packages' own service starts).
set -euo pipefail

PKGS=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server mariadb-client)

missing=()
for p in "${PKGS[@]}"; do
  if [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" != installed ]; then
    missing+=("$p")
  fi
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "slurm: already installed ($(slurmctld -V))"
  exit 0
fi

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  SUDO=(sudo)
fi
echo "slurm: installing ${missing[*]}"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "${SUDO[@]}" apt-get update -qq >"$log" 2>&1; then
  cat "$log" >&2
  echo "slurm: apt-get update failed" >&2
  exit 1
fi
if ! "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  -o Dpkg::Use-Pty=0 "${missing[@]}" >"$log" 2>&1; then
  cat "$log" >&2
  echo "slurm: apt-get install failed" >&2
  exit 1
fi
echo "slurm: installed ($(slurmctld -V))"
