#!/bin/sh
# Checks of the launcher (meson test --suite tools): $1 = the configured launcher of the build
# tree, $2 = the library it should preload. vmmhook-config is next to the launcher.
set -eu
launcher=$1
lib=$2
config=$(dirname "$launcher")/vmmhook-config
fail() {
    printf 'FAIL: %s\n' "$*" >&2
    exit 1
}
expect_line() { # output, exact line
    printf '%s\n' "$1" | grep -qxF -- "$2" || fail "no line '$2' in:
$1"
}
status_of() { # the exit status of the command
    st=0
    "$@" >/dev/null 2>&1 || st=$?
    echo "$st"
}

# Dry run: every option maps to its variable, with '=' or as the next argument; relative paths
# become absolute; values with spaces and glob characters arrive intact.
out=$(cd /tmp && env -u LD_PRELOAD sh "$launcher" -n --granularity=64M --handle-type posix_fd \
    --headroom=2G --va-limit=1T --cache-limit=0 --mem-limit=8G --pack-below 256K --rdma \
    --peers 'all' --free-sync --disable --verbose --stats --stats-json='a b*.json' --trace t.csv \
    --leaks --strict=off --park-limit 1G --pin-limit=64M --set=VMMHOOK_HEADROOM=3G \
    -- /bin/true x y)
expect_line "$out" "LD_PRELOAD=$lib"
expect_line "$out" "VMMHOOK_GRANULARITY=64M"
expect_line "$out" "VMMHOOK_HANDLE_TYPE=posix_fd"
expect_line "$out" "VMMHOOK_HEADROOM=3G"
expect_line "$out" "VMMHOOK_VA_LIMIT=1T"
expect_line "$out" "VMMHOOK_CACHE_LIMIT=0"
expect_line "$out" "VMMHOOK_MEM_LIMIT=8G"
expect_line "$out" "VMMHOOK_PACK_BELOW=256K"
expect_line "$out" "VMMHOOK_RDMA=1"
expect_line "$out" "VMMHOOK_PEERS=all"
expect_line "$out" "VMMHOOK_FREE_SYNC=1"
expect_line "$out" "VMMHOOK_DISABLE=1"
expect_line "$out" "VMMHOOK_VERBOSE=1"
expect_line "$out" "VMMHOOK_STATS=1"
expect_line "$out" "VMMHOOK_STATS_JSON=/tmp/a b*.json"
expect_line "$out" "VMMHOOK_TRACE=/tmp/t.csv"
expect_line "$out" "VMMHOOK_LEAKS=1"
expect_line "$out" "VMMHOOK_STRICT=off"
expect_line "$out" "VMMHOOK_PARK_LIMIT=1G"
expect_line "$out" "VMMHOOK_PIN_LIMIT=64M"
expect_line "$out" "exec /bin/true x y"

# Every option of the table has its flag, and --help shows it (generated from the table).
help=$(sh "$launcher" --help)
n=0
for flag in $("$config" --list | cut -d' ' -f3); do
    printf '%s\n' "$help" | grep -q -- "^  $flag" || fail "--help lacks $flag"
    n=$((n + 1))
done
[ "$n" -ge 19 ] || fail "vmmhook-config --list gave $n options"
printf '%s\n' "$help" | grep -q 'VMMHOOK_TRACE' || fail "--help lacks VMMHOOK_TRACE"

# A boolean flag never takes the next argument: it is the program.
out=$(env -u LD_PRELOAD sh "$launcher" -n --stats /bin/echo hi)
expect_line "$out" "VMMHOOK_STATS=1"
expect_line "$out" "exec /bin/echo hi"

# An existing LD_PRELOAD is kept first; the library is not added twice.
out=$(LD_PRELOAD=libm.so.6 sh "$launcher" -n -- /bin/true)
expect_line "$out" "LD_PRELOAD=libm.so.6 $lib"
out=$(LD_PRELOAD="$lib" sh "$launcher" -n -- /bin/true)
expect_line "$out" "LD_PRELOAD=$lib"

# Without "--", the first non-option is the program; --lib overrides.
out=$(env -u LD_PRELOAD sh "$launcher" -n --lib="$lib" /bin/echo --stats)
expect_line "$out" "exec /bin/echo --stats"

# Values are checked with the library's parser: a bad one stops the launcher before the
# program runs (exit 2), naming the variable; so does one already in the environment.
err=$(sh "$launcher" --cache-limit=12Q -- /bin/echo ran 2>&1) && fail "a bad value ran: $err"
printf '%s\n' "$err" | grep -q 'VMMHOOK_CACHE_LIMIT="12Q" is not valid' ||
    fail "no message for the bad value: $err"
printf '%s\n' "$err" | grep -q '^ran$' && fail "the program ran despite a bad value"
[ "$(status_of sh "$launcher" --cache-limit=12Q -- /bin/true)" = 2 ] || fail "bad value: not 2"
[ "$(status_of env VMMHOOK_GRANULARITY=2T sh "$launcher" -- /bin/true)" = 2 ] ||
    fail "a bad value in the environment: not 2"
[ "$(status_of sh "$launcher" --granularity=1T -- /bin/true)" = 0 ] || fail "1T refused"

# --check prints the resolved options and exits with the checker's status.
out=$(sh "$launcher" --cache-limit 2G --stats --check)
expect_line "$out" "  VMMHOOK_CACHE_LIMIT  = 2G"
expect_line "$out" "  VMMHOOK_STATS        = on"
expect_line "$out" "  VMMHOOK_HEADROOM     = 1G (default)"
[ "$(status_of sh "$launcher" --pin-limit=x --check)" = 1 ] || fail "--check of a bad value: not 1"

# Errors: unknown option (never swallowed with its neighbour), no program, missing value,
# missing --lib file.
[ "$(status_of sh "$launcher" --bogus -- /bin/true)" = 2 ] || fail "unknown option: not 2"
[ "$(status_of sh "$launcher" --statss /bin/true)" = 2 ] || fail "misspelt flag: not 2"
[ "$(status_of sh "$launcher" --stats)" = 2 ] || fail "no program: not 2"
# What was wrong comes first, not 75 lines of usage (issue 22).
err=$(sh "$launcher" --stats 2>&1 >/dev/null || true)
[ "$(printf '%s\n' "$err" | wc -l)" -eq 1 ] && printf '%s\n' "$err" | grep -q '^vmmhook: no program to run' ||
    fail "no program: $err"
err=$("$config" --bogus 2>&1 >/dev/null || true)
[ "$(printf '%s\n' "$err" | sed -n 1p)" = "vmmhook-config: unknown option '--bogus'" ] ||
    fail "vmmhook-config --bogus: $err"
[ "$(status_of "$config" --bogus)" = 2 ] || fail "vmmhook-config --bogus: not 2"
[ "$(status_of sh "$launcher" --trace)" = 2 ] || fail "missing value: not 2"
[ "$(status_of sh "$launcher" --lib=/nonexistent/lib.so -- /bin/true)" = 2 ] ||
    fail "missing --lib file: not 2"

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
