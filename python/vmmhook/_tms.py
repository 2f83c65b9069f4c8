"""A drop-in for torch_memory_saver (TMS) over libvmmhook's tags (docs/PYTORCH.md lists what
differs):

    from vmmhook import torch_memory_saver        # instead of: from torch_memory_saver import ...
    with torch_memory_saver.region(tag="kv"):
        cache = torch.empty(..., device="cuda")
    torch_memory_saver.pause("kv")                # memory back to the driver, addresses kept
    torch_memory_saver.resume("kv")

How TMS's meanings map onto the library:
- A TMS tag is up to four library tags, one per kind of backup (TMS decides backup per
  allocation, the library per pause): "tms:<tag>" without backup, "tms+cpu:<tag>" with the
  "pinned" CPU backup (VMM_PAUSE_BACKUP: pinned within the budget), "tms+mmap:<tag>" with the
  "mmap" one (VMM_PAUSE_PAGEABLE: never pinned) and "tms+disk:<tag>" with disk backup
  (VMM_PAUSE_DISK: files in the directory of set_disk_backup_dir). pause(tag) pauses each with
  its flags. Memory allocated outside every region stays in the library's other tags
  ("default"), which this object pauses only when TMS_INIT_ENABLE says that memory allocated
  outside regions is a region's (preload mode), as TMS does.
- Backups are given back after each resume (vmm_backup_trim: the library otherwise keeps pinned
  ones for the next pause) unless retain_cpu_backup is set, as TMS frees them; retained, each
  stays attached to its buffer (vmm_resume_flags' VMM_RESUME_KEEP_BACKUP), as in TMS.
- Like TMS, each region allocates through a PyTorch MemPool of its own per (tag, backup,
  device), so that PyTorch's caching allocator never hands a region's cached block to a tensor
  outside it, nor the reverse. hook_mode "preload": the pool's memory comes from cudaMalloc,
  which the preloaded library serves in the tag pushed for the region. "torch": the pool's
  allocator is the library's vmm_torch_alloc / vmm_torch_free (CUDAPluggableAllocator), nothing
  preloaded; memory outside regions is PyTorch's own.
- Everything PyTorch is reached through one small adapter (_Torch), which the tests replace:
  the rest runs, and is tested, without PyTorch (tests/python, simulated driver).
"""

import contextlib
import ctypes
import functools
import os

import vmmhook as _vm

_TAG_DEFAULT = "default"
_TAG_OFF = "tms-off"  # disable() under TMS_INIT_ENABLE: "default" is a region's then
# The kinds of backup: the library tag's prefix and vmmhook.pause's backup argument of each.
_KINDS = {None: ("tms:", False), "pinned": ("tms+cpu:", True),
          "mmap": ("tms+mmap:", "pageable"), "disk": ("tms+disk:", "disk")}
_BACKUP_OF_PREFIX = {prefix: backup for prefix, backup in _KINDS.values()}
_TAG_MAX = 31 - max(len(p) for p, _ in _KINDS.values())  # VMM_TAG_NAME_MAX less: 22 bytes
_BACKENDS = ("pinned", "mmap")


def library_tag(tag, kind=None):
    """The library's tag name for a TMS tag and kind of backup (None, "pinned", "mmap",
    "disk"): what vmmhook.stats() and memory_stats() show."""
    name = os.fsencode(tag)
    if not name or len(name) > _TAG_MAX:
        raise ValueError(f"torch_memory_saver tag {tag!r}: 1 to {_TAG_MAX} bytes under libvmmhook "
                         f"(its tag names hold 31 bytes, a prefix such as 'tms+mmap:' included)")
    return _KINDS[kind][0] + tag


def _env_bool(name):
    """A TMS switch read as TMS reads it: unset false; 1/true/TRUE/yes/YES and
    0/false/FALSE/no/NO; anything else refused (TMS exits)."""
    value = os.environ.get(name)
    if value is None:
        return False
    if value in ("1", "true", "TRUE", "yes", "YES"):
        return True
    if value in ("0", "false", "FALSE", "no", "NO"):
        return False
    raise ValueError(f"{name}={value!r}: 1, true, TRUE, yes, YES, 0, false, FALSE, no or NO")


