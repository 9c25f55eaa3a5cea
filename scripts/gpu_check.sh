#!/usr/bin/env bash
# The GPU machine's check in one command, sized to fit 8 minutes on a 16-core H100/H200 host from a bare
# checkout (docs/gpu-check.md: the steps, their expected times, what each proves). Steps, in order of what a
# short lease must not miss (correctness first, then the figures, then the long tails):
#   device        nvidia-smi, nvcc, torch; then the arch this machine builds (build.py --arch native)
#   build         python build.py --arch native --jobs $JOBS (one arch, parallel); stops the run on failure
#   cuda-build    dgserve._C imports, has CUDA and every op's CUDA path (gpu_kernels.py build-info); stops the run
#   self-check    python -m dgserve.ops.native_check cuda --mode strict
#   pytest-cuda   the cuda tests of CUDA_TESTS in parallel (pytest-xdist), OMP_NUM_THREADS = cores / workers;
#                 strict native ops (tests/conftest.py): a test fails when an op is switched off in its worker.
#                 Paths named, so collection needs only what the GPU image has (tests/test_gpu_check.py)
#   bench-nvfp4   bench/bench_engine.py --shape 26b-a4b --experts nvfp4 (the native W4A16 path + its baseline)
#   bench-bf16    the same with bf16 experts
#   big-step      one diffusion step over > 2^31 logits (scripts/gpu_kernels.py big-step)
#   memcheck      compute-sanitizer memcheck over scripts/gpu_kernels.py launch (every kernel once, small
#                 shapes), PYTORCH_NO_CUDA_MEMORY_CACHING=1 so torch's pool cannot hide an overrun; no leak check
#   racecheck     the same launches under racecheck
#   synccheck     the same under synccheck, with whatever time is left
# Every step runs under `timeout`: its own cap, never past the run's budget (BUDGET, default 480 s); a step is
# skipped when less than its least useful time is left (15 s; a bench: BENCH_MIN, 60 s: the weights, the engine
# and the batch-1 and batch-16 steps). At most 7 files are written under $OUT; summary.txt lists each step's
# status and seconds.
# Usage: scripts/gpu_check.sh [--dry-run] [--print-pytest-commands] [--no-build] [--no-sanitizer] [--no-bench]
#   --dry-run                  print each step's command and time cap, run nothing
#   --print-pytest-commands    print the arguments of each pytest run (after `python -m pytest`), one per line
# Environment: PYTHON (python3), OUT (gpu-check-<time>), JOBS (nproc), BUDGET (480), BENCH_MIN (60),
# DG_SANITIZER_FILTER (kns=dg; "" checks every kernel), COMPUTE_SANITIZER (found on PATH or under
# /usr/local/cuda/bin).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
OUT=${OUT:-gpu-check-$(date +%Y%m%d-%H%M%S)}
JOBS=${JOBS:-$(nproc)}
BUDGET=${BUDGET:-480}
BENCH_MIN=${BENCH_MIN:-60}
FILTER=${DG_SANITIZER_FILTER-kns=dg}
SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
export PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH}

# The test files that hold cuda-marked tests (grep -l 'mark.cuda' tests): named so that pytest never imports
# the service's tests, whose packages (grpc health, jsonschema, llguidance, fastapi, ...) the image lacks.
CUDA_TESTS=(
  tests/ops/test_cuda_edge_cases.py tests/ops/test_diffusion_step_cuda.py tests/ops/test_linear.py tests/ops/test_moe_align.py
  tests/ops/test_moe_combine.py tests/ops/test_moe_experts.py tests/ops/test_moe_route.py
  tests/ops/test_nvfp4_cuda.py tests/test_engine_cuda.py tests/test_fp8_w8a8_cuda.py
)
WORKERS=$((JOBS / 2 > 8 ? 8 : (JOBS / 2 > 1 ? JOBS / 2 : 1)))  # each worker holds a CUDA context (~0.5 GB)
THREADS=$((JOBS / WORKERS))  # CPU threads per worker (the tests' CPU references), so workers do not oversubscribe

pytest_commands() {  # one line per pytest run: its arguments after `python -m pytest`
  echo "-m cuda -q -rfE -p no:cacheprovider -n $WORKERS ${CUDA_TESTS[*]}"
}

