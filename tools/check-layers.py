#!/usr/bin/env python3
"""check-layers: every #include "x.h" and every call in src/ points down docs/DESIGN.md's table.

The layers are read from docs/DESIGN.md, the markdown table under "## Layers, bottom up": one
row per layer, bottom up; its first column is the layer's label, its second names the layer's
files in backticks (`src/<dir>/x.c`, `src/<dir>/x.h`). A file stands for its header too
(`src/ipc/ipc.c` places ipc.h). Inside a row, "A over B, C" puts A above B and C: the files before
"over" form a step above the files after it. There is no other copy of the list.

A layer is a directory: every file of a row is in one directory of src/, that row's alone, and a
file (a header too) found in another directory than its row's fails, as does a file directly in
src/. So the directory a file sits in says its layer, and the table says the directories' order.

A file may include its own header, headers of its own step, and headers of lower rows or steps.
An include of a higher one's header is an arrow pointing up: the file calls a layer above it,
which DESIGN.md forbids (a lower layer that must trigger higher work takes a function as data
instead). A .c or .h file of src/'s directories that the table does not name fails too, so that a
new file gets a place in the diagram; so does a table that names a file src/ lacks, or a file
twice.

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
SRC_NAME = re.compile(r"`src/([A-Za-z0-9_]+)/([A-Za-z0-9_]+)\.(c|h)`")
INCLUDE = re.compile(r'\s*#\s*include\s+"([^"]+)\.h"')
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
DEFINED = re.compile(r"^(?!static\b)[A-Za-z_][\w \t\*]*?\b(vmh_\w+)\s*\(", re.M)
CALLED = re.compile(r"\b(vmh_\w+)\s*\(")


def read_calls(src, names):
    """For each .c file of names (paths under src): the vmh_ functions it defines (non-static)
    and calls."""
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


def stem_of(name):
    """The name a file is known by in includes and in the table's ranks: "heap/heap.c" -> heap."""
    return os.path.splitext(os.path.basename(name))[0]


def check_calls(src, rank, steps, files):
    """Calls that point up a step, and circles of calls inside a step."""
    bad = []
    sources = [n for n in files if n.endswith(".c") and stem_of(n) in rank]
    defines, calls = read_calls(src, sources)
    owner = {fn: name for name, fns in defines.items() for fn in fns}
    graph = {}
    for name in sources:
        here = rank[stem_of(name)]
        for fn in sorted(calls[name]):
            callee = owner.get(fn)
            if callee is None or callee == name:
                continue
            there = rank[stem_of(callee)]
            if there > here:
                bad.append(f"{name}: calls {fn} of {callee}, of '{steps[there][0]}', above its own"
                           f" '{steps[here][0]}': an arrow pointing up")
            elif there == here:
                graph.setdefault(name, set()).add(callee)
    for part in circles(graph):
        bad.append(f"{', '.join(part)}: call each other in a circle within "
                   f"'{steps[rank[stem_of(part[0])]][0]}'")
    return bad


