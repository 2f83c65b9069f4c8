"""torch_step_table.py LOGDIR [PREFIX [MAX_OVER]]: a PyTorch step-time table of the GPU suite.

Reads LOGDIR/PREFIX.{nocache.hooked,cache.native,nocache.native}.out (STEP, SYNC, CALLS and MEM
lines of tests/gpu/torch_step.py; PREFIX torch_step by default, torch_step_small for the small
model) and the hooked run's stats JSON (PREFIX.nocache.hooked.json, written at exit: its
counters cover the whole run, warm-up and model set-up included). Prints a markdown table, the
targets of issue 21 with MET/MISS (step time at most MAX_OVER times caching on, default 1.00;
no blocking synchronization; peak device memory at most 1.15x peak requested), and a last line
"ROW|<one-line note>".
"""
import json
import os
import sys

log = sys.argv[1]
prefix = sys.argv[2] if len(sys.argv) > 2 else "torch_step"
max_over = float(sys.argv[3]) if len(sys.argv) > 3 else 1.00
MAX_RATIO = 1.15
RUNS = (("nocache.hooked", "caching off, hook"), ("cache.native", "caching on, native"),
        ("nocache.native", "caching off, native"))


def parse(run):
    d = {"step": {}, "sync": {}, "mem": None, "calls": {}}
    try:
        text = open(os.path.join(log, f"{prefix}.{run}.out")).read()
    except OSError:
        return None
    for line in text.splitlines():
        f = line.split()
        if not f:
            continue
        if f[0] == "STEP":
            d["step"] = {k: float(v) for k, v in zip(f[1::2], f[2::2])}
        elif f[0] == "SYNC":
            d["sync"] = {k: float(v) for k, v in zip(f[1::2], f[2::2])}
        elif f[0] == "CALLS":
            d["calls"] = {k: float(v) for k, v in zip(f[1::2], f[2::2])}
        elif f[0] == "MEM" and d["mem"] is None:
            d["mem"] = dict(zip(f[1::2], f[2::2]))
    return d


def exit_json(run):
    try:
        return json.load(open(os.path.join(log, f"{prefix}.{run}.json")))
    except (OSError, ValueError):
        return None


def fmt(v, nd=2, unit=""):
    return "n/a" if v is None else f"{v:.{nd}f}{unit}"


res = {r: parse(r) for r, _ in RUNS}
cache_ms = (res["cache.native"] or {}).get("step", {}).get("median_ms")
out = ["| run | step ms: median (p10-p90) | over caching on | syncs per step | "
       "driver calls per allocation (program's threads) | peak device / peak requested |",
       "| --- | --- | --- | --- | --- | --- |"]
hook = {}
for run, label in RUNS:
    d = res[run]
    if not d or not d["step"]:
        out.append(f"| {label} | n/a | | | | |")
        continue
    s = d["step"]
    med = s.get("median_ms")
    over = med / cache_ms if med and cache_ms else None
    syncs = "-"
    if run.endswith("hooked"):
        if d["sync"]:
            syncs = ", ".join(f"{k} {v:.2f}" for k, v in sorted(d["sync"].items()))
        else:
            j = exit_json(run) or {}
            c = j.get("counters") or {}
            n = s.get("steps", 0) + 5
            tot = {k: v for k, v in c.items()
                   if ("sync" in k or "wait" in k) and isinstance(v, (int, float))}
            if tot and n:
                syncs = ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(tot.items())) + \
                    " (exit JSON, whole run / steps)"
                d["sync"] = {k: v / n for k, v in tot.items()}
    ratio = None
    m = d["mem"]
    if m is None and run.endswith("hooked"):
        g = (exit_json(run) or {}).get("gauges") or {}
        pm = (g.get("bytes_mapped") or {}).get("peak") if isinstance(g.get("bytes_mapped"), dict) else None
        pr = (g.get("bytes_requested") or {}).get("peak") if isinstance(g.get("bytes_requested"), dict) else None
        if pm and pr:
            m = {"peak_requested": pr, "peak_device": pm, "source": "hook-gauges(exit JSON)"}
    if m:
        try:
            ratio = float(m["peak_device"]) / float(m["peak_requested"])
        except (KeyError, ValueError, ZeroDivisionError):
            ratio = None
    mem = f"{fmt(ratio, 3)} ({int(float(m['peak_device'])) >> 20} / " \
          f"{int(float(m['peak_requested'])) >> 20} MiB, {m.get('source', '?')})" if m and ratio else "n/a"
    calls = d["calls"].get("app_per_alloc")
    calls_txt = "-" if calls is None else \
        f"{calls:.4f} ({d['calls'].get('allocs_per_step', 0):.0f} allocations a step)"
    out.append(f"| {label} | {fmt(med)} ({fmt(s.get('p10_ms'))}-{fmt(s.get('p90_ms'))}) | "
               f"{fmt(over, unit='x')} | {syncs} | {calls_txt} | {mem} |")
    if run.endswith("hooked"):
        hook = {"over": over, "sync": d["sync"], "ratio": ratio, "calls": calls}


