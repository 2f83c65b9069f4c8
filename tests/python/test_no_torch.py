"""vmmhook in a Python without PyTorch (issue 37, item 9), on the simulated driver with the
library preloaded: the torch_memory_saver drop-in (vmmhook.torch_memory_saver, vmmhook's
TorchMemorySaver) and torch_allocator() say that they need PyTorch and that the rest of vmmhook
works without it, instead of Python's bare "No module named 'torch'"; and the rest does work.

PyTorch is made absent in this process whether it is installed or not: an import hook, first
on sys.meta_path, answers every import of torch as Python does for a module that is not
installed. A second hook plays a PyTorch that is installed but broken (one of its own imports
missing): that error passes through unchanged, since "install PyTorch" would be wrong there.
"""

import importlib.abc
import sys
import unittest

import vmmhook  # noqa: E402 (PYTHONPATH set by meson)
from simdriver import MiB, FakeDriver


class _Absent(importlib.abc.MetaPathFinder):
    """`import torch` fails as for a module not installed; `missing` names the module reported
    missing ("torch" itself, or one PyTorch's own import needs)."""

    def __init__(self, missing="torch"):
        self.missing = missing

    def find_spec(self, fullname, path, target=None):
        if fullname == "torch" or fullname.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {self.missing!r}", name=self.missing)
        return None


class NoTorch(unittest.TestCase):
    def setUp(self):
        self.saved = sys.modules.pop("torch", None)
        self.finder = _Absent()
        sys.meta_path.insert(0, self.finder)

    def tearDown(self):
        sys.meta_path.remove(self.finder)
        if self.saved is not None:
            sys.modules["torch"] = self.saved

    def assert_clear(self, e, what):
        text = str(e.exception)
        self.assertEqual(e.exception.name, "torch")
        self.assertIn(what, text)
        self.assertIn("needs PyTorch", text)
        self.assertIn("pip install torch", text)
        self.assertIn("The rest of vmmhook", text)
        self.assertIn("works without PyTorch", text)
        # Not chained to the bare error: the message stands alone.
        self.assertIsNone(e.exception.__cause__)
        self.assertTrue(e.exception.__suppress_context__)

    def test_the_drop_in_imports(self):
        # Importing the drop-in needs no PyTorch (TMS's users import it at the top).
        from vmmhook import TorchMemorySaver, torch_memory_saver  # noqa: F401

        self.assertTrue(torch_memory_saver.enabled)
        self.assertEqual(torch_memory_saver.hook_mode, "preload")

    def test_region_says_pytorch_is_needed(self):
        tms = vmmhook.TorchMemorySaver()
        with self.assertRaises(ModuleNotFoundError) as e:
            with tms.region(tag="kv"):
                pass
        self.assert_clear(e, "torch_memory_saver drop-in")

    def test_pause_and_resume_say_pytorch_is_needed(self):
        for call in ("pause", "resume"):
            with self.subTest(call=call):
                with self.assertRaises(ModuleNotFoundError) as e:
                    getattr(vmmhook.TorchMemorySaver(), call)("kv")
                self.assert_clear(e, "torch_memory_saver drop-in")

    def test_torch_allocator_says_pytorch_is_needed(self):
        with self.assertRaises(ModuleNotFoundError) as e:
            vmmhook.torch_allocator()
        self.assert_clear(e, "vmmhook.torch_allocator()")

    def test_the_rest_works(self):
        self.assertTrue(vmmhook.available())
        drv = FakeDriver()
        with vmmhook.tag("notorch"):
            p = drv.alloc(8 * MiB)
        self.assertEqual(vmmhook.stats()["tags"]["notorch"]["requested"], 8 * MiB)
        vmmhook.pause("notorch")
        self.assertEqual(vmmhook.stats()["tags"]["notorch"]["state"], "paused")
        vmmhook.resume("notorch")
        self.assertEqual(vmmhook.stats()["tags"]["notorch"]["state"], "running")
        self.assertIn("allocated_bytes.all.current", vmmhook.memory_stats())
        drv.free(p)
        self.assertNotIn("torch", sys.modules)


class BrokenTorch(unittest.TestCase):
    """PyTorch installed but one of its imports missing: that error, as Python raised it."""

    def setUp(self):
        self.saved = sys.modules.pop("torch", None)
        self.finder = _Absent(missing="sympy")
        sys.meta_path.insert(0, self.finder)

    def tearDown(self):
        sys.meta_path.remove(self.finder)
        if self.saved is not None:
            sys.modules["torch"] = self.saved

    def test_other_missing_module_passes_through(self):
        with self.assertRaises(ModuleNotFoundError) as e:
            with vmmhook.TorchMemorySaver().region(tag="kv"):
                pass
        self.assertEqual(e.exception.name, "sympy")
        self.assertNotIn("needs PyTorch", str(e.exception))


def main():
    loader = unittest.TestLoader()
    suite = unittest.TestSuite(loader.loadTestsFromTestCase(c) for c in (NoTorch, BrokenTorch))
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    sys.exit(0 if result.wasSuccessful() and result.testsRun > 0 else 1)


if __name__ == "__main__":
    main()
