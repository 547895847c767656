#!/usr/bin/env bash
# The GPU suite, as two back-to-back runs that each fit one command of a short GPU run
# (at most 600 s a command, 15 minutes in all; docs/gpu.md says exactly how to call them
# and how to read what comes back):
#
#   bash python/gpu_suite.sh build-test   # <= 300 s: build for sm_90 against the machine's
#                                         #   own torch, CUDA tests, the dispatch's tuning
#                                         #   table (tune), compute-sanitizer memcheck
#   bash python/gpu_suite.sh bench        # <= 240 s: GPU benchmarks, CUDA-graph capture tests,
#                                         #   offload H2D benchmark (reuses build-test's build)
#   bash python/gpu_suite.sh profile      # <= 190 s, optional: engine decode with / without
#                                         #   CUDA graphs; Nsight Compute over the slowest kernels
#   bash python/gpu_suite.sh <mode> --dry-run   # print the stages, limits and files; run nothing
#
# Each stage runs under its own `timeout`, and a mode's stages never outlast its budget
# (a stage gets at most the time the mode has left). Each mode writes at most 8 files to
# $OUT (./gpu_out if unset), what a short GPU run brings back: summary.md (environment, one
# row per stage, the tail of each failed log, the result tables), one log per stage and,
# for build-test, tuning.json (the table `python -m torch_topg tune` measured).
# Exit status: 0 all stages passed; 1 a stage failed; 2 no usable GPU (nothing was run);
# 64 usage error.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

usage() {
  sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 64
}
MODE=${1:-}
DRY=0
case "${2:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) usage ;;
esac
[ "$#" -le 2 ] || usage

OUT="${OUT:-$ROOT/gpu_out}"
PY="${PYTHON:-python3}"
BUILD="$ROOT/build/gpu"
LIB_DIR="$BUILD/out" # _C.so there means a finished build (the link is its last step)
# Lean build: one architecture (the H200 is sm_90), every core of the GPU machine.
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TOPG_NATIVE_DIR="$LIB_DIR"
export TOPG_REQUIRE_NATIVE=1

# Stages per mode: "name limit_s log command". The limits of a mode add up to at most
# its budget (checked below); the budget leaves 10 s of the run's timeout_s for the
# summary. Tests whose name contains "capture" (CUDA-graph capture) run in `bench`.
q() { printf '%q' "$1"; }
PYTEST="$(q "$PY") -m pytest -q -rs -p no:cacheprovider"
# Device-parametrised op tests: the test files that import tests/op_samples.py (one
# sample_inputs(op, device) per op); their CUDA cases are those whose id contains "cuda".
device_tests() {
  local f
  for f in tests/test_*.py; do
    case "$f" in tests/test_cuda_*) continue ;; esac
    if grep -qE "^(from op_samples import|import op_samples)" "$f"; then printf ' %s' "$f"; fi
  done
}
CUDA_TESTS="tests/test_cuda_*.py$(device_tests)"
# Eight pytest workers when pytest-xdist is there (it is in the GPU machine's image; the
# machine has 16 cores): the tests fit their limit, and a kernel fault that poisons a CUDA
# context takes down one worker, which xdist replaces (up to its limit on replacements:
# 2026-12-04, a crash in every error path ended the stage at 17% of the tests).
XDIST="\$($(q "$PY") -c 'import xdist' >/dev/null 2>&1 && printf '%s' '-n 8')"
CONFIGURE="cmake -S $(q "$ROOT") -B $(q "$BUILD") -G Ninja -DPython3_EXECUTABLE=\$(command -v $(q "$PY")) \
-DTOPG_OUTPUT_DIR=$(q "$LIB_DIR") -DTOPG_CUDA=ON"
# Configured once: a configure re-runs the torch queries (about 20 s), and `cmake --build`
# configures again by itself when a CMake file changed.
BUILD_CMD="{ [ -f $(q "$BUILD/build.ninja") ] || $CONFIGURE; } && cmake --build $(q "$BUILD") -- -j$MAX_JOBS && $(q "$PY") python/check_cuda_build.py $(q "$LIB_DIR")"