def _env_backend():
    value = os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND") or "pinned"
    if value not in _BACKENDS:
        raise ValueError(f"TMS_INIT_CPU_BACKUP_BACKEND={value!r}: 'mmap' or 'pinned'")
    return value


class _Torch:
    """The PyTorch calls the drop-in makes (imported when first needed)."""

    def __init__(self):
        # PyTorch missing: an error that says the drop-in needs it (the package does not).
        self.torch = _vm._import_torch("vmmhook.torch_memory_saver (the torch_memory_saver "
                                       "drop-in)")

    def check_environment(self):
        # As TMS: expandable segments map PyTorch's own VMM memory, which the library does not
        # serve, so a region's tensors would not be paused.
        if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            raise RuntimeError("torch_memory_saver (vmmhook) cannot work with "
                               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: PyTorch maps "
                               "that memory itself, so it cannot be paused")

    def pluggable_allocator(self, path):
        alloc = self.torch.cuda.memory.CUDAPluggableAllocator(path, "vmm_torch_alloc",
                                                              "vmm_torch_free")
        self.pluggable = alloc  # kept for the process's life, with the library it loaded (as TMS)
        return alloc.allocator()

    def current_device(self):
        return self.torch.cuda.current_device()

    def mem_get_info(self):
        """(free, total) bytes of the current device."""
        return self.torch.cuda.mem_get_info()

    def mem_pool(self, allocator):
        return self.torch.cuda.MemPool(allocator=allocator)

    def use_mem_pool(self, pool):
        return self.torch.cuda.use_mem_pool(pool)

    def graph(self, cuda_graph, pool, stream, capture_error_mode):
        return self.torch.cuda.graph(cuda_graph, pool=pool, stream=stream,
                                     capture_error_mode=capture_error_mode)

    def cpu_backup(self, x, backup_of):
        """(x's device address, x's bytes): backup_of(address, nbytes) gives the host address
        of the backup, or None."""
        assert x.is_cuda, f"{x.device=}"
        assert x.is_contiguous(), f"{x.shape=} {x.stride()=} {x.dtype=}"
        return backup_of(x.data_ptr(), x.nbytes)

    def host_tensor(self, x, host, zero_copy):
        """A CPU tensor shaped as x over the library's host memory at `host` (TMS's
        zero_copy), or a copy of it."""
        torch = self.torch
        if x.nbytes == 0:
            return torch.empty(x.shape, dtype=x.dtype)
        # The tensor holds the ctypes array, which names the memory without owning it (as
        # TMS's numpy view does): it is valid while the backup lives.
        raw = (ctypes.c_uint8 * x.nbytes).from_address(host)
        out = torch.frombuffer(raw, dtype=torch.uint8).view(x.dtype).view(x.shape)
        return out if zero_copy else out.clone()


