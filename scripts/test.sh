#!/usr/bin/env bash
# Set up a virtual environment with torch 2.13.0, the package and every extra the
# suite tests (test, serve, plot, dynamo, nixl), then run the test suite.
#   VENV=path             picks the environment (default .venv); extra args go to pytest.
#   TEST_WORKERS=n        pytest-xdist workers (default auto: one per CPU; 0 runs in this process).
#                         Each test file runs whole on one worker (its module-scoped engines
#                         and servers start once), the longest files first (tests/conftest.py).
#   TORCH_INDEX_URL=url   where torch comes from. Unset, pip's configured index decides:
#                         PyPI's default index serves the CUDA build on Linux x86_64
#                         (torch plus NVIDIA's CUDA wheels, about 2.8 GB); for the CPU
#                         build (about 190 MB) use https://download.pytorch.org/whl/cpu
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
python -m pip install -q -e ".[test,serve,plot,dynamo,nixl]"  # serve: a real tritonserver for tests/serve; plot: the bench plot test; nixl: entry moves
python -m pip install -q --no-deps ai-dynamo==1.6.1  # dynamo: tests/dynamo (its aisimulate dependency cannot install)
python -m pytest tests -n "${TEST_WORKERS:-auto}" --dist loadfile --no-loadscope-reorder "$@"
