#!/usr/bin/env bash
# dgserve container entrypoint.
#
#   entrypoint.sh [serve] [FLAGS...]   run `python -m service FLAGS...` (exec: the server is PID 1 and gets
#                                      SIGTERM itself, which starts its graceful drain)
#   entrypoint.sh --dry-run [FLAGS...] print the resolved configuration as JSON and exit
#   entrypoint.sh COMMAND [ARGS...]    run any other command instead (e.g. `bash`, `dgserve info --server ...`)
#
# Configuration is read by service/__main__.py alone: NIM_* / DGSERVE_* environment variables, overridden by
# the words of NIM_PASSTHROUGH_ARGS (NIM's convention), overridden by the flags given here.
set -euo pipefail

app_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"   # holds service/ (the app is not installed)
export PYTHONPATH="${app_dir}${PYTHONPATH:+:${PYTHONPATH}}"

case "${1:-}" in
    "" | -*) ;;
    serve) shift ;;
    *) exec "$@" ;;
esac

passthrough=()
if [[ -n "${NIM_PASSTHROUGH_ARGS:-}" ]]; then
    read -r -a passthrough <<< "${NIM_PASSTHROUGH_ARGS}"
fi

exec python -m service ${passthrough[@]+"${passthrough[@]}"} "$@"
