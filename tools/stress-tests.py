#!/usr/bin/env python3
"""Repeats the concurrency suites (meson suite 'stress': tests/unit/meson.build's stress_suites)
many times, in parallel, each run under a perturbed schedule (the simulated driver's
SIM_PERTURB, tests/sim/simcall.c), to find rare races. `tools/run-tests --stress N` calls it.

    tools/stress-tests.py N [--build DIR] [--jobs J] [--seed S] [--budget SECONDS]
                            [--suite NAME] [--only TEST,...] [--logs DIR]

Each test runs N times (repetitions 1..N, every test of a repetition before the next one; J at
a time, default the number of cores). Run (test, repetition) gets the seed S + 1000 * repetition
+ the test's index, printed with every failure, so that one run can be repeated by hand:

    SIM_PERTURB=<seed> build/tests/unit/test_<name>

(the seed replays each thread's perturbation choices, not the kernel's interleaving: run it a
few times). The first failure stops new runs (the running ones end), prints the test, the
repetition, the seed and the output's tail, keeps the whole output under --logs, and the exit
status is 1. Nothing is retried. With --budget, no run starts once that many seconds have
passed: the repetitions not run are reported (a note, not a failure), so that CI stays within
its time whatever the machine. Exit status 0: every run passed; 1: one failed or timed out;
2: usage or setup error (no build, no test in the suite).
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", type=int, help="repetitions of each test")
    ap.add_argument("--build", default="build", help="meson build directory (default: build)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--seed", type=int, default=None,
                    help="base seed (default: from the clock; printed)")
    ap.add_argument("--budget", type=float, default=0, help="seconds; 0: no limit")
    ap.add_argument("--suite", default="stress")
    ap.add_argument("--only", default="", help="comma-separated test names of the suite")
    ap.add_argument("--logs", default=None, help="default: BUILD/meson-logs/stress")
    ap.add_argument("--timeout", type=float, default=0,
                    help="seconds per run (default: the test's meson timeout)")
    a = ap.parse_args()
    if a.n < 1 or a.jobs < 1:
        ap.error("N and --jobs are at least 1")

    try:
        tests = json.loads(subprocess.run(["meson", "introspect", a.build, "--tests"],
                                          check=True, capture_output=True, text=True).stdout)
    except (subprocess.CalledProcessError, OSError, ValueError) as e:
        print(f"stress: cannot list the tests of {a.build}: {e}", file=sys.stderr)
        return 2
    want = [t for t in tests
            if any(s == a.suite or s.endswith(":" + a.suite) for s in t.get("suite", []))]
    if a.only:
        names = set(a.only.split(","))
        want = [t for t in want if t["name"] in names]
    if not want:
        print(f"stress: no test in the suite '{a.suite}' of {a.build}", file=sys.stderr)
        return 2
    for t in want:
        if not os.path.exists(t["cmd"][0]):
            print(f"stress: {t['cmd'][0]} is not built (meson compile -C {a.build})",
                  file=sys.stderr)
            return 2

    seed = a.seed if a.seed is not None else int(time.time()) % 1000000 * 100000
    logs = a.logs or os.path.join(a.build, "meson-logs", "stress")
    os.makedirs(logs, exist_ok=True)
    names = [t["name"] for t in want]
    print(f"stress: {len(want)} tests x {a.n} repetitions, {a.jobs} at a time, "
          f"base seed {seed}{f', budget {a.budget:.0f} s' if a.budget else ''}: "
          f"{' '.join(names)}", flush=True)

    queue = [(rep, i) for rep in range(1, a.n + 1) for i in range(len(want))]
    lock = threading.Lock()
    state = {"next": 0, "failed": None, "done": 0, "skipped": 0}
    runs_done = {n: 0 for n in names}
    slowest = {n: 0.0 for n in names}
    start = time.monotonic()

    def take():
        with lock:
            if state["failed"] or state["next"] >= len(queue):
                return None
            if a.budget and time.monotonic() - start > a.budget:
                state["skipped"] = len(queue) - state["next"]
                state["next"] = len(queue)
                return None
            job = queue[state["next"]]
            state["next"] += 1
            return job

    def worker():
        while True:
            job = take()
            if job is None:
                return
            rep, i = job
            t = want[i]
            s = seed + 1000 * rep + i
            env = dict(os.environ)
            env.update(t.get("env") or {})
            env["SIM_PERTURB"] = str(s)
            log = os.path.join(logs, f"{t['name'].replace('/', '.')}.{rep}.log")
            limit = a.timeout or t.get("timeout") or 600
            t0 = time.monotonic()
            with open(log, "w") as f:
                try:
                    p = subprocess.run(t["cmd"], env=env, cwd=t.get("workdir") or None,
                                       stdout=f, stderr=subprocess.STDOUT, timeout=limit)
                    rc, why = p.returncode, None
                except subprocess.TimeoutExpired:
                    rc, why = -1, f"timed out after {limit:.0f} s"
            took = time.monotonic() - t0
            if rc == 0 and env.get("VMH_TEST_FILTER"):
                with open(log, errors="replace") as f:
                    if "Running 0 test(s)" in f.read():  # cmocka: the filter matched nothing
                        rc, why = 1, f"VMH_TEST_FILTER={env['VMH_TEST_FILTER']} matched no test"
            with lock:
                slowest[t["name"]] = max(slowest[t["name"]], took)
                if rc == 0:
                    runs_done[t["name"]] += 1
                    state["done"] += 1
                    now = time.monotonic()
                    if now - state.get("said", start) >= 60:  # a line a minute at most
                        state["said"] = now
                        print(f"stress: {state['done']} of {len(queue)} runs passed "
                              f"({now - start:.0f} s)", flush=True)
                    continue
                first = state["failed"] is None
                if first:
                    state["failed"] = (t["name"], rep, s, log, why or f"exit status {rc}")
            if first:
                with open(log, errors="replace") as f:
                    tail = f.read().splitlines()[-80:]
                print(f"\nstress: FAIL {t['name']}, repetition {rep} of {a.n}, "
                      f"SIM_PERTURB={s} ({why or f'exit status {rc}'}); whole output: {log}",
                      file=sys.stderr)
                print("\n".join("  | " + line for line in tail), file=sys.stderr)
                print(f"stress: to run it again: SIM_PERTURB={s} {' '.join(t['cmd'])}",
                      file=sys.stderr, flush=True)

    threads = [threading.Thread(target=worker) for _ in range(min(a.jobs, len(queue)))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    took = time.monotonic() - start
    reps = sorted(set(runs_done.values()))
    slow = sorted(names, key=lambda n: -slowest[n])[:4]
    print(f"stress: {state['done']} runs passed in {took:.0f} s (each test {'-'.join(map(str, reps[::max(1, len(reps) - 1)]))} "
          f"times; slowest runs: {', '.join(f'{n} {slowest[n]:.1f} s' for n in slow)})", flush=True)
    if state["failed"]:
        name, rep, s, log, why = state["failed"]
        print(f"stress: FAILED: {name}, repetition {rep} of {a.n}, SIM_PERTURB={s} ({why})",
              file=sys.stderr)
        return 1
    if state["skipped"]:
        print(f"stress: the budget ({a.budget:.0f} s) ran out: {state['skipped']} of "
              f"{len(queue)} runs not started (not a failure; every run started passed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
