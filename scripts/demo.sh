#!/usr/bin/env bash
# Run `fullbatch demo` in .venv, creating it if needed. Arguments go to the demo,
# e.g. `bash scripts/demo.sh --steps 20 --out /tmp/demo`.
source "$(dirname "$0")/_env.sh" demo
"$VENV/bin/fullbatch" demo "$@"
