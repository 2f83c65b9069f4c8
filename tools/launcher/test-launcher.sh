#!/bin/sh
# Checks of the launcher (meson test --suite tools): $1 = the configured launcher of the build
# tree, $2 = the library it should preload, $3 = the source tree (for tools/quickstart).
# vmmhook-config is next to the launcher.
set -eu
launcher=$1
lib=$2
root=${3:-}
config=$(dirname "$launcher")/vmmhook-config
build=$(cd "$(dirname "$launcher")/../.." && pwd)
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

# Each option's words in --help are the words the parser accepts (issue 30: --overflow's help
# listed the handle types). Each word of the help passes --check; a bad value's warning lists
# the accepted words, and those equal the help's (in any order).
words_rows=0
for row in $("$config" --list | awk '$2 == "value" { print $1 "," $3 }'); do
    var=${row%,*} flag=${row#*,}
    mv=$(printf '%s\n' "$help" | sed -n "s/^  $flag=\(.*\)$/\1/p")
    words=$(printf '%s\n' "$mv" | tr '|' '\n' | grep -v '^[A-Z]*$' | sort | tr '\n' ' ')
    [ -n "$words" ] || continue
    words_rows=$((words_rows + 1))
    for w in $words; do
        [ "$(status_of env "$var=$w" "$config" --check)" = 0 ] ||
            fail "$flag=$w is in --help but the parser refuses it"
    done
    warn=$(env "$var=not-a-word" "$config" --check 2>&1 >/dev/null | grep -m1 "$var=" || true)
    # "accepted: a, b, or a size ...": the words before the first "or ..." item.
    accepted=$(printf '%s\n' "${warn#*accepted: }" | tr ',' '\n' | sed 's/^ *//' |
        awk '/^or / { exit } { print }' | sort | tr '\n' ' ')
    [ "$accepted" = "$words" ] ||
        fail "$flag: --help lists '$words', the parser accepts '$accepted' ($warn)"
done
[ "$words_rows" -ge 4 ] || fail "only $words_rows options with words in --help"

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
# 1T and 512G no GPU can make (every served allocation failed with them, silently): refused
# before the run; 256G, the bound, is left to the library's check at the device's set-up.
[ "$(status_of sh "$launcher" --granularity=1T -- /bin/true)" = 2 ] || fail "1T: not 2"
[ "$(status_of sh "$launcher" --granularity=512G --check)" = 2 ] || fail "--check 512G: not 2"
[ "$(status_of sh "$launcher" --granularity=256G -- /bin/true)" = 0 ] || fail "256G refused"

# --check prints the resolved options and exits with the checker's status; the '=' column is
# after the longest name (issue 37: three names pushed it out).
width=$("$config" --list | awk '{ if (length($1) > w) w = length($1) } END { print w }')
row() { # NAME VALUE: the line of --check
    awk -v n="$1" -v v="$2" -v w="$width" 'BEGIN { printf "  %-" w "s = %s\n", n, v }'
}
out=$(sh "$launcher" --cache-limit 2G --stats --check)
expect_line "$out" "$(row VMMHOOK_CACHE_LIMIT 2G)"
expect_line "$out" "$(row VMMHOOK_STATS on)"
expect_line "$out" "$(row VMMHOOK_HEADROOM '1G (default)')"
expect_line "$out" "$(row VMMHOOK_OVERFLOW_RESERVE '4G (default)')"
cols=$(printf '%s\n' "$out" | grep '^  VMMHOOK_' | awk '{ print index($0, " = ") }' | sort -u)
[ "$(printf '%s\n' "$cols" | wc -l)" = 1 ] || fail "--check's '=' is in several columns ($cols): $out"
[ "$cols" = $((width + 3)) ] || fail "--check's '=' at column $cols, not after the longest name"
[ "$(status_of sh "$launcher" --pin-limit=x --check)" = 2 ] || fail "--check of a bad value: not 2"
# A bad value is not shown as resolved to the default the library would fall back to (issue 30).
out=$(sh "$launcher" --granularity=zz --check 2>/dev/null) && fail "--check of zz: status 0"
expect_line "$out" "$(row VMMHOOK_GRANULARITY 'not resolved: a bad value (above)')"
printf '%s\n' "$out" | grep -q 'VMMHOOK_GRANULARITY *= recommended' &&
    fail "--check shows a bad value as the default: $out"
# An option that needs a value does not take the next option as it (issue 30).
err=$(sh "$launcher" --granularity --check 2>&1) && fail "--granularity --check: status 0: $err"
[ "$(status_of sh "$launcher" --granularity --check)" = 2 ] || fail "--granularity --check: not 2"
printf '%s\n' "$err" |
    grep -q "^vmmhook: option '--granularity' needs a value, not the option '--check'" ||
    fail "--granularity --check: $err"
[ "$(status_of sh "$launcher" -n --trace --stats -- /bin/true)" = 2 ] ||
    fail "--trace --stats: not 2"
# --help documents the exit statuses, 2 included.
printf '%s\n' "$help" | grep -q '^Exit status: ' || fail "--help has no exit statuses"
printf '%s\n' "$help" | grep -q '2: a usage' || fail "--help does not document exit 2"
# Messages name vmmhook-config by the path it has (it is on PATH only once installed).
err=$("$config" --bogus 2>&1 || true)
printf '%s\n' "$err" | grep -qxF "Try '$config --help'." || fail "vmmhook-config --bogus: $err"

# --check checks what can be checked before the run, and its messages agree with its status
# (issue 20): each problem on a line of its own, then "the check fails", exit 2 for a bad
# value, 1 for the others.
check_fails() { # exit status (2: a bad value, 1: other problems), expected text on stderr,
    # then the environment assignments
    want_st=$1 want=$2
    shift 2
    st=0
    err=$(env "$@" "$config" --check 2>&1 >/dev/null) || st=$?
    [ "$st" = "$want_st" ] || fail "--check with $*: status $st, not $want_st: $err"
    printf '%s\n' "$err" | grep -qF -- "$want" || fail "--check with $*: no '$want' in: $err"
    printf '%s\n' "$err" | tail -n 1 | grep -qF "$config: the check fails: " ||
        fail "--check with $*: the last line does not say the check fails: $err"
    printf '%s\n' "$err" | grep -q 'would use the default\|ignored' &&
        fail "--check with $*: says the value would be used or ignored, and fails: $err"
    return 0
}
# No GPU can make a chunk of 1T; --check has no driver to ask (the library's set-up does).
check_fails 2 'VMMHOOK_GRANULARITY="1T" is not valid (larger than any GPU' VMMHOOK_GRANULARITY=1T
# An output path that is a directory was found only at exit, after the whole run.
check_fails 1 'VMMHOOK_STATS_JSON="/tmp": the library could not write it: it is a directory' \
    VMMHOOK_STATS_JSON=/tmp
# A misspelt name fails, with the closest known name.
check_fails 1 'VMMHOOK_GRANULARTY: unknown; did you mean VMMHOOK_GRANULARITY?' \
    VMMHOOK_GRANULARTY=2M
check_fails 1 'VMMHOOK_STATS_FILE: unknown; did you mean VMMHOOK_STATS_JSON?' VMMHOOK_STATS_FILE=x
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
check_fails 1 "VMMHOOK_TRACE=\"$scratch/no/t.csv\": the library could not write it: cannot create" \
    VMMHOOK_TRACE="$scratch/no/t.csv"
# %p and %% are expanded as the library does: "100%%" names "100%", here a directory.
mkdir "$scratch/100%"
check_fails 1 'it is a directory' VMMHOOK_STATS_JSON="$scratch/100%%"
[ "$(status_of env VMMHOOK_STATS_JSON="$scratch/j.%p.json" VMMHOOK_TRACE="$scratch/t.%p.csv" \
    "$config" --check)" = 0 ] || fail "--check of creatable files: not 0"
[ -z "$(ls -A "$scratch" | grep -v '^100%$')" ] || fail "--check created files: $(ls "$scratch")"
# The trace's gauges file is checked beside it.
mkdir "$scratch/t.csv.gauges.csv"
check_fails 1 "VMMHOOK_TRACE's gauges file" VMMHOOK_TRACE="$scratch/t.csv"
# Several problems: each one, and the count of each.
check_fails 2 'the check fails: 1 bad value, 1 unknown VMMHOOK_* variable, 1 output file' \
    VMMHOOK_PIN_LIMIT=x VMMHOOK_PEER=all VMMHOOK_STATS_JSON=/tmp
# The launcher refuses to run then, saying so (not that the library would go on).
err=$(env VMMHOOK_STATS_JSON=/tmp sh "$launcher" -- /bin/echo ran 2>&1) && fail "ran: $err"
printf '%s\n' "$err" | tail -n 1 |
    grep -q "^vmmhook: not running /bin/echo: the check of the settings failed (above)" ||
    fail "the launcher's refusal: $err"

# --check applies the library's own validation of a granularity (issue 37: 3M and 1000 passed
# it, and the library refused them at the device's set-up): a size must be a multiple of 2M.
for v in 3M 1000 1M 3145728; do
    err=$(sh "$launcher" --granularity=$v --check 2>&1 >/dev/null) && fail "--check of $v: status 0"
    printf '%s\n' "$err" | grep -qF "VMMHOOK_GRANULARITY=\"$v\" is not valid (not a multiple of 2M)" ||
        fail "--check of $v: $err"
    [ "$(status_of sh "$launcher" --granularity=$v -- /bin/true)" = 2 ] || fail "$v ran: not 2"
done
# What only the GPU can tell is said to be left to the run, for an explicit size only.
out=$(sh "$launcher" --granularity=64M --check) || fail "--check of 64M failed: $out"
printf '%s\n' "$out" | grep -q '^Checked only when the program runs, on its GPU' ||
    fail "--check of 64M does not say what is left to the run: $out"
printf '%s\n' "$out" | grep -q "^  VMMHOOK_GRANULARITY=64M: whether this GPU's driver takes the size" ||
    fail "--check of 64M does not say the GPU checks the size: $out"
out=$(sh "$launcher" --granularity=min --check) || fail "--check of min failed: $out"
printf '%s\n' "$out" | grep -q 'Checked only when' && fail "--check of min defers a check: $out"
out=$(sh "$launcher" --handle-type=fabric --check) || fail "--check of fabric failed: $out"
printf '%s\n' "$out" | grep -q '^  VMMHOOK_HANDLE_TYPE=fabric: whether the driver' ||
    fail "--check of fabric does not say the driver decides: $out"
# An empty value is the library's unset: the default, and --check says so.
out=$(sh "$launcher" --granularity= --cache-limit= --check) || fail "--check of empty values: $out"
expect_line "$out" "$(row VMMHOOK_GRANULARITY 'recommended (default: the value given is empty)')"
expect_line "$out" "$(row VMMHOOK_CACHE_LIMIT '1G (default: the value given is empty)')"

# Every message of the launcher starts with its name, vmmhook-config's through it too (issue
# 37: those named vmmhook-config by its full path).
err=$(sh "$launcher" --stats-json=/tmp --pin-limit=x --set=VMMHOOK_PEER=all --check 2>&1 >/dev/null) &&
    fail "--check of three problems: status 0"
[ "$(printf '%s\n' "$err" | wc -l)" -ge 4 ] || fail "--check of three problems: $err"
printf '%s\n' "$err" | grep -v '^vmmhook: ' && fail "a message not starting with 'vmmhook: ': $err"
printf '%s\n' "$err" | grep -q '^vmmhook: the check fails: ' || fail "no 'the check fails': $err"
err=$(sh "$launcher" --stats-json=/tmp -- /bin/true 2>&1) && fail "ran with a bad file: $err"
printf '%s\n' "$err" | grep -v '^vmmhook: ' && fail "a message not starting with 'vmmhook: ': $err"
err=$(VMMHOOK_LAUNCHER_NAME='python -m vmmhook' sh "$launcher" --stats-json=/tmp --check 2>&1 >/dev/null) &&
    fail "python -m vmmhook --check: status 0"
printf '%s\n' "$err" | grep -q '^python -m vmmhook: the check fails: ' ||
    fail "python -m vmmhook --check: $err"

# A misspelt flag gets the library's "did you mean" (issue 37), for the launcher's own too.
for pair in --granularty=64M:--granularity --stats-jsno=x:--stats-json -granularity=2M:--granularity \
    --chek:--check --dry-rum:--dry-run; do
    err=$(sh "$launcher" "${pair%%:*}" -- /bin/true 2>&1) && fail "${pair%%:*}: ran"
    printf '%s\n' "$err" | grep -q "^vmmhook: unknown option '.*'; did you mean ${pair#*:}? (see --help)\$" ||
        fail "${pair%%:*}: no suggestion of ${pair#*:}: $err"
done
err=$(sh "$launcher" --bogus -- /bin/true 2>&1) && fail "--bogus: ran"
printf '%s\n' "$err" | grep -q 'did you mean' && fail "--bogus: a suggestion: $err"

# A word among the options that is neither an option nor a program is refused before anything
# runs (issue 37: `--cache-limit=64 M --check` ran M, and the shell said "exec: M: not found").
err=$(sh "$launcher" --cache-limit=64 M --check 2>&1) && fail "a stray word ran: $err"
[ "$(status_of sh "$launcher" --cache-limit=64 M --check)" = 2 ] || fail "a stray word: not 2"
printf '%s\n' "$err" | head -n 1 |
    grep -q "^vmmhook: 'M' (after '--cache-limit=64') is not an option, nor a program found on PATH; the program comes after the options and '--'" ||
    fail "a stray word: $err"
err=$(sh "$launcher" -n --cache-limit 64 M 2>&1) && fail "a stray word (dry run): $err"
printf '%s\n' "$err" | grep -q "^vmmhook: 'M' (after '--cache-limit 64') is not an option" ||
    fail "a stray word after a separate value: $err"
# A program that is not there, after '--': the launcher says so, with the shell's 127.
err=$(sh "$launcher" --stats -- vmmhook-no-such-program 2>&1) && fail "no such program: ran"
[ "$err" = "vmmhook: cannot run vmmhook-no-such-program: not found on PATH" ] ||
    fail "no such program: $err"
[ "$(status_of sh "$launcher" --stats -- ./vmmhook-no-such-program)" = 127 ] ||
    fail "no such program: not 127"

# The build tree's launcher without vmmhook-config says how to build it, with the target's real
# name (issue 37: tools/quickstart did not build it, and the message did not say how).
mkdir -p "$scratch/tree/tools/launcher"
cp "$launcher" "$scratch/tree/tools/launcher/vmmhook"
: >"$scratch/tree/build.ninja"
if ! PATH=/usr/bin:/bin command -v vmmhook-config >/dev/null; then
    err=$(PATH=/usr/bin:/bin sh "$scratch/tree/tools/launcher/vmmhook" --stats -- /bin/true 2>&1) &&
        fail "ran without vmmhook-config"
    printf '%s\n' "$err" | grep -q "^vmmhook: vmmhook-config not found next to .*; build it with: meson compile -C $scratch/tree vmmhook-config\$" ||
        fail "no way to build vmmhook-config in: $err"
fi
if command -v meson >/dev/null; then
    meson introspect "$build" --targets | grep -q '"name": "vmmhook-config"' ||
        fail "the build has no target named vmmhook-config"
fi
# ... and tools/quickstart builds it, for the README's launcher line after it.
if [ -n "$root" ]; then
    grep -E '^ *targets(\+)?=\(' "$root/tools/quickstart" | grep -qw 'tools/launcher/vmmhook-config' ||
        fail "tools/quickstart does not build tools/launcher/vmmhook-config"
    [ -x "$build/tools/launcher/vmmhook-config" ] || fail "no $build/tools/launcher/vmmhook-config"
fi

# Usage errors say what was wrong in their first line, and at most a hint after it.
err=$(sh "$launcher" --stats 2>&1) && fail "no program: ran"
printf '%s\n' "$err" | head -n 1 | grep -q '^vmmhook: no program to run' ||
    fail "no program: the first line does not say so: $err"
[ "$(printf '%s\n' "$err" | wc -l)" -le 2 ] || fail "no program: more than 2 lines: $err"
err=$("$config" --bogus 2>&1) && fail "vmmhook-config --bogus: status 0"
printf '%s\n' "$err" | head -n 1 | grep -qF "vmmhook-config: unknown option '--bogus'" ||
    fail "vmmhook-config --bogus: the first line does not name it: $err"
[ "$(printf '%s\n' "$err" | wc -l)" -le 2 ] || fail "vmmhook-config --bogus: more than 2 lines: $err"
[ "$(status_of "$config" --bogus)" = 2 ] || fail "vmmhook-config --bogus: not 2"
err=$("$config" 2>&1) && fail "vmmhook-config without a mode: status 0"
printf '%s\n' "$err" | head -n 1 |
    grep -qxF "$config: a mode is needed (--check, --help-text, --markdown, --list, --version)" ||
    fail "vmmhook-config without a mode: $err"
"$config" --help | grep -q '^Usage: vmmhook-config' || fail "vmmhook-config --help"

# Errors: unknown option (never swallowed with its neighbour), no program, missing value,
# missing --lib file.
[ "$(status_of sh "$launcher" --bogus -- /bin/true)" = 2 ] || fail "unknown option: not 2"
[ "$(status_of sh "$launcher" --statss /bin/true)" = 2 ] || fail "misspelt flag: not 2"
[ "$(status_of sh "$launcher" --stats)" = 2 ] || fail "no program: not 2"
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
