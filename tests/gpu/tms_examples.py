#!/usr/bin/env python3
"""tms_examples: torch_memory_saver's own examples (its test suite: test/examples/*.py, as its
test/test_examples.py runs them) against libvmmhook's drop-in, on a GPU.

    tms_examples.py TMS_DIR [NAME ...]

TMS_DIR: a checkout of torch_memory_saver (none ships with this project: tests/gpu/
torch_tms-round.sh's .tms-src, which the device tool carries). The examples import
`torch_memory_saver`; here that name is a package made in a temporary directory whose
__init__ re-exports the drop-in (vmmhook.torch_memory_saver, TorchMemorySaver,
configure_subprocess) and whose testing_utils and utils are TMS's own files from TMS_DIR, put
first on the path. Each case runs in a spawned process, under configure_subprocess() in "preload"
mode, with the environment TMS's test sets, and passes as TMS's _test_core decides (the
process's exit code in "preload" mode, the function's outcome in "torch" mode). Cases named
"(private)" reach TMS's internals (torch_memory_saver._impl or its C symbols): they are run and
reported, and expected to fail. cpu_backup.run is both: whole, it is private (its last helper,
_assert_cpu_backup_released_on_allocation_free, reaches _impl); its public part runs with that
helper replaced by a no-op (PUBLIC_PART). Multi-device cases need two GPUs and are left out.
Prints "PASS case", "FAIL case" per case and a summary; exit 0 when every public case passed,
1 otherwise, 77 skip (no torch, no GPU, no TMS_DIR).
"""
import multiprocessing
import os
import shutil
import sys
import tempfile
import traceback

BOTH = ("preload", "torch")
INIT_BACKUP = {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}
# (module, function, hook modes, environment, public): test/test_examples.py's single-GPU cases.
CASES = [
    ("simple", "run", BOTH, {}, True),
    ("cuda_graph", "run", BOTH, {}, True),
    # cpu_backup.run ends in _assert_cpu_backup_released_on_allocation_free, which reaches
    # torch_memory_saver._impl (its pools, its region config, its C library's cudaHostGetFlags):
    # run whole as a private case, and as a public one with that tail left out (PUBLIC_PART).
    ("cpu_backup", "run", BOTH, {}, True),
    ("cpu_backup", "run", BOTH, {}, False),
    ("cpu_backup", "run_rss", ("torch",), {}, True),
    ("cpu_backup", "run_backend_from_env", BOTH, {"TMS_INIT_CPU_BACKUP_BACKEND": "mmap"}, False),
    ("cpu_backup", "run_preload_backend_from_env", ("preload",),
     dict(INIT_BACKUP, TMS_INIT_CPU_BACKUP_BACKEND="mmap"), False),
    ("disk_backup", "run", BOTH, {}, True),
    ("cpu_backup", "run_retain_from_env", BOTH, {"TMS_RETAIN_CPU_BACKUP": "1"}, True),
    ("rl_example", "run", BOTH, {}, True),
    ("training_engine", "run", ("preload",), INIT_BACKUP, True),
    ("cuda_vmm_granularity", "run", ("preload",), {"TMS_INIT_ENABLE": "1"}, False),
    ("nested_region", "run", ("preload",), INIT_BACKUP, False),
]

# (module, function) -> the module's helpers that reach TMS's internals, replaced by no-ops in
# the case's public run (the private run keeps them).
PUBLIC_PART = {("cpu_backup", "run"): ("_assert_cpu_backup_released_on_allocation_free",)}

SHIM_INIT = '''"""torch_memory_saver's name over libvmmhook's drop-in (tms_examples.py)."""
from vmmhook import (TorchMemorySaver, configure_subprocess,  # noqa: F401
                     torch_memory_saver)
'''


def make_shim(tms_dir):
    shim = tempfile.mkdtemp(prefix="tms-shim-")
    pkg = os.path.join(shim, "torch_memory_saver")
    os.makedirs(pkg)
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write(SHIM_INIT)
    for name in ("testing_utils.py", "utils.py"):
        shutil.copy(os.path.join(tms_dir, "torch_memory_saver", name), pkg)
    return shim


def child(module, function, hook_mode, queue, leave_out=()):
    import importlib

    try:
        mod = importlib.import_module(f"examples.{module}")
        for name in leave_out:
            setattr(mod, name, lambda *args, **kwargs: None)
        fn = getattr(mod, function)
        fn(hook_mode=hook_mode)
        queue.put(True)
    except BaseException:  # noqa: BLE001 (reported, as TMS's wrapper does)
        traceback.print_exc()
        queue.put(False)
        raise


def run_case(module, function, hook_mode, env, leave_out=()):
    import vmmhook

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        with (vmmhook.configure_subprocess() if hook_mode == "preload" else _nothing()):
            proc = ctx.Process(target=child, args=(module, function, hook_mode, queue, leave_out))
            proc.start()
            proc.join(timeout=600)
        if proc.is_alive():
            proc.kill()
            return False, "timed out"
        outcome = queue.get(timeout=5) if not queue.empty() else None
        ok = proc.exitcode == 0 if hook_mode == "preload" else bool(outcome)
        return ok, f"exit {proc.exitcode}"
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main():
    if len(sys.argv) < 2 or not os.path.isdir(os.path.join(sys.argv[1], "test", "examples")):
        print(f"SKIP: tms_examples: no torch_memory_saver checkout at {sys.argv[1:2]} (exit 77)")
        return 77
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        print(f"SKIP: tms_examples: no PyTorch ({e}) (exit 77)")
        return 77
    if not torch.cuda.is_available():
        print("SKIP: tms_examples: no CUDA device (exit 77)")
        return 77
    tms_dir = os.path.abspath(sys.argv[1])
    only = set(sys.argv[2:])
    shim = make_shim(tms_dir)
    here = os.path.dirname(os.path.abspath(__file__))
    # The spawned children find the shim, the drop-in (this tree's python/ unless installed)
    # and TMS's examples through PYTHONPATH.
    paths = [shim, os.path.join(here, "..", "..", "python"), os.path.join(tms_dir, "test")]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    sys.path[:0] = paths
    results = []
    try:
        for module, function, modes, env, public in CASES:
            if only and module not in only:
                continue
            for mode in modes:
                leave_out = PUBLIC_PART.get((module, function), ()) if public else ()
                name = f"{module}.{function}[{mode}]" + ("" if public else " (private)")
                if leave_out:
                    name += f" (public part: without {', '.join(leave_out)})"
                print(f"I running {name}", flush=True)
                ok, why = run_case(module, function, mode, env, leave_out)
                print(f"{'PASS' if ok else 'FAIL'} {name}{'' if ok else ': ' + why}", flush=True)
                results.append((public, ok))
    finally:
        shutil.rmtree(shim, ignore_errors=True)
    pub = [ok for public, ok in results if public]
    priv = [ok for public, ok in results if not public]
    print(f"I public cases: {sum(pub)} of {len(pub)} passed; private: {sum(priv)} of {len(priv)}")
    if all(pub):
        print("PASS: tms_examples")
        return 0
    print("FAIL: tms_examples")
    return 1


if __name__ == "__main__":
    sys.exit(main())
