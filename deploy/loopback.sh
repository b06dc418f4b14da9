#!/usr/bin/env bash
# Two llama-burn-server replicas on 127.0.0.1 behind HAProxy (deploy/haproxy.cfg).
# Everything it starts it records in $LB_DIR and stops again.
#
#   deploy/loopback.sh up                 start both replicas and the balancer, wait until
#                                         the balancer sees both healthy
#   deploy/loopback.sh down               stop everything (SIGTERM, then SIGKILL after 10 s)
#   deploy/loopback.sh status             what runs, and the balancer's view of each replica
#   deploy/loopback.sh kill N [SIGNAL]    stop replica N (1 or 2) with SIGNAL (default KILL)
#   deploy/loopback.sh start N [ARGS...]  start replica N again (extra server arguments)
#   deploy/loopback.sh wait N UP|DOWN     wait until the balancer marks replica N so
#   deploy/loopback.sh run -- CMD...      up, run CMD, down (whatever CMD does)
#
# Environment (defaults in brackets):
#   LLAMA_BURN_SERVER  the server binary [$CARGO_TARGET_DIR/release/llama-burn-server,
#                      else target/release/llama-burn-server]
#   HAPROXY            HAProxy 3.0 or later [what deploy/get_haproxy.sh prints]
#   LB_DIR             state: pid files, logs, generated names [/tmp/llama-burn-loopback]
#   LB_PORT            the balancer's port; replicas use LB_PORT+1 and LB_PORT+2, the
#                      balancer's stats page LB_PORT+9 [18100]
#   LB_STICKY          1: a session stays on one replica; 0: leastconn only [1]
#   SERVER_ARGS        extra arguments for every replica (e.g. "--max-running 8") []
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
LB_DIR="${LB_DIR:-/tmp/llama-burn-loopback}"
LB_PORT="${LB_PORT:-18100}"
LB_STICKY="${LB_STICKY:-1}"
SERVER_ARGS="${SERVER_ARGS:-}"
export LB_ADDR="127.0.0.1:$LB_PORT"
export LB_STATS_ADDR="127.0.0.1:$((LB_PORT + 9))"
export REPLICA1_ADDR="127.0.0.1:$((LB_PORT + 1))"
export REPLICA2_ADDR="127.0.0.1:$((LB_PORT + 2))"
export LB_STICKY
mkdir -p "$LB_DIR"

server_bin() {
  if [ -n "${LLAMA_BURN_SERVER:-}" ]; then
    echo "$LLAMA_BURN_SERVER"
  elif [ -n "${CARGO_TARGET_DIR:-}" ]; then
    echo "$CARGO_TARGET_DIR/release/llama-burn-server"
  else
    echo "$here/../target/release/llama-burn-server"
  fi
}

log() { echo "loopback: $*" >&2; }

# Whether the process of pid file $1 runs. A killed replica stays a zombie until whoever
# adopted it reaps it, and `kill -0` succeeds on a zombie: state Z counts as exited (a
# restart right after a SIGKILL was once refused as "already runs").
alive() {
  [ -f "$1" ] || return 1
  local pid state
  pid=$(cat "$1")
  kill -0 "$pid" 2>/dev/null || return 1
  state=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1)
  [ "$state" != Z ]
}

# Stops the process of a pid file: SIGNAL, then SIGKILL if it is still there after 10 s.
stop_pid() {
  local file=$1 signal=${2:-TERM}
  if alive "$file"; then
    local pid
    pid=$(cat "$file")
    kill "-$signal" "$pid" 2>/dev/null || true
    for _ in $(seq 100); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
}

replica_port() { echo $((LB_PORT + $1)); }

start_replica() {
  local n=$1
  shift
  case $n in 1 | 2) ;; *) log "no replica $n (1 or 2)"; exit 2 ;; esac
  if alive "$LB_DIR/replica$n.pid"; then
    log "replica $n already runs"
    return
  fi
  local bin
  bin=$(server_bin)
  [ -x "$bin" ] || { log "no server binary at $bin (cargo build --release --features server)"; exit 1; }
  # shellcheck disable=SC2086
  "$bin" --host 127.0.0.1 --port "$(replica_port "$n")" \
    --served-model-name llama-burn-demo --trust-forwarded-for $SERVER_ARGS "$@" \
    >>"$LB_DIR/replica$n.log" 2>&1 &
  echo $! >"$LB_DIR/replica$n.pid"
  log "replica $n: pid $!, http://127.0.0.1:$(replica_port "$n"), log $LB_DIR/replica$n.log"
}

