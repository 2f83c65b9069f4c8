#!/usr/bin/env python3
"""Issue 37: every ```c block of the given Markdown files compiles without a warning.

Each block becomes one translation unit, compiled with
    CC -std=c11 -Wall -Wextra -Werror -c -o SCRATCH.o -I INCLUDE
(the header's VMM_NODISCARD makes a dropped vmm_status a -Wunused-result error). Not
-fsyntax-only: gcc (12) gives -Wunused-result only past the front end, so with -fsyntax-only it
passes a dropped vmm_realloc result that clang rejects (the selftest below catches that).
  - its #include lines go to the top, after <vmmhook.h> and the usual C headers (stdio, stdlib,
    string, stddef, stdint, stdbool);
  - a block with a function definition at column 0 (`int main(void)`, `{` on that line or the
    next) is a whole file and is compiled as it is; any other block is statements, put inside
    `int readme_snippet_N(void) { ... return 0; }` (so `return -1;` on an error is fine);
  - functions the block calls that nothing declares (placeholders such as load_model(),
    alloc_cache()) are declared `void name(void);` (`void name();` when a call passes
    arguments), found from the compiler's own implicit-declaration errors. Names that look like
    the library's or CUDA's (vmm_*, cu*, cuda*) are never declared so: a misspelt or removed API
    call fails.
The check fails when a block does not compile, when a file has no ```c block at all (so it
cannot pass by finding nothing), or when the compiler cannot be run; nothing is skipped.

  check-readme-snippets.py [--cc 'CC ARGS'] --include DIR FILE.md...
  check-readme-snippets.py [--cc 'CC ARGS'] --include DIR --selftest
The selftest shows the check can fail: a block that drops vmm_realloc's result must fail, the
same block using the result must pass.
"""
import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile

PRELUDE_HEADERS = ["stdbool.h", "stddef.h", "stdint.h", "stdio.h", "stdlib.h", "string.h",
                   "vmmhook.h"]
FLAGS = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-c"]
API_PREFIX = re.compile(r"^(vmm_|vmh_|VMM_|cu|CU)")
KEYWORDS = {"if", "while", "for", "switch", "return", "sizeof", "do", "else", "case", "goto",
            "_Alignof", "_Generic", "_Static_assert", "defined"}
# gcc: "implicit declaration of function 'x'"; clang: the same, or "call to undeclared
# function 'x'".
IMPLICIT = re.compile(r"(?:implicit declaration of function|call to undeclared function) "
                      r"['\u2018`\"]([A-Za-z_]\w*)['\u2019`\"]")


def blocks(path):
    """(first line number, text) of each ```c block of a Markdown file."""
    out, cur, start = [], None, 0
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            s = line.rstrip("\n")
            if cur is None:
                if re.fullmatch(r"\s*```\s*c\s*", s):
                    cur, start = [], n + 1
            elif re.fullmatch(r"\s*```\s*", s):
                out.append((start, "\n".join(cur) + "\n"))
                cur = None
            else:
                cur.append(s)
    if cur is not None:
        raise SystemExit(f"{path}:{start - 1}: a ```c block is not closed")
    return out


def strip_comments_and_strings(code):
    code = re.sub(r"/\*.*?\*/", " ", code, flags=re.S)
    code = re.sub(r"//[^\n]*", " ", code)
    code = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', code)
    return re.sub(r"'(?:\\.|[^'\\\n])*'", "''", code)


def is_whole_file(code):
    """True when the block defines a function at column 0 (then it is compiled as a file)."""
    lines = strip_comments_and_strings(code).split("\n")
    for i, line in enumerate(lines):
        m = re.match(r"^(?:static\s+|extern\s+|inline\s+)*[A-Za-z_][\w\s\*]*?\b([A-Za-z_]\w*)\s*"
                     r"\([^;]*\)\s*(\{.*)?$", line)
        if not m or m.group(1) in KEYWORDS or line.split("(")[0].split()[0] in KEYWORDS:
            continue
        nxt = next((l for l in lines[i + 1:] if l.strip()), "")
        if m.group(2) is not None or nxt.strip().startswith("{"):
            return True
    return False


def call_args(code, name):
    """True when some call of name in code passes arguments."""
    for m in re.finditer(r"\b%s\s*\(\s*(\))?" % re.escape(name), strip_comments_and_strings(code)):
        if m.group(1) is None:
            return True
    return False


def translation_unit(code, index, placeholders):
    """The block as a C file: the prelude, placeholder declarations, then the block (its line
    numbers kept: diagnostics say "snippet:N" for line N of the block)."""
    lines = code.split("\n")
    whole = is_whole_file(code)
    tu = ["#include <%s>" % h for h in PRELUDE_HEADERS]
    if not whole:  # a fragment's #include lines go to the top; blank lines keep the numbering
        tu += [l for l in lines if re.match(r"\s*#\s*include\b", l)]
        lines = ["" if re.match(r"\s*#\s*include\b", l) else l for l in lines]
    for name in sorted(placeholders):
        tu.append("void %s(%s); /* a placeholder the snippet calls */"
                  % (name, "" if call_args(code, name) else "void"))
    if whole:
        tu += ['#line 1 "snippet"'] + lines
    else:
        fn = "readme_snippet_%d" % index
        tu += ["int %s(void);" % fn, "int %s(void)" % fn, "{", '#line 1 "snippet"'] + lines + \
              ["return 0;", "}"]
    return "\n".join(tu) + "\n"


