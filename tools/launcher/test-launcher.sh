#!/bin/sh
# Checks of the launcher (meson test --suite tools): $1 = the configured launcher of the build
# tree, $2 = the library it should preload.
set -eu
launcher=$1
lib=$2
fail() {
    printf 'FAIL: %s\n' "$*" >&2
    exit 1
}
expect_line() { # output, exact line
    printf '%s\n' "$1" | grep -qxF -- "$2" || fail "no line '$2' in:
$1"
}

# Dry run: every option maps to its variable; relative paths become absolute; values with
# spaces and glob characters arrive intact.
out=$(cd /tmp && env -u LD_PRELOAD sh "$launcher" -n --granularity=64M --handle-type posix_fd \
    --headroom=2G --va-limit=1T --cache-limit=0 --mem-limit=8G --pack-below=256K --rdma \
    --peers '*' --free-sync --disable --verbose --stats --stats-json='a b.json' --trace t.csv \
    --leaks --strict=off --set=VMMHOOK_HEADROOM=3G -- /bin/true x y)
expect_line "$out" "LD_PRELOAD=$lib"
expect_line "$out" "VMMHOOK_GRANULARITY=64M"
expect_line "$out" "VMMHOOK_HANDLE_TYPE=posix_fd"
expect_line "$out" "VMMHOOK_HEADROOM=3G"
expect_line "$out" "VMMHOOK_VA_LIMIT=1T"
expect_line "$out" "VMMHOOK_CACHE_LIMIT=0"
expect_line "$out" "VMMHOOK_MEM_LIMIT=8G"
expect_line "$out" "VMMHOOK_PACK_BELOW=256K"
expect_line "$out" "VMMHOOK_RDMA=1"
expect_line "$out" "VMMHOOK_PEERS=*"
expect_line "$out" "VMMHOOK_FREE_SYNC=1"
expect_line "$out" "VMMHOOK_DISABLE=1"
expect_line "$out" "VMMHOOK_VERBOSE=1"
expect_line "$out" "VMMHOOK_STATS=1"
expect_line "$out" "VMMHOOK_STATS_JSON=/tmp/a b.json"
expect_line "$out" "VMMHOOK_TRACE=/tmp/t.csv"
expect_line "$out" "VMMHOOK_LEAKS=1"
expect_line "$out" "VMMHOOK_STRICT=off"
expect_line "$out" "exec /bin/true x y"

# An existing LD_PRELOAD is kept first; the library is not added twice.
out=$(LD_PRELOAD=libm.so.6 sh "$launcher" -n -- /bin/true)
expect_line "$out" "LD_PRELOAD=libm.so.6 $lib"
out=$(LD_PRELOAD="$lib" sh "$launcher" -n -- /bin/true)
expect_line "$out" "LD_PRELOAD=$lib"

# Without "--", the first non-option is the program; --lib overrides.
out=$(env -u LD_PRELOAD sh "$launcher" -n --lib="$lib" /bin/echo --stats)
expect_line "$out" "exec /bin/echo --stats"

# Help and errors.
sh "$launcher" --help | grep -q -- '--granularity=G' || fail "--help lacks --granularity"
sh "$launcher" --help | grep -q 'VMMHOOK_TRACE' || fail "--help lacks VMMHOOK_TRACE"
st=0; sh "$launcher" --bogus -- /bin/true 2>/dev/null || st=$?
[ "$st" = 2 ] || fail "unknown option: status $st, expected 2"
st=0; sh "$launcher" --stats 2>/dev/null || st=$?
[ "$st" = 2 ] || fail "no program: status $st, expected 2"
st=0; sh "$launcher" --trace 2>/dev/null || st=$?
[ "$st" = 2 ] || fail "missing value: status $st, expected 2"
st=0; sh "$launcher" --lib=/nonexistent/lib.so -- /bin/true 2>/dev/null || st=$?
[ "$st" = 2 ] || fail "missing --lib file: status $st, expected 2"

# For real: a program that never uses CUDA runs under the library, sees the variables, and
# nothing is printed on its standard error.
err=$(mktemp)
# shellcheck disable=SC2016 # expanded by the inner shell
out=$(env -u LD_PRELOAD sh "$launcher" --stats --peers=0,1 -- /bin/sh -c 'echo "P=$LD_PRELOAD"; echo "S=$VMMHOOK_STATS"; echo "R=$VMMHOOK_PEERS"' 2>"$err")
expect_line "$out" "P=$lib"
expect_line "$out" "S=1"
expect_line "$out" "R=0,1"
[ ! -s "$err" ] || fail "a program without CUDA got output on stderr: $(cat "$err")"
rm -f "$err"
echo "launcher: all checks passed"
