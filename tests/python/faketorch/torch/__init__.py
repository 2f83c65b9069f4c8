"""A stand-in `torch` for running tests/gpu/torch_tms.py on the simulated driver (tests/sim's
fake libcuda.so.1), so that the program's own logic, the drop-in's PyTorch half and the
library in both hook modes run without a GPU (meson test --suite python).

Only what torch_tms.py and vmmhook's adapter (python/vmmhook/_tms.py, _Torch) call. A CUDA
tensor is a device buffer of the fake driver: allocated with cuMemAlloc (served by the library
when it is preloaded) or, inside a MemPool whose allocator is a CUDAPluggableAllocator, with
that library's alloc function; its bytes are read and written with sim_read / sim_write, so a
paused buffer cannot be read (an "illegal address" here, as on a GPU). Arithmetic is not real:
an operation's output is a deterministic function (a hash) of its inputs' bytes, which is all
a bit-for-bit comparison needs. CUDA graphs record the operations and run them again at replay,
into the same output buffers. No caching: every tensor is one allocation, freed when the
tensor is collected.
"""

import contextlib
import ctypes
import hashlib
import random
import struct
import threading

__version__ = "0.0-fake"


class _Version:
    cuda = "13.0"
    hip = None


version = _Version()


class dtype:
    def __init__(self, name, itemsize, fmt):
        self.name, self.itemsize, self.fmt = name, itemsize, fmt

    def __repr__(self):
        return f"torch.{self.name}"


uint8 = dtype("uint8", 1, "B")
float32 = dtype("float32", 4, "f")


class device:
    def __init__(self, spec):
        self.type = str(spec).split(":")[0]

    def __repr__(self):
        return f"device({self.type!r})"


# ---- the driver --------------------------------------------------------------------------------
_cu = ctypes.CDLL("libcuda.so.1")
for _name, _args in [
    ("cuInit", [ctypes.c_uint]),
    ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]),
    ("cuCtxSetCurrent", [ctypes.c_void_p]),
    ("cuMemAlloc_v2", [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]),
    ("cuMemFree_v2", [ctypes.c_uint64]),
    ("cuMemGetInfo_v2", [ctypes.POINTER(ctypes.c_size_t)] * 2),
    ("sim_write", [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]),
    ("sim_read", [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]),
]:
    getattr(_cu, _name).argtypes = _args
    getattr(_cu, _name).restype = ctypes.c_int
assert _cu.cuInit(0) == 0
_ctx = ctypes.c_void_p()
assert _cu.cuDevicePrimaryCtxRetain(ctypes.byref(_ctx), 0) == 0
assert _cu.cuCtxSetCurrent(_ctx) == 0

_local = threading.local()


def _pools():
    if not hasattr(_local, "pools"):
        _local.pools = []
    return _local.pools


def _device_alloc(n):
    """(address, free function) from the current pool's allocator, or the driver."""
    pools = _pools()
    alloc = pools[-1].allocator if pools else None
    if alloc is not None:
        p = alloc.alloc(n, 0, None)
        if not p:
            raise RuntimeError(f"CUDA out of memory (pluggable allocator, {n} bytes)")
        return p, lambda: alloc.free(p, n, 0, None)
    p = ctypes.c_uint64()
    rc = _cu.cuMemAlloc_v2(ctypes.byref(p), n)
    if rc != 0:
        raise RuntimeError(f"CUDA out of memory (cuMemAlloc {n} bytes: {rc})")
    return p.value, lambda: _cu.cuMemFree_v2(p.value)


def _read(p, n):
    buf = ctypes.create_string_buffer(n)
    if _cu.sim_read(buf, p, n) != 0:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (unmapped)")
    return buf.raw


def _write(p, data):
    if _cu.sim_write(p, data, len(data)) != 0:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (unmapped)")


