#!/usr/bin/env python3
"""Fails when an nvcc command of the build carries `--threads` (or its short form `-t`).

With it nvcc runs one nvlink per -gencode target at once, all on one temporary file, and the
build fails at random (`nvlink fatal : Could not read file '/tmp/tmpxft_..._dlink.reg.c'`,
issues 20 and 30; the top meson.build says more). Reads, outside comments, every string of
every meson.build under the source root (build directories skipped), and every shell line of
tools/ that runs nvcc.

    check-nvcc-threads.py SOURCE_ROOT
"""
import os
import re
import sys

FLAG = re.compile(r"""(['"])(--threads(=\S*)?|-t)\1""")  # a meson string that is the flag
SHELL_FLAG = re.compile(r"(^|\s)(--threads(=\S*)?|-t)(\s|$)")


def strip_comment(line):
    """The line without its # comment (a # inside a string is kept)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "#":
            return line[:i]
    return line


def is_build_dir(path):
    return os.path.isdir(os.path.join(path, "meson-private"))


def main(root):
    bad = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs
                   if not x.startswith(".") and not is_build_dir(os.path.join(d, x))]
        for f in files:
            path = os.path.join(d, f)
            rel = os.path.relpath(path, root)
            if f == "meson.build":
                pattern = FLAG
            elif f.endswith(".sh") and rel.startswith("tools" + os.sep):
                pattern = SHELL_FLAG
            else:
                continue
            with open(path, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    code = strip_comment(line)
                    if f != "meson.build" and "nvcc" not in code.lower():
                        continue
                    if pattern.search(code):
                        bad.append(f"{rel}:{n}: {line.strip()}")
    if bad:
        print("nvcc must not get --threads (top meson.build: why):")
        print("\n".join(bad))
        return 1
    print("no nvcc command carries --threads")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: check-nvcc-threads.py SOURCE_ROOT")
    sys.exit(main(sys.argv[1]))
