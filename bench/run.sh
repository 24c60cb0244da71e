#!/usr/bin/env bash
# Front-door load benchmark: Bursar's RLS and HTTP admit beside a Redis GCRA baseline,
# in one run. Installs Debian's redis-server when missing, starts it on a private port
# with persistence off, builds release binaries, runs, and stops Redis.
#
#   bench/run.sh [frontdoor-load run options, e.g. --seconds 5 --callers 1,8,50]
#   bench/run.sh --callers 8 --rate 8000    # every target paced at one load: p99 at equal load
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${REDIS_PORT:-6390}
if ! command -v redis-server >/dev/null 2>&1; then
  echo "== installing redis-server (Debian package)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
DIR=$(mktemp -d)
redis-server --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no \
  --dir "$DIR" --daemonize yes --pidfile "$DIR/redis.pid" --logfile "$DIR/redis.log"
stop_redis() {
  # Wait for it to exit, so that a run right after this one finds the port free.
  local pid
  pid=$(cat "$DIR/redis.pid" 2>/dev/null) || pid=""
  if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  fi
  rm -rf "$DIR"
}
trap stop_redis EXIT
# `--daemonize yes` returns before Redis listens: wait for the port (the Redis-backed
# RLS server connects at once and gives up if nothing answers).
for _ in $(seq 100); do
  if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then break; fi
  sleep 0.05
done

echo "== building release binaries"
cargo build --release -q -p bursar-agent -p bursar-bench

echo "== redis-server $(redis-server --version | awk '{print $3}') on 127.0.0.1:$PORT"
./target/release/frontdoor-load run --redis "127.0.0.1:$PORT" "$@"
