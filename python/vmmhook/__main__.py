"""python -m vmmhook [OPTIONS] [--] PROGRAM [ARGS...]   run PROGRAM with libvmmhook preloaded
python -m vmmhook [OPTIONS] --check                   check the options, print the configuration

The launcher's own options (python -m vmmhook --help lists them): this runs the installed
launcher script (tools/launcher/vmmhook), whose options come from the library's options table
through vmmhook-config, with the library this package finds (vmmhook.library_path(), so
$LIBVMMHOOK overrides it; a --lib given here wins over both). Nothing is parsed here.
"""

import os
import shutil
import sys

import vmmhook


def launcher():
    """The launcher script: the package's own (pip), the installation's bin/ (meson install),
    else the first `vmmhook` on PATH."""
    found = vmmhook._installed("BIN", "vmmhook")
    return found or shutil.which("vmmhook")


def main(argv):
    script = launcher()
    if not script:
        sys.stderr.write("python -m vmmhook: the launcher script `vmmhook` is not installed with "
                         f"this package ({vmmhook._package_dir()}) nor on PATH; install the "
                         "package with pip or meson install\n")
        return 2
    args = ["sh", script]
    lib = vmmhook.library_path()
    if lib:
        args.append("--lib=" + lib)
    args += argv
    os.environ["VMMHOOK_LAUNCHER_NAME"] = "python -m vmmhook"
    sys.stdout.flush()
    os.execvp("sh", args)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
