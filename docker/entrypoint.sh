#!/usr/bin/env bash
# dgserve container entrypoint.
#
#   entrypoint.sh [serve] [FLAGS...]   run `dgserve serve FLAGS...` (exec: the server is PID 1 and gets
#                                      SIGTERM itself, which starts its graceful drain)
#   entrypoint.sh --dry-run [FLAGS...] print the resolved configuration as JSON and exit
#   entrypoint.sh COMMAND [ARGS...]    run any other command instead (e.g. `bash`, `dgserve info --server ...`)
#
# Configuration is read by dgserve/service/__main__.py alone: NIM_* / DGSERVE_* environment variables, overridden
# by the words of NIM_PASSTHROUGH_ARGS (NIM's convention), overridden by the flags given here. The server is the
# installed `dgserve` package (dgserve.service); nothing is taken from the source tree.
# Exit status: 0 after a graceful drain, 2 when startup cannot succeed (one line on stderr says why).
set -euo pipefail

case "${1:-}" in
    "" | -*) ;;
    serve) shift ;;
    *) exec "$@" ;;
esac

passthrough=()
if [[ -n "${NIM_PASSTHROUGH_ARGS:-}" ]]; then
    read -r -a passthrough <<< "${NIM_PASSTHROUGH_ARGS}"
fi

exec dgserve serve ${passthrough[@]+"${passthrough[@]}"} "$@"
