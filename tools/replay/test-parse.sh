#!/bin/sh
# GPU-free test of the trace parser: replay --parse-only and plot-trace.py must both read
# sample-trace.csv as the expected PARSE line (worked out by hand from the file: one allocate
# failure, one free of a pointer never allocated, one block live at the end, peak at event 18),
# and plot-trace.py must write a PNG.
# Then the gauges plot: a small synthetic trace with libvmmhook's companion TRACE.gauges.csv
# beside it (found by itself) or named with --gauges, drawn by the built-in PNG writer: the
# GAUGES summary line, and a PNG holding the colour of every curve (requested, mapped,
# reserved, cached dashed) and its legend; --no-gauges goes back to the requested-only plot.
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

    # A synthetic trace and its gauges (as libvmmhook writes them): 2 MiB chunks mapped,
    # 64 MiB ranges reserved, freed chunks cached.
    python3 - "$tmp/g.csv" <<'PY' || { echo "cannot write the synthetic trace"; exit 1; }
import sys
M = 1 << 20
ev = [("allocate", 0x7f0000000000, 3 * M), ("allocate", 0x7f0004000000, 5 * M),
      ("free", 0x7f0000000000, 3 * M), ("allocate", 0x7f0000000000, 1 * M),
      ("allocate failure", 0, 1 << 40), ("free", 0x7f0004000000, 5 * M),
      ("free", 0x7f0000000000, 1 * M)]
req = mapped = reserved = cached = 0
live = {}
with open(sys.argv[1], "w") as t, open(sys.argv[1] + ".gauges.csv", "w") as g:
    t.write("Thread,Time,Action,Pointer,Size,Stream\n")
    g.write("Time,Requested,Mapped,Reserved,Cached\n")
    for i, (action, ptr, size) in enumerate(ev):
        chunk = -(-size // (2 * M)) * 2 * M
        if action == "allocate":
            req += size
            live[ptr] = chunk
            if cached >= chunk:
                cached -= chunk
            else:
                mapped += chunk
                reserved += 64 * M
        elif action == "free":
            req -= size
            cached += live.pop(ptr)
        time = "00:00:00.%06d" % (100 + 250 * i)
        t.write("4242,%s,%s,0x%x,%d,0\n" % (time, action, ptr, size))
        g.write("%s,%d,%d,%d,%d\n" % (time, req, mapped, reserved, cached))
PY
    gwant='GAUGES lines=7 peak_requested=8388608 peak_mapped=10485760 peak_reserved=134217728 peak_cached=10485760 malformed=0'
    # Checks that PNG $1 holds pixels of each curve's colour (the built-in writer's colours).
    check_png() {
        python3 - "$1" "$2" <<'PY'
import struct, sys, zlib
data = open(sys.argv[1], "rb").read()
assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
pos, idat, w = 8, b"", 0
while pos < len(data):
    n, tag = struct.unpack(">I4s", data[pos:pos + 8])
    body = data[pos + 8:pos + 8 + n]
    if tag == b"IHDR":
        w, h = struct.unpack(">II", body[:8])
    elif tag == b"IDAT":
        idat += body
    pos += 12 + n
raw = zlib.decompress(idat)
count = {}
for y in range(h):
    row = raw[y * (1 + 3 * w):(y + 1) * (1 + 3 * w)]
    assert row[0] == 0, "unexpected filter"
    for x in range(w):
        c = bytes(row[1 + 3 * x:4 + 3 * x])
        count[c] = count.get(c, 0) + 1
colours = {"requested": (31, 95, 168), "mapped": (222, 110, 20), "reserved": (46, 150, 70),
           "cached": (140, 70, 170)}
want = sys.argv[2].split(",") if sys.argv[2] else []
for name, rgb in colours.items():
    n = count.get(bytes(rgb), 0)
    if (name in want) != (n > 0):
        sys.exit("%s: %d pixels of the %s colour" % (sys.argv[1], n, name))
PY
    }
    out=$(python3 "$plot" "$tmp/g.csv" --no-matplotlib -o "$tmp/g.png") || { echo "plot-trace.py (gauges) failed"; exit 1; }
    got=$(printf '%s\n' "$out" | grep '^GAUGES')
    [ "$got" = "$gwant" ] || { printf 'plot-trace.py gauges:\n  got  %s\n  want %s\n' "$got" "$gwant"; exit 1; }
    printf '%s\n' "$out" | grep -q "with the gauges of $tmp/g.csv.gauges.csv" || { echo "gauges file not used: $out"; exit 1; }
    check_png "$tmp/g.png" requested,mapped,reserved,cached || exit 1
    # Named explicitly, and under another name; by index too.
    mv "$tmp/g.csv.gauges.csv" "$tmp/other.csv"
    out=$(python3 "$plot" "$tmp/g.csv" --gauges "$tmp/other.csv" --by-index --no-matplotlib -o "$tmp/h.png") || { echo "plot-trace.py --gauges failed"; exit 1; }
    got=$(printf '%s\n' "$out" | grep '^GAUGES')
    [ "$got" = "$gwant" ] || { printf 'plot-trace.py --gauges:\n  got  %s\n  want %s\n' "$got" "$gwant"; exit 1; }
    check_png "$tmp/h.png" requested,mapped,reserved,cached || exit 1
    # No gauges file (or --no-gauges): the requested-only plot, as before.
    out=$(python3 "$plot" "$tmp/g.csv" --no-matplotlib -o "$tmp/r.png") || { echo "plot-trace.py (no gauges) failed"; exit 1; }
    ! printf '%s\n' "$out" | grep -q '^GAUGES' || { echo "GAUGES without a gauges file"; exit 1; }
    check_png "$tmp/r.png" requested || exit 1
    mv "$tmp/other.csv" "$tmp/g.csv.gauges.csv"
    out=$(python3 "$plot" "$tmp/g.csv" --no-gauges --no-matplotlib -o "$tmp/n.png") || { echo "plot-trace.py --no-gauges failed"; exit 1; }
    ! printf '%s\n' "$out" | grep -q '^GAUGES' || { echo "GAUGES with --no-gauges"; exit 1; }
    check_png "$tmp/n.png" requested || exit 1
    # A named gauges file that is missing is an error.
    python3 "$plot" "$tmp/g.csv" --gauges "$tmp/missing.csv" --no-matplotlib -o "$tmp/m.png" >/dev/null 2>&1 && { echo "missing --gauges file accepted"; exit 1; }
    echo "ok: gauges plot"
fi
echo "ok: $want"
