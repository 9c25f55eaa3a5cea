#!/usr/bin/env bash
# The project's static checks, run exactly this way by CI (.ci/run) and by pre-commit (.pre-commit-config.yaml):
#
#   ruff          ruff check                      lint (rules: pyproject.toml [tool.ruff.lint])
#   format        ruff format --check             Python formatting
#   mypy          mypy                            types of dgserve and service/ (pyproject.toml [tool.mypy])
#   clang-format  clang-format --dry-run -Werror  csrc/ C++ and CUDA (.clang-format)
#   buf           buf lint                        proto/ (buf.yaml)
#
# Usage: bash tools/lint.sh                 every check; exit status 1 if any fails (all of them still run)
#        bash tools/lint.sh ruff mypy       only the named checks
#        bash tools/lint.sh --fix           apply the mechanical fixes instead: ruff format, ruff check --fix,
#                                           ruff format again, clang-format -i (then re-run the checks)
#
# The tools are pinned in pyproject.toml's [dev] extra (`.venv/bin/pip install -e '.[dev]'`). They are taken
# from the Python environment of $LINT_PYTHON, else of .venv/bin/python, else of python3 on PATH.
set -uo pipefail
cd "$(dirname "$0")/.."

LINT_PYTHON=${LINT_PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3)}
BIN=$(dirname "$LINT_PYTHON")
ALL=(ruff format mypy clang-format buf)

tool() {  # the path of a pinned tool, or a message saying how to install it
  if [ -x "$BIN/$1" ]; then
    echo "$BIN/$1"
  elif command -v "$1" >/dev/null; then
    command -v "$1"
  else
    echo "lint: $1 not found in $BIN or on PATH: pip install -e '.[dev]'" >&2
    return 1
  fi
}

csrc_files() { find csrc -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \) | sort; }

proto_stubs() {  # mypy reads the generated python/dgserve/v1/*_pb2.pyi: (re)generate them when missing or stale
  local stub=python/dgserve/v1/text_generation_pb2.pyi
  if [ ! -e "$stub" ] || [ -n "$(find proto -name '*.proto' -newer "$stub")" ]; then
    "$LINT_PYTHON" build.py --no-ext >/dev/null || return 1
  fi
}

run_check() {
  local t
  case "$1" in
    ruff) t=$(tool ruff) && "$t" check . ;;
    format) t=$(tool ruff) && "$t" format --check . ;;
    mypy) t=$(tool mypy) && proto_stubs && "$t" ;;
    clang-format) t=$(tool clang-format) && csrc_files | xargs "$t" --dry-run -Werror ;;
    buf) t=$(tool buf) && "$t" lint ;;
    *) echo "lint: unknown check '$1' (one of: ${ALL[*]})" >&2; return 2 ;;
  esac
}

if [ "${1:-}" = "--fix" ]; then
  set -e
  ruff=$(tool ruff)
  clang_format=$(tool clang-format)
  "$ruff" format .
  "$ruff" check --fix . || true  # what is left needs a hand: `bash tools/lint.sh` lists it
  "$ruff" format .
  csrc_files | xargs "$clang_format" -i
  exit 0
fi

if [ $# -gt 0 ]; then CHECKS=("$@"); else CHECKS=("${ALL[@]}"); fi
failed=()
for check in "${CHECKS[@]}"; do
  t0=$(date +%s%N)
  if run_check "$check"; then status=ok; else status=FAILED; failed+=("$check"); fi
  ms=$((($(date +%s%N) - t0) / 1000000))
  printf '[lint] %-12s %-6s %d.%d s\n' "$check" "$status" $((ms / 1000)) $((ms % 1000 / 100))
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "[lint] failed: ${failed[*]} (bash tools/lint.sh --fix applies the mechanical fixes)" >&2
  exit 1
fi
