#!/usr/bin/env python3
"""torch_sleep: a PyTorch model put to sleep and woken through the hook's tags (issue 15).

Runs only under the hook (natively: exit 77). PyTorch's caching allocator stays on.
  1. The model's weights are allocated under tag "weights", a 1 GiB cache tensor under tag "kv".
  2. The forward pass (reads the weights, writes the cache, reads it back) is captured in a CUDA
     graph; the graph's replay and an eager forward are recorded (on the host).
  3. Both tags are paused: "weights" with backup, "kv" without.
  4. A second process (python3 with ctypes on libcuda.so.1, without the hook) allocates all it
     can on the GPU, writes it, and exits.
  5. Both tags are resumed; the graph is replayed and the eager forward run again: both must be
     bit-identical to step 2, and the weights' bytes unchanged.
The tag calls go through the package python/vmmhook when it is importable (with tag(...),
pause(tag, backup=...), resume(tag)), else straight through ctypes (vmm_tag_push, vmm_tag_pop,
vmm_pause, vmm_resume with VMM_PAUSE_BACKUP = 1).
Prints R lines (outcomes), "I ..." information and a final PASS/FAIL line. Exit 0 pass, 1 fail,
77 skip (no torch, no GPU, no hook).
"""
import contextlib
import ctypes
import json
import os
import subprocess
import sys
import time

VMM_PAUSE_BACKUP = 1  # issue 15's flag value, used only on the ctypes path

FILLER = r"""
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1")
def ck(r, what):
    if r != 0:
        print(f"filler: {what} -> {r}"); sys.exit(2)
ck(cu.cuInit(0), "cuInit")
dev = ctypes.c_int()
ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p()
ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
total = 0
for piece in (1 << 30, 1 << 26, 1 << 21):
    while True:
        p = ctypes.c_uint64()
        if cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(piece)) != 0:
            break
        ck(cu.cuMemsetD8_v2(p, ctypes.c_ubyte(0xA5), ctypes.c_size_t(piece)), "cuMemsetD8")
        total += piece
ck(cu.cuCtxSynchronize(), "cuCtxSynchronize")
print(f"filler: allocated and wrote {total >> 20} MiB")
"""


def skip(msg):
    print(f"SKIP: {msg}")
    print("SKIP: torch_sleep (exit 77)")
    sys.stdout.flush()
    sys.exit(77)


class Tags:
    """The hook's tag API: through the vmmhook package when present, else through ctypes."""

    def __init__(self, lib):
        self.lib = lib
        self.pkg = None
        here = os.path.dirname(os.path.abspath(__file__))
        pkg_dir = os.path.join(here, "..", "..", "python")
        if os.path.isdir(os.path.join(pkg_dir, "vmmhook")):
            sys.path.insert(0, pkg_dir)
        try:
            import vmmhook  # noqa: PLC0415 - optional, the sleep helper's package
            if all(hasattr(vmmhook, a) for a in ("tag", "pause", "resume")):
                self.pkg = vmmhook
        except Exception as e:  # noqa: BLE001 - absent or broken: ctypes instead
            print(f"I python package vmmhook not used: {type(e).__name__}: {e}")
        if self.pkg is None:
            for name in ("vmm_tag_push", "vmm_tag_pop", "vmm_pause", "vmm_resume"):
                getattr(lib, name)  # AttributeError when the library lacks issue 15's API
            lib.vmm_tag_push.argtypes = [ctypes.c_char_p]
            lib.vmm_tag_pop.argtypes = []
            lib.vmm_pause.argtypes = [ctypes.c_char_p, ctypes.c_uint]
            lib.vmm_pause.restype = ctypes.c_int
            lib.vmm_resume.argtypes = [ctypes.c_char_p]
            lib.vmm_resume.restype = ctypes.c_int
        print(f"I tag API through {'the vmmhook package' if self.pkg else 'ctypes'}")

    @contextlib.contextmanager
    def tag(self, name):
        if self.pkg:
            with self.pkg.tag(name):
                yield
            return
        self.lib.vmm_tag_push(name.encode())
        try:
            yield
        finally:
            self.lib.vmm_tag_pop()

    def pause(self, name, backup):
        """0 on success, else the status (or the exception's text)."""
        if self.pkg:
            try:
                r = self.pkg.pause(name, backup=backup)
                return 0 if r in (None, 0, True) else r
            except Exception as e:  # noqa: BLE001
                return f"{type(e).__name__}: {e}"
        return self.lib.vmm_pause(name.encode(), VMM_PAUSE_BACKUP if backup else 0)

    def resume(self, name):
        if self.pkg:
            try:
                r = self.pkg.resume(name)
                return 0 if r in (None, 0, True) else r
            except Exception as e:  # noqa: BLE001
                return f"{type(e).__name__}: {e}"
        return self.lib.vmm_resume(name.encode())


def tag_stats(lib, names):
    """The hook's per-tag figures (vmm_stats_json "tags") of the named tags, or a reason."""
    try:
        fn = lib.vmm_stats_json
    except AttributeError:
        return "no vmm_stats_json"
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    buf = ctypes.create_string_buffer(1 << 20)
    if fn(buf, len(buf)) < 0:
        return "vmm_stats_json failed"
    try:
        tags = json.loads(buf.value.decode()).get("tags") or {}
    except ValueError as e:
        return f"not JSON: {e}"
    keys = ("state", "requested", "mapped", "paused", "backed_up")
    return "; ".join(f"{n}: " + ", ".join(f"{k} {tags.get(n, {}).get(k)}" for k in keys)
                     for n in names)


