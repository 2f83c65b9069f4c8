"""The vmmhook Python package against the simulated driver (no GPU).

Run by meson test in one of three modes (argv[1]):
  preloaded  LD_PRELOAD=libvmmhook.so, the fake libcuda.so.1 on LD_LIBRARY_PATH: allocations
             made through the fake driver are served by the library; tags, pause, resume and
             statistics are checked against the fake's own view (sim_is_mapped, sim_read).
  loaded     no preload, LIBVMMHOOK names the library: the package loads it itself.
  absent     neither: available() is False and the calls raise VmmError.
  badpath    LIBVMMHOOK names a missing file: the error names it and the loader's reason.
"""

import ctypes
import os
import sys
import types
import unittest

MODE = sys.argv[1] if len(sys.argv) > 1 else "preloaded"
LIBRARY = os.environ.get("VMH_PYTEST_LIBRARY", "")

import vmmhook  # noqa: E402 (PYTHONPATH set by meson)
from simdriver import MiB, FakeDriver  # noqa: E402



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

    def test_prefetch_codes(self):
        # Nothing spilled (VMMHOOK_OVERFLOW is off here): a served buffer is on the device
        # already; tests/unit/test_overflow.c moves spilled ones.
        drv = self.drv
        p = drv.alloc(4 * MiB)
        vmmhook.prefetch(p)
        vmmhook.prefetch_tag()
        drv.free(p)
        with self.assertRaises(vmmhook.VmmError) as e:
            vmmhook.prefetch(p)  # freed: nobody's
        self.assertEqual(e.exception.status, 2)  # VMM_ERR_FOREIGN
        with self.assertRaises(vmmhook.VmmError) as e:
            vmmhook.prefetch_tag("never-pushed")
        self.assertEqual(e.exception.status, vmmhook.ERR_UNKNOWN_TAG)


