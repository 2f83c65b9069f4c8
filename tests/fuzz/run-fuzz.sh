#!/bin/sh
# Builds the option-parser fuzzer (fuzz_options) with clang in its own build directory and runs
# it for a bounded time. CI calls this.
#
#   tests/fuzz/run-fuzz.sh [SECONDS]       default 60 (or $FUZZ_SECONDS)
#
# Environment: FUZZ_BUILD_DIR (default <repo>/build-fuzz), FUZZ_SECONDS.
# Exit status: 0 when the run ends without a finding; libFuzzer's non-zero status on a crash,
# sanitizer report, leak or timeout (the input is saved under $FUZZ_BUILD_DIR/fuzz-artifacts/);
# 2 when the fuzzer cannot be built.
set -eu

secs=${1:-${FUZZ_SECONDS:-60}}
case $secs in
    '' | *[!0-9]*) echo "run-fuzz.sh: SECONDS must be a whole number, not '$secs'" >&2; exit 2 ;;
esac
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${FUZZ_BUILD_DIR:-$root/build-fuzz}

if ! command -v clang >/dev/null 2>&1; then
    echo "run-fuzz.sh: clang not found; the fuzzer needs clang's -fsanitize=fuzzer" >&2
    exit 2
fi
# A build directory of its own, configured for clang; one configured with another compiler
# (or half-configured) is set up again.
if [ -f "$build/build.ninja" ] && ! grep -q '"clang"' "$build/meson-info/intro-compilers.json" 2>/dev/null; then
    echo "run-fuzz.sh: $build is not a clang build; reconfiguring it" >&2
    rm -rf "$build"
fi
if [ ! -f "$build/build.ninja" ]; then
    CC=clang meson setup "$build" "$root" -Dfuzz=enabled -Dgpu_tests=disabled \
        --buildtype=debugoptimized || exit 2
fi
meson compile -C "$build" tests/fuzz/fuzz_options || exit 2

corpus=$build/fuzz-corpus
artifacts=$build/fuzz-artifacts
mkdir -p "$corpus" "$artifacts"
echo "run-fuzz.sh: fuzzing the option parser for ${secs}s"
# libFuzzer writes new inputs to the first corpus directory only: the seeds in the source tree
# (the second) are read, never written.
status=0
"$build/tests/fuzz/fuzz_options" \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
    -dict="$here/options.dict" -artifact_prefix="$artifacts/" -print_final_stats=1 \
    "$corpus" "$here/corpus" || status=$?
if [ "$status" -ne 0 ]; then
    echo "run-fuzz.sh: the fuzzer found a problem (status $status); inputs in $artifacts:" >&2
    ls -l "$artifacts" >&2 || true
    echo "reproduce with: $build/tests/fuzz/fuzz_options <input>" >&2
fi
exit "$status"
