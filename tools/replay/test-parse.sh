#!/bin/sh
# GPU-free test of the trace parser: replay --parse-only and plot-trace.py must both read
# sample-trace.csv as the expected PARSE line (worked out by hand from the file: one allocate
# failure, one free of a pointer never allocated, one block live at the end, peak at event 18),
# and plot-trace.py must write a PNG.
# usage: test-parse.sh REPLAY_BINARY SAMPLE_TRACE PLOT_SCRIPT
set -u
replay=$1 trace=$2 plot=$3
want='PARSE events=29 allocs=15 frees=14 peak_requested_bytes=341512831 threads=2 unmatched_frees=1 failures=1 live_at_end=1'
got=$("$replay" --parse-only "$trace" | grep '^PARSE') || { echo "replay --parse-only failed"; exit 1; }
[ "$got" = "$want" ] || { printf 'replay:\n  got  %s\n  want %s\n' "$got" "$want"; exit 1; }
if command -v python3 >/dev/null 2>&1; then
    tmp=$(mktemp -d) || exit 1
    trap 'rm -rf "$tmp"' EXIT
    got=$(python3 "$plot" "$trace" -o "$tmp/t.png" | grep '^PARSE') || { echo "plot-trace.py failed"; exit 1; }
    [ "$got" = "$want" ] || { printf 'plot-trace.py:\n  got  %s\n  want %s\n' "$got" "$want"; exit 1; }
    [ "$(head -c 4 "$tmp/t.png" | od -An -c | tr -d ' ')" = '211PNG' ] || { echo "no PNG written"; exit 1; }
fi
echo "ok: $want"
