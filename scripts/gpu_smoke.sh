#!/usr/bin/env bash
# GPU smoke test, for a machine with an NVIDIA GPU (GB10, H100/H200, B200...).
# Runs, in order, and stops at the first failure:
#   1. the data-plane and plugin tests on CUDA (real Triton kernels instead of the
#      interpreter, compared against the plain-torch references);
#   2. the kernel micro-benchmark (bandwidth vs a device-to-device copy), the FP8 row format's
#      pack/unpack throughput against a plain copy of the same bf16 rows
#      (scripts/bench_row_format.py: paired, median and IQR), and the carry
#      store's host tier copies (scripts/bench_host_tier.py: demote to pinned host memory and
#      restore into fresh blocks, synchronized, per entry size; rows checked bit for bit);
#   3. the ahead-of-time kernel builds: Triton's own ABI (build_kernels.py) and the
#      TensorRT plugin ABI (build_abi_kernels.py: PTX + cubin + manifest);
#   4. the AOT launcher check (scripts/gpu_check_aot.py): the plugins' exact PTX through the
#      CUDA driver API, bit for bit (copy) / within one 16-bit rounding (append) against the
#      references, odd shapes, scattered block tables, untouched rows; the custom ops with
#      TRTLLM_MTP_CARRY_KERNELS=aot; bandwidth against a D2D copy (CUDA events). Needs the
#      `cuda` extra (cuda-python);
#   5. where `tensorrt.plugin` imports: a TensorRT engine with both AOT plugins
#      (builders/build_engine.py), run by the plain TensorRT runtime without the plugin
#      module (scripts/run_trt_engine.py) and compared with the references; else skipped;
#   6. the session benchmark on the GPU at an 8k-token history.
# Usage: bash scripts/gpu_smoke.sh [OUT_DIR]   (inside an environment with the package installed)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-smoke}
mkdir -p "$OUT"
export TRITON_DEFAULT_FP_FUSION=1
python - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device: this script is for a GPU machine"
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB; torch {torch.__version__}")
PY
unset TRITON_INTERPRET
python -m pytest tests/dataplane tests/plugins -q 2>&1 | tee "$OUT/dataplane-tests.txt"
python scripts/bench_kernels.py 2>&1 | tee "$OUT/bench-kernels.txt"
python scripts/bench_row_format.py 2>&1 | tee "$OUT/bench-row-format.txt"
python scripts/bench_host_tier.py --device cuda 2>&1 | tee "$OUT/bench-host-tier.txt"
python builders/build_kernels.py --out "$OUT/kernels" 2>&1 | tee "$OUT/build-kernels.txt"
TARGET=$(python -c "import torch; M, m = torch.cuda.get_device_capability(); print(f'sm_{M}{m}a')")
python builders/build_abi_kernels.py --out "$OUT/abi-kernels" --targets "$TARGET" 2>&1 \
    | tee "$OUT/build-abi-kernels.txt"
python builders/build_abi_kernels.py --out "$OUT/abi-kernels" --targets "$TARGET" \
    --dtypes bf16,fp16 --num-kv-heads 3 --head-dim 40 >/dev/null
python scripts/gpu_check_aot.py --kernel-dir "$OUT/abi-kernels" 2>&1 | tee "$OUT/gpu-check-aot.txt"
if python -c "import tensorrt.plugin" 2>/dev/null; then
    python builders/build_engine.py --kernel-dir "$OUT/abi-kernels" --target "$TARGET" \
        --out "$OUT/carry.engine" 2>&1 | tee "$OUT/build-engine.txt"
    python scripts/run_trt_engine.py "$OUT/carry.engine" 2>&1 | tee "$OUT/run-trt-engine.txt"
else
    echo "skipped: TensorRT engine build/run (tensorrt.plugin does not import here)" \
        | tee "$OUT/run-trt-engine.txt"
fi
trtllm-mtp-carry bench --device cuda --history 8192 --new-span 256 --sessions 3 --turns 4 \
    --no-progress --json "$OUT/bench-8k.json" 2>&1 | tee "$OUT/bench-8k.txt"
echo "gpu smoke: all steps passed; results in $OUT/"
