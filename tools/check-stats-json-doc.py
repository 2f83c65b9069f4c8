#!/usr/bin/env python3
"""Fails when a field of the stats JSON is not named in docs/OPTIONS.md's "Stats JSON" section.

Both JSON texts are checked, as the library writes them on the simulated driver: the exit
report (VMMHOOK_STATS_JSON, with the leak report on) of hook_demo, and the live one
(vmm_stats_json, through vmmhook.stats()). Every key at every level must appear in the section
as `key`; the names of tags (keys of "tags") are data, not fields. Issue 30: the page listed
half the counters and neither "tags" nor "app_driver_calls_per_1000_allocs".

    check-stats-json-doc.py OPTIONS.md HOOK_DEMO LIBVMMHOOK FAKE_LIBCUDA_DIR PYTHON_SRC_DIR
"""
import json
import os
import re
import subprocess
import sys
import tempfile


def section(doc):
    with open(doc, encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"^## Stats JSON\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    if not m:
        sys.exit(f"FAIL: {doc} has no '## Stats JSON' section")
    return m.group(1)


def keys(obj, path=""):
    """(key, where) for every key; the level under "tags" is tag names, not fields."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if path.endswith("/tags"):
                yield from keys(v, f"{path}/<tag>")
            else:
                yield k, path
                yield from keys(v, f"{path}/{k}")


def main(doc, demo, lib, fakecuda, pysrc):
    env = dict(os.environ, LD_PRELOAD=lib, LD_LIBRARY_PATH=fakecuda, PYTHONPATH=pysrc)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "exit.json")
        run = subprocess.run([demo], env=dict(env, VMMHOOK_STATS_JSON=path, VMMHOOK_LEAKS="1"),
                             capture_output=True, text=True, timeout=120)
        if run.returncode != 0 or not os.path.exists(path):
            sys.exit(f"FAIL: hook_demo: status {run.returncode}, no JSON:\n{run.stderr}")
        with open(path, encoding="utf-8") as f:
            exit_json = json.load(f)
    live = subprocess.run(
        [sys.executable, "-c", "import json, vmmhook; print(json.dumps(vmmhook.stats()))"],
        env=env, capture_output=True, text=True, timeout=120)
    if live.returncode != 0:
        sys.exit(f"FAIL: vmmhook.stats(): status {live.returncode}:\n{live.stderr}")
    live_json = json.loads(live.stdout)
    if exit_json.get("leaks") is None:
        sys.exit("FAIL: the exit report has no leak report (VMMHOOK_LEAKS=1 was set)")
    text = section(doc)
    missing = sorted({f"{k} (at {w or '/'}, {which})"
                      for which, j in (("exit", exit_json), ("live", live_json))
                      for k, w in keys(j) if f"`{k}`" not in text})
    if missing:
        print(f"FAIL: fields of the stats JSON that {doc}'s 'Stats JSON' does not name:")
        print("\n".join(missing))
        return 1
    n = len({k for j in (exit_json, live_json) for k, _ in keys(j)})
    print(f"PASS: all {n} field names of the exit and live stats JSON are documented")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 6:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
