#!/usr/bin/env bash
# The system programs the test suite starts, each on a free loopback port with its own
# config (the services the packages install are never used):
# - prometheus and promtool: the exporter, rule and dashboard tests;
# - chromium: the headless browser that renders the report's HTML;
# - redis-server: the state shared by sidecar replicas (tests/support/redis.py);
# - haproxy: the replicas' front door (weighbridge.launch.haproxy_config).
#
#   system-programs.sh check    print the Debian packages of the missing ones; exit 1 if any
#   system-programs.sh install  install the missing ones with apt-get when this user may
#                               (root); otherwise one line naming the command, exit 1
set -euo pipefail

missing=()
{ command -v prometheus && command -v promtool; } >/dev/null || missing+=(prometheus)
{ command -v chromium || command -v chromium-browser; } >/dev/null || missing+=(chromium)
command -v redis-server >/dev/null || missing+=(redis-server)
command -v haproxy >/dev/null || missing+=(haproxy)

case "${1:-}" in
check)
    ((${#missing[@]} == 0)) || { echo "${missing[*]}"; exit 1; }
    ;;
install)
    ((${#missing[@]} == 0)) && exit 0
    # Without recommends: no node exporter, no desktop extras.
    command=(apt-get install -y -q --no-install-recommends "${missing[@]}")
    if ! command -v apt-get >/dev/null; then
        echo "make test needs these system programs: ${missing[*]} (prometheus with" \
             "promtool); install them with your package manager, then run make test again" >&2
        exit 1
    fi
    if [[ $(id -u) != 0 ]]; then
        echo "make test needs ${missing[*]}; run: sudo apt-get update &&" \
             "sudo ${command[*]}" >&2
        exit 1
    fi
    echo "installing ${missing[*]} with apt-get" >&2
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive "${command[@]}"
    ;;
*)
    echo "usage: $0 check|install" >&2
    exit 2
    ;;
esac