class TorchMemorySaver:
    """torch_memory_saver's object: region, cuda_graph, disable, pause, resume, get_cpu_backup,
    enabled, hook_mode ("preload" by default, as in TMS)."""

    def __init__(self, torch_adapter=None):
        self._adapter = torch_adapter
        self._mode = "preload"
        self._ready = False
        self._allocator = None  # hook_mode "torch": the library as PyTorch's allocator
        self._pools = {}
        self._names = {}  # TMS tag -> the library tags it has used, in order
        # TMS's environment switches, read at construction as TMS reads them when it loads. A
        # bad value is refused at the first use (TMS exits then), not at `import vmmhook`.
        self._env_error = None
        try:
            self._retain = _env_bool("TMS_RETAIN_CPU_BACKUP")
            self._init_enable = _env_bool("TMS_INIT_ENABLE")
            self._init_backup = _env_bool("TMS_INIT_ENABLE_CPU_BACKUP")
            self._default_backend = _env_backend()
        except ValueError as e:
            self._env_error = e
            self._retain = self._init_enable = self._init_backup = False
            self._default_backend = "pinned"
        self._margin = 0
        self._disk_dir = os.environ.get("TMS_DISK_BACKUP_DIR") or "/tmp"
        self._disk_dir_given = False

    # ---- configuration, as TMS ----
    @property
    def enabled(self):
        return True

    @property
    def hook_mode(self):
        return self._mode

    @hook_mode.setter
    def hook_mode(self, mode):
        if self._ready:
            raise RuntimeError("torch_memory_saver.hook_mode: set it before the first region, "
                               "pause or resume (TMS: cannot configure after initialization)")
        if mode not in ("preload", "torch"):
            raise ValueError(f"hook_mode {mode!r}: 'preload' or 'torch'")
        self._mode = mode

    @property
    def retain_cpu_backup(self):
        """False (the default, or TMS_RETAIN_CPU_BACKUP): a resume gives the host memory of
        the backups back. True at a resume: each backup stays attached to its tensor
        (get_cpu_backup answers while running, the next pause writes into the same host memory)
        until a resume without it or the tensor's free."""
        return self._retain

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value):
        self._retain = bool(value)

    @property
    def memory_margin_bytes(self):
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value):
        """A resume refuses (VmmError ERR_NO_MEMORY, nothing done) when it would leave less
        than this many bytes of the device free."""
        value = int(value)
        if value < 0:
            raise ValueError(f"memory_margin_bytes={value}: 0 or more")
        self._margin = value

    def set_disk_backup_dir(self, path):
        """The directory of disk backups (created if needed; TMS_DISK_BACKUP_DIR, else /tmp, by
        default): one file per paused buffer, removed at the resume."""
        os.makedirs(path, exist_ok=True)
        self._disk_dir = os.fspath(path)
        self._disk_dir_given = False
        if self._ready:
            self._give_disk_dir()

    def _give_disk_dir(self):
        """The directory to the library, at the first disk region (or when it changes after):
        a program that never backs up to disk never needs it to exist."""
        if not self._disk_dir_given:
            if not hasattr(self._lib, "vmm_backup_dir"):
                raise NotImplementedError("disk backup needs a libvmmhook with vmm_backup_dir")
            os.makedirs(self._disk_dir, exist_ok=True)
            _vm.backup_dir(self._disk_dir)
            self._disk_dir_given = True

    # ---- set-up ----
    def _torch(self):
        if self._adapter is None:
            self._adapter = _Torch()
        return self._adapter

    def _ensure_initialized(self):
        if self._ready:
            return
        if self._env_error is not None:
            raise self._env_error
        lib = _vm._need()  # the library missing or unloadable: the reason, now
        t = self._torch()
        t.check_environment()
        if self._mode == "preload":
            if _vm._preloaded() is None:
                raise RuntimeError(
                    "torch_memory_saver (vmmhook): hook_mode 'preload' needs libvmmhook "
                    "preloaded: run the program as `python -m vmmhook python PROGRAM.py` (or with "
                    f"LD_PRELOAD={_vm.library_path()}), or set "
                    "torch_memory_saver.hook_mode = 'torch' first")
        else:
            self._allocator = t.pluggable_allocator(_vm.library_path())
        self._lib = lib
        self._ready = True

    def _pool(self, key):
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = self._torch().mem_pool(self._allocator)
        return pool

    def _remember(self, tag, name):
        names = self._names.setdefault(tag, [])
        if name not in names:
            names.append(name)

    @contextlib.contextmanager
    def _in_tag(self, name, tag=None):
        with _vm.tag(name):
            if tag is not None:  # registered in the library now: pause(tag) may name it
                self._remember(tag, name)
            yield

    # ---- regions ----
    @contextlib.contextmanager
    def region(self, tag=_TAG_DEFAULT, enable_cpu_backup=False, enable_disk_backup=False,
               cpu_backup_backend=None):
        """Tensors allocated inside belong to `tag`: pause(tag) gives their memory back. With
        enable_cpu_backup their contents are copied to host memory at the pause and back at
        the resume. Regions nest: the innermost one decides."""
        kind = self._kind(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        name = library_tag(tag, kind)
        self._ensure_initialized()
        if kind == "disk":
            self._give_disk_dir()
        # TMS's key (its tests pop pools by it: _Internals)
        pool = self._pool((tag, kind in _BACKENDS, kind == "disk", kind if kind in _BACKENDS
                           else "", self._torch().current_device()))
        with self._torch().use_mem_pool(pool):
            with self._in_tag(name, tag):
                yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global",
                   tag=_TAG_DEFAULT, enable_cpu_backup=False, cpu_backup_backend=None):
        """torch.cuda.graph(...), with the memory the capture allocates in `tag` (so the
        graph's intermediate tensors are paused with it)."""
        name = library_tag(tag, self._kind(enable_cpu_backup, False, cpu_backup_backend))
        self._ensure_initialized()
        if self._mode != "preload":
            raise RuntimeError("torch_memory_saver.cuda_graph: hook_mode 'preload' only, as in "
                               "torch_memory_saver (use torch.cuda.graph in 'torch' mode)")
        with self._torch().graph(cuda_graph, pool, stream, capture_error_mode):
            with self._in_tag(name, tag):
                yield

    @contextlib.contextmanager
    def disable(self, dispose_mem_pool_after_use=True):
        """Inside a region: allocations here are not the region's (never paused), from a
        fresh pool, as TMS."""
        assert dispose_mem_pool_after_use, "Only dispose_mem_pool_after_use=true is supported now"
        self._ensure_initialized()
        pool = self._torch().mem_pool(None)  # PyTorch's own allocator ("default" if preloaded)
        with self._torch().use_mem_pool(pool):
            with self._in_tag(self._off_tag()):
                yield
        del pool
        # The pool's memory, freed now, goes back to the driver (TMS frees it with cudaFree;
        # the library would keep it for reuse).
        self._lib.vmm_trim()

    def _kind(self, enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
        """The kind of backup of a region (library_tag's), checked as TMS checks it."""
        if cpu_backup_backend is not None:
            if not enable_cpu_backup:
                raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
            if cpu_backup_backend not in _BACKENDS:
                raise ValueError(f"cpu_backup_backend {cpu_backup_backend!r}: 'mmap' or 'pinned'")
        if enable_cpu_backup and enable_disk_backup:
            raise AssertionError("enable_cpu_backup and enable_disk_backup are mutually exclusive")
        if enable_disk_backup:
            return "disk"
        return (cpu_backup_backend or self._default_backend) if enable_cpu_backup else None

    def _init_region(self):
        """TMS_INIT_ENABLE in preload mode: memory allocated outside regions (the library's
        "default" tag) is TMS tag "default"'s, backed up per TMS_INIT_ENABLE_CPU_BACKUP (and
        TMS_INIT_CPU_BACKUP_BACKEND). In "torch" mode that memory is PyTorch's own."""
        return self._init_enable and self._mode == "preload"

    def _off_tag(self):
        return _TAG_OFF if self._init_region() else _TAG_DEFAULT

    def _backup_of(self, name):
        if name == _TAG_DEFAULT:
            return _KINDS[self._default_backend if self._init_backup else None][1]
        return _BACKUP_OF_PREFIX[name[:name.index(":") + 1]]

    # ---- pause and resume ----
    def _targets(self, tag):
        init = [_TAG_DEFAULT] if self._init_region() and tag in (None, _TAG_DEFAULT) else []
        if tag is None:
            return init + [n for names in self._names.values() for n in names]
        return init + list(self._names.get(tag, ()))

    def _state(self, name):
        return _vm.stats()["tags"].get(name, {}).get("state")

    def pause(self, tag=None):
        """Gives the memory of `tag` (None: of every tag used in a region) back to the driver;
        addresses are kept. Backed-up regions keep their contents on the host. A tag never
        used: nothing to do. Raises VmmError (ERR_PAUSED) when a named tag is paused already;
        with None, paused tags are skipped."""
        self._ensure_initialized()
        self._switch(tag, pausing=True)

    def resume(self, tag=None):
        """Maps memory again at the same addresses (None: every paused tag); backed-up regions
        get their contents back. Raises VmmError (ERR_NOT_PAUSED) when a named tag is not
        paused; with None, running tags are skipped."""
        self._ensure_initialized()
        self._switch(tag, pausing=False)

    def _switch(self, tag, pausing):
        names = self._targets(tag)
        stop = "running" if not pausing else "paused"
        call = "pause" if pausing else "resume"
        if tag is not None and any(self._state(n) == stop for n in names):
            # Nothing done when any part is already there (TMS would exit the process).
            code = _vm.ERR_PAUSED if pausing else _vm.ERR_NOT_PAUSED
            raise _vm.VmmError(f"torch_memory_saver.{call}({tag!r})", code,
                               f"tag {tag!r} is {stop} already")
        todo = [n for n in names if self._state(n) != stop]  # (None): the others are skipped
        if not pausing:
            self._check_margin(tag, todo)
        done = []
        try:
            for n in todo:
                if pausing:
                    _vm.pause(n, backup=self._backup_of(n))
                else:  # retained: the backups stay attached to the buffers (TMS's meaning)
                    _vm.resume(n, keep_backup=self._retain)
                done.append(n)
        except _vm.VmmError:
            # All or nothing over the library tags of this call: undo the ones done.
            for n in reversed(done):
                try:
                    _vm.resume(n) if pausing else _vm.pause(n, backup=self._backup_of(n))
                except _vm.VmmError:
                    pass
            raise
        if not pausing and not self._retain and hasattr(self._lib, "vmm_backup_trim"):
            # TMS frees a backup at the resume unless retained: the pinned host memory the
            # library keeps for the next pause goes back too (pageable backups and files went
            # with the resume).
            _vm.backup_trim()

    def _check_margin(self, tag, names):
        """memory_margin_bytes: refuse a resume that would leave less than that free."""
        if not self._margin or not names:
            return
        tags = _vm.stats()["tags"]
        need = sum(tags.get(n, {}).get("paused", 0) for n in names)
        free, _ = self._torch().mem_get_info()
        if free < need + self._margin:
            raise _vm.VmmError(f"torch_memory_saver.resume({tag!r})", _vm.ERR_NO_MEMORY,
                               f"{need} bytes to map with {free} free would leave less than "
                               f"memory_margin_bytes={self._margin} free (nothing resumed)")

    # ---- backups ----
    def get_cpu_backup(self, x, zero_copy=False):
        """A CPU copy of tensor x's backup while its tag is paused with enable_cpu_backup, or
        while it runs with the backup retained (retain_cpu_backup at the resume); None
        otherwise. zero_copy: the backup's own host memory, as TMS (valid until the backup
        goes: a resume without retain, the tensor's free; the next pause rewrites it)."""
        self._ensure_initialized()
        host = self._torch().cpu_backup(x, _vm.backup_host)
        return None if host is None else self._torch().host_tensor(x, host, zero_copy)

    @property
    def _impl(self):
        """What torch_memory_saver's own tests reach inside TMS (its private _impl), answered
        over this object's pools and tags; not an API."""
        self._ensure_initialized()
        return _Internals(self)


class _Internals:
    """TMS's examples (test/examples/cpu_backup.py) reach TMS's private parts: the MemPools by
    TMS's key (tag, enable_cpu_backup, enable_disk_backup, backend, device), the region
    configuration as a context manager, and cudart's calls (cudaHostGetFlags) through
    _binary_wrapper.cdll. The same names here, over the drop-in's own pools, tags and the
    process's libcudart (TMS's tms_* symbols are not answered)."""

    def __init__(self, saver):
        self._saver = saver
        self._mem_pools = saver._pools
        self._binary_wrapper = self  # ._binary_wrapper.cdll

    @property
    def cdll(self):
        return _cudart()

    def _with_region_config(self, tag, enable_cpu_backup, cpu_backup_backend,
                            enable_disk_backup=False):
        kind = self._saver._kind(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        return self._saver._in_tag(library_tag(tag, kind), tag)


@functools.lru_cache(maxsize=1)
def _cudart():
    """The libcudart this process has loaded (PyTorch's), else the system's."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libcudart.so"):
                return ctypes.CDLL(path)
    return ctypes.CDLL("libcudart.so")


@contextlib.contextmanager
def configure_subprocess():
    """Child processes started inside the block preload the library (TMS's
    configure_subprocess, for hook_mode "preload")."""
    path = _vm.library_path()  # not loaded here: only the children need it
    if not path or not os.path.isfile(path):
        raise _vm.VmmError("configure_subprocess", -1,
                           f"no libvmmhook.so to preload ({path or 'none found'}): install the "
                           "package with pip, or set LIBVMMHOOK=/path/to/libvmmhook.so")
    old = os.environ.get("LD_PRELOAD")
    parts = (old or "").replace(":", " ").split()
    if path not in parts:
        os.environ["LD_PRELOAD"] = f"{path} {old}" if old else path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = old


# The singleton, as torch_memory_saver's module has it.
torch_memory_saver = TorchMemorySaver()