def main():
    os.environ.pop("PYTORCH_NO_CUDA_MEMORY_CACHING", None)
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        skip(f"no PyTorch: import torch -> {type(e).__name__}: {e}")
    if not torch.cuda.is_available():
        skip("no CUDA device: torch.cuda.is_available() is False")
    lib = None
    if os.environ.get("VMMHOOK_DISABLE", "").lower() not in ("1", "true", "yes", "on"):
        try:
            lib = ctypes.CDLL(None)
            lib.vmm_owns
        except (AttributeError, OSError):
            lib = None
    expect = os.environ.get("GPUTEST_EXPECT_HOOK") == "1"
    if lib is None:
        if expect:
            print("FAIL: torch_sleep: GPUTEST_EXPECT_HOOK=1 but the hook is not loaded")
            return 1
        skip("needs the hook (LD_PRELOAD=libvmmhook.so): pause and resume are the hook's API")
    try:
        tags = Tags(lib)
    except AttributeError as e:
        print(f"FAIL: torch_sleep: the loaded library lacks issue 15's tag API ({e})")
        return 1
    failures = []
    torch.manual_seed(99)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda:0")
    nn = torch.nn
    d = 2048
    with tags.tag("weights"):
        model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(d, d), nn.GELU())])
        model = model.to(dev).eval()
        torch.cuda.synchronize()
    rows = 256
    with tags.tag("kv"):
        kv = torch.zeros((1 << 30) // (4 * d), d, device=dev)  # 1 GiB
        torch.cuda.synchronize()
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"I weights {wbytes >> 20} MiB under tag weights, cache {kv.numel() * 4 >> 20} MiB "
          f"under tag kv")

    def forward(x):
        h = model(x)
        kv[:rows].copy_(h)  # written, then read back: its old contents do not matter
        return h + 0.5 * kv[:rows]

    def weight_sum():
        return sum(p.detach().double().sum().item() for p in model.parameters())

    static_x = torch.randn(rows, d, device=dev)
    x2 = torch.randn(rows, d, device=dev)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                forward(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = forward(static_x)
        graph.replay()
        g0 = static_out.cpu()
        e0 = forward(x2).cpu()
        w0 = weight_sum()
        torch.cuda.synchronize()

        t0 = time.perf_counter()
        rw = tags.pause("weights", backup=True)
        t1 = time.perf_counter()
        rk = tags.pause("kv", backup=False)
        t2 = time.perf_counter()
        print(f"R pause weights (backup) -> {rw}, pause kv -> {rk}")
        print(f"I pause weights {1000 * (t1 - t0):.1f} ms, kv {1000 * (t2 - t1):.1f} ms")
        if rw != 0 or rk != 0:
            failures.append(f"pause failed: weights {rw}, kv {rk}")
        print(f"I tags while paused: {tag_stats(lib, ('weights', 'kv'))}")
        free_paused, total = torch.cuda.mem_get_info()
        env = {k: v for k, v in os.environ.items()
               if k != "LD_PRELOAD" and not k.startswith("VMMHOOK_")}
        try:
            filler = subprocess.run([sys.executable, "-c", FILLER], env=env, timeout=120,
                                    capture_output=True, text=True)
            print(f"I {filler.stdout.strip()} {filler.stderr.strip()[-300:]}")
            print(f"R second process filled the GPU and exited: {filler.returncode == 0}")
            if filler.returncode != 0:
                failures.append(f"the second process failed (exit {filler.returncode})")
        except subprocess.TimeoutExpired:
            print("R second process filled the GPU and exited: False")
            failures.append("the second process did not finish within 120 s")
        print(f"I cudaMemGetInfo free while paused {free_paused >> 20} MiB of {total >> 20} MiB")

        t0 = time.perf_counter()
        rw = tags.resume("weights")
        rk = tags.resume("kv")
        print(f"R resume weights -> {rw}, resume kv -> {rk}")
        print(f"I resume both {1000 * (time.perf_counter() - t0):.1f} ms")
        print(f"I tags after resume: {tag_stats(lib, ('weights', 'kv'))}")
        if rw != 0 or rk != 0:
            failures.append(f"resume failed: weights {rw}, kv {rk}")
        else:
            same_w = weight_sum() == w0
            graph.replay()
            g1 = static_out.cpu()
            e1 = forward(x2).cpu()
            torch.cuda.synchronize()
            same_g = torch.equal(g0, g1)
            same_e = torch.equal(e0, e1)
            print(f"R weights unchanged: {same_w}")
            print(f"R graph replay bit-identical: {same_g}")
            print(f"R eager forward bit-identical: {same_e}")
            if not (same_w and same_g and same_e):
                failures.append(f"after resume: weights same {same_w}, graph {same_g}, "
                                f"eager {same_e}")
    del graph, static_out, model, kv
    torch.cuda.synchronize()
    for f in failures:
        print(f"FAIL {f}")
    if failures:
        print(f"FAIL: torch_sleep ({len(failures)} failures)")
        return 1
    print("PASS: torch_sleep")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        print(f"FAIL: torch_sleep: {type(e).__name__}: {e}")
        sys.stdout.flush()
        sys.exit(1)
