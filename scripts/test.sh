#!/usr/bin/env bash
# Set up a virtual environment (the CPU torch build first, so no CUDA build is
# pulled in) with the package and its test extras, then run the test suite.
#   VENV=path  picks the environment (default .venv); extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test,serve,plot,dynamo]"  # serve: a real tritonserver for tests/serve; plot: the bench plot test
python -m pip install -q --no-deps ai-dynamo==1.6.1  # dynamo: tests/dynamo (its aisimulate dependency cannot install)
python -m pytest tests "$@"
