#!/usr/bin/env python3
"""Plots the device memory requested over time by an RMM logging_resource_adaptor trace, and,
when libvmmhook's gauges file is there, the memory mapped, reserved and cached too.

usage: plot-trace.py TRACE.csv [-o OUT.png] [--gauges FILE | --no-gauges] [--curves LIST]
                     [--by-index] [--no-matplotlib]

Reads "Thread,Time,Action,Pointer,Size,Stream" (the parsing rules of replay.cu: columns named
by the header, allocate / free (deallocate) / allocate failure, a free of a pointer that is not
live is skipped, an allocate of a live pointer first frees the older block) and draws the
bytes live after every event, over seconds since the first event (or over the event index with
--by-index, or when the times do not parse). Prints the same summary line as
`replay --parse-only` (PARSE events=... peak_requested_bytes=...).

Gauges: libvmmhook writes beside its trace TRACE.csv a companion TRACE.csv.gauges.csv
("Time,Requested,Mapped,Reserved,Cached", one line per trace line, same clock; see the "Trace
format" section of docs/OPTIONS.md). When that file exists (or is named with --gauges FILE),
the plot shows bytes requested, mapped and reserved (solid) and cached (dashed) over time on the
same axes, with a legend, all four read from the gauges file (--curves picks some of them: the
address space reserved can dwarf the rest), and a second summary line is printed:
GAUGES lines=... peak_requested=... peak_mapped=... peak_reserved=... peak_cached=... malformed=...
Without it (or with --no-gauges) only the bytes requested, replayed from the trace, are plotted.

With matplotlib (the GPU machine has it) the plot is a matplotlib figure; without it (or with
--no-matplotlib) a small built-in PNG writer draws the curve, the axes and their labels.
Default output: TRACE.png beside the trace.
"""
import argparse
import math
import os
import re
import struct
import sys
import zlib


# ---- the trace ------------------------------------------------------------------------------

def parse_time(s):
    m = re.match(r"^\s*(\d+):(\d+):(\d+)(?:[.:](\d+))?\s*$", s)
    if m:
        frac = float("0." + m.group(4)) if m.group(4) else 0.0
        return int(m.group(1)) * 3600 + int(m.group(2)) * 60 + int(m.group(3)) + frac
    try:
        return float(s)
    except ValueError:
        return None


def parse_ptr(s):
    t = s.strip().lower()
    if t in ("", "(nil)", "nil", "null", "0"):
        return 0
    return int(t[2:] if t.startswith("0x") else t, 16)


def load(path):
    """Returns (times, requested, stats): one entry per replayed event."""
    cols = {"thread": 0, "time": 1, "action": 2, "pointer": 3, "size": 4}
    live = {}
    times, req = [], []
    st = dict(events=0, allocs=0, frees=0, failures=0, unmatched_frees=0, malformed=0,
              unknown_actions=0, peak=0, peak_event=0, threads=set())
    cur = 0
    t_prev, wrap = None, 0.0
    first = True
    with open(path, newline="") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            fields = [x.strip() for x in line.split(",")]
            if first:
                first = False
                if fields[0].lower() == "thread":
                    for i, name in enumerate(fields):
                        if name.lower() in cols:
                            cols[name.lower()] = i
                    continue
            if len(fields) <= max(cols.values()):
                st["malformed"] += 1
                continue
            action = fields[cols["action"]].lower()
            try:
                ptr = parse_ptr(fields[cols["pointer"]])
                size = int(fields[cols["size"]])
            except ValueError:
                st["malformed"] += 1
                continue
            st["threads"].add(fields[cols["thread"]])
            t = parse_time(fields[cols["time"]])
            if t is not None:
                if t_prev is not None and t + wrap < t_prev - 43200:  # past midnight
                    wrap += 86400
                t += wrap
                t_prev = t

            def event():
                times.append(t)
                req.append(cur)
                st["events"] += 1

            if action == "allocate":
                if size == 0 or ptr == 0:
                    continue
                if ptr in live:  # its free was not logged
                    cur -= live.pop(ptr)
                    st["frees"] += 1
                    event()
                live[ptr] = size
                cur += size
                st["allocs"] += 1
                event()
                if cur > st["peak"]:
                    st["peak"], st["peak_event"] = cur, st["events"] - 1
            elif action in ("free", "deallocate"):
                if ptr == 0:
                    continue
                if ptr not in live:
                    st["unmatched_frees"] += 1
                    continue
                cur -= live.pop(ptr)
                st["frees"] += 1
                event()
            elif action.startswith("allocate failure") or action == "allocate_failure":
                st["failures"] += 1
            else:
                st["unknown_actions"] += 1
    st["threads"] = len(st["threads"])
    st["live_at_end"] = len(live)
    return times, req, st


