#!/bin/sh
# What tools/demo/hook_demo says, on the simulated driver (meson test --suite tools, test
# hook-demo-text; issue 37, item 4): $1 = hook_demo, $2 = libvmmhook.so, $3 = the folder of the
# fake libcuda.so.1. Its text must be true:
#   - the second 64 MiB allocation reuses the freed memory (same address, no driver call: the
#     simulated driver runs the work in one queue, so freed memory is reusable at once), and the
#     demo says that "allocations served from the cache" does not count that reuse (the table
#     says 0);
#   - "the hook's statistics follow" only when VMMHOOK_STATS asks for the table, which then
#     follows; otherwise neither;
#   - the table explains "bytes held idle for reuse" against VMMHOOK_CACHE_LIMIT on the next line.
set -eu
demo=$1
lib=$2
fakecuda=$3
fail() {
    printf 'FAIL: %s\n' "$*" >&2
    exit 1
}
run() { # VMMHOOK_STATS value ("-": unset) -> $out, stdout and stderr together
    st=0
    if [ "$1" = - ]; then
        out=$(env -u VMMHOOK_STATS LD_PRELOAD="$lib" LD_LIBRARY_PATH="$fakecuda" "$demo" 2>&1) ||
            st=$?
    else
        out=$(env VMMHOOK_STATS="$1" LD_PRELOAD="$lib" LD_LIBRARY_PATH="$fakecuda" "$demo" 2>&1) ||
            st=$?
    fi
    [ "$st" = 0 ] || fail "hook_demo (VMMHOOK_STATS=$1) exited $st:
$out"
}
has() { # output, fixed text
    printf '%s\n' "$1" | grep -qF -- "$2"
}

run 1
has "$out" "the freed memory reused (the same address, no driver call)" ||
    fail "the second 64 MiB allocation did not say it reused the freed memory:
$out"
has "$out" "the table's \"allocations served from the cache\" does not count it" ||
    fail "no word on why \"allocations served from the cache\" stays 0:
$out"
hits=$(printf '%s\n' "$out" | sed -n 's/^vmmhook: *allocations served from the cache *//p')
[ "$hits" = 0 ] || fail "allocations served from the cache: '$hits', the demo says 0:
$out"
has "$out" "the hook's statistics follow" || fail "VMMHOOK_STATS=1: no 'statistics follow':
$out"
# The announcement comes first, then the table.
printf '%s\n' "$out" | sed -n '/statistics follow/,$p' | grep -q '^vmmhook: statistics (pid ' ||
    fail "VMMHOOK_STATS=1: no table after 'statistics follow':
$out"
printf '%s\n' "$out" | grep -A1 '^vmmhook: *bytes held idle for reuse' | tail -n 1 |
    grep -q 'not capped by VMMHOOK_CACHE_LIMIT' ||
    fail "no note on VMMHOOK_CACHE_LIMIT under 'bytes held idle for reuse':
$out"

for v in - 0 off; do
    run "$v"
    ! has "$out" "statistics follow" || fail "VMMHOOK_STATS=$v: 'statistics follow' and none do:
$out"
    ! has "$out" "vmmhook: statistics (pid " || fail "VMMHOOK_STATS=$v: a table:
$out"
    has "$out" "run with VMMHOOK_STATS=1 for the hook's statistics" ||
        fail "VMMHOOK_STATS=$v: no word on how to get the statistics:
$out"
done
echo "PASS: hook_demo's text"
