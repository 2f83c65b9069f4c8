#!/usr/bin/env python3
"""Mutation check of the safety gates: each line that stops reuse, unmapping or release under
queued work, exports, pauses or kept backups (tools/mutation-gates.txt) is deleted one at a
time, and the tests named for it must then fail. A deletion that leaves them passing means no
test guards that gate: the check fails (issue 38).

    tools/mutation-check.py [--only GATE,...] [--list] [--jobs J] [--timeout S]
                            [--gates FILE] [--workdir DIR] [--tree worktree|head]

The source tree (git's tracked files and the untracked ones it does not ignore, or --tree head:
the last commit) is copied into a scratch directory with ONE build directory (gcc, unit tests
only), reused by every mutation: each recompiles the mutated file and relinks only the test
programs its gate names. First every named test runs unmutated (they must pass: a baseline that
fails is reported as such, never as kills). Then, per gate: the gate's text is found (exactly
once, whitespace-insensitively: a refactor that moves or rewrites a gate fails the check
loudly instead of skipping it), replaced, built, its tests run (J at a time, each under a
timeout; the first failure stops the others), and the file restored. KILLED: some test failed
(or timed out, or crashed); SURVIVED: all passed. Exit status 0 when every gate was killed, 1
when one survived, could not be found or did not build, 2 on a setup error (no build, a
baseline failure). --workdir keeps the copy and its build for the next run (only changed files
are copied again and rebuilt).
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
DEFAULT_GATES = os.path.join(ROOT, "tools", "mutation-gates.txt")
MESON_OPTS = ["-Dunit_tests=enabled", "-Dgpu_tests=disabled", "-Dfuzz=disabled"]


class Gate:
    def __init__(self, name, line):
        self.name, self.line = name, line
        self.file = self.match = self.why = None
        self.replace = ""
        self.tests = []  # (meson test name, VMH_TEST_FILTER or None)
        self.timeout = None


def unescape(s):
    return s.replace("\\n", "\n").replace("\\t", "\t")


def parse_gates(path):
    """The gate list: blocks of `key: value` lines separated by blank lines; `#` starts a
    comment line. Keys: gate, file, match, with (the replacement; empty or absent: the match is
    deleted), why, tests (space-separated meson test names, each optionally NAME:CASE, CASE a
    VMH_TEST_FILTER pattern), timeout (seconds per test run). A value may go on over lines that
    start with whitespace."""
    gates, cur, key, errors = [], None, None, []
    with open(path) as f:
        lines = f.read().split("\n")
    for no, raw in enumerate(lines, 1):
        if raw.lstrip().startswith("#"):
            continue
        if not raw.strip():
            cur, key = None, None
            continue
        if raw[0] in " \t":
            if cur is None or key is None:
                errors.append(f"{path}:{no}: a continuation line outside a gate")
                continue
            if key == "tests":
                cur.tests.extend(parse_tests(raw))
            else:
                setattr(cur, key, (getattr(cur, key) or "") + " " + raw.strip())
            continue
        k, sep, v = raw.partition(":")
        k, v = k.strip(), v.strip()
        if not sep:
            errors.append(f"{path}:{no}: expected `key: value`")
            continue
        if k == "gate":
            cur = Gate(v, no)
            gates.append(cur)
            key = None
            continue
        if cur is None:
            errors.append(f"{path}:{no}: `{k}` before any `gate:`")
            continue
        if k == "file":
            cur.file, key = v, "file"
        elif k == "match":
            cur.match, key = v, "match"
        elif k == "with":
            cur.replace, key = v, "replace"
        elif k == "why":
            cur.why, key = v, "why"
        elif k == "tests":
            cur.tests.extend(parse_tests(v))
            key = "tests"
        elif k == "timeout":
            cur.timeout, key = float(v), None
        else:
            errors.append(f"{path}:{no}: unknown key `{k}`")
    names = set()
    for g in gates:
        for what in ("file", "match", "why"):
            if not getattr(g, what):
                errors.append(f"{path}:{g.line}: gate {g.name} has no `{what}`")
        if not g.tests:
            errors.append(f"{path}:{g.line}: gate {g.name} names no test")
        if g.name in names:
            errors.append(f"{path}:{g.line}: gate {g.name} listed twice")
        names.add(g.name)
    return gates, errors


def parse_tests(v):
    out = []
    for t in v.split():
        name, _, case = t.partition(":")
        out.append((name, case or None))
    return out


def pattern(match):
    """The match text as a regex: every run of whitespace matches any run (or none between two
    punctuation characters), everything else literally."""
    parts = [re.escape(p) for p in re.split(r"\s+", unescape(match).strip()) if p]
    return re.compile(r"\s*".join(parts))


def find(text, gate):
    return list(pattern(gate.match).finditer(text))


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)


def tree_files(tree):
    if tree == "head":
        return None
    out = sh(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"])
    return sorted({f for f in out.stdout.split("\0") if f})


def copy_tree(tree, dest):
    """Copies the tree into dest (files whose bytes did not change keep their time, so a kept
    build rebuilds only what changed); removes files no longer there."""
    os.makedirs(dest, exist_ok=True)
    if tree == "head":
        staging = tempfile.mkdtemp(prefix="mutation-head-")
        try:
            archive = subprocess.run(["git", "-C", ROOT, "archive", "HEAD"], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", staging], input=archive, check=True)
            files = []
            for d, _, fs in os.walk(staging):
                files += [os.path.relpath(os.path.join(d, f), staging) for f in fs]
            sync(staging, sorted(files), dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    else:
        sync(ROOT, tree_files(tree), dest)


def sync(src_root, files, dest):
    keep = set()
    for rel in files:
        src = os.path.join(src_root, rel)
        if not os.path.isfile(src) or os.path.islink(src):
            continue  # deleted in the work tree, or a link (none in the sources)
        keep.add(rel)
        dst = os.path.join(dest, rel)
        with open(src, "rb") as f:
            data = f.read()
        try:
            with open(dst, "rb") as f:
                if f.read() == data:
                    continue
        except OSError:
            pass
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "wb") as f:
            f.write(data)
        shutil.copymode(src, dst)
    for d, dirs, fs in os.walk(dest):
        if os.path.relpath(d, dest).split(os.sep)[0] in ("_build", ".git"):
            dirs[:] = []
            continue
        for f in fs:
            rel = os.path.relpath(os.path.join(d, f), dest)
            if rel not in keep:
                os.unlink(os.path.join(d, f))


class Runner:
    def __init__(self, build, tests, jobs, timeout, logdir):
        self.build, self.tests, self.jobs, self.timeout = build, tests, jobs, timeout
        self.logdir = logdir

    def exe(self, name):
        return self.tests[name]["cmd"][0]

    def targets(self, names):
        return sorted({os.path.relpath(self.exe(n), self.build) for n in names})

    def compile(self, names):
        r = subprocess.run(["ninja", "-C", self.build] + self.targets(names), text=True,
                           capture_output=True)
        return r.returncode == 0, r.stdout + r.stderr

    def run_one(self, label, name, case, timeout, stop):
        t = self.tests[name]
        env = dict(os.environ)
        env.update(t.get("env") or {})
        env.pop("VMH_TEST_FILTER", None)
        env.pop("VMH_TEST_SHARD", None)
        if case:
            env["VMH_TEST_FILTER"] = case
        log = os.path.join(self.logdir, re.sub(r"[^A-Za-z0-9_.-]", "_", f"{label}-{name}-{case}")
                           + ".log")
        t0 = time.monotonic()
        with open(log, "w") as out:
            p = subprocess.Popen(t["cmd"], cwd=t.get("workdir") or self.build, env=env,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            status = None
            while status is None:
                try:
                    p.wait(timeout=0.1)
                    status = "pass" if p.returncode == 0 else f"exit {p.returncode}"
                    if p.returncode < 0:
                        status = f"signal {-p.returncode}"
                except subprocess.TimeoutExpired:
                    if time.monotonic() - t0 > timeout:
                        status = f"timeout {timeout:.0f}s"
                    elif stop.is_set():
                        status = "stopped"
                    if status:
                        try:
                            os.killpg(p.pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                        p.wait()
        return status, time.monotonic() - t0, log

    def run(self, label, tests, timeout, stop_at_first=True):
        """Runs (name, case) pairs, J at a time; returns [(name, case, status, secs, log)]. The
        first failure stops the rest (stop_at_first)."""
        stop = threading.Event()
        results = []

        def one(tc):
            if stop.is_set():
                return (tc[0], tc[1], "stopped", 0.0, None)
            st, secs, log = self.run_one(label, tc[0], tc[1], timeout, stop)
            if st not in ("pass", "stopped") and stop_at_first:
                stop.set()
            return (tc[0], tc[1], st, secs, log)

        with ThreadPoolExecutor(max_workers=self.jobs) as ex:
            for r in ex.map(one, tests):
                results.append(r)
        return results


def tail(path, n=30):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except (OSError, TypeError):
        return ""


def test_label(name, case):
    return f"{name}:{case}" if case else name


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gates", default=DEFAULT_GATES, help="the gate list (default: %(default)s)")
    ap.add_argument("--only", default="", help="comma-separated gate names")
    ap.add_argument("--list", action="store_true", help="list the gates and whether each is found")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="tests run at a time")
    ap.add_argument("--timeout", type=float, default=120, help="seconds per test run (default 120)")
    ap.add_argument("--workdir", default=None,
                    help="where the copy and its build live (kept); default: a temporary "
                         "directory, removed at the end")
    ap.add_argument("--tree", choices=["worktree", "head"], default="worktree",
                    help="copy the work tree (default) or the last commit")
    a = ap.parse_args()
    t_start = time.monotonic()

    gates, errors = parse_gates(a.gates)
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 2
    if a.only:
        want = a.only.split(",")
        unknown = [w for w in want if w not in {g.name for g in gates}]
        if unknown:
            print(f"mutation: no gate named {', '.join(unknown)} (--list lists them)",
                  file=sys.stderr)
            return 2
        gates = [g for g in gates if g.name in want]

    # Matches are checked against the tree itself first: a gate that moved fails loudly.
    src_root = ROOT
    if a.tree == "head":
        src_root = None
    found = {}
    for g in gates:
        if src_root:
            path = os.path.join(src_root, g.file)
            text = open(path).read() if os.path.isfile(path) else None
        else:
            r = subprocess.run(["git", "-C", ROOT, "show", f"HEAD:{g.file}"], text=True,
                               capture_output=True)
            text = r.stdout if r.returncode == 0 else None
        found[g.name] = -1 if text is None else len(find(text, g))

    if a.list:
        for g in gates:
            n = found[g.name]
            state = "found" if n == 1 else ("NO FILE" if n < 0 else f"FOUND {n} TIMES")
            print(f"{g.name:24} {g.file:28} {state:14} tests: "
                  + " ".join(test_label(*t) for t in g.tests))
            print(f"{'':24} why: {g.why}")
        return 0 if all(found[g.name] == 1 for g in gates) else 1

    work = a.workdir or tempfile.mkdtemp(prefix="mutation-check-")
    os.makedirs(work, exist_ok=True)
    src = os.path.join(work, "src")
    build = os.path.join(work, "_build")
    logdir = os.path.join(work, "logs")
    os.makedirs(logdir, exist_ok=True)
    rows = []
    try:
        print(f"mutation: copying the {'work tree' if a.tree == 'worktree' else 'last commit'} "
              f"into {src}", flush=True)
        copy_tree(a.tree, src)
        if not os.path.isfile(os.path.join(build, "build.ninja")):
            env = dict(os.environ, CC=os.environ.get("CC", "gcc"))
            r = subprocess.run(["meson", "setup", build, src] + MESON_OPTS, env=env, text=True,
                               capture_output=True)
            if r.returncode:
                print(r.stdout + r.stderr, file=sys.stderr)
                print("mutation: meson setup failed", file=sys.stderr)
                return 2
        tests = {}
        for t in json.loads(sh(["meson", "introspect", build, "--tests"]).stdout):
            tests.setdefault(t["name"], t)
            # A program registered in shards (tests/unit/meson.build: 'backup/2of6') or per case
            # ('steady/<case>') answers to its own name too: the runner clears both selections.
            tests.setdefault(t["name"].split("/")[0], t)
        missing = sorted({n for g in gates for n, _ in g.tests if n not in tests})
        if missing:
            print(f"mutation: no meson test named {', '.join(missing)}", file=sys.stderr)
            return 2
        runner = Runner(build, tests, a.jobs, a.timeout, logdir)
        names = sorted({n for g in gates for n, _ in g.tests})
        t0 = time.monotonic()
        ok, out = runner.compile(names)
        if not ok:
            print(out[-6000:], file=sys.stderr)
            print("mutation: the unmutated tree does not build", file=sys.stderr)
            return 2
        print(f"mutation: built {len(runner.targets(names))} test programs in "
              f"{time.monotonic() - t0:.0f} s", flush=True)

        # The baseline: every test a gate names passes unmutated (longest first).
        pairs = sorted({t for g in gates for t in g.tests}, key=lambda t: (t[0], t[1] or ""))
        t0 = time.monotonic()
        base = runner.run("baseline", pairs, a.timeout, stop_at_first=False)
        bad = [r for r in base if r[2] != "pass"]
        print(f"mutation: baseline, {len(pairs)} test runs unmutated: "
              f"{'all pass' if not bad else f'{len(bad)} FAIL'} "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
        if bad:
            for name, case, st, secs, log in bad:
                print(f"\n--- {test_label(name, case)}: {st} ({log})\n{tail(log)}",
                      file=sys.stderr)
            print("mutation: the tests fail without any mutation: fix them first",
                  file=sys.stderr)
            return 2
        took = {(n, c): s for n, c, _, s, _ in base}

        for g in gates:
            t0 = time.monotonic()
            row = {"gate": g.name, "file": g.file, "by": "", "secs": 0.0}
            rows.append(row)
            path = os.path.join(src, g.file)
            original = open(path).read() if os.path.isfile(path) else None
            hits = find(original, g) if original is not None else []
            if len(hits) != 1:
                row["status"] = "NO FILE" if original is None else (
                    "NOT FOUND" if not hits else f"FOUND {len(hits)}x")
                print(f"mutation: {g.name}: {row['status']}: the match text of "
                      f"{a.gates}:{g.line} must occur exactly once in {g.file}", flush=True)
                continue
            m = hits[0]
            mutated = original[:m.start()] + unescape(g.replace) + original[m.end():]
            try:
                with open(path, "w") as f:
                    f.write(mutated)
                gnames = [n for n, _ in g.tests]
                ok, out = runner.compile(gnames)
                if not ok:
                    # The mutation must compile (warnings are errors): fix its `with`.
                    row["status"] = "BUILD FAILED"
                    errs = [l for l in out.splitlines() if "error" in l and "gcc" not in l]
                    row["by"] = (errs[0] if errs else out.strip().splitlines()[-1])[:160]
                else:
                    # The quickest tests first: a kill is usually found by any of them.
                    order = sorted(g.tests, key=lambda t: took.get(t, 0))
                    res = runner.run(g.name, order, g.timeout or a.timeout)
                    failed = [r for r in res if r[2] not in ("pass", "stopped")]
                    if failed:
                        row["status"] = "KILLED"
                        row["by"] = f"{test_label(failed[0][0], failed[0][1])} ({failed[0][2]})"
                    else:
                        row["status"] = "SURVIVED"
            finally:
                with open(path, "w") as f:
                    f.write(original)
            row["secs"] = time.monotonic() - t0
            print(f"mutation: {g.name:24} {row['status']:12} {row['secs']:5.0f} s  {row['by']}",
                  flush=True)
        # The unmutated sources are rebuilt, so that a kept work dir starts from them.
        runner.compile(names)
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)

    total = time.monotonic() - t_start
    print()
    print(f"{'gate':24} {'file':28} {'result':12} {'secs':>5}  killed by")
    for r in rows:
        print(f"{r['gate']:24} {r['file']:28} {r['status']:12} {r['secs']:5.0f}  {r['by']}")
    bad = [r for r in rows if r["status"] != "KILLED"]
    print(f"\nmutation: {len(rows) - len(bad)} of {len(rows)} gates killed, {len(bad)} not; "
          f"{total:.0f} s in all")
    for r in bad:
        g = next(x for x in gates if x.name == r["gate"])
        if r["status"] == "SURVIVED":
            print(f"  SURVIVED {g.name}: with it deleted ({g.file}) every test named for it "
                  f"passes: {g.why}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
