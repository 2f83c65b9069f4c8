#!/usr/bin/env python3
"""Plots the device memory requested over time by an RMM logging_resource_adaptor trace.

usage: plot-trace.py TRACE.csv [-o OUT.png] [--by-index] [--no-matplotlib]

Reads "Thread,Time,Action,Pointer,Size,Stream" (the parsing rules of replay.cu: columns named
by the header, allocate / free (deallocate) / allocate failure, a free of a pointer that is not
live is skipped, an allocate of a live pointer first frees the older block) and draws the
bytes live after every event, over seconds since the first event (or over the event index with
--by-index, or when the times do not parse). Prints the same summary line as
`replay --parse-only` (PARSE events=... peak_requested_bytes=...).

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


def unit_of(peak):
    for u, d in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if peak >= 2 * d:
            return u, d
    return "B", 1


# ---- plotting with matplotlib ---------------------------------------------------------------

def plot_matplotlib(xs, ys, xlabel, title, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    u, d = unit_of(max(ys) if ys else 0)
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    yv = [y / d for y in ys]
    ax.step(xs, yv, where="post", color="#1f5fa8", linewidth=1)
    ax.fill_between(xs, yv, step="post", color="#9cc3ea", alpha=0.6)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("requested (%s)" % u)
    ax.set_title(title)
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


def plot_builtin(xs, ys, xlabel, title, out):
    W, H, L, R, T, B = 960, 440, 90, 24, 40, 56
    cv = Canvas(W, H)
    pw, ph = W - L - R, H - T - B
    u, d = unit_of(max(ys) if ys else 0)
    x0, x1 = (xs[0], xs[-1]) if xs else (0, 1)
    if x1 <= x0:
        x1 = x0 + 1
    ymax = (max(ys) / d if ys else 1) * 1.05 or 1
    # Per pixel column: the largest value live in that column (a step function).
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
    grid, fill, line = (225, 225, 225), (156, 195, 234), (31, 95, 168)
    for v in nice_ticks(ymax):
        y = T + ph - int(v / ymax * ph)
        cv.rect(L, y, L + pw, y, grid)
        cv.text(L - 8, y - 5, tick_label(v), anchor="right")
    for v in nice_ticks(x1 - x0):
        x = L + int(v / (x1 - x0) * pw)
        cv.rect(x, T, x, T + ph, grid)
        cv.text(x, T + ph + 8, tick_label(v), anchor="center")
    prev = None
    for c, v in enumerate(col):
        y = T + ph - int(v / ymax * ph)
        cv.rect(L + c, y, L + c, T + ph, fill)
        cv.rect(L + c, y if prev is None else min(y, prev), L + c, y if prev is None else max(y, prev), line)
        prev = y
    cv.rect(L, T, L, T + ph, (0, 0, 0))
    cv.rect(L, T + ph, L + pw, T + ph, (0, 0, 0))
    cv.text(L + pw // 2, H - 20, xlabel, anchor="center")
    cv.text(L + pw // 2, 12, title + "   Y: REQUESTED " + u, anchor="center")
    cv.save(out)


def main():
    ap = argparse.ArgumentParser(description="Plot memory requested over time from an RMM trace.")
    ap.add_argument("trace")
    ap.add_argument("-o", "--output")
    ap.add_argument("--by-index", action="store_true", help="x = event index, not time")
    ap.add_argument("--no-matplotlib", action="store_true", help="use the built-in PNG writer")
    a = ap.parse_args()
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
    if not req:
        print("plot-trace: no events to plot", file=sys.stderr)
        return 1
    by_time = not a.by_index and all(t is not None for t in times) and times[-1] > times[0]
    if by_time:
        xs = [t - times[0] for t in times]
        xlabel = "seconds since the first event"
    else:
        xs = list(range(len(req)))
        xlabel = "event"
    u, d = unit_of(st["peak"])
    title = "%s: peak %.1f %s requested, %d events" % (os.path.basename(a.trace), st["peak"] / d, u,
                                                      st["events"])
    out = a.output or os.path.splitext(a.trace)[0] + ".png"
    used = "built-in PNG writer"
    if not a.no_matplotlib:
        try:
            plot_matplotlib(xs, req, xlabel, title, out)
            used = "matplotlib"
        except ImportError:
            print("plot-trace: matplotlib not available: using the built-in PNG writer")
        except Exception as e:  # a broken matplotlib install must not cost the plot
            print("plot-trace: matplotlib failed (%s): using the built-in PNG writer" % e)
    if used != "matplotlib":
        plot_builtin(xs, req, xlabel.upper(), "PEAK %.1f %s, %d EVENTS" % (st["peak"] / d, u, st["events"]), out)
    print("plot-trace: wrote %s (%s)" % (out, used))
    return 0


if __name__ == "__main__":
    sys.exit(main())