RESULTS=()
OUTPUTS=()
case "$MODE" in
  build-test)
    BUDGET=290
    # tune: every implementation of the dispatched ops (docs/gpu.md, "Dispatch") timed at
    # the quick shapes; its own budget (--budget) ends it well inside the stage's limit,
    # so the table is written before the stage's timeout could stop it.
    STAGES=(
      "build 125 build.log $BUILD_CMD"
      "tests 90 tests.log $PYTEST $XDIST $CUDA_TESTS -k 'cuda and not capture'"
      "tune 45 tune.log $(q "$PY") -m torch_topg tune --quick --budget 25 --out $(q "$OUT/tuning.json")"
      "sanitizer 10 sanitizer.log compute-sanitizer --tool memcheck --error-exitcode 3 $(q "$PY") python/benchmarks/gpu/sanitize_cases.py"
    )
    OUTPUTS=(tuning.json)
    ;;
  bench)
    BUDGET=230
    # build-test's build is reused while the machine is still warm (ninja finds nothing to
    # do: the 30 s limit). On a fresh machine the build runs again under build-test's
    # limit, which the deadline then takes from the later stages; the benchmarks run
    # --quick to fit.
    QUICK=""
    [ -f "$LIB_DIR/_C.so" ] || QUICK=" --quick"
    STAGES=(
      "build 30 build.log $BUILD_CMD"
      "benchmarks 90 bench.log $(q "$PY") python/benchmarks/gpu/bench_gpu.py$QUICK --md $(q "$OUT/results.md") --json $(q "$OUT/results.json")"
      "capture 50 capture.log $PYTEST $CUDA_TESTS -k 'cuda and capture'"
      "offload 35 offload.log $(q "$PY") python/benchmarks/gpu/offload_h2d.py --quick --md $(q "$OUT/offload.md")"
    )
    RESULTS=(results.md offload.md)
    ;;
  profile)
    # Optional third call (docs/gpu.md): the engine's decode with and without CUDA graphs,
    # and Nsight Compute over the kernels furthest from their targets.
    BUDGET=180
    QUICK=""
    [ -f "$LIB_DIR/_C.so" ] || QUICK=" --quick"
    NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)"
    STAGES=(
      "build 30 build.log $BUILD_CMD"
      "engine 75 engine.log $(q "$PY") python/benchmarks/gpu/engine_decode.py$QUICK --md $(q "$OUT/engine.md")"
      "ncu 55 ncu.log $(q "${NCU:-ncu}") --profile-from-start off --clock-control none --section SpeedOfLight \
--section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \
$(q "$PY") python/benchmarks/gpu/profile_cases.py"
    )
    RESULTS=(engine.md)
    ;;
  *) usage ;;
esac
REBUILD_LIMIT=125
PREFLIGHT_LIMIT=20

# Self-check: the stage limits fit the budget, the files fit the 8 a run brings back.
total=$PREFLIGHT_LIMIT
files=(summary.md)
for s in "${STAGES[@]}"; do
  read -r name limit log _ <<<"$s"
  total=$((total + limit))
  files+=("$log")
done
files+=("${RESULTS[@]}" "${OUTPUTS[@]}")
[ "$MODE" = bench ] && files+=(results.json)
if [ "$total" -gt "$BUDGET" ] || [ "${#files[@]}" -gt 8 ]; then
  echo "gpu_suite.sh $MODE: stage limits $total s (budget $BUDGET s), ${#files[@]} files (at most 8)" >&2
  exit 64
fi

if [ "$DRY" = 1 ]; then
  echo "mode $MODE: budget $BUDGET s, stage limits $total s (preflight $PREFLIGHT_LIMIT s)"
  echo "stage preflight limit=${PREFLIGHT_LIMIT}s log=summary.md cmd: nvidia-smi; $PY -c 'import torch; torch.cuda.is_available()' (plus the versions, into summary.md)"
  for s in "${STAGES[@]}"; do
    read -r name limit log cmd <<<"$s"
    echo "stage $name limit=${limit}s log=$log cmd: $cmd"
  done
  [ "$MODE" = bench ] && [ ! -f "$LIB_DIR/_C.so" ] && echo "(no build in build/gpu: the build stage gets ${REBUILD_LIMIT} s, taken from the later stages; the benchmarks run --quick)"
  echo "writes (${#files[@]}): ${files[*]}"
  exit 0
fi

mkdir -p "$OUT"
start=$(date +%s)
deadline=$((start + BUDGET))
status=0
summary="$OUT/summary.md"
ENV_TXT=$(mktemp)
trap 'rm -f "$ENV_TXT"' EXIT
rows=()
failed_logs=()