def read_layers(design):
    """The steps, bottom up: a list of (label, [file paths under src], row index), and the
    problems found reading."""
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
    for row, (label, files) in enumerate(rows):
        # "A over B, C": the part before "over" is a step above the part after it.
        parts = re.split(r"\bover\b", files)
        if not any(SRC_NAME.search(p) for p in parts):
            problems.append(f"{design}: layer '{label}' names no `src/...` file")
        for part in reversed(parts):
            names = [f"{m.group(1)}/{m.group(2)}.{m.group(3)}" for m in SRC_NAME.finditer(part)]
            shown = [os.path.basename(n) for n in names]
            step = label if len(parts) == 1 else f"{label} ({', '.join(shown)})"
            steps.append((step, names, row))
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
    row_dir = {}  # row -> the one directory of its files
    home = {}  # stem -> the directory the table puts it in
    for i, (label, names, row) in enumerate(steps):
        for name in names:
            stem = stem_of(name)
            if stem in rank and rank[stem] != i:
                bad.append(f"{name}: named twice in {design} ('{steps[rank[stem]][0]}', '{label}')")
            rank[stem] = i
            folder = os.path.dirname(name)
            home[stem] = folder
            if row_dir.setdefault(row, folder) != folder:
                bad.append(f"{name}: layer '{label}' is in src/{row_dir[row]}/, one directory per"
                           " layer")
            if not os.path.exists(os.path.join(src, name)):
                bad.append(f"{name}: in {design}'s layer table but not in {src}")
    rows_of = {}
    for row, folder in row_dir.items():
        rows_of.setdefault(folder, []).append(row)
    for folder, rows in sorted(rows_of.items()):
        if len(rows) > 1:
            labels = sorted({label for label, _, row in steps if row in rows})
            bad.append(f"src/{folder}/: the directory of more than one layer ({', '.join(labels)})")
    files = []
    for folder, _, names in os.walk(src):
        for n in names:
            if os.path.splitext(n)[1] in (".c", ".h"):
                files.append(os.path.relpath(os.path.join(folder, n), src))
    files.sort()
    for name in files:
        stem = stem_of(name)
        if stem not in rank:
            bad.append(f"{name}: not in the layer table of {design}")
            continue
        if os.path.dirname(name) != home[stem]:
            where = f"src/{os.path.dirname(name)}/" if os.path.dirname(name) else "src/ itself"
            bad.append(f"{name}: in {where}, but its layer '{steps[rank[stem]][0]}' is "
                       f"src/{home[stem]}/")
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
    """The checker must fail a tree whose files of one step call each other, one whose lower
    step calls a higher one, one with a file outside its row's directory (or directly in src/),
    and one whose two rows share a directory; and pass the same tree without those faults."""
    import subprocess
    import tempfile
    design = ("## Layers, bottom up\n\n| layer | file | owns |\n| --- | --- | --- |\n"
              "| 0. low | `src/low/a.c`, `src/low/b.c` | a, b |\n"
              "| 1. high | `src/high/c.c` | c |\n")
    clean = {"low/a.c": "void vmh_a(void) {}\n", "low/b.c": "void vmh_b(void) { vmh_a(); }\n",
             "high/c.c": "void vmh_c(void) { vmh_b(); }\n"}
    cases = {
        "clean": (clean, design, 0),
        "circle": ({"low/a.c": "void vmh_a(void) { vmh_b(); }\n",
                    "low/b.c": "void vmh_b(void) { vmh_a(); }\n",
                    "high/c.c": "void vmh_c(void) { vmh_b(); }\n"}, design, 1),
        "up": ({"low/a.c": "void vmh_a(void) { vmh_c(); }\n", "low/b.c": "void vmh_b(void) {}\n",
                "high/c.c": "void vmh_c(void) {}\n"}, design, 1),
        "header in another layer's directory": (dict(clean, **{"high/a.h": "void vmh_a(void);\n"}),
                                                design, 1),
        "file directly in src/": (dict(clean, **{"b.h": "void vmh_b(void);\n"}), design, 1),
        "two layers in one directory": ({"low/a.c": "void vmh_a(void) {}\n",
                                         "low/b.c": "void vmh_b(void) { vmh_a(); }\n",
                                         "low/c.c": "void vmh_c(void) { vmh_b(); }\n"},
                                        design.replace("src/high/c.c", "src/low/c.c"), 1),
    }
    failed = 0
    for label, (sources, table, want) in cases.items():
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "docs"))
            with open(os.path.join(d, "docs", "DESIGN.md"), "w", encoding="utf-8") as f:
                f.write(table)
            for name, text in sources.items():
                path = os.path.join(d, "src", name)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
            run = subprocess.run([sys.executable, os.path.abspath(__file__),
                                  os.path.join(d, "src"), os.path.join(d, "docs", "DESIGN.md")],
                                 capture_output=True, text=True)
        ok = (run.returncode != 0) == bool(want)
        failed += not ok
        print(f"{'ok' if ok else 'FAIL'} selftest {label}: exit {run.returncode}")
        if not ok or want:
            print("  " + run.stdout.strip().replace("\n", "\n  "))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(selftest() if sys.argv[1:] == ["--selftest"] else main())
