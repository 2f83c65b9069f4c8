"""The vmmhook Python package against the simulated driver (no GPU).

Run by meson test in one of three modes (argv[1]):
  preloaded  LD_PRELOAD=libvmmhook.so, the fake libcuda.so.1 on LD_LIBRARY_PATH: allocations
             made through the fake driver are served by the library; tags, pause, resume and
             statistics are checked against the fake's own view (sim_is_mapped, sim_read).
  loaded     no preload, LIBVMMHOOK names the library: the package loads it itself.
  absent     neither: available() is False and the calls raise VmmError.
"""

import ctypes
import os
import sys
import types
import unittest

MODE = sys.argv[1] if len(sys.argv) > 1 else "preloaded"
LIBRARY = os.environ.get("VMH_PYTEST_LIBRARY", "")

import vmmhook  # noqa: E402 (PYTHONPATH set by meson)

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


class Common(unittest.TestCase):
    def test_library_found(self):
        self.assertTrue(vmmhook.available())
        path = vmmhook.library_path()
        self.assertIsNotNone(path)
        self.assertEqual(os.path.realpath(path), os.path.realpath(LIBRARY))

    def test_tag_context(self):
        with vmmhook.tag("py-outer"):
            with vmmhook.tag("py-inner"):
                pass
        names = vmmhook.stats()["tags"]
        self.assertIn("py-outer", names)
        self.assertIn("py-inner", names)
        self.assertIn("default", names)

    def test_tag_errors(self):
        with self.assertRaises(vmmhook.VmmError) as e:
            with vmmhook.tag("x" * 40):
                pass
        self.assertEqual(e.exception.status, 1)  # VMM_ERR_INVALID
        with self.assertRaises(vmmhook.VmmError):
            with vmmhook.tag(""):
                pass

    def test_tag_popped_on_exception(self):
        # The block raises: the tag is still popped (the stack is balanced afterwards).
        with self.assertRaises(KeyError):
            with vmmhook.tag("py-raise"):
                raise KeyError("inside")
        lib = vmmhook._load()
        self.assertEqual(lib.vmm_tag_pop(), 1)  # empty stack: VMM_ERR_INVALID

    def test_stats_dict(self):
        s = vmmhook.stats()
        self.assertEqual(s["library"], "libvmmhook")
        self.assertIn("counters", s)
        self.assertIn("gauges", s)
        self.assertIn("pinned_host_bytes", s)
        for figures in s["tags"].values():
            for key in ("requested", "mapped", "paused", "backed_up", "pauses", "resumes",
                        "pause_ns", "resume_ns"):
                self.assertIn(key, figures)

    def test_unknown_tag(self):
        with self.assertRaises(vmmhook.VmmError) as e:
            vmmhook.pause("never-pushed")
        self.assertEqual(e.exception.status, vmmhook.ERR_UNKNOWN_TAG)
        with self.assertRaises(vmmhook.VmmError) as e:
            vmmhook.resume("never-pushed")
        self.assertEqual(e.exception.status, vmmhook.ERR_UNKNOWN_TAG)

    def test_torch_allocator(self):
        # A stand-in torch module records what the helper asks PyTorch for; torch is imported
        # only when the helper is called.
        calls = []
        fake = types.ModuleType("torch")
        fake.cuda = types.SimpleNamespace(memory=types.SimpleNamespace(
            CUDAPluggableAllocator=lambda *a: calls.append(a) or "allocator"))
        saved = sys.modules.get("torch")
        sys.modules["torch"] = fake
        try:
            self.assertEqual(vmmhook.torch_allocator(), "allocator")
        finally:
            if saved is None:
                del sys.modules["torch"]
            else:
                sys.modules["torch"] = saved
        self.assertEqual(len(calls), 1)
        path, alloc, free = calls[0]
        self.assertEqual(os.path.realpath(path), os.path.realpath(LIBRARY))
        self.assertEqual((alloc, free), ("vmm_torch_alloc", "vmm_torch_free"))
        lib = ctypes.CDLL(path)
        lib.vmm_torch_alloc  # noqa: B018 (the symbols PyTorch will look up exist)
        lib.vmm_torch_free  # noqa: B018


class Preloaded(unittest.TestCase):
    """Served allocations, through the preloaded library."""

    @classmethod
    def setUpClass(cls):
        cls.drv = FakeDriver()

    def test_preloaded_is_the_loaded_one(self):
        self.assertIsNotNone(vmmhook._preloaded())

    def test_pause_resume_with_backup(self):
        drv = self.drv
        with vmmhook.tag("py-weights"):
            big = drv.alloc(12 * MiB)
            small = drv.alloc(3000)
        with vmmhook.tag("py-cache"):
            cache = drv.alloc(10 * MiB)
        pattern = bytes(range(256)) * 16
        drv.write(big, pattern)
        drv.write(small, pattern[:3000])
        used = drv.cu.sim_device_used(0)

        vmmhook.pause("py-weights", backup=True)
        self.assertFalse(drv.mapped(big))
        self.assertFalse(drv.mapped(small))
        self.assertTrue(drv.cu.sim_is_reserved(big))  # the address is kept
        self.assertIsNone(drv.read(big, 16))          # touching it faults
        self.assertTrue(drv.mapped(cache))            # another tag is untouched
        self.assertLess(drv.cu.sim_device_used(0), used)
        figures = vmmhook.stats()["tags"]["py-weights"]
        self.assertEqual(figures["state"], "paused")
        self.assertGreaterEqual(figures["paused"], 12 * MiB)
        self.assertEqual(figures["backed_up"], figures["paused"])
        self.assertEqual(figures["mapped"], 0)
        self.assertEqual(figures["pauses"], 1)

        with self.assertRaises(vmmhook.VmmError) as e:
            vmmhook.pause("py-weights")
        self.assertEqual(e.exception.status, vmmhook.ERR_PAUSED)

        vmmhook.resume("py-weights")
        self.assertTrue(drv.mapped(big))
        self.assertEqual(drv.read(big, len(pattern)), pattern)
        self.assertEqual(drv.read(small, 3000), pattern[:3000])
        self.assertEqual(drv.cu.sim_device_used(0), used)
        with self.assertRaises(vmmhook.VmmError) as e:
            vmmhook.resume("py-weights")
        self.assertEqual(e.exception.status, vmmhook.ERR_NOT_PAUSED)

        # Everything at once, without backup; a free while paused is fine.
        vmmhook.pause()
        self.assertFalse(drv.mapped(cache))
        drv.free(cache)
        vmmhook.resume()
        self.assertFalse(drv.mapped(cache))
        self.assertTrue(drv.mapped(big))
        drv.free(big)
        drv.free(small)
        self.assertEqual(vmmhook.stats()["tags"]["py-weights"]["requested"], 0)


class Absent(unittest.TestCase):
    def test_not_available(self):
        self.assertFalse(vmmhook.available())
        self.assertIsNone(vmmhook.library_path())
        with self.assertRaises(vmmhook.VmmError):
            vmmhook.stats()
        with self.assertRaises(vmmhook.VmmError):
            vmmhook.pause()
        with self.assertRaises(vmmhook.VmmError):
            with vmmhook.tag("x"):
                pass


def main():
    suites = {"preloaded": [Common, Preloaded], "loaded": [Common], "absent": [Absent]}[MODE]
    loader = unittest.TestLoader()
    suite = unittest.TestSuite(loader.loadTestsFromTestCase(c) for c in suites)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    # A run that ran nothing must not pass.
    sys.exit(0 if result.wasSuccessful() and result.testsRun > 0 else 1)


if __name__ == "__main__":
    main()
