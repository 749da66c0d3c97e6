#!/usr/bin/env bash
# Run the whole test suite (lint included) in .venv, creating it if needed.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k exactness`.
source "$(dirname "$0")/_env.sh" test
"$PY" -m ruff check src tests examples benchmarks
"$PY" -m ruff format --check src tests examples benchmarks
"$PY" -m mypy
"$PY" -m pytest -q --durations=15 "$@"
