# Sourced by scripts/demo.sh and scripts/test.sh: make (or reuse) the virtual environment and
# install fullbatch into it. torch==2.13.0 goes first and explicitly: a bare `torch`
# requirement would pull a multi-GB CUDA build on a machine that has no torch yet. The
# frameworks and linters are held at the versions in scripts/constraints.txt.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${FULLBATCH_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "fullbatch: creating $VENV" >&2
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
echo "fullbatch: [1/2] torch==2.13.0 into $VENV (seconds when the CPU wheel is on disk)" >&2
"$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
echo "fullbatch: [2/2] fullbatch[$1] and the pinned frameworks of scripts/constraints.txt" \
  "(about 3 minutes the first time, seconds after)" >&2
"$PY" -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt -e ".[$1]"
echo "fullbatch: environment ready ($("$PY" -c 'import torch; print("torch", torch.__version__)'))" >&2
