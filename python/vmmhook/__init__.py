"""libvmmhook from Python: tags, pause and resume, statistics (docs/SLEEP.md).

Pure Python over ctypes; nothing here needs CUDA or PyTorch to import. The library is used
from wherever it is loaded: preloaded (LD_PRELOAD=libvmmhook.so, every cudaMalloc served), or
loaded by PyTorch as a CUDAPluggableAllocator (torch_allocator()), or, failing both, loaded
here from library_path().

    import vmmhook
    with vmmhook.tag("weights"):
        model = build_model().cuda()
    with vmmhook.tag("kv"):
        cache = torch.empty(..., device="cuda")
    vmmhook.pause("weights", backup=True)   # memory back to the driver, contents kept on host
    vmmhook.pause("kv")                      # memory back to the driver, contents dropped
    ...                                      # another process may use the GPU now
    vmmhook.resume()                         # same addresses; weights restored
"""

import contextlib
import ctypes
import json
import os
import sys

__all__ = [
    "VmmError",
    "available",
    "library_path",
    "tag",
    "pause",
    "resume",
    "backup_dir",
    "backup_trim",
    "backup_host",
    "prefetch",
    "prefetch_tag",
    "stats",
    "memory_stats",
    "torch_allocator",
    "torch_memory_saver",
    "TorchMemorySaver",
    "configure_subprocess",
]

PAUSE_BACKUP = 1  # VMM_PAUSE_BACKUP
PAUSE_PAGEABLE = 2  # VMM_PAUSE_PAGEABLE: with PAUSE_BACKUP, never pinned
PAUSE_DISK = 4  # VMM_PAUSE_DISK: with PAUSE_BACKUP, in files of backup_dir()
RESUME_KEEP_BACKUP = 1  # VMM_RESUME_KEEP_BACKUP: resume(keep_backup=True)

# vmm_status codes (include/vmmhook.h); the text comes from vmm_status_string.
OK = 0
ERR_NO_MEMORY = 4
ERR_PAUSED = 9
ERR_NOT_PAUSED = 10
ERR_LIMIT = 11
ERR_UNKNOWN_TAG = 12
ERR_CAPTURING = 13
ERR_SHARED = 14


class VmmError(RuntimeError):
    """A libvmmhook call failed; .status is the vmm_status code."""

    def __init__(self, call, status, text):
        super().__init__(f"{call}: {text} (vmm_status {status})")
        self.status = status


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


_lib = None
_load_error = None  # why the last load failed: (path, the loader's message)


def _preloaded():
    """The library when it is already in the process (preloaded, or dlopened by PyTorch)."""
    try:
        process = ctypes.CDLL(None)
        process.vmm_version  # noqa: B018 (the look-up is the test)
        return process
    except (AttributeError, OSError):
        return None


def _path_of_loaded(process):
    """The file the loaded library came from, through dladdr on one of its functions."""
    try:
        libc = ctypes.CDLL(None)
        dladdr = libc.dladdr
    except AttributeError:
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    dladdr.restype = ctypes.c_int
    info = _DlInfo()
    fn = ctypes.cast(process.vmm_version, ctypes.c_void_p)
    if dladdr(fn, ctypes.byref(info)) and info.dli_fname:
        return os.path.realpath(os.fsdecode(info.dli_fname))
    return None


def _package_dir():
    return os.path.dirname(os.path.abspath(__file__))


def _installed(kind, name):
    """An installed file: `kind` "LIB" or "BIN". Looked for in this package's folder (a wheel
    has the library there), then where meson install put it, relative to this folder (a
    DESTDIR staging or a moved installation), then at its absolute path."""
    here = _package_dir()
    candidates = [os.path.join(here, name)] if kind == "LIB" else [os.path.join(here, "bin", name)]
    try:
        from . import _paths  # written by meson (python/meson.build)
    except ImportError:
        _paths = None
    if _paths is not None:
        rel = getattr(_paths, kind + "DIR_REL", "")
        if rel:
            candidates.append(os.path.normpath(os.path.join(here, rel, name)))
        absolute = getattr(_paths, kind + "DIR", "")
        if absolute:
            candidates.append(os.path.join(absolute, name))
    for c in candidates:
        if os.path.isfile(c):
            return c
    return None


def _installed_path():
    return _installed("LIB", "libvmmhook.so")


def library_path():
    """Path of libvmmhook.so: the loaded one if any, else $LIBVMMHOOK (whether or not it
    exists: the override is used as given), else the installed one (inside this package when
    installed by pip); None when none is found."""
    process = _preloaded()
    if process is not None:
        path = _path_of_loaded(process)
        if path:
            return path
    env = os.environ.get("LIBVMMHOOK")
    if env:
        return env
    return _installed_path()