GAUGE_COLUMNS = ("requested", "mapped", "reserved", "cached")


def load_gauges(path):
    """Reads a gauges file: returns (times, {column: values}, malformed), one entry per line, in
    time order (stable) when every time parses. Columns are named by the header; a column that is
    missing is absent from the dict. Raises ValueError when the file has no usable header."""
    times, vals = [], {}
    idx = None
    malformed = 0
    with open(path, newline="") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            fields = [x.strip() for x in line.split(",")]
            if idx is None:
                names = [x.lower() for x in fields]
                if "time" not in names or "requested" not in names:
                    raise ValueError("not a gauges file (want a header Time,Requested,...)")
                idx = {c: names.index(c) for c in ("time",) + GAUGE_COLUMNS if c in names}
                vals = {c: [] for c in GAUGE_COLUMNS if c in idx}
                continue
            if len(fields) <= max(idx.values()):
                malformed += 1
                continue
            try:
                row = {c: int(fields[idx[c]]) for c in vals}
            except ValueError:
                malformed += 1
                continue
            times.append(parse_time(fields[idx["time"]]))
            for c in vals:
                vals[c].append(row[c])
    if idx is None:
        raise ValueError("empty (no header)")
    if times and all(t is not None for t in times):
        # Lines of threads tracing at once may be out of order by a few microseconds.
        order = sorted(range(len(times)), key=lambda i: times[i])
        times = [times[i] for i in order]
        vals = {c: [v[i] for i in order] for c, v in vals.items()}
    return times, vals, malformed


def unit_of(peak):
    for u, d in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if peak >= 2 * d:
            return u, d
    return "B", 1


# ---- plotting with matplotlib ---------------------------------------------------------------

# The curves of a gauges plot: (column, label, RGB, dashed). Requested is also filled.
CURVES = (
    ("reserved", "reserved", (46, 150, 70), False),
    ("mapped", "mapped", (222, 110, 20), False),
    ("cached", "cached", (140, 70, 170), True),
    ("requested", "requested", (31, 95, 168), False),
)
FILL = (156, 195, 234)


def curves_of(series):
    """The curves of CURVES present in series ({column: values}), in drawing order."""
    return [c for c in CURVES if c[0] in series]


def legend_of(series):
    """The same, in the order of the legend (that of the gauges file's columns)."""
    return sorted(curves_of(series), key=lambda c: GAUGE_COLUMNS.index(c[0]))


def hexrgb(c):
    return "#%02x%02x%02x" % c


