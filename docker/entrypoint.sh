#!/usr/bin/env bash
# dgserve container entrypoint.
#
#   entrypoint.sh [serve] [FLAGS...]   run `dgserve serve FLAGS...` (exec: the server is PID 1 and gets
#                                      SIGTERM itself, which starts its graceful drain)
#   entrypoint.sh [serve] ORG/NAME [FLAGS...]   the same with `--model ORG/NAME`: a Hub id (docs/deployment.md,
#                                      "Models by name"), downloaded into NIM_CACHE_PATH unless cached there
#   entrypoint.sh download ORG/NAME [--revision R]   run `dgserve download` (the init container's job: fill the
#                                      cache volume once; docs/deployment.md, "Kubernetes")
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
    download) shift; exec dgserve download "$@" ;;
    *) ;;
esac

# A first word that is a Hub id (org/name, no command of that name) is the model: `--model` goes in front of it.
hub_id='^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$'
if [[ "${1:-}" =~ $hub_id ]] && ! command -v "$1" > /dev/null; then
    set -- --model "$@"
elif [[ -n "${1:-}" && "${1:-}" != -* ]]; then
    exec "$@"
fi

passthrough=()
if [[ -n "${NIM_PASSTHROUGH_ARGS:-}" ]]; then
    read -r -a passthrough <<< "${NIM_PASSTHROUGH_ARGS}"
fi

exec dgserve serve ${passthrough[@]+"${passthrough[@]}"} "$@"
