#!/usr/bin/env bash
# Lint, format and type checks of the whole tree (the settings are in pyproject.toml; .ci/run runs
# this before the tests).   bash tools/check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
