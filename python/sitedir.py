"""Where `meson install` puts the package vmmhook: the site directory that the Python of this
build searches under the install prefix (python/meson.build runs this at setup).

    sitedir.py PREFIX MESON_DIR LIBDIR BINDIR

MESON_DIR is meson's own choice, py.get_install_dir(): PREFIX joined with the interpreter's
install scheme. On Debian that scheme is deb_system (lib/python3/dist-packages), which the
system Python searches under /usr but not under /usr/local, where it searches
lib/python3.X/dist-packages instead (site.py's Debian patch). So: MESON_DIR when this Python
searches it; else the first directory of sys.path under PREFIX that is a site directory; else
MESON_DIR (a prefix this Python never searches: PYTHONPATH must name it, and meson says so).
Prints three lines: the site directory, then LIBDIR and BINDIR relative to the package folder
(site/vmmhook), so that an installation moved or staged with DESTDIR still finds its library.
"""

import os
import sys

prefix, meson_dir, libdir, bindir = sys.argv[1:5]
norm = os.path.normpath
searched = [norm(p) for p in sys.path if p]
site = norm(meson_dir)
found = site in searched
if not found:
    under = [p for p in searched
             if p.startswith(norm(prefix) + os.sep) and p.endswith(("dist-packages", "site-packages"))]
    if under:
        site, found = under[0], True
pkg = os.path.join(site, "vmmhook")
print(site)
print(os.path.relpath(norm(libdir), pkg))
print(os.path.relpath(norm(bindir), pkg))
print("searched" if found else "not-searched")