DRY=0 BUILD=1 SANITIZE=1 BENCH=1
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --print-pytest-commands) pytest_commands; exit 0 ;;
    --no-build) BUILD=0 ;; --no-sanitizer) SANITIZE=0 ;; --no-bench) BENCH=0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ "$DRY" = 1 ] || mkdir -p "$OUT"
declare -a SUMMARY=()
FAILED=0

left() {  # left CAP: the seconds a step may take: its cap, within what is left of the budget
  local rest=$((BUDGET - SECONDS))
  echo $((rest < $1 ? rest : $1))
}

step() {  # [MIN=s] step NAME CAP LOGFILE COMMAND...: run under timeout (skipped with under MIN s, default 15,
  # of the budget left), append to $OUT/LOGFILE, record status and time
  local name=$1 cap=$2 logf=$3 need=${MIN:-15}; shift 3
  local t
  t=$(left "$cap")
  if [ "$DRY" = 1 ]; then
    echo "[dry-run] $name (at most ${cap}s, skipped under ${need}s) > $logf: $*"
    return 0
  fi
  if [ "$t" -lt "$need" ]; then
    SUMMARY+=("$(printf '%-12s %-8s %5ss  %s' "$name" skipped 0 "needs ${need} s, ${t} s of the budget left")")
    return 1
  fi
  echo "=== $name (timeout ${t}s): $*" | tee -a "$OUT/$logf"
  local t0=$SECONDS
  timeout -k 10 "$t" "$@" 2>&1 | tee -a "$OUT/$logf"
  local rc=${PIPESTATUS[0]} status=ok
  [ "$rc" -eq 0 ] || status="rc=$rc"
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && status="timeout"
  SUMMARY+=("$(printf '%-12s %-8s %5ss  %s' "$name" "$status" "$((SECONDS - t0))" "$logf")")
  [ "$rc" -eq 0 ] || FAILED=1
  return "$rc"
}

finish() {
  [ "$DRY" = 1 ] && exit 0
  { echo "gpu_check $(git rev-parse --short HEAD 2>/dev/null) on $(hostname), ${SECONDS}s of ${BUDGET}s"
    printf '%s\n' "${SUMMARY[@]}"; } | tee "$OUT/summary.txt"
  exit "$FAILED"
}

step device 30 device.txt bash -c "nvidia-smi; nvcc --version; $PY -c 'import torch; print(torch.__version__, \
torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))'; $PY build.py --help >/dev/null"
if [ "$BUILD" = 1 ]; then
  step build 240 build.txt "$PY" build.py --arch native --jobs "$JOBS" || finish
fi
step cuda-build 30 device.txt "$PY" scripts/gpu_kernels.py build-info || finish
step self-check 60 checks.txt "$PY" -m dgserve.ops.native_check cuda --mode strict
while read -r -a args; do
  step pytest-cuda 150 pytest-cuda.txt env OMP_NUM_THREADS="$THREADS" "$PY" -m pytest "${args[@]}"
done < <(pytest_commands)
if [ "$BENCH" = 1 ]; then
  # the bench stops starting figures 20 s before its timeout, so what it measured is printed
  for experts in nvfp4 bf16; do
    cap=$([ "$experts" = nvfp4 ] && echo 110 || echo 75)
    MIN=$BENCH_MIN step "bench-$experts" "$cap" bench.txt "$PY" bench/bench_engine.py --shape 26b-a4b \
      --device cuda --experts "$experts" --figures --max-seconds $(($(left "$cap") - 20))
  done
fi
step big-step 60 checks.txt "$PY" scripts/gpu_kernels.py big-step
KFILTER=()
[ -n "$FILTER" ] && KFILTER=(--kernel-name "$FILTER")
sanitize() {  # sanitize TOOL CAP EXTRA...: scripts/gpu_kernels.py launch under compute-sanitizer --tool TOOL
  local tool=$1 cap=$2; shift 2
  step "$tool" "$cap" sanitizer.txt env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SAN" --tool "$tool" \
    --error-exitcode 99 "${KFILTER[@]}" "$@" "$PY" scripts/gpu_kernels.py launch
}
if [ "$SANITIZE" = 1 ]; then
  sanitize memcheck 90 --leak-check no
  sanitize racecheck 90 --racecheck-report all
  sanitize synccheck 90
fi
finish
