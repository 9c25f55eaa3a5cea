#!/usr/bin/env bash
# The first run on a GPU machine, in one command (issue 20, item 4):
#   1. the device and toolchain (nvidia-smi, nvcc, torch);
#   2. `python build.py` (skip with --no-build); fails unless dgserve._C has CUDA;
#   3. `pytest -m cuda` plainly (every cuda test FAILS, not skips, when the build lacks CUDA: tests/conftest.py);
#   4. the same tests under compute-sanitizer: memcheck, racecheck, synccheck (our kernels only: --kernel-name
#      kns=dg, override with DG_SANITIZER_FILTER=""), any sanitizer error fails the run;
#   5. the native self-check on the device (python -m dgserve.native_check cuda --mode strict);
#   6. the benches (bench/bench_ops.py subcommands and bench/bench_engine.py), one JSON line per configuration.
# Everything is written under $OUT (default gpu-check-<time>/); the summary at the end lists each step's status.
# Usage: scripts/gpu_check.sh [--no-build] [--no-sanitizer] [--no-bench] [-- extra pytest args]
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-gpu-check-$(date +%Y%m%d-%H%M%S)}
FILTER=${DG_SANITIZER_FILTER-kns=dg}
BUILD=1 SANITIZE=1 BENCH=1
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) BUILD=0 ;; --no-sanitizer) SANITIZE=0 ;; --no-bench) BENCH=0 ;;
    --) shift; break ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
declare -a SUMMARY=()
FAILED=0

step() {  # step NAME LOGFILE COMMAND...: run, tee to the log, record the status
  local name=$1 logf=$2; shift 2
  echo "=== $name: $*" | tee "$OUT/$logf"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$OUT/$logf"
  local rc=${PIPESTATUS[0]}
  SUMMARY+=("$(printf '%-28s rc=%-3s %5ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$OUT/$logf")")
  [ "$rc" -eq 0 ] || FAILED=1
  return "$rc"
}

step device device.txt bash -c "nvidia-smi; nvcc --version; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))'"
if [ "$BUILD" = 1 ]; then
  step build build.txt "$PY" build.py || { echo "build failed: see $OUT/build.txt" >&2; exit 1; }
fi
step cuda-build cuda-build.txt "$PY" -c 'from dgserve import ops; p = ops.cuda_build_problem(); print(ops.native._C.build_info() if ops.native._C else None); raise SystemExit(p)' \
  || { echo "dgserve._C cannot run CUDA kernels: see $OUT/cuda-build.txt" >&2; exit 1; }
step pytest-cuda pytest-cuda.txt "$PY" -m pytest -m cuda -q -rA -p no:cacheprovider "$@"
step self-check self-check.txt "$PY" -m dgserve.native_check cuda --mode strict
if [ "$SANITIZE" = 1 ]; then
  KFILTER=()
  [ -n "$FILTER" ] && KFILTER=(--kernel-name "$FILTER")
  for tool in memcheck racecheck synccheck; do
    extra=()
    [ "$tool" = memcheck ] && extra=(--leak-check full)
    [ "$tool" = racecheck ] && extra=(--racecheck-report all)
    step "sanitizer-$tool" "sanitizer-$tool.txt" compute-sanitizer --tool "$tool" --error-exitcode 99 \
      "${KFILTER[@]}" "${extra[@]}" "$PY" -m pytest -m cuda -q -x -p no:cacheprovider "$@"
  done
fi
if [ "$BENCH" = 1 ]; then
  for sub in moe nvfp4 diffusion_step; do
    step "bench-ops-$sub" "bench-ops-$sub.jsonl" "$PY" bench/bench_ops.py "$sub"
  done
  step bench-engine bench-engine.jsonl "$PY" bench/bench_engine.py --device cuda --dtype bfloat16 --no-baseline
fi
echo
echo "=== summary ($OUT)"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
exit "$FAILED"