def verdict(ok):
    return "n/a" if ok is None else ("MET" if ok else "MISS")


# The application threads' waits: the library's syncs_blocking counter (src/util/stats.h: the
# synchronizations that blocked an application thread; syncs_background are the reclaim
# thread's, which no application thread waits for). Without it (an older library), a counter
# named for blocking or for the foreground; without any, every sync/wait counter together (an
# upper bound).
hsync = hook.get("sync") or {}
if "syncs_blocking" in hsync:
    blocking = {"syncs_blocking": hsync["syncs_blocking"]}
else:
    blocking = {k: v for k, v in hsync.items()
                if ("block" in k and "nonblock" not in k and "non_block" not in k)
                or "foreground" in k}
bsync = max(blocking.values()) if blocking else None
bname = ", ".join(sorted(blocking)) if blocking else \
    "no syncs_blocking counter: all sync/wait counters summed"
if bsync is None and hsync:
    bsync = sum(hsync.values())
bg = hsync.get("syncs_background")
over_ok = None if hook.get('over') is None else hook['over'] <= max_over
sync_ok = None if bsync is None else bsync == 0
ratio_ok = None if hook.get('ratio') is None else hook['ratio'] <= MAX_RATIO
out += ["", f"Targets (issue 21, caching off under the hook, {prefix}):", "",
        "| target | value | verdict |", "| --- | --- | --- |",
        f"| step time <= {max_over:.2f}x caching on (native) | {fmt(hook.get('over'), unit='x')} | "
        f"{verdict(over_ok)} |",
        f"| blocking synchronizations per step: 0 ({bname}) | {fmt(bsync)} | {verdict(sync_ok)} |",
        f"| peak device memory <= {MAX_RATIO:.2f}x peak requested | {fmt(hook.get('ratio'), 3)} | "
        f"{verdict(ratio_ok)} |",
        f"| driver calls per allocation on the program's threads (steady state) | "
        f"{fmt(hook.get('calls'), 4)} | INFO |"]
print("\n".join(out))
print(f"ROW|median ms: hook(off) {fmt((res['nocache.hooked'] or {}).get('step', {}).get('median_ms'))}, "
      f"native on {fmt(cache_ms)}, native off "
      f"{fmt((res['nocache.native'] or {}).get('step', {}).get('median_ms'))}; hook/on "
      f"{fmt(hook.get('over'), unit='x')} (<={max_over:.2f} {verdict(over_ok)}); "
      f"blocking syncs/step {fmt(bsync)} ({verdict(sync_ok)}"
      f"{'' if bg is None else f', background {bg:.2f}'}); "
      f"app driver calls/alloc {fmt(hook.get('calls'), 4)}; "
      f"peak ratio {fmt(hook.get('ratio'), 3)} ({verdict(ratio_ok)})")