def _load():
    global _lib, _load_error
    if _lib is not None:
        return _lib
    lib = _preloaded()
    if lib is None:
        path = library_path()
        if not path:
            _load_error = None
            return None
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            _load_error = (path, str(e))
            return None
    _load_error = None
    lib.vmm_version.restype = ctypes.c_int
    lib.vmm_version.argtypes = []
    lib.vmm_status_string.restype = ctypes.c_char_p
    lib.vmm_status_string.argtypes = [ctypes.c_int]
    lib.vmm_tag_push.restype = ctypes.c_int
    lib.vmm_tag_push.argtypes = [ctypes.c_char_p]
    lib.vmm_tag_pop.restype = ctypes.c_int
    lib.vmm_tag_pop.argtypes = []
    lib.vmm_pause.restype = ctypes.c_int
    lib.vmm_pause.argtypes = [ctypes.c_char_p, ctypes.c_uint]
    lib.vmm_resume.restype = ctypes.c_int
    lib.vmm_resume.argtypes = [ctypes.c_char_p]
    lib.vmm_stats_json.restype = ctypes.c_int
    lib.vmm_stats_json.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    if hasattr(lib, "vmm_prefetch"):  # newer libraries: VMMHOOK_OVERFLOW=host
        lib.vmm_prefetch.restype = ctypes.c_int
        lib.vmm_prefetch.argtypes = [ctypes.c_void_p]
        lib.vmm_prefetch_tag.restype = ctypes.c_int
        lib.vmm_prefetch_tag.argtypes = [ctypes.c_char_p]
    if hasattr(lib, "vmm_backup_trim"):  # newer libraries: TMS's disk backup and retain
        lib.vmm_backup_trim.restype = ctypes.c_size_t
        lib.vmm_backup_trim.argtypes = []
        lib.vmm_backup_dir.restype = ctypes.c_int
        lib.vmm_backup_dir.argtypes = [ctypes.c_char_p]
    if hasattr(lib, "vmm_backup_read"):  # newer libraries: TMS's get_cpu_backup
        lib.vmm_backup_read.restype = ctypes.c_int
        lib.vmm_backup_read.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    if hasattr(lib, "vmm_resume_flags"):  # newer libraries: TMS's retained backups
        lib.vmm_resume_flags.restype = ctypes.c_int
        lib.vmm_resume_flags.argtypes = [ctypes.c_char_p, ctypes.c_uint]
        lib.vmm_backup_host.restype = ctypes.c_int
        lib.vmm_backup_host.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.POINTER(ctypes.c_void_p)]
    _lib = lib
    return lib


def available():
    """True when the library can be used from this process (loaded, or loadable)."""
    return _load() is not None


def _need():
    lib = _load()
    if lib is not None:
        return lib
    if _load_error is not None:
        path, why = _load_error
        source = " (from $LIBVMMHOOK)" if os.environ.get("LIBVMMHOOK") == path else ""
        raise VmmError("vmmhook", -1, f"cannot load {path}{source}: {why}")
    raise VmmError("vmmhook", -1,
                   "libvmmhook is not loaded in this process and no libvmmhook.so was found "
                   f"(not preloaded, $LIBVMMHOOK unset, none installed with the package in "
                   f"{_package_dir()}): preload it, or set LIBVMMHOOK=/path/to/libvmmhook.so")


def _check(lib, call, status):
    if status != OK:
        raise VmmError(call, status, lib.vmm_status_string(status).decode())


def _name(t):
    return None if t is None else os.fsencode(t)


@contextlib.contextmanager
def tag(name):
    """Allocations made by this thread inside the block belong to tag `name`."""
    lib = _need()
    _check(lib, "vmm_tag_push", lib.vmm_tag_push(_name(name)))
    try:
        yield
    finally:
        _check(lib, "vmm_tag_pop", lib.vmm_tag_pop())


_BACKUP_FLAGS = {False: 0, None: 0, True: PAUSE_BACKUP, "pageable": PAUSE_BACKUP | PAUSE_PAGEABLE,
                 "disk": PAUSE_BACKUP | PAUSE_DISK}


def pause(tag=None, backup=False):
    """Gives the memory of `tag` (None: of every tag) back to the driver, keeping addresses.
    backup=True copies the contents to host memory first (pinned within VMMHOOK_PIN_LIMIT);
    "pageable": to host memory never pinned; "disk": to files in backup_dir(). resume()
    restores them. Raises VmmError (e.g. status ERR_PAUSED when the tag is paused already)."""
    if backup not in _BACKUP_FLAGS:
        raise ValueError(f"backup={backup!r}: False, True, 'pageable' or 'disk'")
    lib = _need()
    _check(lib, "vmm_pause", lib.vmm_pause(_name(tag), _BACKUP_FLAGS[backup]))


def backup_dir(path):
    """The directory of pause(backup="disk")'s files (None: none)."""
    lib = _need()
    _check(lib, "vmm_backup_dir", lib.vmm_backup_dir(_name(path)))


def backup_trim():
    """Gives back the pinned host memory kept for later backups that holds no paused backup;
    returns the bytes."""
    return _need().vmm_backup_trim()