def compile_tu(cc, include, text, tmpdir, index):
    path = os.path.join(tmpdir, "snippet%d.c" % index)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    cmd = cc + FLAGS + ["-o", path[:-2] + ".o", "-I", include, path]
    env = dict(os.environ, LC_ALL="C", LANG="C")
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env)
    except OSError as e:
        raise SystemExit("cannot run the compiler %s: %s" % (shlex.join(cmd), e))
    return p.returncode, p.stdout, cmd


def check_block(cc, include, code, tmpdir, index):
    """(ok, diagnostics, placeholders, command) for one block."""
    placeholders = set()
    for _ in range(8):
        rc, out, cmd = compile_tu(cc, include, translation_unit(code, index, placeholders),
                                  tmpdir, index)
        if rc == 0:
            return True, out, placeholders, cmd
        missing = {n for n in IMPLICIT.findall(out) if not API_PREFIX.match(n)} - placeholders
        if not missing:
            return False, out, placeholders, cmd
        placeholders |= missing
    return False, out, placeholders, cmd


def check_files(cc, include, files):
    failed = total = 0
    with tempfile.TemporaryDirectory() as tmpdir:
        for path in files:
            found = blocks(path)
            if not found:
                print("FAIL: %s has no ```c block to check" % path)
                failed += 1
                continue
            for line, code in found:
                total += 1
                ok, out, ph, cmd = check_block(cc, include, code, tmpdir, total)
                where = "%s:%d" % (os.path.normpath(path), line)
                extra = " (placeholders declared: %s)" % ", ".join(sorted(ph)) if ph else ""
                if ok:
                    print("ok: %s%s" % (where, extra))
                else:
                    failed += 1
                    print("FAIL: %s: the ```c block starting here does not compile cleanly%s"
                          % (where, extra))
                    print("  %s" % shlex.join(cmd))
                    # "snippet:N" in the diagnostics is line N of the block.
                    for l in out.rstrip().split("\n"):
                        m = re.match(r"snippet:(\d+):(.*)", l)
                        if m:
                            l = "%s:%d:%s" % (os.path.normpath(path), line + int(m.group(1)) - 1,
                                              m.group(2))
                        print("  " + l)
    print("%d C block(s) checked, %d failed" % (total, failed))
    return failed == 0 and total > 0


def selftest(cc, include):
    bad = ("void *buf = NULL;\n"
           "if (vmm_realloc(&buf, 1 << 20) != VMM_OK) return -1;\n"
           "load_model(buf);\n"
           "vmm_realloc(&buf, 0);\n")
    good = bad.replace("vmm_realloc(&buf, 0);", "if (vmm_realloc(&buf, 0) != VMM_OK) return -1;")
    whole = ("#include <vmmhook.h>\n\nint main(void)\n{\n    void *p = NULL;\n"
             "    return vmm_realloc(&p, 4096) == VMM_OK ? 0 : 1;\n}\n")
    misspelt = good.replace("vmm_realloc(&buf, 1 << 20)", "vmm_reallocate(&buf, 1 << 20)")
    cases = [("ignored vmm_realloc result", bad, False),
             ("the same with its result checked", good, True),
             ("a whole file with main()", whole, True),
             ("a misspelt API call (no placeholder for vmm_*)", misspelt, False)]
    ok = True
    with tempfile.TemporaryDirectory() as tmpdir:
        md = os.path.join(tmpdir, "t.md")
        for i, (what, code, want) in enumerate(cases, 1):
            with open(md, "w") as f:
                f.write("text\n\n```c\n%s```\n" % code)
            (line, text), = blocks(md)
            got, out, _, _ = check_block(cc, include, text, tmpdir, i)
            verdict = "passes" if got else "fails"
            if got != want:
                ok = False
                print("FAIL: selftest: %s %s, it should not:\n%s" % (what, verdict, out))
            else:
                print("ok: selftest: %s %s" % (what, verdict))
                if not got and "ignored" in what and "unused-result" not in out \
                        and "warn_unused_result" not in out:
                    ok = False
                    print("FAIL: selftest: it failed for another reason than the ignored "
                          "result:\n%s" % out)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"),
                    help="the C compiler command (default $CC or cc)")
    ap.add_argument("--include", required=True, help="the directory of vmmhook.h")
    ap.add_argument("--selftest", action="store_true")
    ap.add_argument("files", nargs="*")
    a = ap.parse_args()
    cc = shlex.split(a.cc)
    if a.selftest:
        return 0 if selftest(cc, a.include) else 1
    if not a.files:
        ap.error("no Markdown file given")
    return 0 if check_files(cc, a.include, a.files) else 1


if __name__ == "__main__":
    sys.exit(main())
