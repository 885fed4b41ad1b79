#!/usr/bin/env bash
# Lint, format and type checks of the whole tree (the settings are in pyproject.toml; .ci/run runs
# this before the tests).   bash tools/check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# No new copy-paste inside the package: pylint's symilar, blocks of 8 lines or more (comments and
# docstrings left out; --ignore-imports would make it parse and infer every module, 90 s of CPU).
# tools/duplicates-baseline holds the duplicated lines accepted so far; lower it when they go.
mapfile -d '' sources < <(find relax_hpc -name '*.py' -print0)
report=$(.venv/bin/symilar -d 8 -i --ignore-docstrings "${sources[@]}")
found=$(sed -n 's/^TOTAL lines=[0-9]* duplicates=\([0-9]*\) .*/\1/p' <<< "$report")
allowed=$(grep -v '^#' tools/duplicates-baseline)
if [ -z "$found" ] || [ "$found" -gt "$allowed" ]; then
    echo "$report"
    echo "duplicated lines in relax_hpc/: ${found:-unknown}, baseline $allowed (tools/duplicates-baseline): factor the blocks above out" >&2
    exit 1
fi
