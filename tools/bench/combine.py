#!/usr/bin/env python3
"""Joins the outputs of the two bench runs (plain: native + async; preloaded: hook) into
markdown tables, judges the targets of issue 5 and repeats every number as a RESULT line.

usage: combine.py OUT_PLAIN.txt [OUT_HOOK.txt]   (markdown on stdout)

Input lines used: "RESULT <impl>.<metric> <value|NA> <unit>" and "INFO <key> <value...>".
Output: markdown tables; "TARGET <name> <PASS|MISS|NA> measured=<v> goal=<g>" lines; the raw
RESULT lines of both runs, then "RESULT ratio.<metric>.<a>_over_<b> <v> x" lines.
"""
import math
import sys

SIZES = ["256B", "64KiB", "2MiB", "64MiB", "1GiB"]
GROW = ["1GiB", "8GiB", "64GiB"]


def parse(path, res, info, raw):
    try:
        f = open(path)
    except OSError as e:
        info.setdefault("missing", []).append("%s (%s)" % (path, e.strerror))
        return
    with f:
        for line in f:
            w = line.split()
            if len(w) >= 3 and w[0] == "RESULT" and "." in w[1]:
                impl, metric = w[1].split(".", 1)
                try:
                    v = float(w[2])
                except ValueError:
                    v = None
                res.setdefault(impl, {})[metric] = (v, w[3] if len(w) > 3 else "")
                raw.append(line.rstrip("\n"))
            elif len(w) >= 2 and w[0] == "INFO":
                info.setdefault(w[1], []).append(" ".join(w[2:]))
            elif (w and w[0] in ("SKIP", "ERROR", "WARNING:")) or " ERROR " in line or "SKIPPED" in line:
                info.setdefault("notes", []).append(line.strip())


def get(res, impl, metric):
    v = res.get(impl, {}).get(metric)
    return None if v is None else v[0]


