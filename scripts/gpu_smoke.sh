#!/usr/bin/env bash
# The one GPU check: run on a fresh NVIDIA GPU machine (H100/H200, GB10, B200...) with python3,
# torch with CUDA and Triton; no TensorRT needed. About 6 minutes on an H200 (the 2026-12-04 run's
# steps took 6; engine-cuda, restore-check and standin-race are new and estimated at under a
# minute together: see BENCHMARKS.md, "What the next GPU run fills in").
#
#   bash scripts/gpu_smoke.sh [OUT_DIR]        (default OUT_DIR: gpu-smoke-<UTC date-time>)
#
# Every step runs, even after one fails, each under its own time limit (`timeout`), each with its
# output in its own log in OUT_DIR (the tail is printed afterwards; a killed step keeps its log):
#   tests          the whole test suite on CUDA (pytest -n <cores> --dist loadfile where
#                  pytest-xdist imports, as scripts/test.sh); the reference engine's tests on the CPU
#   engine-cuda    the engine and runtime tests with the reference engine on the GPU
#                  (MTP_CARRY_TEST_DEVICE=cuda: tests/engine_factories.py), the prep's CUDA sync test
#   aot-build      the TensorRT plugins' kernels ahead of time (builders/build_abi_kernels.py)
#   aot-check      their exact PTX through the CUDA driver, bit for bit, and their kernel
#                  bandwidth in CUDA graphs (scripts/gpu_check_aot.py); SKIP without cuda-python
#   kernels        both kernels at 512 / 4k / 64k / 256k rows: per call vs index_copy_, kernel
#                  time vs a D2D copy (scripts/bench_kernels.py)
#   fp8-codec      the FP8 row codec against a plain copy (scripts/bench_row_format.py); CHECK:
#                  every row codec's gather into an arena extent (out=) holds the CPU path's bytes,
#                  nothing outside the extent written
#   host-tier      demote/restore against the pinned-copy ceiling (scripts/bench_host_tier.py);
#                  CHECK: the pinned bytes held are exactly the host budgets (registered once,
#                  no host copy in torch's power-of-two pinned pool)
#   restore-check  rows read back after a host restore equal the demoted ones, unsynced, with
#                  and without delays queued on each stream (scripts/gpu_check_restore.py)
#   session-28k    the session bench at a 28k-token history: carry, carry-fp8, carry-nvfp4, rebuild, blind
#   host-hits      the same history with every carry-host warm turn adopted from the host tier;
#                  per warm turn carry-host's accepted/drafted must equal carry's exactly
#   sessions-64    64 sessions at concurrency 32
#   standin-cuda   the TensorRT-LLM adapter's data path on the stand-in with CUDA pages (its
#                  draft manager's own stream), every scattered row read back
#   standin-race   the same with delays queued on the executor's and the draft stream and every
#                  scattered row read back on the executor's stream with no sync first
#   trt-engine     where `tensorrt.plugin` imports: an engine with both plugins, built and run;
#                  else SKIP
# It ends with one table (scripts/gpu_smoke_table.py): a row per step (exit code, seconds),
# every CHECK (PASS/FAIL) and every FIGURE with its target, collected from the steps' logs.
# Exit status: 1 on any correctness failure (a correctness step's non-zero exit or a CHECK
# FAIL), 2 on a machine without CUDA, else 0. A FIGURE that misses its target is reported only.
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if ! command -v python3 >/dev/null 2>&1; then
    echo "gpu_smoke: error: python3 not found" >&2
    exit 2
fi
if ! DEVICE_LINE=$(python3 - 2>/dev/null <<'PY'
import torch
if not torch.cuda.is_available():
    raise SystemExit(1)
p = torch.cuda.get_device_properties(0)
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "absent"
print(f"device: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB; "
      f"torch {torch.__version__} (CUDA {torch.version.cuda}); triton {tv}")
PY
); then
    echo "gpu_smoke: error: no CUDA device (torch.cuda.is_available() is False in python3): this check needs an NVIDIA GPU" >&2
    exit 2
fi

OUT=${1:-gpu-smoke-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
: > "$OUT/steps.tsv"
echo "$DEVICE_LINE" | tee "$OUT/device.txt"
echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown); out: $OUT"

export TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's package, installed or not
CORES=$(nproc 2>/dev/null || echo 4)
TABLE="python3 $ROOT/scripts/gpu_smoke_table.py"
CARRY="python3 -m trtllm_mtp_carry.cli"  # the `trtllm-mtp-carry` command, installed or not

# step NAME KIND LIMIT_S CMD...: run CMD under `timeout`, output to OUT/NAME.log, one steps.tsv row.
step() {
    local name=$1 kind=$2 limit=$3
    shift 3
    local log="$OUT/$name.log" t0=$SECONDS rc
    echo "== $name (limit ${limit} s): $*"
    timeout --kill-after=15 "$limit" "$@" > "$log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$kind" "$rc" "$((SECONDS - t0))" "$name.log" >> "$OUT/steps.tsv"
    echo "   exit $rc after $((SECONDS - t0)) s; log $log:"
    tail -n 4 "$log" | sed 's/^/   | /'
    return 0
}

# skip NAME KIND REASON: a step that cannot run here (recorded as skip, not a failure).
skip() {
    echo "SKIP: $3" > "$OUT/$1.log"
    printf '%s\t%s\tskip\t0\t%s\n' "$1" "$2" "$1.log" >> "$OUT/steps.tsv"
    echo "== $1: SKIP ($3)"
}