start_balancer() {
  if alive "$LB_DIR/haproxy.pid"; then
    return
  fi
  local haproxy="${HAPROXY:-}"
  [ -n "$haproxy" ] || haproxy=$("$here/get_haproxy.sh")
  "$haproxy" -c -q -f "$here/haproxy.cfg"
  "$haproxy" -db -f "$here/haproxy.cfg" >>"$LB_DIR/haproxy.log" 2>&1 &
  echo $! >"$LB_DIR/haproxy.pid"
  log "balancer: pid $!, http://$LB_ADDR (sticky=$LB_STICKY), stats http://$LB_STATS_ADDR/stats"
}

# The balancer's status of replica N (UP, DOWN, ...) from its stats CSV.
replica_state() {
  curl -fsS --max-time 2 "http://$LB_STATS_ADDR/stats;csv" 2>/dev/null |
    awk -F, -v s="replica$1" '$1 == "replicas" && $2 == s { print $18 }' | cut -d' ' -f1
}

# Polls `CHECK...` every 0.1 s until it succeeds: 0; 1 after TIMEOUT seconds, or at once
# when replica N has exited while we wait for it to come up (`WHAT` names the wait).
poll() {
  local n=$1 timeout=$2 what=$3
  shift 3
  for _ in $(seq $((timeout * 10))); do
    "$@" && return 0
    if [ "$what" != DOWN ] && ! alive "$LB_DIR/replica$n.pid"; then
      log "replica $n exited; the end of its log:"
      tail -5 "$LB_DIR/replica$n.log" >&2
      return 1
    fi
    sleep 0.1
  done
  log "replica $n not $what after ${timeout}s"
  return 1
}

in_state() { [ "$(replica_state "$1")" = "$2" ]; }

healthy() { curl -fsS --max-time 2 -o /dev/null "http://127.0.0.1:$(replica_port "$1")/health" 2>/dev/null; }

# Waits until the balancer marks replica N so (UP or DOWN).
wait_state() { poll "$1" "${3:-300}" "$2" in_state "$1" "$2"; }

# Waits until replica N itself answers /health with 200 (its model is loaded).
wait_healthy() { poll "$1" "${2:-300}" healthy healthy "$1"; }

up() {
  start_replica 1
  start_replica 2
  # HAProxy 3.0 counts a server UP from its start until checks fail: start it once the
  # replicas are ready, so that no request meets a replica that is still loading.
  wait_healthy 1 && wait_healthy 2
  start_balancer
  wait_state 1 UP && wait_state 2 UP
  log "up: http://$LB_ADDR"
}

down() {
  stop_pid "$LB_DIR/haproxy.pid"
  stop_pid "$LB_DIR/replica1.pid"
  stop_pid "$LB_DIR/replica2.pid"
  log "down"
}

status() {
  for n in 1 2; do
    local state=stopped
    alive "$LB_DIR/replica$n.pid" && state="pid $(cat "$LB_DIR/replica$n.pid")"
    echo "replica$n 127.0.0.1:$(replica_port "$n") $state balancer:$(replica_state "$n")"
  done
  local state=stopped
  alive "$LB_DIR/haproxy.pid" && state="pid $(cat "$LB_DIR/haproxy.pid")"
  echo "balancer $LB_ADDR $state"
}

command=${1:-}
[ $# -gt 0 ] && shift
case $command in
  up) up ;;
  down) down ;;
  status) status ;;
  kill)
    n=${1:?replica number}
    stop_pid "$LB_DIR/replica$n.pid" "${2:-KILL}"
    log "replica $n stopped (${2:-KILL})"
    ;;
  start)
    n=${1:?replica number}
    shift
    start_replica "$n" "$@"
    ;;
  wait) wait_state "${1:?replica number}" "${2:?UP or DOWN}" "${3:-300}" ;;
  run)
    [ "${1:-}" = "--" ] && shift
    trap down EXIT
    trap 'exit 130' INT TERM
    up
    LB_URL="http://$LB_ADDR" "$@"
    ;;
  *)
    sed -n '2,23p' "$0" >&2
    exit 2
    ;;
esac
