# Sourced by bench/instructions.sh and bench/allocator_instructions.sh: installs
# Debian's valgrind when missing, and sets D1 and LL, the cache model both simulate:
# this machine's L1d and its L2 per core as the last level (getconf), or
# CACHE_MODEL=amd for the one used until 2026-12-01 (32 KiB 8-way L1d, 1 MiB 16-way),
# to compare with figures from then (also used when getconf does not know).
if ! command -v valgrind >/dev/null 2>&1; then
  echo "== installing valgrind (Debian package)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq valgrind >/dev/null
fi
if [ "${CACHE_MODEL:-}" = amd ]; then
  D1=32768,8,64 LL=1048576,16,64
else
  D1="$(getconf LEVEL1_DCACHE_SIZE),$(getconf LEVEL1_DCACHE_ASSOC),64"
  LL="$(getconf LEVEL2_CACHE_SIZE),$(getconf LEVEL2_CACHE_ASSOC),64"
  case "$D1,$LL" in
    *,,*|,*) D1=32768,8,64 LL=1048576,16,64 ;;
  esac
fi
# Valgrind's summary (cachegrind's, or callgrind's with --cache-sim=yes) on stdin ->
# "instructions d1_misses ll_misses".
counts() {
  awk '/I *refs/ {gsub(",","",$4); i=$4} /D1  misses/ {gsub(",","",$4); d=$4}
       /LLd misses/ {gsub(",","",$4); l=$4} END {print i, d, l}'
}
# per_op MODE SMALL LARGE UNIT: the caller's `run MODE N` at two sizes, and the
# difference per UNIT (start-up and set-up cancel out).
per_op() {
  read -r i1 d1 l1 < <(run "$1" "$2")
  read -r i2 d2 l2 < <(run "$1" "$3")
  awk -v m="$1" -v n="$(($3 - $2))" -v i="$((i2 - i1))" -v d="$((d2 - d1))" \
    -v l="$((l2 - l1))" -v u="$4" \
    'BEGIN { printf "%-19s %9.0f instructions  %7.2f L1d misses  %7.2f LL misses per %s\n", m, i/n, d/n, l/n, u }'
}
