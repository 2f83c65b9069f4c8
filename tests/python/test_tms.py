"""The torch_memory_saver drop-in (vmmhook.torch_memory_saver) on the simulated driver, without
PyTorch: a stand-in adapter plays PyTorch's part (pools, graphs, CPU tensors), and "tensors" are
buffers allocated through the fake libcuda.so.1, which the preloaded library serves in the tag
the region pushed. What TMS's users rely on: addresses kept, the memory back to the driver while
paused, contents after a backed-up pause, nested regions, several tags, pause(None) pausing
every region's tag and nothing else. The PyTorch half (tensors, CUDA graphs, hook_mode "torch")
is tests/gpu/torch_tms.py, on a GPU.

Run by meson test in one of two modes (argv[1]):
  preloaded  LD_PRELOAD=libvmmhook.so, the fake driver on LD_LIBRARY_PATH
  loaded     LIBVMMHOOK names the library, nothing preloaded: "preload" mode must refuse
"""

import contextlib
import ctypes
import sys
import unittest

import vmmhook  # noqa: E402 (PYTHONPATH set by meson)
from vmmhook import TorchMemorySaver
from simdriver import MiB, FakeDriver

MODE = sys.argv[1] if len(sys.argv) > 1 else "preloaded"


class FakeTorch:
    """The adapter's interface (vmmhook._tms._Torch) with PyTorch left out. A "tensor" is a
    (device address, nbytes) pair."""

    def __init__(self):
        self.pools = []       # (allocator) of each pool made
        self.used = []        # the pools entered, in order
        self.graphs = []
        self.allocator_path = None

    def check_environment(self):
        pass

    def pluggable_allocator(self, path):
        self.allocator_path = path
        return "vmm-allocator"

    def current_device(self):
        return 0

    def mem_get_info(self):
        return device_free(FakeDriver()), 0

    def mem_pool(self, allocator):
        self.pools.append(allocator)
        return len(self.pools) - 1

    @contextlib.contextmanager
    def use_mem_pool(self, pool):
        self.used.append(pool)
        yield

    @contextlib.contextmanager
    def graph(self, cuda_graph, pool, stream, capture_error_mode):
        self.graphs.append((cuda_graph, pool, stream, capture_error_mode))
        yield

    def cpu_backup(self, x, backup_of):
        address, nbytes = x
        return backup_of(address, nbytes)

    def host_tensor(self, x, host, zero_copy):
        """A copy: the bytes; zero_copy: (host address, the bytes there now)."""
        data = ctypes.string_at(host, x[1])
        return (host, data) if zero_copy else data


def tag_of(name):
    return vmmhook.stats()["tags"].get(name)


def pinned():
    """Pinned host memory kept for backups (process-wide)."""
    return vmmhook.memory_stats()["pinned_host_bytes.current"]


def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def device_free(drv):
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    assert drv.cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
    return free.value


