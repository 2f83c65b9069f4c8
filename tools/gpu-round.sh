#!/usr/bin/env bash
# tools/gpu-round.sh: what a session measures on the GPU machine, in one call of the device tool
# (each start of a machine costs minutes of a 30-minute budget): the whole GPU suite
# (tools/gpu-suite.sh, ~150 s), then the park-limit sweep of PyTorch training with its caching
# allocator off (tools/probe/park-limit-sweep.sh, ~25 s a setting) with the time left.
#
#   GIT_COMMIT=$(git rev-parse --short HEAD) OUT=/some/dir bash tools/gpu-round.sh [LIMIT ...]
#
# LIMITs default to "256M 512M 1G". Writes $OUT/summary.md and $OUT/logs.tar.gz (the suite's),
# $OUT/sweep.txt (the sweep's STEP, SYNC, COUNTS and MEM lines per limit). The device tool's
# commands end after 600 s: the sweep runs only while more than 60 s are left of a 560 s whole.
# Exit: the suite's (0 every check passed, 1 a check failed, 2 no build, 77 no GPU).
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
T0=$(date +%s)
OUT=${OUT:-$root/gpu-suite-out}
mkdir -p "$OUT" || exit 2
export OUT
bash tools/gpu-suite.sh
rc=$?
[ "$rc" = 77 ] && exit 77
: >"$OUT/sweep.txt"
for limit in ${*:-256M 512M 1G}; do
    left=$((560 - ($(date +%s) - T0)))
    if [ "$left" -le 60 ]; then
        echo "== VMMHOOK_PARK_LIMIT=$limit: not run (${left} s left)" >>"$OUT/sweep.txt"
        continue
    fi
    timeout $((left - 10)) bash tools/probe/park-limit-sweep.sh "$limit" 2>&1 |
        grep -E '^(==|STEP|SYNC|COUNTS|MEM|FAIL)' >>"$OUT/sweep.txt"
done
cat "$OUT/sweep.txt"
exit "$rc"