def fmt(v, digits=None):
    if v is None or (isinstance(v, float) and (math.isnan(v) or math.isinf(v))):
        return "n/a"
    a = abs(v)
    if digits is not None:
        return "%.*f" % (digits, v)
    if a >= 1e5:
        return "%.3g" % v if a >= 1e7 else "%.0f" % v
    if a >= 100:
        return "%.0f" % v
    if a >= 10:
        return "%.1f" % v
    if a >= 1:
        return "%.2f" % v
    return "%.3f" % v


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def main(argv):
    if len(argv) < 2:
        sys.stderr.write(__doc__)
        return 2
    res, info, raw = {}, {}, []
    for p in argv[1:]:
        parse(p, res, info, raw)
    out = []
    P = out.append
    ratios = []  # (name, value[, unit]); unit defaults to x
    targets = []  # (name, verdict, measured, goal)

    def verdict(ok):
        return "NA" if ok is None else ("PASS" if ok else "MISS")

    gpu = (info.get("gpu") or ["?"])[0]
    P("# libvmmhook benchmark")
    P("")
    P("GPU: %s; driver %s; runtime %s; libvmmhook version %s; memory source %s." % (
        gpu, ",".join(sorted(set(info.get("cuda_driver", ["?"])))),
        ",".join(sorted(set(info.get("cuda_runtime", ["?"])))),
        (info.get("vmmhook_version") or ["not loaded"])[0],
        " / ".join(info.get("memory_source", ["?"]))))
    for e in info.get("env", []):
        P("Hook environment: `%s`." % e)
    for m in info.get("missing", []):
        P("**Missing run output: %s.**" % m)
    P("")

    # (a)
    P("## (a) Isolated alloc+free pair (ns per pair, median; p10-p90)")
    P("")
    P("| size | native | async (warm pool) | hook | hook/native | hook/async |")
    P("| --- | --- | --- | --- | --- | --- |")
    for s in SIZES:
        cells = []
        for impl in ("native", "async", "hook"):
            p50 = get(res, impl, "pair.%s.p50" % s)
            p10 = get(res, impl, "pair.%s.p10" % s)
            p90 = get(res, impl, "pair.%s.p90" % s)
            cells.append("%s (%s-%s)" % (fmt(p50), fmt(p10), fmt(p90)) if p50 is not None else "n/a")
        h, n, a = (get(res, i, "pair.%s.p50" % s) for i in ("hook", "native", "async"))
        rn, ra = ratio(h, n), ratio(h, a)
        ratios += [("pair.%s.p50.hook_over_native" % s, rn), ("pair.%s.p50.hook_over_async" % s, ra)]
        P("| %s | %s | %s | %s | %s | %s |" % (s, cells[0], cells[1], cells[2], fmt(rn, 4) if rn is not None else "n/a",
                                             fmt(ra, 2) if ra is not None else "n/a"))
        sp = ratio(n, h)
        targets.append(("pair.%s.speedup_vs_native>=20" % s, verdict(None if sp is None else sp >= 20),
                        fmt(sp) + "x", ">= 20x"))
        targets.append(("pair.%s.within_2x_of_async" % s, verdict(None if ra is None else ra <= 2.0),
                        fmt(ra) + "x", "<= 2x"))
    P("")
    # The hook's pairs before the program made a stream (bench.cu's workload a says why).
    if any(get(res, "hook", "pair_nostream.%s.p50" % s) is not None for s in SIZES):
        P("Hook pairs before the program has made a stream (a free reused without a wait):")
        P("")
        P("| size | hook, no stream yet | hook/async |")
        P("| --- | --- | --- |")
        for s in SIZES:
            h = get(res, "hook", "pair_nostream.%s.p50" % s)
            ra = ratio(h, get(res, "async", "pair.%s.p50" % s))
            ratios.append(("pair_nostream.%s.p50.hook_over_async" % s, ra))
            P("| %s | %s (%s-%s) | %s |" % (s, fmt(h), fmt(get(res, "hook", "pair_nostream.%s.p10" % s)),
                                           fmt(get(res, "hook", "pair_nostream.%s.p90" % s)),
                                           fmt(ra, 2) if ra is not None else "n/a"))
        P("")

    # (b), (c)
    P("## (b, c) Churn: 1000 live blocks of mixed sizes (step = one free + one alloc)")
    P("")
    P("| metric | native | async (warm pool) | hook | hook/native | hook/async |")
    P("| --- | --- | --- | --- | --- | --- |")
    for metric, label in (("churn1.us_per_step.p50", "1 thread: us per step (median of batches)"),
                          ("churn1.steps_per_s", "1 thread: steps/s"),
                          ("churn16.steps_per_s", "16 threads: steps/s in all"),
                          ("churn16.scaling", "16 threads over 1 thread")):
        n, a, h = (get(res, i, metric) for i in ("native", "async", "hook"))
        rn, ra = ratio(h, n), ratio(h, a)
        if metric == "churn16.scaling":  # already a ratio: compared within each column
            rn = ra = None
        ratios += [("%s.hook_over_native" % metric, rn), ("%s.hook_over_async" % metric, ra)]
        P("| %s | %s | %s | %s | %s | %s |" % (label, fmt(n), fmt(a), fmt(h), fmt(rn), fmt(ra)))
    sc = get(res, "hook", "churn16.scaling")
    targets.append(("churn16.scaling>=4", verdict(None if sc is None else sc >= 4), fmt(sc) + "x", ">= 4x"))
    # Issue 14: one thread no slower than the async pool's warm path; 16 threads faster than
    # the async pool on 16 threads (one stream each).
    r1 = ratio(get(res, "hook", "churn1.us_per_step.p50"), get(res, "async", "churn1.us_per_step.p50"))
    targets.append(("churn1.hook_time_over_async<=1", verdict(None if r1 is None else r1 <= 1.0),
                    fmt(r1) + "x", "<= 1x"))
    r16 = ratio(get(res, "hook", "churn16.steps_per_s"), get(res, "async", "churn16.steps_per_s"))
    targets.append(("churn16.hook_over_async_steps_per_s>1", verdict(None if r16 is None else r16 > 1.0),
                    fmt(r16) + "x", "> 1x"))
    P("")
    P("Threads: the 1000 live blocks are split over the 16 threads (62-63 each), so the live "
      "memory matches the 1-thread run.")
    P("")

    # (d)
    P("## (d) Peak device memory used / peak bytes requested (churn of (b))")
    P("")
    P("| metric | native | async (warm pool) | hook |")
    P("| --- | --- | --- | --- |")
    for metric, label in (("mem.ratio", "used / requested"), ("mem.peak_used_MiB", "peak used MiB"),
                          ("mem.peak_requested_MiB", "peak requested MiB")):
        P("| %s | %s | %s | %s |" % ((label,) + tuple(
            fmt(get(res, i, metric), 3 if metric == "mem.ratio" else None)
            for i in ("native", "async", "hook"))))
    srcs = [res.get(i, {}).get("mem.ratio", (None, "?"))[1] for i in ("native", "async", "hook")]
    P("| source | %s | %s | %s |" % tuple(srcs))
    mr = get(res, "hook", "mem.ratio")
    hook_src = res.get("hook", {}).get("mem.ratio", (None, ""))[1]
    if mr is not None and hook_src != "nvml":
        targets.append(("mem.ratio<=1.10", "NA", fmt(mr, 3) + " (not NVML: hook cache hidden)", "<= 1.10"))
    else:
        targets.append(("mem.ratio<=1.10", verdict(None if mr is None else mr <= 1.10),
                        fmt(mr, 3) if mr is not None else "n/a", "<= 1.10"))
    P("")

    # (e)
    P("## (e) Grow a buffer by 2 MiB (us: median of the repetitions, their min, and the warm-up grow apart as \"first\")")
    P("")
    P("| size | copy-based (native cudaMalloc+cudaMemcpy+cudaFree) | vmm_realloc (hook) | copy / vmm |")
    P("| --- | --- | --- | --- |")
    vmm = {}
    for s in GROW:
        c = get(res, "native", "grow.%s.copy.p50" % s)
        v = get(res, "hook", "grow.%s.vmm.p50" % s)
        vmm[s] = v
        cf = get(res, "native", "grow.%s.copy.first" % s)
        vf = get(res, "hook", "grow.%s.vmm.first" % s)
        cm = get(res, "native", "grow.%s.copy.min" % s)
        vm = get(res, "hook", "grow.%s.vmm.min" % s)
        r = ratio(c, v)
        ratios.append(("grow.%s.copy_over_vmm" % s, r))
        cnote = res.get("native", {}).get("grow.%s.copy.p50" % s, (None, ""))[1]
        def cell(p50, mn, first):
            return "%s (%sfirst %s)" % (fmt(p50), "" if mn is None else "min %s; " % fmt(mn), fmt(first))
        ccell = cell(c, cm, cf) if c is not None else ("n/a" + (" (%s)" % cnote if cnote else ""))
        vcell = cell(v, vm, vf) if v is not None else "n/a"
        P("| %s | %s | %s | %s |" % (s, ccell, vcell, fmt(r) + "x" if r is not None else "n/a"))
    r8 = ratio(get(res, "native", "grow.8GiB.copy.p50"), vmm["8GiB"])
    targets.append(("grow.8GiB.copy_over_vmm>=200", verdict(None if r8 is None else r8 >= 200),
                    fmt(r8) + "x", ">= 200x"))
    flat = ratio(vmm["64GiB"], vmm["1GiB"])
    ratios.append(("grow.64GiB_over_1GiB.vmm", flat))
    targets.append(("grow.vmm.64GiB_over_1GiB<=1.5", verdict(None if flat is None else flat <= 1.5),
                    fmt(flat) + "x", "<= 1.5x"))
    P("")

    # (f)
    P("## (f) Pass-through calls (ns per call, median of 200 batches of 1000)")
    P("")
    P("| call | native | hook | added |")
    P("| --- | --- | --- | --- |")
    for metric, label in (("floor", "empty call (timing floor)"),
                          ("cuPointerGetAttribute", "cuPointerGetAttribute(RANGE_SIZE), cudaMallocAsync ptr"),
                          ("cuMemGetAddressRange", "cuMemGetAddressRange, cudaMallocAsync ptr"),
                          ("cudaPointerGetAttributes", "cudaPointerGetAttributes, cudaMallocAsync ptr"),
                          ("cudaFree_NULL", "cudaFree(NULL)"),
                          ("dlsym_libcuda", "dlsym(libcuda, \"cuMemAlloc_v2\")"),
                          ("dlsym_libc", "dlsym(libc, \"strlen\")")):
        n, h = get(res, "native", "pass." + metric), get(res, "hook", "pass." + metric)
        add = None if n is None or h is None else h - n
        ratios.append(("pass.%s.added" % metric, add, "ns"))
        P("| %s | %s | %s | %s |" % (label, fmt(n), fmt(h), fmt(add)))
        if metric in ("cuPointerGetAttribute", "cuMemGetAddressRange"):
            targets.append(("pass.%s.added<50ns" % metric, verdict(None if add is None else add < 50),
                            fmt(add) + " ns", "< 50 ns"))
    P("")

    P("## Targets (issue 5)")
    P("")
    P("| target | measured | goal | verdict |")
    P("| --- | --- | --- | --- |")
    for name, v, m, g in targets:
        P("| %s | %s | %s | %s |" % (name, m, g, v))
    P("")
    notes = info.get("notes", [])
    if notes:
        P("Notes from the runs:")
        P("")
        for n in notes:
            P("- %s" % n)
        P("")
    P("```")
    for name, v, m, g in targets:
        P("TARGET %s %s measured=%s goal=%s" % (name, v, m.replace(" ", ""), g.replace(" ", "")))
    for line in raw:
        P(line)
    for r in ratios:
        if r[1] is not None:
            P("RESULT ratio.%s %.6g %s" % (r[0], r[1], r[2] if len(r) > 2 else "x"))
    P("```")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