class Preloaded(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.drv = FakeDriver()

    def setUp(self):
        self.torch = FakeTorch()
        self.tms = TorchMemorySaver(torch_adapter=self.torch)

    def test_names_and_defaults(self):
        from vmmhook import torch_memory_saver

        self.assertIsInstance(torch_memory_saver, TorchMemorySaver)
        self.assertTrue(torch_memory_saver.enabled)
        self.assertEqual(torch_memory_saver.hook_mode, "preload")  # TMS's default
        for name in ("region", "pause", "resume", "cuda_graph", "disable", "get_cpu_backup"):
            self.assertTrue(callable(getattr(torch_memory_saver, name)), name)
        self.assertFalse(torch_memory_saver.retain_cpu_backup)  # TMS_RETAIN_CPU_BACKUP unset
        self.tms.retain_cpu_backup = True
        self.assertTrue(self.tms.retain_cpu_backup)
        with self.assertRaises(NotImplementedError):
            self.tms.memory_margin_bytes  # noqa: B018 (TMS: "Only setter is supported")
        with self.assertRaises(ValueError):
            self.tms.hook_mode = "other"
        with self.assertRaises(ValueError):
            with self.tms.region(cpu_backup_backend="mmap"):  # needs enable_cpu_backup, as TMS
                pass
        with self.assertRaises(ValueError):
            with self.tms.region(enable_cpu_backup=True, cpu_backup_backend="other"):
                pass
        with self.assertRaises(AssertionError):  # as TMS: one kind of backup a region
            with self.tms.region(enable_cpu_backup=True, enable_disk_backup=True):
                pass
        with self.assertRaises(ValueError):
            with self.tms.region(tag="x" * 23):  # 22 bytes at most under the library
                pass
        with self.tms.region(tag="x" * 22, enable_cpu_backup=True, cpu_backup_backend="mmap"):
            pass

    def test_addresses_kept_memory_given_back(self):
        drv = self.drv
        with self.tms.region(tag="kv"):
            bufs = [drv.alloc(40 * MiB) for _ in range(8)]
        self.assertEqual(self.torch.used, [0])  # a pool of its own, as TMS
        self.assertEqual(tag_of("tms:kv")["requested"], 8 * 40 * MiB)
        used = drv.cu.sim_device_used(0)
        self.tms.pause("kv")
        freed = used - drv.cu.sim_device_used(0)
        self.assertGreater(freed, 0.9 * 8 * 40 * MiB)  # TMS's simple.py: > 90% back
        for b in bufs:
            self.assertFalse(drv.mapped(b))
            self.assertTrue(drv.cu.sim_is_reserved(b))  # nobody else gets the address
        self.tms.resume("kv")
        for b in bufs:
            self.assertTrue(drv.mapped(b))  # the same address, memory again
        self.assertGreater(drv.cu.sim_device_used(0), used - 0.1 * 8 * 40 * MiB)
        for b in bufs:
            drv.free(b)

    def test_cpu_backup_contents(self):
        drv = self.drv
        with self.tms.region(tag="w", enable_cpu_backup=True):
            big = drv.alloc(24 * MiB)
            small = drv.alloc(5000)
        with self.tms.region(tag="w-nobackup"):
            other = drv.alloc(8 * MiB)
        pattern = bytes((i * 13 + 1) & 255 for i in range(8192))
        drv.write(big + 20 * MiB, pattern)
        drv.write(small, pattern[:5000])
        self.assertIsNone(self.tms.get_cpu_backup((big, 16)))  # running: None, as TMS
        self.tms.pause()
        self.assertEqual(tag_of("tms+cpu:w")["state"], "paused")
        self.assertGreaterEqual(tag_of("tms+cpu:w")["backed_up"], 24 * MiB)
        self.assertEqual(tag_of("tms:w-nobackup")["backed_up"], 0)
        self.assertEqual(self.tms.get_cpu_backup((big + 20 * MiB, 8192)), pattern)
        self.assertEqual(self.tms.get_cpu_backup((small, 5000)), pattern[:5000])
        self.assertIsNone(self.tms.get_cpu_backup((other, 16)))  # paused without backup
        # The device is free for others meanwhile: allocate and write where the tag was.
        squatter = drv.alloc(32 * MiB)
        drv.write(squatter, b"\xff" * 4096)
        drv.free(squatter)
        self.tms.resume()
        self.assertEqual(drv.read(big + 20 * MiB, 8192), pattern)
        self.assertEqual(drv.read(small, 5000), pattern[:5000])
        self.assertIsNone(self.tms.get_cpu_backup((big, 16)))  # resumed: None, as TMS
        for b in (big, small, other):
            drv.free(b)

    def test_nested_regions_and_tags(self):
        # TMS's nested_region.py: an outer region with backup, an inner one without; the
        # innermost decides, and leaving it restores the outer one.
        drv = self.drv
        outside = drv.alloc(4 * MiB)
        with self.tms.region(tag="model", enable_cpu_backup=True):
            weight = drv.alloc(6 * MiB)
            with self.tms.region(tag="grad", enable_cpu_backup=False):
                grad = drv.alloc(6 * MiB)
                with self.tms.disable():
                    plain = drv.alloc(2 * MiB)  # not the region's: never paused
            extra = drv.alloc(3 * MiB)
        self.assertEqual(tag_of("tms+cpu:model")["requested"], 9 * MiB)
        self.assertEqual(tag_of("tms:grad")["requested"], 6 * MiB)
        drv.write(weight, b"w" * 4096)
        drv.write(extra, b"x" * 4096)

        self.tms.pause("grad")  # one tag alone
        self.assertFalse(drv.mapped(grad))
        self.assertTrue(drv.mapped(weight))
        with self.assertRaises(vmmhook.VmmError) as e:
            self.tms.pause("grad")  # paused already (TMS would exit the process)
        self.assertEqual(e.exception.status, vmmhook.ERR_PAUSED)
        self.tms.pause()  # None: every region's tag still running; "grad" skipped
        for b in (weight, extra):
            self.assertFalse(drv.mapped(b))
        for b in (outside, plain):
            self.assertTrue(drv.mapped(b))  # memory outside regions is never paused
        self.tms.resume("model")
        self.assertEqual(drv.read(weight, 4096), b"w" * 4096)
        self.assertEqual(drv.read(extra, 4096), b"x" * 4096)
        self.assertFalse(drv.mapped(grad))
        with self.assertRaises(vmmhook.VmmError) as e:
            self.tms.resume("model")
        self.assertEqual(e.exception.status, vmmhook.ERR_NOT_PAUSED)
        self.tms.resume()  # None: the paused ones ("grad")
        self.assertTrue(drv.mapped(grad))
        self.tms.pause("never-used")  # a tag never used: nothing to do, as TMS
        self.tms.resume("never-used")
        for b in (outside, weight, grad, plain, extra):
            drv.free(b)

    def test_one_tag_with_and_without_backup(self):
        # TMS decides backup per allocation: one tag, both kinds; pause(tag) takes both.
        drv = self.drv
        with self.tms.region(tag="mixed", enable_cpu_backup=True):
            kept = drv.alloc(5 * MiB)
        with self.tms.region(tag="mixed"):
            dropped = drv.alloc(5 * MiB)
        self.assertEqual(len(self.torch.pools), 2)  # a pool per (tag, backup, device)
        drv.write(kept, b"k" * 1000)
        self.tms.pause("mixed")
        self.assertFalse(drv.mapped(kept))
        self.assertFalse(drv.mapped(dropped))
        self.tms.resume("mixed")
        self.assertEqual(drv.read(kept, 1000), b"k" * 1000)
        drv.free(kept)
        drv.free(dropped)

    def test_cuda_graph_tag(self):
        drv = self.drv
        with self.tms.cuda_graph("graph-object", tag="graph", capture_error_mode="relaxed"):
            inter = drv.alloc(10 * MiB)  # what a capture allocates
        self.assertEqual(self.torch.graphs, [("graph-object", None, None, "relaxed")])
        self.assertEqual(tag_of("tms:graph")["requested"], 10 * MiB)
        self.tms.pause("graph")
        self.assertFalse(drv.mapped(inter))
        self.tms.resume("graph")
        self.assertTrue(drv.mapped(inter))
        drv.free(inter)

    # ---- TMS's settings: retain_cpu_backup, backends, disk backup, margin ----

    def backed_up_region(self, tag, size=64 * MiB, **kwargs):
        with self.tms.region(tag=tag, **kwargs):
            buf = self.drv.alloc(size)
        seed = bytes((i * 7 + len(tag)) & 255 for i in range(251))  # 251: no 2^k period
        pattern = (seed * (size // 251 + 1))[:size]
        self.drv.write(buf, pattern)
        return buf, pattern

    def test_retain_cpu_backup(self):
        # Not retained (TMS's default): after the resume no pinned host memory is left and the
        # process's resident memory is back within 64 MiB of before the pause (the backup,
        # 128 MiB, went; the simulated device's memory is the process's too, and is back).
        # Retained: the pinned backup stays, resident, and the next cycle reuses it.
        buf, pattern = self.backed_up_region("r", size=128 * MiB, enable_cpu_backup=True)
        for _ in range(2):
            before = rss()
            self.tms.pause("r")
            self.assertEqual(tag_of("tms+cpu:r")["backed_up"], 128 * MiB)
            self.tms.resume("r")
            self.assertEqual(self.drv.read(buf, len(pattern)), pattern)
            self.assertEqual(pinned(), 0)
            self.assertLess(abs(rss() - before), 64 * MiB)
        # Retained at the resume (TMS): the backup stays attached to the running buffer, at the
        # same host address, resident; setting retain False meanwhile drops nothing; the next
        # pause writes the fresh bytes into the same memory; a resume without retain gives it
        # back.
        self.tms.retain_cpu_backup = True
        before = rss()
        self.tms.pause("r")
        host, data = self.tms.get_cpu_backup((buf, 4096), zero_copy=True)
        self.assertEqual(data, pattern[:4096])
        self.tms.resume("r")
        self.assertEqual(self.drv.read(buf, len(pattern)), pattern)
        self.assertEqual(self.tms.get_cpu_backup((buf, 4096), zero_copy=True),
                         (host, pattern[:4096]))
        self.assertGreater(rss(), before + 100 * MiB)  # held (pinned when the host has room)
        self.tms.retain_cpu_backup = False
        self.assertEqual(self.tms.get_cpu_backup((buf + 4096, 100)), pattern[4096:4196])
        fresh = pattern[1:] + pattern[:1]
        self.drv.write(buf, fresh)
        self.tms.pause("r")
        self.assertEqual(self.tms.get_cpu_backup((buf, 4096), zero_copy=True), (host, fresh[:4096]))
        self.tms.resume("r")  # not retained now: given back
        self.assertIsNone(self.tms.get_cpu_backup((buf, 16)))
        self.assertEqual(self.drv.read(buf, len(fresh)), fresh)
        self.assertEqual(pinned(), 0)
        # Freed while retained: the backup leaves the buffer with it. (Pinned, it goes to the
        # library's free pool, given back at the next resume without retain: not at the free
        # as in TMS, docs/PYTORCH.md.)
        self.tms.retain_cpu_backup = True
        self.tms.pause("r")
        self.tms.resume("r")
        self.assertIsNotNone(self.tms.get_cpu_backup((buf, 16)))
        self.assertEqual(vmmhook.backup_trim(), 0)  # attached: not free
        held = pinned()  # the retained backup's, when the host's budget let it be pinned
        self.drv.free(buf)
        self.assertEqual(vmmhook.backup_trim(), held)
        self.assertEqual(pinned(), 0)
        self.tms.retain_cpu_backup = False

    def test_tms_internals_for_its_tests(self):
        # The private names TMS's examples reach (_Internals): pools by TMS's key, the region
        # configuration as a context manager.
        with self.tms.region(tag="i", enable_cpu_backup=True):
            pass
        impl = self.tms._impl
        self.assertIn(("i", True, False, "pinned", 0), impl._mem_pools)
        with impl._with_region_config(tag="i", enable_cpu_backup=True, cpu_backup_backend="mmap"):
            b = self.drv.alloc(MiB)
        self.assertEqual(tag_of("tms+mmap:i")["requested"], MiB)
        self.drv.free(b)

    def test_backends(self):
        # "pinned" (TMS's default): the backup is pinned during the pause; "mmap": never
        # pinned (reclaimable), and resident only while paused. Both restore the contents.
        pin, pin_pattern = self.backed_up_region("bp", enable_cpu_backup=True,
                                                 cpu_backup_backend="pinned")
        mm, mm_pattern = self.backed_up_region("bm", enable_cpu_backup=True,
                                               cpu_backup_backend="mmap")
        self.assertIsNotNone(tag_of("tms+cpu:bp"))
        self.assertIsNotNone(tag_of("tms+mmap:bm"))
        self.tms.pause("bm")
        self.assertEqual(pinned(), 0)
        self.assertEqual(tag_of("tms+mmap:bm")["backed_up"], 64 * MiB)
        self.assertEqual(self.tms.get_cpu_backup((mm + 100, 1000)), mm_pattern[100:1100])
        self.tms.pause("bp")
        self.assertGreaterEqual(pinned(), 64 * MiB)
        self.tms.resume()
        self.assertEqual(self.drv.read(pin, len(pin_pattern)), pin_pattern)
        self.assertEqual(self.drv.read(mm, len(mm_pattern)), mm_pattern)
        self.assertEqual(pinned(), 0)
        self.drv.free(pin)
        self.drv.free(mm)

    def test_disk_backup(self):
        import os
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            self.tms.set_disk_backup_dir(os.path.join(d, "made"))  # created, as TMS
            big, big_pattern = self.backed_up_region("dk", size=24 * MiB,
                                                     enable_disk_backup=True)
            small, small_pattern = self.backed_up_region("dk", size=7, enable_disk_backup=True)
            sizes = set()
            for _ in range(3):
                rss0 = rss()
                self.tms.pause("dk")
                files = os.listdir(os.path.join(d, "made"))
                total = sum(os.path.getsize(os.path.join(d, "made", f)) for f in files)
                self.assertGreaterEqual(len(files), 2)  # a file per paused buffer
                self.assertGreaterEqual(total, 24 * MiB)
                sizes.add(total)
                self.assertLess(rss(), rss0 + 8 * MiB)  # the backup is not resident
                self.tms.resume("dk")
                self.assertEqual(os.listdir(os.path.join(d, "made")), [])  # removed after
                self.assertEqual(self.drv.read(big, len(big_pattern)), big_pattern)
                self.assertEqual(self.drv.read(small, 7), small_pattern)
            self.assertEqual(len(sizes), 1)  # as TMS's disk_backup.py: constant on disk
            self.drv.free(big)
            self.drv.free(small)
            self.tms.set_disk_backup_dir(d)  # a directory that stays for the later tests

    def test_memory_margin(self):
        buf, pattern = self.backed_up_region("m", size=64 * MiB, enable_cpu_backup=True)
        self.tms.pause("m")
        free = device_free(self.drv)
        self.tms.memory_margin_bytes = free - 32 * MiB  # 64 MiB more would leave less
        with self.assertRaises(vmmhook.VmmError) as e:
            self.tms.resume("m")
        self.assertEqual(e.exception.status, vmmhook.ERR_NO_MEMORY)
        self.assertEqual(tag_of("tms+cpu:m")["state"], "paused")  # nothing done
        self.tms.memory_margin_bytes = free - 96 * MiB
        self.tms.resume("m")
        self.assertEqual(self.drv.read(buf, len(pattern)), pattern)
        self.tms.memory_margin_bytes = 0
        self.drv.free(buf)

    def saver_with_env(self, **env):
        """A TorchMemorySaver made under TMS's environment switches (read at construction)."""
        import os

        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return TorchMemorySaver(torch_adapter=self.torch)
        finally:
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

    def test_environment_switches(self):
        tms = self.saver_with_env(TMS_RETAIN_CPU_BACKUP="1", TMS_INIT_CPU_BACKUP_BACKEND="mmap")
        self.assertTrue(tms.retain_cpu_backup)
        with tms.region(tag="e", enable_cpu_backup=True):  # the backend from the environment
            buf = self.drv.alloc(4 * MiB)
        self.assertEqual(tag_of("tms+mmap:e")["requested"], 4 * MiB)
        self.drv.free(buf)
        self.assertFalse(self.saver_with_env(TMS_RETAIN_CPU_BACKUP="NO").retain_cpu_backup)
        for bad in ({"TMS_RETAIN_CPU_BACKUP": "maybe"}, {"TMS_INIT_ENABLE": "2"},
                    {"TMS_INIT_CPU_BACKUP_BACKEND": "disk"}):
            tms = self.saver_with_env(**bad)  # made: `import vmmhook` must not fail
            with self.assertRaises(ValueError):  # at the first use (TMS exits the process)
                with tms.region():
                    pass

    def test_init_enable(self):
        # TMS_INIT_ENABLE=1 TMS_INIT_ENABLE_CPU_BACKUP=1 (TMS's training_engine.py): memory
        # allocated from the start, outside any region, is TMS tag "default"'s, with backup;
        # disable() still allocates memory that is never paused.
        tms = self.saver_with_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
        outside = self.drv.alloc(32 * MiB)
        pattern = bytes(range(256)) * 64
        self.drv.write(outside + 16 * MiB, pattern)
        with tms.region(tag="kv"):
            kv = self.drv.alloc(8 * MiB)
        used = self.drv.cu.sim_device_used(0)
        tms.pause()
        self.assertFalse(self.drv.mapped(outside))
        self.assertFalse(self.drv.mapped(kv))
        self.assertGreaterEqual(tag_of("default")["backed_up"], 32 * MiB)
        self.assertLess(self.drv.cu.sim_device_used(0), used - 36 * MiB)
        with tms.disable():
            plain = self.drv.alloc(4 * MiB)  # allowed while "default" is paused
        self.assertTrue(self.drv.mapped(plain))
        tms.resume()
        self.assertEqual(self.drv.read(outside + 16 * MiB, len(pattern)), pattern)
        tms.pause("default")  # the TMS tag of the memory from the start
        self.assertFalse(self.drv.mapped(outside))
        self.assertTrue(self.drv.mapped(kv))
        tms.resume("default")
        self.assertEqual(self.drv.read(outside + 16 * MiB, len(pattern)), pattern)
        for b in (outside, kv, plain):
            self.drv.free(b)
        # Without the switch "default" is never paused (the test above, nested regions).
        self.assertEqual(tag_of("default")["state"], "running")

    def test_configure_subprocess(self):
        import os
        import subprocess

        before = os.environ.get("LD_PRELOAD")
        with vmmhook.configure_subprocess():
            out = subprocess.run([sys.executable, "-c", "import os; print(os.environ['LD_PRELOAD'])"],
                                 capture_output=True, text=True, check=True).stdout.split()
            self.assertIn(vmmhook.library_path(), out)
            self.assertEqual(out.count(vmmhook.library_path()), 1)  # never twice
        self.assertEqual(os.environ.get("LD_PRELOAD"), before)

    def test_hook_mode_fixed_once_used(self):
        with self.tms.region(tag="fixed"):
            pass
        with self.assertRaises(RuntimeError):
            self.tms.hook_mode = "torch"

    def test_torch_mode_pools(self):
        # hook_mode "torch": each region's pool allocates with the library's
        # vmm_torch_alloc / vmm_torch_free (a CUDAPluggableAllocator of library_path()).
        tms = TorchMemorySaver(torch_adapter=self.torch)
        tms.hook_mode = "torch"
        with tms.region(tag="t"):
            with tms.disable():
                pass
        self.assertEqual(self.torch.allocator_path, vmmhook.library_path())
        self.assertEqual(self.torch.pools, ["vmm-allocator", None])
        with self.assertRaises(RuntimeError):
            with tms.cuda_graph("g"):  # as TMS: preload mode only
                pass


class Loaded(unittest.TestCase):
    def test_preload_mode_needs_preload(self):
        tms = TorchMemorySaver(torch_adapter=FakeTorch())
        with self.assertRaises(RuntimeError) as e:
            with tms.region():
                pass
        self.assertIn("python -m vmmhook", str(e.exception))
        tms = TorchMemorySaver(torch_adapter=FakeTorch())
        tms.hook_mode = "torch"  # nothing preloaded: the library as PyTorch's allocator
        with tms.region(tag="ok"):
            pass


def main():
    suites = {"preloaded": [Preloaded], "loaded": [Loaded]}[MODE]
    loader = unittest.TestLoader()
    suite = unittest.TestSuite(loader.loadTestsFromTestCase(c) for c in suites)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    sys.exit(0 if result.wasSuccessful() and result.testsRun > 0 else 1)


if __name__ == "__main__":
    main()
