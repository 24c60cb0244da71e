#!/usr/bin/env bash
# Instructions and simulated cache misses per hot-path operation, from cachegrind:
# deterministic where wall-clock figures on a shared machine are not. Runs the
# `hot_loop` example at two sizes and divides the difference (start-up cancels out).
# Installs Debian's valgrind when missing.
#
#   bench/instructions.sh            # every loop
#   bench/instructions.sh keyed-10k  # one
set -euo pipefail
cd "$(dirname "$0")/.."

. bench/valgrind_setup.sh
cargo build --release -q -p bursar-agent --example hot_loop
BIN=target/release/examples/hot_loop

echo "== cache model: L1d $D1, last level $LL (size,ways,line)"
run() { # mode ops -> "instructions d1_misses ll_misses"
  valgrind --tool=cachegrind --cache-sim=yes --D1="$D1" --LL="$LL" \
    --cachegrind-out-file=/dev/null "$BIN" "$1" "$2" 2>&1 | counts
}

for mode in ${1:-admit-complete admit-into-complete keyed-10k governor-10k}; do
  case $mode in
    admit-complete|admit-into-complete) small=20000; large=120000 ;;
    keyed-10k|governor-10k) small=100000; large=1100000 ;;
    *) echo "unknown loop: $mode" >&2; exit 2 ;;
  esac
  per_op "$mode" "$small" "$large" operation
done
