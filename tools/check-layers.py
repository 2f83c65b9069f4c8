#!/usr/bin/env python3
"""check-layers: every #include "x.h" in src/ points down docs/DESIGN.md's layer table.

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

    python3 tools/check-layers.py [SRC_DIR [DESIGN_MD]]   # exit 0 when every arrow points down
"""
import os
import re
import sys

HEADING = "## Layers, bottom up"
SRC_NAME = re.compile(r"`src/([A-Za-z0-9_]+)\.(c|h)`")
INCLUDE = re.compile(r'\s*#\s*include\s+"([^"]+)\.h"')


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
    for b in bad:
        print("FAIL", b)
    if not bad:
        print(f"check-layers: every include of {len(files)} files in {src} points down "
              f"({len(steps)} steps read from {design})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
