#!/usr/bin/env bash
# The GPU suite: one script for a lent H200 (or any sm_80+ GPU), run from anywhere:
#   bash python/gpu_suite.sh
# 1. builds the extension with the CUDA kernels (TORCH_CUDA_ARCH_LIST=9.0, MAX_JOBS=16)
#    out of tree (build/gpu/out, loaded through TOPG_NATIVE_DIR);
# 2. runs the CUDA tests (every kernel against its reference, opcheck, torch.compile,
#    a CUDA graph capture), TOPG_REQUIRE_NATIVE=1;
# 3. runs a few small awkward cases of every kernel under compute-sanitizer memcheck;
# 4. runs the GPU benchmarks (CUDA events, warm-up, median) against the issue's targets.
# Logs and the results table go to $OUT (the device tool's output folder; ./gpu_out if
# unset): summary.md, env.txt, build.log, tests.log, sanitizer.log, bench.log,
# results.md, results.json, offload_tests.log, offload_bench.log, offload.md (11 files).
# Each stage has a time limit; the whole suite is
# meant to finish in under 8 minutes. The exit code is non-zero if a stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}"
export PYTHONUNBUFFERED=1
start=$(date +%s)
status=0
summary="$OUT/summary.md"
: >"$summary"
note() { echo "- [$(($(date +%s) - start)) s] $*" | tee -a "$summary"; }
stage() { # stage <name> <seconds> <log> <command...>: run with a time limit, note the result
  local name=$1 limit=$2 log=$3
  shift 3
  local t0 rc
  t0=$(date +%s)
  timeout "$limit" "$@" >"$log" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ]; then status=1; fi
  note "$name: exit $rc in $(($(date +%s) - t0)) s (limit $limit s), log $(basename "$log")"
  tail -n 3 "$log" | sed 's/^/    /' | tee -a "$summary"
  return "$rc"
}

{
  echo "# environment"
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  command -v nvcc && nvcc --version | tail -n 2
  command -v compute-sanitizer || echo "compute-sanitizer: not found"
  git -C "$ROOT" log -1 --oneline 2>/dev/null || true
} >"$OUT/env.txt" 2>&1
note "GPU suite on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"

BUILD="$ROOT/build/gpu"
build() {
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DPython3_EXECUTABLE="$(command -v "$PY")" \
    -DTOPG_OUTPUT_DIR="$BUILD/out" -DTOPG_CUDA=ON &&
    cmake --build "$BUILD" -- -j"$MAX_JOBS"
}
if ! stage build 180 "$OUT/build.log" build; then
  note "build failed: nothing else can run"
  exit 1
fi
export TOPG_NATIVE_DIR="$BUILD/out"

stage tests 150 "$OUT/tests.log" env TOPG_REQUIRE_NATIVE=1 "$PY" -m pytest -q -rs -p no:cacheprovider \
  tests/test_cuda_ops.py tests/test_cuda_attention.py

# offload (issue 7): bitwise vs resident on the GPU, then H2D rate and offloaded forward
stage offload-tests 90 "$OUT/offload_tests.log" "$PY" -m pytest -q -rs -s -p no:cacheprovider \
  tests/test_cuda_offload.py
stage offload-bench 90 "$OUT/offload_bench.log" "$PY" python/benchmarks/gpu/offload_h2d.py \
  --quick --md "$OUT/offload.md"

if command -v compute-sanitizer >/dev/null; then
  stage sanitizer 90 "$OUT/sanitizer.log" compute-sanitizer --tool memcheck --error-exitcode 3 \
    "$PY" python/benchmarks/gpu/sanitize_cases.py
else
  note "sanitizer: compute-sanitizer not on PATH, skipped"
fi

stage benchmarks 110 "$OUT/bench.log" "$PY" python/benchmarks/gpu/bench_gpu.py \
  --md "$OUT/results.md" --json "$OUT/results.json"
if [ -f "$OUT/results.md" ]; then cat "$OUT/results.md"; fi
if [ -f "$OUT/offload.md" ]; then cat "$OUT/offload.md"; fi
note "done in $(($(date +%s) - start)) s, status $status"
exit "$status"
