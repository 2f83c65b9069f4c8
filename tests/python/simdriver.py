"""The fake libcuda.so.1 of tests/sim through ctypes, for the Python tests (on
LD_LIBRARY_PATH, set by meson)."""

import ctypes

MiB = 1 << 20


class FakeDriver:
    """The fake libcuda.so.1 through ctypes: the same look-ups cudart makes, so that the
    preloaded library's dlsym hook answers for the allocation entry points."""

    def __init__(self):
        self.cu = ctypes.CDLL("libcuda.so.1")
        for name, args in [
            ("cuInit", [ctypes.c_uint]),
            ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]),
            ("cuCtxSetCurrent", [ctypes.c_void_p]),
            ("cuMemAlloc_v2", [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]),
            ("cuMemFree_v2", [ctypes.c_uint64]),
            ("cuMemGetInfo_v2", [ctypes.POINTER(ctypes.c_size_t)] * 2),
            ("sim_write", [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]),
            ("sim_read", [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]),
        ]:
            fn = getattr(self.cu, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
        self.cu.sim_is_mapped.argtypes = [ctypes.c_uint64]
        self.cu.sim_is_mapped.restype = ctypes.c_bool
        self.cu.sim_is_reserved.argtypes = [ctypes.c_uint64]
        self.cu.sim_is_reserved.restype = ctypes.c_bool
        self.cu.sim_device_used.argtypes = [ctypes.c_int]
        self.cu.sim_device_used.restype = ctypes.c_size_t
        assert self.cu.cuInit(0) == 0
        ctx = ctypes.c_void_p()
        assert self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        assert self.cu.cuCtxSetCurrent(ctx) == 0

    def alloc(self, size):
        p = ctypes.c_uint64()
        rc = self.cu.cuMemAlloc_v2(ctypes.byref(p), size)
        assert rc == 0, f"cuMemAlloc_v2({size}) -> {rc}"
        return p.value

    def free(self, p):
        assert self.cu.cuMemFree_v2(p) == 0

    def write(self, p, data):
        assert self.cu.sim_write(p, data, len(data)) == 0

    def read(self, p, n):
        buf = ctypes.create_string_buffer(n)
        rc = self.cu.sim_read(buf, p, n)
        return buf.raw if rc == 0 else None

    def mapped(self, p):
        return self.cu.sim_is_mapped(p)