# 1. the whole suite on CUDA, in parallel where pytest-xdist is importable (each file whole on
# one worker, as scripts/test.sh); then the engine and runtime tests with the engine on the GPU
if python3 -c "import xdist" 2>/dev/null; then
    PAR=(-n "$CORES" --dist loadfile)
else
    PAR=()
fi
step tests correctness 240 python3 -m pytest tests -q ${PAR[@]+"${PAR[@]}"} -p no:cacheprovider
$TABLE step-check "test suite on CUDA" "$(tail -n 1 "$OUT/steps.tsv" | cut -f3)" "$OUT/tests.log"
step engine-cuda correctness 180 env MTP_CARRY_TEST_DEVICE=cuda python3 -m pytest tests/engine tests/runtime \
    -q ${PAR[@]+"${PAR[@]}"} -p no:cacheprovider
$TABLE step-check "engine and runtime tests with the engine on the GPU" \
    "$(tail -n 1 "$OUT/steps.tsv" | cut -f3)" "$OUT/engine-cuda.log"

# 2. the plugins' kernels ahead of time, then their PTX through the CUDA driver
TARGET=$(python3 -c "import torch; M, m = torch.cuda.get_device_capability(); print(f'sm_{M}{m}a')")
step aot-build correctness 120 bash -c "python3 builders/build_abi_kernels.py --out '$OUT/abi-kernels' \
    --targets $TARGET && python3 builders/build_abi_kernels.py --out '$OUT/abi-kernels' \
    --targets $TARGET --dtypes bf16,fp16 --num-kv-heads 3 --head-dim 40"
if python3 -c "from cuda.bindings import driver" 2>/dev/null || python3 -c "from cuda import cuda" 2>/dev/null; then
    step aot-check correctness 150 python3 scripts/gpu_check_aot.py --kernel-dir "$OUT/abi-kernels"
else
    skip aot-check correctness "cuda-python is not installed (pip install 'trtllm-mtp-carry[cuda]')"
fi

# 3. speed: the kernels, the FP8 codec, the host tier
step kernels speed 150 python3 scripts/bench_kernels.py --rows 512 4096 65536 262144
step fp8-codec correctness 90 python3 scripts/bench_row_format.py
step host-tier correctness 90 python3 scripts/bench_host_tier.py --device cuda
step restore-check correctness 90 python3 scripts/gpu_check_restore.py --device cuda --delay-cycles 20000000

# 4. the session bench (outputs must be identical across policies)
step session-28k correctness 260 $CARRY bench --device cuda --history 28000 --new-span 512 \
    --policies carry,carry-fp8,carry-nvfp4,rebuild,blind --no-progress --figures --json "$OUT/session-28k.json"
$TABLE json-check "session bench 28k outputs identical" "$OUT/session-28k.json" "$OUT/session-28k.log"
# host-tier hits: one device slot, two interleaved sessions, so every carry-host warm turn adopts
# from host memory (FIGURE carry-host ttft / carry, target <= 1.05x)
step host-hits correctness 150 $CARRY bench --device cuda --history 28000 --new-span 512 --sessions 2 \
    --interleave --policies carry,carry-host --no-progress --figures --json "$OUT/host-hits.json"
$TABLE json-check "host-tier hits outputs identical" "$OUT/host-hits.json" "$OUT/host-hits.log"
$TABLE accept-check "host-tier hits accepted/drafted equal carry's per warm turn" "$OUT/host-hits.json" \
    "$OUT/host-hits.log" carry-host carry
step sessions-64 correctness 120 $CARRY bench --device cuda --concurrency 32 --sessions 64 \
    --history 1024 --no-progress --json "$OUT/sessions-64.json"
$TABLE json-check "64 sessions at concurrency 32 outputs identical" "$OUT/sessions-64.json" \
    "$OUT/sessions-64.log"

# 5. the TensorRT-LLM adapter's data path with CUDA pages (the stand-in executor)
# (exit 1 when the policies' outputs differ)
step standin-cuda correctness 150 python3 scripts/trtllm_standin_bench.py --device cuda --fp8 \
    --history 4096 --sessions 2 --turns 3
$TABLE step-check "stand-in with CUDA pages outputs identical" \
    "$(tail -n 1 "$OUT/steps.tsv" | cut -f3)" "$OUT/standin-cuda.log"
step standin-race correctness 120 python3 scripts/trtllm_standin_bench.py --device cuda --fp8 \
    --history 1024 --sessions 2 --turns 3 --delay-cycles 20000000
$TABLE step-check "stand-in race check outputs identical" \
    "$(tail -n 1 "$OUT/steps.tsv" | cut -f3)" "$OUT/standin-race.log"

# 6. TensorRT, where it imports
if python3 -c "import tensorrt.plugin" 2>/dev/null; then
    step trt-engine correctness 240 bash -c "python3 builders/build_engine.py --kernel-dir \
        '$OUT/abi-kernels' --target $TARGET --out '$OUT/carry.engine' \
        && python3 scripts/run_trt_engine.py '$OUT/carry.engine'"
else
    skip trt-engine correctness "tensorrt.plugin does not import here"
fi

echo
$TABLE "$OUT" | tee "$OUT/summary.txt"
exit "${PIPESTATUS[0]}"
