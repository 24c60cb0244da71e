#!/usr/bin/env bash
# Instructions and simulated cache misses per allocator report (100 keys, the fleet of
# `cargo bench -p bursar-allocator --bench allocation -- report/`), from valgrind's
# callgrind with its cache simulation: deterministic where wall-clock figures on a
# shared machine are not. Counts only inside `Reporter::report` (--toggle-collect), so
# building the 1,000,000-entry fleet is not in the figure (it still runs under
# valgrind: about two minutes per mode). Installs Debian's valgrind when missing.
#
#   bench/allocator_instructions.sh                # report, then handle-report
#   bench/allocator_instructions.sh handle-report  # one
#   SMALL=2000 LARGE=4000 bench/allocator_instructions.sh report   # other rounds
set -euo pipefail
cd "$(dirname "$0")/.."

. bench/valgrind_setup.sh
cargo build --release -q -p bursar-allocator --example report_loop
BIN=target/release/examples/report_loop
# Two runs, rounds 1-4 and 1-8 of every agent reporting once (1,000 reports a round);
# the difference is rounds 5-8: past the first rounds' transients (demand steps every
# other round, large keys' whole passes come due), as the criterion loop runs.
SMALL="${SMALL:-4000}"
LARGE="${LARGE:-8000}"

echo "== cache model: L1d $D1, last level $LL (size,ways,line); reports $SMALL and $LARGE"
run() { # mode reports -> "instructions d1_misses ll_misses"
  valgrind --tool=callgrind --cache-sim=yes --D1="$D1" --LL="$LL" \
    --toggle-collect='*Reporter*report*' \
    --callgrind-out-file=/dev/null "$BIN" "$1" "$2" 2>&1 | counts
}
for mode in ${1:-report handle-report}; do
  per_op "$mode" "$SMALL" "$LARGE" report
done
