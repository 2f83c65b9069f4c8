#!/usr/bin/env python3
"""check-layers: every #include "x.h" in src/ points down docs/DESIGN.md's layer table.

A file may include its own header, headers of its own layer (the group of files that make one
layer, e.g. the IPC files), and headers of lower layers. An include of a higher layer's header
is an arrow pointing up: the file calls a layer above it, which DESIGN.md forbids (a lower layer
that must trigger higher work takes a function as data instead). A file that is not in the table
fails too, so that a new file gets a place in the diagram.

    python3 tools/check-layers.py [SRC_DIR]      # exit 0 when every arrow points down
"""
import os
import re
import sys

# Bottom up; one entry per layer, the file stems that make it. Keep in step with DESIGN.md.
LAYERS = [
    ("utilities", ["log", "options", "optparse", "stats", "testable"]),
    ("tags", ["tags"]),
    ("driver table", ["driver"]),
    ("contexts", ["contexts"]),
    ("backup staging", ["copypool", "staging"]),
    ("handles", ["handle"]),
    ("ranges", ["range"]),
    ("arena, registry", ["arena", "arena_internal", "arena_check", "registry"]),
    ("device", ["device"]),
    ("reclaim", ["reclaim"]),
    ("cache", ["cache"]),
    ("packing", ["packing"]),
    ("big buffers", ["bigbuf"]),
    ("heap front", ["heap"]),
    ("sleep", ["pause"]),
    ("sharing", ["ipc", "ipc_wire", "ipc_export", "ipc_listener", "ipc_import"]),
    ("lifetime", ["lifetime", "announce"]),
    ("entry points", ["interpose", "interpose_mem", "interpose_ctx", "hooked", "api"]),
]


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "src")
    rank = {stem: i for i, (_, stems) in enumerate(LAYERS) for stem in stems}
    bad = []
    for name in sorted(os.listdir(src)):
        stem, ext = os.path.splitext(name)
        if ext not in (".c", ".h"):
            continue
        if stem not in rank:
            bad.append(f"{name}: not in the layer table (tools/check-layers.py, docs/DESIGN.md)")
            continue
        with open(os.path.join(src, name), encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                m = re.match(r'\s*#\s*include\s+"([^"]+)\.h"', line)
                if not m:
                    continue
                dep = os.path.basename(m.group(1))
                if dep not in rank:
                    continue  # a public header (vmmhook.h) or a generated one
                if rank[dep] > rank[stem]:
                    bad.append(f"{name}:{lineno}: includes {dep}.h, layer '{LAYERS[rank[dep]][0]}'"
                               f" above its own '{LAYERS[rank[stem]][0]}'")
    for b in bad:
        print("FAIL", b)
    if not bad:
        print(f"check-layers: every include of {src} points down ({len(rank)} files in "
              f"{len(LAYERS)} layers)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