write_summary() {
  {
    echo "# GPU suite: $MODE ($(date -u +%FT%TZ), $(($(date +%s) - start)) s of $BUDGET s, status $status)"
    echo
    echo '```'
    cat "$ENV_TXT" 2>/dev/null
    echo '```'
    echo
    echo "| stage | exit | seconds | limit | log |"
    echo "|---|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
    for log in "${failed_logs[@]}"; do
      echo
      echo "## $log (last 30 lines)"
      echo '```'
      tail -n 30 "$OUT/$log"
      echo '```'
    done
    for r in "${RESULTS[@]}"; do
      if [ -f "$OUT/$r" ]; then
        echo
        echo "## $r"
        echo
        cat "$OUT/$r"
      fi
    done
  } >"$summary.tmp"
  mv "$summary.tmp" "$summary"
}

# Preflight (one torch import): a machine without a usable GPU stops here, before anything
# is built.
{
  echo "mode $MODE, commit $(git -C "$ROOT" log -1 --format='%h %s' 2>/dev/null || echo unknown)"
  if command -v nvidia-smi >/dev/null; then
    timeout 5 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1
  else
    echo "nvidia-smi: not on PATH"
  fi
  if command -v nvcc >/dev/null; then nvcc --version | grep release; else echo "nvcc: not on PATH"; fi
  command -v compute-sanitizer || echo "compute-sanitizer: not on PATH"
  echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS build=$BUILD"
  # The toolchain as CMake will see it (a -static-libstdc++ here once crashed every error path).
  echo "CXX=${CXX:-} CUDAHOSTCXX=${CUDAHOSTCXX:-} CXXFLAGS=${CXXFLAGS:-} LDFLAGS=${LDFLAGS:-}"
} >"$ENV_TXT" 2>&1
timeout 15 "$PY" -c "
import sys, torch
ok = torch.cuda.is_available()
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'device', torch.cuda.get_device_name(0) if ok else None)
sys.exit(0 if ok else 1)" >>"$ENV_TXT" 2>&1
rc=$?
if [ "$rc" -ne 0 ]; then
  status=2
  rows+=("| preflight | $rc | $(($(date +%s) - start)) | $PREFLIGHT_LIMIT | - (no usable GPU: torch.cuda.is_available() is not True for $PY, or torch did not import; nothing was run) |")
  write_summary
  cat "$summary"
  exit 2
fi
rows+=("| preflight | 0 | $(($(date +%s) - start)) | $PREFLIGHT_LIMIT | summary.md |")

run_stage() { # run_stage <name> <limit> <log> <command>: time-limited, noted in the summary
  local name=$1 limit=$2 log=$3 cmd=$4 left t0 rc
  left=$((deadline - $(date +%s)))
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  if [ "$limit" -lt 5 ]; then
    rows+=("| $name | skipped | 0 | - | no time left in the $BUDGET s budget |")
    status=1
    return 1
  fi
  t0=$(date +%s)
  echo "\$ $cmd" >"$OUT/$log"
  timeout -k 5 "$limit" bash -c "$cmd" >>"$OUT/$log" 2>&1
  rc=$?
  [ "$rc" -eq 124 ] && echo "gpu_suite.sh: stopped at the stage limit ($limit s)" >>"$OUT/$log"
  rows+=("| $name | $rc | $(($(date +%s) - t0)) | $limit | $log |")
  if [ "$rc" -ne 0 ]; then
    status=1
    failed_logs+=("$log")
  fi
  echo "[$(($(date +%s) - start)) s] $name: exit $rc"
  return "$rc"
}

# nvcc may live outside PATH on the GPU image; cmake and ninja come with its Python.
PATH="$(dirname "$(command -v "$PY")"):$PATH"
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then PATH="/usr/local/cuda/bin:$PATH"; fi
export PATH

for s in "${STAGES[@]}"; do
  read -r name limit log cmd <<<"$s"
  if [ "$name" = build ] && [ ! -f "$LIB_DIR/_C.so" ]; then limit=$REBUILD_LIMIT; fi
  if [ "$name" = sanitizer ] && ! command -v compute-sanitizer >/dev/null; then
    rows+=("| sanitizer | skipped | 0 | $limit | compute-sanitizer not on PATH |")
    continue
  fi
  if ! run_stage "$name" "$limit" "$log" "$cmd" && [ "$name" = build ]; then
    rows+=("| (rest) | skipped | 0 | - | the build failed: nothing else can run |")
    break
  fi
done
write_summary
cat "$summary"
exit "$status"
