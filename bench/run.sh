#!/usr/bin/env bash
# Front-door load benchmark: Bursar's RLS and HTTP admit beside a Redis GCRA baseline,
# in one run. Installs Debian's redis-server when missing, starts it on a private port
# with persistence off, builds release binaries, runs, and stops Redis.
#
#   bench/run.sh [frontdoor-load run options, e.g. --seconds 5 --callers 1,8,50]
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
trap 'kill "$(cat "$DIR/redis.pid")" 2>/dev/null || true; rm -rf "$DIR"' EXIT

echo "== building release binaries"
cargo build --release -q -p bursar-agent -p bursar-bench

echo "== redis-server $(redis-server --version | awk '{print $3}') on 127.0.0.1:$PORT"
./target/release/frontdoor-load run --redis "127.0.0.1:$PORT" "$@"
