#!/usr/bin/env bash
# GPU smoke test, for a machine with an NVIDIA GPU (GB10, H100/H200, B200...).
# Runs, in order, and stops at the first failure:
#   1. the data-plane tests on CUDA (real Triton kernels instead of the interpreter,
#      compared against the plain-torch references);
#   2. the kernel micro-benchmark (bandwidth vs a device-to-device copy);
#   3. the ahead-of-time kernel build (PTX + cubin + manifest);
#   4. the session benchmark on the GPU at an 8k-token history.
# Usage: bash scripts/gpu_smoke.sh [OUT_DIR]   (inside an environment with the package installed)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-smoke}
mkdir -p "$OUT"
python - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device: this script is for a GPU machine"
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB; torch {torch.__version__}")
PY
unset TRITON_INTERPRET
python -m pytest tests/dataplane -q 2>&1 | tee "$OUT/dataplane-tests.txt"
python scripts/bench_kernels.py 2>&1 | tee "$OUT/bench-kernels.txt"
python builders/build_kernels.py --out "$OUT/kernels" 2>&1 | tee "$OUT/build-kernels.txt"
trtllm-mtp-carry bench --device cuda --history 8192 --new-span 256 --sessions 3 --turns 4 \
    --no-progress --json "$OUT/bench-8k.json" 2>&1 | tee "$OUT/bench-8k.txt"
echo "gpu smoke: all steps passed; results in $OUT/"