def resume(tag=None, keep_backup=False):
    """Maps memory again at the same addresses (None: every paused tag). Raises VmmError;
    out of memory leaves the tag paused, and the call can be retried. keep_backup: each
    buffer's backup stays attached to it (backup_host() answers while it runs, its next backup
    pause writes into the same host memory) until a resume without it, or the buffer's free."""
    lib = _need()
    if not keep_backup:
        _check(lib, "vmm_resume", lib.vmm_resume(_name(tag)))
        return
    if not hasattr(lib, "vmm_resume_flags"):
        raise NotImplementedError("resume(keep_backup=True) needs a libvmmhook with "
                                  "vmm_resume_flags")
    _check(lib, "vmm_resume_flags", lib.vmm_resume_flags(_name(tag), RESUME_KEEP_BACKUP))


def backup_host(address, nbytes):
    """The host address of the backup of device memory [address, address + nbytes) (one
    buffer's: paused with a backup, or running with one kept), or None when it has none. The
    memory is the library's, valid until the backup goes (a resume without keep_backup, the
    buffer's free, a pause without backup)."""
    lib = _need()
    if not hasattr(lib, "vmm_backup_host"):
        raise NotImplementedError("backup_host needs a libvmmhook with vmm_backup_host")
    host = ctypes.c_void_p()
    st = lib.vmm_backup_host(ctypes.c_void_p(address), nbytes, ctypes.byref(host))
    if st == ERR_NOT_PAUSED:
        return None
    _check(lib, "vmm_backup_host", st)
    return host.value


def prefetch(buffer):
    """Moves a buffer that spilled to host memory (VMMHOOK_OVERFLOW=host, docs/OVERFLOW.md) back
    to the device at the same address. `buffer`: a device pointer (int) or anything with
    data_ptr() (a torch.Tensor). Waits for the device's work first; no work touching the
    buffer may be submitted until it returns. Raises VmmError (ERR_NO_MEMORY: no room, the
    buffer stays where it is)."""
    lib = _need()
    ptr = buffer.data_ptr() if hasattr(buffer, "data_ptr") else int(buffer)
    _check(lib, "vmm_prefetch", lib.vmm_prefetch(ptr))


def prefetch_tag(tag=None):
    """prefetch() for every spilled buffer of `tag` (None: the calling thread's current tag) on
    the current device."""
    lib = _need()
    _check(lib, "vmm_prefetch_tag", lib.vmm_prefetch_tag(_name(tag)))


def stats():
    """The library's statistics (vmm_stats_json) as a dict; per-tag figures under "tags"."""
    lib = _need()
    size = 4096
    while True:
        buf = ctypes.create_string_buffer(size)
        need = lib.vmm_stats_json(buf, size)
        if need < 0:
            raise VmmError("vmm_stats_json", need, "statistics unavailable")
        if need < size:
            return json.loads(buf.value.decode())
        size = need + 1


def _import_torch(what):
    """PyTorch, for `what` (a part of this package that needs it), imported only when that part
    is used. Where PyTorch is not installed, a ModuleNotFoundError (name "torch") that says so
    and that the rest of the package works without it, instead of Python's bare "No module
    named 'torch'"; any other failure of PyTorch's import (PyTorch there, but broken) as it
    is."""
    try:
        import torch
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise ModuleNotFoundError(
            f"{what} needs PyTorch, which this Python ({sys.executable}) cannot import: "
            "install it (pip install torch) to use it. The rest of vmmhook (tag, pause, resume, "
            "stats, memory_stats, ...) works without PyTorch.", name="torch") from None
    return torch


def torch_allocator():
    """PyTorch's CUDAPluggableAllocator over this library, for
    torch.cuda.memory.change_current_allocator() (before the first CUDA allocation)."""
    # only when asked: the package itself does not need PyTorch
    torch = _import_torch("vmmhook.torch_allocator()")

    _need()  # a missing or unloadable library fails here, with the reason
    path = library_path()
    return torch.cuda.memory.CUDAPluggableAllocator(path, "vmm_torch_alloc", "vmm_torch_free")


def memory_stats(tag=None):
    """Statistics in the names of torch.cuda.memory_stats() where a meaning matches
    ("allocated_bytes.all.current", "reserved_bytes.all.peak", "num_alloc_retries",
    "num_ooms", ...), for the whole process (tag None) or one tag, plus the tag figures of
    docs/SLEEP.md under "tag.*" names. See _stats.py for the table of meanings."""
    from ._stats import torch_names

    return torch_names(stats(), tag)


def configure_subprocess():
    """A context manager: child processes started inside it run with the library preloaded
    (torch_memory_saver's configure_subprocess, for hook_mode "preload")."""
    from ._tms import configure_subprocess as cs

    return cs()


from ._tms import TorchMemorySaver, torch_memory_saver  # noqa: E402 (imports nothing heavy)
