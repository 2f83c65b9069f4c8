#!/usr/bin/env python3
"""check-layers: every #include "x.h" and every call in src/ points down docs/DESIGN.md's table.

The layers are read from docs/DESIGN.md, the markdown table under "## Layers, bottom up": one
row per layer, bottom up; its first column is the layer's label, its second names the layer's
files in backticks (`src/x.c`, `src/x.h`). A file stands for its header too (`src/ipc.c` places
ipc.h). Inside a row, "A over B, C" puts A above B and C: the files before "over" form a step
above the files after it. There is no other copy of the list.

A file may include its own header, headers of its own step, and headers of lower rows or steps.
An include of a higher one's header is an arrow pointing up: the file calls a layer above it,
which DESIGN.md forbids (a lower layer that must trigger higher work takes a function as data
instead). A .c or .h file of src/ that the table does not name fails too, so that a new file
gets a place in the diagram; so does a table that names a file src/ lacks, or a file twice.

Calls are checked too, since files of one step may include each other's headers: a .c file that
calls a function defined (not static) in a .c file of a higher step points up, and the calls
between the .c files of one step must not go round in a circle (A calls B, B calls A): a step
is one module whose files stand on each other in one order, never a knot. Calls are found by
name (`vmh_...(` outside comments); a function handed over as data is not a call.

    python3 tools/check-layers.py [SRC_DIR [DESIGN_MD]]   # exit 0 when every arrow points down
    python3 tools/check-layers.py --selftest               # a tree with a circle must fail
"""
import os
import re
import sys

HEADING = "## Layers, bottom up"
SRC_NAME = re.compile(r"`src/([A-Za-z0-9_]+)\.(c|h)`")
INCLUDE = re.compile(r'\s*#\s*include\s+"([^"]+)\.h"')
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
DEFINED = re.compile(r"^(?!static\b)[A-Za-z_][\w \t\*]*?\b(vmh_\w+)\s*\(", re.M)
CALLED = re.compile(r"\b(vmh_\w+)\s*\(")


def read_calls(src, names):
    """For each .c file of names: the vmh_ functions it defines (non-static) and calls."""
    defines, calls = {}, {}
    for name in names:
        with open(os.path.join(src, name), encoding="utf-8") as f:
            text = COMMENT.sub("", f.read())
        mine = set()
        for m in DEFINED.finditer(text):
            depth, i = 1, m.end()
            while depth and i < len(text):
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            if text[i:].lstrip()[:1] == "{":
                mine.add(m.group(1))
        defines[name] = mine
        calls[name] = set(CALLED.findall(text)) - mine
    return defines, calls


