#!/usr/bin/env bash
# CI's CUDA-extension step (.ci/run; docs/gpu-check.md, "The CUDA build in CI"). On this machine, without a GPU:
#   1. a venv of its own (.venv-cuda) with a CUDA build of torch (TORCH_PIN) and pyproject.toml's pins of what
#      build.py and tests/ops import (numpy, pybind11, ninja, pytest, safetensors); dgserve itself is not installed;
#   2. dgserve._C built with its CUDA kernels for sm_90a (build.py --arch sm_90a) into a copy of the package,
#      build/cuda-ext/python/dgserve, so the CPU build in python/dgserve, which the rest of CI uses, stays;
#   3. that extension imported from the copy: it must be a CUDA build that links every op's CUDA path
#      (dgserve.ops.missing_cuda_ops, from build_info()["cuda_ops"]);
#   4. the CPU op tests (tests/ops) with that extension loaded (a CUDA torch runs the CPU paths without a GPU).
# So a change to csrc/ that does not compile or link with CUDA fails here rather than on the GPU machine.
# Where nvcc or TORCH_PIN is missing, it says so on one line and exits 0: skipped, not failed.
# Environment: TORCH_PIN (torch==2.14.1), DGSERVE_CI_CUDA=0 skips, JOBS (nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_PIN=${TORCH_PIN:-torch==2.14.1}
VENV=.venv-cuda
PKG=build/cuda-ext/python
skip() {
    echo "ci: cuda-ext step skipped: $*"
    exit 0
}
quiet_pip() { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; } # the local index's noise
[ "${DGSERVE_CI_CUDA:-1}" = 0 ] && skip "DGSERVE_CI_CUDA=0"
command -v nvcc > /dev/null || [ -x /usr/local/cuda/bin/nvcc ] || skip "nvcc not found"
t0=$SECONDS
[ -x $VENV/bin/python ] || python3 -m venv $VENV
$VENV/bin/pip install -q --dry-run --no-deps "$TORCH_PIN" > /dev/null 2>&1 \
    || skip "pip finds no $TORCH_PIN (the CUDA build of torch) here"
pins=$(grep -oE '"(numpy|pybind11|ninja|pytest|safetensors)==[^"]+"' pyproject.toml | tr -d '"')
# shellcheck disable=SC2086  # the pins are words
$VENV/bin/pip install -q --no-compile "$TORCH_PIN" $pins 2> >(quiet_pip)
$VENV/bin/python -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' \
    || skip "$TORCH_PIN installed here is not a CUDA build"
echo "ci: cuda-ext: $VENV ready in $((SECONDS - t0)) s"
rm -rf $PKG
mkdir -p $PKG
cp -a python/dgserve $PKG/
rm -f $PKG/dgserve/_C*.so
$VENV/bin/python build.py --no-proto --arch sm_90a --jobs "${JOBS:-$(nproc)}" --package-dir $PKG/dgserve
PYTHONPATH=$PKG $VENV/bin/python - << 'EOF'
import pathlib

from dgserve import ops

path = ops.native.extension_path()
where = pathlib.Path(path).resolve() if path else None
assert where is not None and "cuda-ext" in where.parts, f"dgserve._C was not loaded from the copy: {where}"
problem = ops.cuda_build_problem()
assert problem is None, problem
print(f"ci: cuda-ext: {where.name}: CUDA paths of {', '.join(ops.native.build_info()['cuda_ops'])}")
EOF
PYTHONPATH=$PKG $VENV/bin/python -m pytest -q -p no:cacheprovider tests/ops
echo "ci: cuda-ext step done in $((SECONDS - t0)) s"
