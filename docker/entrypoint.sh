#!/bin/sh
# SpecRec image entrypoint: the first argument picks what the container runs.
#
#   itemset | drafter | verifier | gateway [--flag value ...]   a service (python -m <module>)
#   load --bundle DIR [...]                                     python -m itemset_svc.load (bulk loader)
#   load-catalogue [--if-empty] --bundle DIR [...]              the loader wrapper (waits for Redis, --if-empty)
#   healthcheck [HOST:PORT]                                     python -m specrec_rpc.healthcheck
#   anything else                                               run as given (e.g. python -m gateway, sh)
#
# Services take their settings from SPECREC_<SERVICE>_* environment variables
# (or --flags); `exec` keeps the Python process as PID 1's direct replacement,
# so SIGTERM reaches it and the graceful shutdown runs.
set -e

if [ "$#" -eq 0 ]; then
    set -- help
fi

cmd="$1"
case "$cmd" in
    itemset)        shift; exec python -m itemset_svc "$@" ;;
    drafter)        shift; exec python -m drafter_svc "$@" ;;
    verifier)       shift; exec python -m verifier_svc "$@" ;;
    gateway)        shift; exec python -m gateway "$@" ;;
    load)           shift; exec python -m itemset_svc.load "$@" ;;
    load-catalogue) shift; exec python /usr/local/bin/specrec-load-catalogue "$@" ;;
    healthcheck)    shift; exec python -m specrec_rpc.healthcheck "$@" ;;
    help|-h|--help)
        sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
        exit 0 ;;
esac
exec "$@"