class Stats(unittest.TestCase):
    """memory_stats(): PyTorch's names over the library's figures; vmm_backup_read."""

    @classmethod
    def setUpClass(cls):
        cls.drv = FakeDriver()

    def test_process_wide(self):
        drv = self.drv
        before = vmmhook.memory_stats()
        with vmmhook.tag("st-a"):
            a = drv.alloc(6 * MiB)
            b = drv.alloc(1000)
        s = vmmhook.memory_stats()
        raw = vmmhook.stats()
        self.assertEqual(s["allocated_bytes.all.current"],
                         raw["gauges"]["bytes_requested"]["current"])
        self.assertEqual(s["allocated_bytes.all.current"] - before["allocated_bytes.all.current"],
                         6 * MiB + 1000)
        self.assertGreaterEqual(s["allocated_bytes.all.peak"], s["allocated_bytes.all.current"])
        self.assertEqual(s["requested_bytes.all.current"], s["allocated_bytes.all.current"])
        self.assertEqual(s["reserved_bytes.all.current"], raw["gauges"]["bytes_mapped"]["current"])
        self.assertGreaterEqual(s["reserved_bytes.all.current"], 6 * MiB + 1000)
        self.assertEqual(s["allocation.all.current"] - before["allocation.all.current"], 2)
        self.assertEqual(s["allocation.all.allocated"] - s["allocation.all.freed"],
                         s["allocation.all.current"])
        for key in ("num_alloc_retries", "num_ooms", "num_sync_all_streams",
                    "cached_bytes.current", "pinned_host_bytes.current",
                    "tag.paused", "tag.backed_up", "tag.pauses", "tag.running_tags"):
            self.assertIn(key, s)

        # A refused allocation (its tag is paused) is an out-of-memory error of the program:
        # num_ooms, as torch.cuda.memory_stats() counts them.
        vmmhook.pause("st-a", backup=True)
        with vmmhook.tag("st-a"):
            p = ctypes.c_uint64()
            self.assertNotEqual(drv.cu.cuMemAlloc_v2(ctypes.byref(p), 4 * MiB), 0)
        after = vmmhook.memory_stats()
        self.assertEqual(after["num_ooms"], s["num_ooms"] + 1)
        self.assertGreaterEqual(after["tag.paused"] - s["tag.paused"], 6 * MiB)
        self.assertGreaterEqual(after["tag.paused_tags"], 1)
        vmmhook.resume("st-a")
        drv.free(a)
        drv.free(b)

    def test_one_tag(self):
        drv = self.drv
        with vmmhook.tag("st-b"):
            a = drv.alloc(4 * MiB)
        t = vmmhook.memory_stats("st-b")
        self.assertEqual(t["allocated_bytes.all.current"], 4 * MiB)
        self.assertEqual(t["allocated_bytes.all.peak"], 4 * MiB)
        self.assertGreaterEqual(t["reserved_bytes.all.current"], 4 * MiB)
        self.assertEqual(t["tag.state"], "running")
        vmmhook.pause("st-b")
        t = vmmhook.memory_stats("st-b")
        self.assertEqual(t["tag.state"], "paused")
        self.assertEqual(t["reserved_bytes.all.current"], 0)  # given back to the driver
        self.assertGreaterEqual(t["tag.paused"], 4 * MiB)
        self.assertEqual(t["tag.backed_up"], 0)
        self.assertEqual(t["tag.pauses"], 1)
        vmmhook.resume("st-b")
        self.assertEqual(vmmhook.memory_stats("st-b")["tag.resumes"], 1)
        drv.free(a)
        self.assertEqual(vmmhook.memory_stats("st-b")["allocated_bytes.all.current"], 0)
        self.assertEqual(vmmhook.memory_stats("st-b")["allocated_bytes.all.peak"], 4 * MiB)
        with self.assertRaises(KeyError):
            vmmhook.memory_stats("never-pushed")

    def test_backup_read(self):
        drv = self.drv
        lib = vmmhook._load()
        with vmmhook.tag("st-c"):
            big = drv.alloc(5 * MiB)
            small = drv.alloc(3000)
        pattern = bytes((i * 7) & 255 for i in range(4096))
        drv.write(big + MiB, pattern)
        drv.write(small, pattern[:3000])
        buf = ctypes.create_string_buffer(4096)

        def read(p, n):
            return lib.vmm_backup_read(ctypes.c_void_p(p), buf, n)

        self.assertEqual(read(big, 16), vmmhook.ERR_NOT_PAUSED)  # running
        vmmhook.pause("st-c", backup=True)
        self.assertEqual(read(big + MiB, 4096), vmmhook.OK)
        self.assertEqual(buf.raw, pattern)
        self.assertEqual(read(small + 100, 2900), vmmhook.OK)  # inside a packed buffer
        self.assertEqual(buf.raw[:2900], pattern[100:3000])
        self.assertEqual(read(small + 100, 2901), 1)  # past its end: VMM_ERR_INVALID
        self.assertEqual(read(0x10, 16), 2)           # not served: VMM_ERR_FOREIGN
        vmmhook.resume("st-c")
        self.assertEqual(read(big, 16), vmmhook.ERR_NOT_PAUSED)
        vmmhook.pause("st-c")  # no backup: nothing to read
        self.assertEqual(read(big, 16), vmmhook.ERR_NOT_PAUSED)
        vmmhook.resume("st-c")
        drv.free(big)
        drv.free(small)


class BadPath(unittest.TestCase):
    """LIBVMMHOOK names a file that cannot be loaded: the error says which, and why."""

    def test_error_names_path_and_reason(self):
        path = os.environ["LIBVMMHOOK"]
        self.assertEqual(vmmhook.library_path(), path)  # the override, as given
        self.assertFalse(vmmhook.available())
        with self.assertRaises(vmmhook.VmmError) as e:
            vmmhook.stats()
        text = str(e.exception)
        self.assertIn(path, text)
        self.assertIn("$LIBVMMHOOK", text)
        self.assertIn("cannot open shared object file", text)  # the loader's own message


class Absent(unittest.TestCase):
    def test_not_available(self):
        self.assertFalse(vmmhook.available())
        self.assertIsNone(vmmhook.library_path())
        with self.assertRaises(vmmhook.VmmError):
            vmmhook.stats()
        with self.assertRaises(vmmhook.VmmError):
            vmmhook.pause()
        with self.assertRaises(vmmhook.VmmError) as e:
            with vmmhook.tag("x"):
                pass
        self.assertIn("LIBVMMHOOK", str(e.exception))  # says how to fix it


def main():
    suites = {"preloaded": [Common, Preloaded, Stats], "loaded": [Common], "absent": [Absent],
              "badpath": [BadPath]}[MODE]
    loader = unittest.TestLoader()
    suite = unittest.TestSuite(loader.loadTestsFromTestCase(c) for c in suites)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    # A run that ran nothing must not pass.
    sys.exit(0 if result.wasSuccessful() and result.testsRun > 0 else 1)


if __name__ == "__main__":
    main()
