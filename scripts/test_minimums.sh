#!/usr/bin/env bash
# Install the *declared minimum* versions (pyproject.toml's floors) in their own venv and run
# the tests there. Not run by CI: torch 2.6.0 from PyPI is a CUDA build for Linux whose
# nvidia-* dependencies are several GB; point FULLBATCH_TORCH_INDEX at a CPU wheel index
# (e.g. https://download.pytorch.org/whl/cpu) to keep it small. Extra arguments go to pytest.
#
#   bash scripts/test_minimums.sh                      # core + integrations at the floors
#   FULLBATCH_TORCH=2.7.0 bash scripts/test_minimums.sh -k fsdp
#
# Known at the floors (issue 18): FSDP2 on CPU needs torch 2.7 (pytorch#145935), so those
# tests skip below it and fully_shard'ed CPU models raise with that message.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${FULLBATCH_MIN_VENV:-.venv-min}"
TORCH="${FULLBATCH_TORCH:-2.6.0}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
INDEX=()
[ -n "${FULLBATCH_TORCH_INDEX:-}" ] && INDEX=(--index-url "$FULLBATCH_TORCH_INDEX")
"$PY" -m pip install --quiet "${INDEX[@]}" "torch==$TORCH"
"$PY" -m pip install --quiet "transformers==4.46.0" "accelerate==1.0.0" "lightning==2.4.0" \
  "matplotlib==3.7.0" "tqdm==4.60.0" "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100"
"$PY" -m pip install --quiet --no-deps -e .
"$PY" -m pytest -q -p no:cacheprovider "$@"
