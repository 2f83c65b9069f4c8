#!/bin/sh
# VMMHOOK_GRANULARITY that the driver cannot serve (issue 20), end to end: the library preloaded
# into ip_linked (a program linked against the simulated libcuda.so.1, SIM_MEMORY=8G as the
# suite sets it). Used to be taken, and every served allocation then failed with out of
# memory, silently.
#   $1 = ip_linked
set -eu
prog=$1
fail() {
    printf 'FAIL: %s\n' "$*" >&2
    exit 1
}
err=$(mktemp)
trap 'rm -f "$err"' EXIT

# A size within the bound of the table that this (simulated) GPU cannot make: refused at the
# device's set-up with one warning naming the variable, the value and the driver's answer, and
# every allocation served at the recommended granularity.
VMMHOOK_GRANULARITY=16G "$prog" served >/dev/null 2>"$err" || fail "16G: $(cat "$err")"
n=$(grep -c 'VMMHOOK_GRANULARITY="16G" is refused: the driver cannot make a chunk of that size' "$err") || true
[ "$n" = 1 ] || fail "16G: $n warnings, not 1: $(cat "$err")"
grep -q 'answers CUDA_ERROR_OUT_OF_MEMORY 2.*using the recommended granularity 2 MiB' "$err" ||
    fail "16G: the warning lacks the driver's answer or what is used: $(cat "$err")"

# Above the bound (no GPU has 1T): refused when the options are read, the default used.
VMMHOOK_GRANULARITY=1T "$prog" served >/dev/null 2>"$err" || fail "1T: $(cat "$err")"
grep -q 'VMMHOOK_GRANULARITY="1T" is not valid (larger than any GPU.s memory' "$err" ||
    fail "1T: no warning: $(cat "$err")"

# VMMHOOK_STRICT: the program stops (abort, after the message) instead.
st=0
VMMHOOK_STRICT=1 VMMHOOK_GRANULARITY=16G "$prog" served >/dev/null 2>"$err" || st=$?
[ "$st" = 134 ] || fail "16G strict: status $st, not 134 (abort): $(cat "$err")"
grep -q 'VMMHOOK_GRANULARITY="16G" is refused: .*stopping because VMMHOOK_STRICT is set' "$err" ||
    fail "16G strict: no message: $(cat "$err")"
echo "granularity: all checks passed"