def _prod(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _shape(args):
    return tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else tuple(args)


def _fill_bytes(value, dt, numel):
    return struct.pack("<" + dt.fmt, value) * numel


# ---- tensors -----------------------------------------------------------------------------------
class _Bool:
    def __init__(self, v):
        self.v = bool(v)

    def all(self):
        return self

    def item(self):
        return self.v

    def __bool__(self):
        return self.v


class Tensor:
    def __init__(self, shape, dt, data=None, on_cuda=True):
        self.shape, self.dtype, self.is_cuda = tuple(shape), dt, on_cuda
        self._free = None
        n = self.nbytes
        if on_cuda:
            self._p, self._free = _device_alloc(max(n, 1))
            if data is not None:
                _write(self._p, data)
        else:
            self._buf = ctypes.create_string_buffer(max(n, 1))
            if data is not None:
                ctypes.memmove(self._buf, data, n)
            self._p = ctypes.addressof(self._buf)

    def __del__(self):
        if self._free is not None:
            try:
                self._free()
            except Exception:  # noqa: BLE001 (interpreter shutdown)
                pass
            self._free = None

    @property
    def device(self):
        return device("cuda" if self.is_cuda else "cpu")

    @property
    def nbytes(self):
        return _prod(self.shape) * self.dtype.itemsize

    def numel(self):
        return _prod(self.shape)

    def element_size(self):
        return self.dtype.itemsize

    def data_ptr(self):
        return self._p

    def is_contiguous(self):
        return True

    def stride(self):
        return (1,)

    def detach(self):
        return self

    def bytes(self):
        if self.is_cuda:
            return _read(self._p, self.nbytes)
        return ctypes.string_at(self._p, self.nbytes)

    def view(self, how):
        """A dtype (the same bytes as that type) or a shape; shares the memory."""
        t = Tensor.__new__(Tensor)
        t.__dict__.update(self.__dict__)
        t._free = None  # the memory stays the viewed tensor's
        t._base = self
        if isinstance(how, dtype):
            t.shape, t.dtype = (self.nbytes // how.itemsize,), how
        else:
            t.shape = tuple(how)
        return t

    def clone(self):
        return Tensor(self.shape, self.dtype, self.bytes(), on_cuda=self.is_cuda)

    def cpu(self):
        return Tensor(self.shape, self.dtype, self.bytes(), on_cuda=False)

    def fill_(self, value):
        data = _fill_bytes(value, self.dtype, self.numel())
        if self.is_cuda:
            _write(self._p, data)
        else:
            ctypes.memmove(self._p, data, len(data))
        return self

    def __eq__(self, value):
        return _Bool(self.bytes() == _fill_bytes(value, self.dtype, self.numel()))

    __hash__ = object.__hash__

    def __add__(self, other):
        return _op("add", [self, other], self.shape)

    def float(self):
        return _Mean(self)


class _Mean:
    """t.float().mean().item() of a uint8 tensor: the mean of its bytes."""

    def __init__(self, t):
        self.t = t

    def mean(self):
        data = self.t.bytes()
        return _Scalar(sum(data) / max(len(data), 1))


class _Scalar:
    def __init__(self, v):
        self.v = v

    def item(self):
        return self.v


def _op(name, inputs, shape):
    out = Tensor(shape, float32)

    def run():
        h = hashlib.sha256(name.encode())
        for t in inputs:
            h.update(t.bytes())
        _write(out.data_ptr(), random.Random(h.digest()).randbytes(out.nbytes))

    run()
    if _capturing:
        _capturing[-1].append(run)
    return out


def full(size, fill_value, dtype=float32, device=None):
    shape = _shape([size])
    return Tensor(shape, dtype, _fill_bytes(fill_value, dtype, _prod(shape)))


def zeros(*size, dtype=float32, device=None):
    shape = _shape(size)
    return Tensor(shape, dtype, bytes(_prod(shape) * dtype.itemsize))


def frombuffer(buffer, dtype=uint8):
    """A CPU tensor over a ctypes array's memory (kept alive with it)."""
    t = Tensor.__new__(Tensor)
    t.shape, t.dtype = (ctypes.sizeof(buffer) // dtype.itemsize,), dtype
    t.is_cuda, t._free = False, None
    t._buf, t._p = buffer, ctypes.addressof(buffer)
    return t


def empty(size, dtype=float32, device=None):
    shape = _shape([size])
    return Tensor(shape, dtype, None, on_cuda=str(device or "cuda") != "cpu")


_rng = random.Random(0)


def manual_seed(s):
    _rng.seed(s)


def randint(low, high, size, dtype=uint8, device=None):
    shape = _shape([size])
    return Tensor(shape, dtype, _rng.randbytes(_prod(shape) * dtype.itemsize))


def randn(*size, device=None):
    shape = _shape(size)
    return Tensor(shape, float32, _rng.randbytes(_prod(shape) * 4))


def equal(a, b):
    return a.shape == b.shape and a.bytes() == b.bytes()


def no_grad():
    return contextlib.nullcontext()


def get_device_module():
    return cuda


# ---- torch.nn ----------------------------------------------------------------------------------
class _Linear:
    def __init__(self, n_in, n_out):
        self.n_in, self.n_out = n_in, n_out
        self.params = []

    def to(self, dev):
        self.params = [randn(self.n_out, self.n_in), randn(self.n_out)]
        return self

    def __call__(self, x):
        return _op("linear", [x] + self.params, (x.shape[0], self.n_out))


class _GELU:
    params = []

    def to(self, dev):
        return self

    def __call__(self, x):
        return _op("gelu", [x], x.shape)


class _Sequential:
    def __init__(self, *mods):
        self.mods = list(mods)

    def to(self, dev):
        for m in self.mods:
            m.to(dev)
        return self

    def eval(self):
        return self

    def parameters(self):
        return [p for m in self.mods for p in m.params]

    def __call__(self, x):
        for m in self.mods:
            x = m(x)
        return x


class nn:  # noqa: N801 (torch.nn)
    Linear = _Linear
    GELU = _GELU
    Sequential = _Sequential


class backends:  # noqa: N801
    class cuda:  # noqa: N801
        class matmul:  # noqa: N801
            allow_tf32 = True


# ---- torch.cuda --------------------------------------------------------------------------------
_capturing = []


class _Stream:
    def wait_stream(self, other):
        pass


class _PluggableAllocator:
    """CUDAPluggableAllocator: the library's functions through ctypes, as PyTorch loads them."""

    def __init__(self, path, alloc_fn, free_fn):
        lib = ctypes.CDLL(path)
        self._alloc = getattr(lib, alloc_fn)
        self._alloc.restype = ctypes.c_void_p
        self._alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._free = getattr(lib, free_fn)
        self._free.restype = None
        self._free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

    def allocator(self):
        return self

    def alloc(self, n, dev, stream):
        return self._alloc(n, dev, stream)

    def free(self, p, n, dev, stream):
        self._free(p, n, dev, stream)


class _MemPool:
    def __init__(self, allocator=None):
        self.allocator = allocator


class _CUDAGraph:
    def __init__(self):
        self.ops = []

    def replay(self):
        for run in self.ops:
            run()


class cuda:  # noqa: N801
    Stream = _Stream
    MemPool = _MemPool
    CUDAGraph = _CUDAGraph

    class memory:  # noqa: N801
        CUDAPluggableAllocator = _PluggableAllocator

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def current_device():
        return 0

    @staticmethod
    def synchronize(device=None):
        pass

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def mem_get_info(device=None):
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        assert _cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
        return free.value, total.value

    @staticmethod
    def current_stream():
        return _Stream()

    @staticmethod
    @contextlib.contextmanager
    def stream(s):
        yield

    @staticmethod
    @contextlib.contextmanager
    def use_mem_pool(pool):
        _pools().append(pool)
        try:
            yield
        finally:
            _pools().pop()

    @staticmethod
    @contextlib.contextmanager
    def graph(g, pool=None, stream=None, capture_error_mode="global"):
        _capturing.append(g.ops)
        try:
            yield
        finally:
            _capturing.pop()