def circles(graph):
    """The strongly connected parts of more than one node (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def check_calls(src, rank, steps, files):
    """Calls that point up a step, and circles of calls inside a step."""
    bad = []
    sources = [n for n in files if n.endswith(".c") and os.path.splitext(n)[0] in rank]
    defines, calls = read_calls(src, sources)
    owner = {fn: name for name, fns in defines.items() for fn in fns}
    graph = {}
    for name in sources:
        here = rank[os.path.splitext(name)[0]]
        for fn in sorted(calls[name]):
            callee = owner.get(fn)
            if callee is None or callee == name:
                continue
            there = rank[os.path.splitext(callee)[0]]
            if there > here:
                bad.append(f"{name}: calls {fn} of {callee}, of '{steps[there][0]}', above its own"
                           f" '{steps[here][0]}': an arrow pointing up")
            elif there == here:
                graph.setdefault(name, set()).add(callee)
    for part in circles(graph):
        bad.append(f"{', '.join(part)}: call each other in a circle within "
                   f"'{steps[rank[os.path.splitext(part[0])[0]]][0]}'")
    return bad


def read_layers(design):
    """The steps, bottom up: a list of (label, [file names]), and the problems found reading."""
    with open(design, encoding="utf-8") as f:
        lines = f.read().splitlines()
    try:
        start = lines.index(HEADING)
    except ValueError:
        return [], [f"{design}: no '{HEADING}' section"]
    rows = []
    in_table = False
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if not line.startswith("|"):
            if in_table:
                break  # the table ended
            continue
        in_table = True
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or set(cells[0]) <= set("-: ") or cells[0] == "layer":
            continue  # the header row or the separator
        rows.append((cells[0], cells[1]))
    steps = []
    problems = []
    for label, files in rows:
        # "A over B, C": the part before "over" is a step above the part after it.
        parts = re.split(r"\bover\b", files)
        if not any(SRC_NAME.search(p) for p in parts):
            problems.append(f"{design}: layer '{label}' names no `src/...` file")
        for part in reversed(parts):
            names = [f"{m.group(1)}.{m.group(2)}" for m in SRC_NAME.finditer(part)]
            step = label if len(parts) == 1 else f"{label} ({', '.join(names)})"
            steps.append((step, names))
    if not rows:
        problems.append(f"{design}: no layer table under '{HEADING}'")
    return steps, problems


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    src = os.path.normpath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "src"))
    design = os.path.normpath(sys.argv[2] if len(sys.argv) > 2
                              else os.path.join(src, "..", "docs", "DESIGN.md"))
    steps, bad = read_layers(design)
    if not steps:
        for b in bad:
            print("FAIL", b)
        return 1
    rank = {}
    for i, (label, names) in enumerate(steps):
        for name in names:
            stem = os.path.splitext(name)[0]
            if stem in rank and rank[stem] != i:
                bad.append(f"{name}: named twice in {design} ('{steps[rank[stem]][0]}', '{label}')")
            rank[stem] = i
            if not os.path.exists(os.path.join(src, name)):
                bad.append(f"{name}: in {design}'s layer table but not in {src}")
    files = sorted(n for n in os.listdir(src) if os.path.splitext(n)[1] in (".c", ".h"))
    for name in files:
        stem = os.path.splitext(name)[0]
        if stem not in rank:
            bad.append(f"{name}: not in the layer table of {design}")
            continue
        with open(os.path.join(src, name), encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                dep = os.path.basename(m.group(1))
                if dep not in rank:
                    continue  # a public header (vmmhook.h) or a generated one
                if rank[dep] > rank[stem]:
                    bad.append(f"{name}:{lineno}: includes {dep}.h, of '{steps[rank[dep]][0]}',"
                               f" above its own '{steps[rank[stem]][0]}': an arrow pointing up")
    bad += check_calls(src, rank, steps, files)
    for b in bad:
        print("FAIL", b)
    if not bad:
        print(f"check-layers: every include and call of {len(files)} files in {src} points "
              f"down, no circle ({len(steps)} steps read from {design})")
    return 1 if bad else 0


def selftest():
    """The checker must fail a tree whose files of one step call each other, and one whose lower
    step calls a higher one; and pass the same tree without those calls."""
    import subprocess
    import tempfile
    design = ("## Layers, bottom up\n\n| layer | file | owns |\n| --- | --- | --- |\n"
              "| 0. low | `src/a.c`, `src/b.c` | a, b |\n| 1. high | `src/c.c` | c |\n")
    cases = {
        "clean": ({"a.c": "void vmh_a(void) {}\n", "b.c": "void vmh_b(void) { vmh_a(); }\n",
                   "c.c": "void vmh_c(void) { vmh_b(); }\n"}, 0),
        "circle": ({"a.c": "void vmh_a(void) { vmh_b(); }\n",
                    "b.c": "void vmh_b(void) { vmh_a(); }\n",
                    "c.c": "void vmh_c(void) { vmh_b(); }\n"}, 1),
        "up": ({"a.c": "void vmh_a(void) { vmh_c(); }\n", "b.c": "void vmh_b(void) {}\n",
                "c.c": "void vmh_c(void) {}\n"}, 1),
    }
    failed = 0
    for label, (sources, want) in cases.items():
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "src"))
            os.makedirs(os.path.join(d, "docs"))
            with open(os.path.join(d, "docs", "DESIGN.md"), "w", encoding="utf-8") as f:
                f.write(design)
            for name, text in sources.items():
                with open(os.path.join(d, "src", name), "w", encoding="utf-8") as f:
                    f.write(text)
            rc = subprocess.run([sys.executable, os.path.abspath(__file__),
                                 os.path.join(d, "src"), os.path.join(d, "docs", "DESIGN.md")],
                                capture_output=True, text=True).returncode
        ok = (rc != 0) == bool(want)
        failed += not ok
        print(f"{'ok' if ok else 'FAIL'} selftest {label}: exit {rc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(selftest() if sys.argv[1:] == ["--selftest"] else main())