def plot_matplotlib(xs, series, xlabel, title, out):
    """series: {"requested": values} for the requested-only plot, or the gauges columns."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    peak = max((max(v) for v in series.values() if v), default=0)
    u, d = unit_of(peak)
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    gauges = list(series) != ["requested"]
    if "requested" in series:
        ax.fill_between(xs, [y / d for y in series["requested"]], step="post",
                        color=hexrgb(FILL), alpha=0.6 if not gauges else 0.4)
    lines = {}
    for name, label, rgb, dashed in curves_of(series):
        lines[name] = ax.step(xs, [y / d for y in series[name]], where="post", color=hexrgb(rgb),
                              linewidth=1.4 if dashed else 1, linestyle="--" if dashed else "-",
                              label=label)[0]
    ax.set_xlabel(xlabel)
    ax.set_ylabel(("requested (%s)" if list(series) == ["requested"] else "bytes (%s)") % u)
    ax.set_title(title)
    if gauges:
        shown = legend_of(series)
        ax.legend([lines[c[0]] for c in shown], [c[1] for c in shown], loc="upper left",
                  fontsize="small", framealpha=0.9)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


# ---- plotting without it: a minimal PNG writer -----------------------------------------------

FONT = {  # 3x5 glyphs, rows top to bottom
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001001001001", "8": "111101111101111",
    "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    ":": "000010000010000", " ": "000000000000000", "(": "010100100100010",
    ")": "010001001001010", "/": "001001010100100", "%": "101001010100101",
    ",": "000000000010100",
    "A": "010101111101101", "B": "110101110101110", "C": "011100100100011",
    "D": "110101101101110", "E": "111100110100111", "F": "111100110100100",
    "G": "011100101101011", "H": "101101111101101", "I": "111010010010111",
    "J": "001001001101010", "K": "101101110101101", "L": "100100100100111",
    "M": "101111111101101", "N": "110101101101101", "O": "010101101101010",
    "P": "110101110100100", "Q": "010101101110011", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111",
    "V": "101101101101010", "W": "101101111111101", "X": "101101010101101",
    "Y": "101101010010010", "Z": "111001010100111",
}


class Canvas:
    def __init__(self, w, h):
        self.w, self.h = w, h
        self.px = bytearray(b"\xff" * (w * h * 3))

    def set(self, x, y, c):
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.px[i:i + 3] = bytes(c)

    def rect(self, x0, y0, x1, y1, c):
        for y in range(max(0, min(y0, y1)), min(self.h, max(y0, y1) + 1)):
            for x in range(max(0, min(x0, x1)), min(self.w, max(x0, x1) + 1)):
                self.set(x, y, c)

    def text(self, x, y, s, c=(0, 0, 0), scale=2, anchor="left"):
        s = s.upper()
        width = len(s) * 4 * scale - scale
        if anchor == "right":
            x -= width
        elif anchor == "center":
            x -= width // 2
        for ch in s:
            g = FONT.get(ch, FONT[" "])
            for r in range(5):
                for k in range(3):
                    if g[r * 3 + k] == "1":
                        self.rect(x + k * scale, y + r * scale, x + k * scale + scale - 1,
                                  y + r * scale + scale - 1, c)
            x += 4 * scale

    def save(self, path):
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3])
                       for y in range(self.h))

        def chunk(tag, data):
            return (struct.pack(">I", len(data)) + tag + data +
                    struct.pack(">I", zlib.crc32(tag + data) & 0xffffffff))

        with open(path, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n")
            f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)))
            f.write(chunk(b"IDAT", zlib.compress(raw, 9)))
            f.write(chunk(b"IEND", b""))


def nice_ticks(hi, n=5):
    if hi <= 0:
        return [0]
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(hi / step) + 1)]


def tick_label(v):
    return ("%d" % v) if float(v).is_integer() else ("%.3g" % v)


def columns(xs, ys, x0, x1, pw, d):
    """Per pixel column: the largest value live in that column (a step function)."""
    col = [None] * pw
    j, last = 0, 0.0
    for c in range(pw):
        cx1 = x0 + (x1 - x0) * (c + 1) / pw
        hi = last
        while j < len(xs) and xs[j] <= cx1:
            last = ys[j] / d
            hi = max(hi, last)
            j += 1
        col[c] = hi
    return col


def plot_builtin(xs, series, xlabel, title, out):
    """series as for plot_matplotlib. A gauges plot draws each curve in its colour of CURVES
    (cached dashed) with a legend in the top left corner of the plot."""
    W, H, L, R, T, B = 960, 440, 90, 24, 40, 56
    cv = Canvas(W, H)
    pw, ph = W - L - R, H - T - B
    peak = max((max(v) for v in series.values() if v), default=0)
    u, d = unit_of(peak)
    x0, x1 = (xs[0], xs[-1]) if xs else (0, 1)
    if x1 <= x0:
        x1 = x0 + 1
    ymax = (peak / d if peak > 0 else 1) * 1.05
    gauges = list(series) != ["requested"]
    cols = {name: columns(xs, ys, x0, x1, pw, d) for name, ys in series.items()}
    grid = (225, 225, 225)

    def ypix(v):  # clamped to the plot (a negative gauge is a bug upstream: drawn at 0)
        return T + ph - int(min(max(v, 0.0), ymax) / ymax * ph)

    for v in nice_ticks(ymax):
        y = T + ph - int(v / ymax * ph)
        cv.rect(L, y, L + pw, y, grid)
        cv.text(L - 8, y - 5, tick_label(v), anchor="right")
    for v in nice_ticks(x1 - x0):
        x = L + int(v / (x1 - x0) * pw)
        cv.rect(x, T, x, T + ph, grid)
        cv.text(x, T + ph + 8, tick_label(v), anchor="center")
    for c, v in enumerate(cols.get("requested", ())):
        cv.rect(L + c, ypix(v), L + c, T + ph, FILL)
    for name, label, rgb, dashed in curves_of(series):
        prev = None
        for c, v in enumerate(cols[name]):
            y = ypix(v)
            if not dashed or (c // 6) % 2 == 0:
                cv.rect(L + c, y if prev is None else min(y, prev), L + c,
                        y if prev is None else max(y, prev), rgb)
            prev = y
    cv.rect(L, T, L, T + ph, (0, 0, 0))
    cv.rect(L, T + ph, L + pw, T + ph, (0, 0, 0))
    if gauges:
        shown = legend_of(series)
        lx, ly = L + 10, T + 8
        bw = 16 + 8 + max(len(c[1]) for c in shown) * 8 + 8
        cv.rect(lx - 6, ly - 6, lx + bw, ly + 16 * len(shown) + 2, (255, 255, 255))
        cv.rect(lx - 6, ly - 6, lx + bw, ly - 6, (160, 160, 160))
        cv.rect(lx - 6, ly + 16 * len(shown) + 2, lx + bw, ly + 16 * len(shown) + 2,
                (160, 160, 160))
        cv.rect(lx - 6, ly - 6, lx - 6, ly + 16 * len(shown) + 2, (160, 160, 160))
        cv.rect(lx + bw, ly - 6, lx + bw, ly + 16 * len(shown) + 2, (160, 160, 160))
        for i, (name, label, rgb, dashed) in enumerate(shown):
            y = ly + 16 * i + 4
            for k in range(16):
                if not dashed or (k // 4) % 2 == 0:
                    cv.rect(lx + k, y, lx + k, y + 1, rgb)
            cv.text(lx + 24, y - 4, label, c=rgb)
    cv.text(L + pw // 2, H - 20, xlabel, anchor="center")
    cv.text(L + pw // 2, 12, title + ("   Y: " if gauges else "   Y: REQUESTED ") + u,
            anchor="center")
    cv.save(out)


def main():
    ap = argparse.ArgumentParser(description="Plot memory requested (and, with libvmmhook's "
                                 "gauges file, mapped, reserved and cached) over time from an "
                                 "RMM trace.")
    ap.add_argument("trace")
    ap.add_argument("-o", "--output")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--gauges", metavar="FILE",
                   help="libvmmhook's gauges file (default: TRACE.gauges.csv when it exists)")
    g.add_argument("--no-gauges", action="store_true",
                   help="plot the bytes requested only, even when a gauges file is there")
    ap.add_argument("--curves", metavar="LIST", default=",".join(GAUGE_COLUMNS),
                    help="with gauges: the curves to draw, from requested,mapped,reserved,cached "
                    "(default all; e.g. requested,mapped when the address space reserved dwarfs "
                    "the rest)")
    ap.add_argument("--by-index", action="store_true", help="x = event index, not time")
    ap.add_argument("--no-matplotlib", action="store_true", help="use the built-in PNG writer")
    a = ap.parse_args()
    want_curves = [c.strip().lower() for c in a.curves.split(",") if c.strip()]
    bad = [c for c in want_curves if c not in GAUGE_COLUMNS]
    if bad or not want_curves:
        ap.error("--curves: want some of %s, not %r" % (",".join(GAUGE_COLUMNS), a.curves))
    try:
        times, req, st = load(a.trace)
    except OSError as e:
        print("plot-trace: %s: %s" % (a.trace, e.strerror), file=sys.stderr)
        return 1
    except ValueError as e:
        print("plot-trace: %s: %s" % (a.trace, e), file=sys.stderr)
        return 1
    print("PARSE events=%d allocs=%d frees=%d peak_requested_bytes=%d threads=%d "
          "unmatched_frees=%d failures=%d live_at_end=%d" % (
              st["events"], st["allocs"], st["frees"], st["peak"], st["threads"],
              st["unmatched_frees"], st["failures"], st["live_at_end"]))
    gpath = None
    if a.gauges:
        gpath = a.gauges
    elif not a.no_gauges and os.path.isfile(a.trace + ".gauges.csv"):
        gpath = a.trace + ".gauges.csv"
    gtimes, gvals = None, None
    if gpath:
        try:
            gtimes, gvals, gbad = load_gauges(gpath)
        except (OSError, ValueError) as e:
            why = e.strerror if isinstance(e, OSError) else str(e)
            if a.gauges:
                print("plot-trace: %s: %s" % (gpath, why), file=sys.stderr)
                return 1
            print("plot-trace: %s: %s: plotting the bytes requested only" % (gpath, why))
        else:
            if not gtimes:
                print("plot-trace: %s: no gauges lines: plotting the bytes requested only" % gpath)
                gtimes, gvals = None, None
            else:
                print("GAUGES lines=%d %s malformed=%d" % (len(gtimes), " ".join(
                    "peak_%s=%d" % (c, max(gvals[c])) for c in GAUGE_COLUMNS if c in gvals),
                    gbad))
    if gtimes is not None:
        # Every curve from the gauges file, one point per line of it.
        pts = gtimes
        series = {c: gvals[c] for c in GAUGE_COLUMNS if c in gvals and c in want_curves}
        if not series:
            print("plot-trace: %s: none of the curves %s in it" % (gpath, a.curves),
                  file=sys.stderr)
            return 1
    else:
        if not req:
            print("plot-trace: no events to plot", file=sys.stderr)
            return 1
        pts, series = times, {"requested": req}
    by_time = not a.by_index and all(t is not None for t in pts) and pts[-1] > pts[0]
    if by_time:
        xs = [t - pts[0] for t in pts]
        xlabel = "seconds since the first event"
    else:
        xs = list(range(len(pts)))
        xlabel = "event"
    u, d = unit_of(st["peak"])
    title = "%s: peak %.1f %s requested, %d events" % (os.path.basename(a.trace), st["peak"] / d, u,
                                                      st["events"])
    btitle = "PEAK %.1f %s, %d EVENTS" % (st["peak"] / d, u, st["events"])
    if gtimes is not None:
        extra = []
        for c in ("mapped", "reserved"):
            if c in gvals:
                gu, gd = unit_of(max(gvals[c]))
                extra.append("%.1f %s %s" % (max(gvals[c]) / gd, gu, c))
        if extra:
            title = "%s: peak %.1f %s requested, %s; %d events" % (
                os.path.basename(a.trace), st["peak"] / d, u, ", ".join(extra), st["events"])
            btitle = "PEAK %.1f %s REQ, %s" % (st["peak"] / d, u, ", ".join(
                e.replace(" mapped", " MAP").replace(" reserved", " RES") for e in extra))
    out = a.output or os.path.splitext(a.trace)[0] + ".png"
    used = "built-in PNG writer"
    if not a.no_matplotlib:
        try:
            plot_matplotlib(xs, series, xlabel, title, out)
            used = "matplotlib"
        except ImportError:
            print("plot-trace: matplotlib not available: using the built-in PNG writer")
        except Exception as e:  # a broken matplotlib install must not cost the plot
            print("plot-trace: matplotlib failed (%s): using the built-in PNG writer" % e)
    if used != "matplotlib":
        plot_builtin(xs, series, xlabel.upper(), btitle, out)
    print("plot-trace: wrote %s (%s%s)" % (out, used, ", with the gauges of " + gpath
                                           if gtimes is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
