#!/usr/bin/env python3
"""torch_train: a small deterministic training run whose losses must not depend on the hook.

Usage: torch_train.py [nocache|cache|expandable|pluggable] [steps=50]

  nocache     PYTORCH_NO_CUDA_MEMORY_CACHING=1: every tensor is a cudaMalloc/cudaFree
  cache       PyTorch's caching allocator (default): segments from cudaMalloc
  expandable  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: PyTorch's own cuMemCreate/cuMemMap
              (the hook must pass them through and not own them)
  pluggable   torch.cuda.memory.CUDAPluggableAllocator over vmm_torch_alloc/vmm_torch_free of the
              loaded hook (runs only under the hook; 77 otherwise)

Prints "R step N loss <repr>" for every step and "R params <repr>" at the end (compared between
the run without the hook and the run with it: identical, bit for bit), "I ..." information, and
a final PASS/FAIL line. Exit 0 pass, 1 fail, 77 skip (no torch, no GPU).
"""
import ctypes
import os
import sys

VARIANTS = ("nocache", "cache", "expandable", "pluggable")


def skip(msg, name="torch_train"):
    print(f"SKIP: {msg}")
    print(f"SKIP: {name} (exit 77)")
    sys.stdout.flush()
    sys.exit(77)


def run_main(main, name):
    """Exits with main()'s code; a crash is a failure with its reason (exit 1)."""
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - a crash is a failure with its reason
        import traceback
        traceback.print_exc()
        print(f"FAIL: {name}: {type(e).__name__}: {e}")
        sys.stdout.flush()
        sys.exit(1)


def hook_lib():
    """The loaded libvmmhook (through dlsym on the whole process), or None; None also under
    VMMHOOK_DISABLE (loaded, but passing everything through: it owns nothing)."""
    if os.environ.get("VMMHOOK_DISABLE", "").lower() in ("1", "true", "yes", "on"):
        return None
    try:
        lib = ctypes.CDLL(None)
        lib.vmm_owns.restype = ctypes.c_int
        lib.vmm_owns.argtypes = [ctypes.c_void_p]
        return lib
    except (AttributeError, OSError):
        return None


def hook_path():
    p = os.environ.get("VMMHOOK_LIB", "")
    if p:
        return p
    for e in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        if "vmmhook" in os.path.basename(e):
            return e
    return ""


def main():
    variant = sys.argv[1] if len(sys.argv) > 1 else "nocache"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 50
    if variant not in VARIANTS:
        print(f"FAIL: torch_train: unknown variant {variant!r} (one of {', '.join(VARIANTS)})")
        return 1
    # The allocator settings must be in the environment before torch initialises CUDA.
    if variant == "nocache":
        os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    else:
        os.environ.pop("PYTORCH_NO_CUDA_MEMORY_CACHING", None)
    if variant == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    else:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure is a skip with its reason
        skip(f"no PyTorch: import torch -> {type(e).__name__}: {e}")
    if not torch.cuda.is_available():
        skip(f"no CUDA device: torch.cuda.is_available() is False "
             f"(torch {torch.__version__}, device_count {torch.cuda.device_count()})")

    hook = hook_lib()
    expect = os.environ.get("GPUTEST_EXPECT_HOOK") == "1"
    failures = []
    if expect and not hook:
        failures.append("GPUTEST_EXPECT_HOOK=1 but vmm_owns is not visible in the process")
    # The pluggable allocator must be installed before anything initialises PyTorch's CUDA
    # state (get_device_name does): an initialised allocator cannot be swapped.
    if variant == "pluggable":
        path = hook_path()
        if not hook or not path:
            if expect:
                failures.append("pluggable: the hook or its path (VMMHOOK_LIB/LD_PRELOAD) is missing")
            else:
                skip("pluggable needs the hook loaded (LD_PRELOAD=libvmmhook.so)")
        else:
            alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "vmm_torch_alloc",
                                                             "vmm_torch_free")
            torch.cuda.memory.change_current_allocator(alloc)
            print(f"I pluggable allocator: {path}")
    print(f"I torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"device {torch.cuda.get_device_name(0)}, variant {variant}, "
          f"hook {'loaded' if hook else 'absent'}, expected {'yes' if expect else 'no'}")

    torch.manual_seed(1234)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    dev = torch.device("cuda:0")
    nn = torch.nn
    # A small CNN (strided convolutions, no pooling: every op has a deterministic kernel) and an
    # MLP head with a 4096 x 4096 layer, so allocations range from bytes to 64 MiB.
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 4096), nn.ReLU(),
        nn.Linear(4096, 4096), nn.ReLU(),
        nn.Linear(4096, 10),
    ).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(99)
    data = torch.randn(8, 64, 3, 32, 32, generator=gen)  # 8 batches of 64, on the host
    labels = torch.randint(0, 10, (8, 64), generator=gen)

    if hook:
        w = model[7].weight
        owned = hook.vmm_owns(ctypes.c_void_p(w.data_ptr()))
        want = {"nocache": 1, "cache": 1, "expandable": 0, "pluggable": 1}[variant]
        print(f"I vmm_owns(4096x4096 weight) = {owned} (want {want})")
        if owned != want:
            failures.append(f"vmm_owns of a {variant} tensor is {owned}, want {want}")

    for step in range(steps):
        x = data[step % 8].to(dev, non_blocking=False)
        y = labels[step % 8].to(dev)
        # A tensor of a step-dependent size: allocations that vary from step to step.
        scratch = torch.empty((step % 7 + 1) * 12345 + 1, device=dev).fill_(step)
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y) + 0.0 * scratch.sum()
        loss.backward()
        opt.step()
        print(f"R step {step} loss {loss.item()!r}")
        del scratch, out, loss, x, y
    torch.cuda.synchronize()
    total = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"R params {total!r}")
    if variant != "pluggable":  # a pluggable allocator keeps no statistics
        print(f"I max_memory_allocated {torch.cuda.max_memory_allocated()} bytes, "
              f"max_memory_reserved {torch.cuda.max_memory_reserved()} bytes")
    del model, opt
    try:
        torch.cuda.empty_cache()
    except RuntimeError as e:  # not every allocator implements it
        print(f"I empty_cache: {e}")
    torch.cuda.synchronize()
    if hook:
        hook.vmm_trim.restype = ctypes.c_size_t
        print(f"I vmm_trim released {hook.vmm_trim()} bytes")

    for f in failures:
        print(f"FAIL {f}")
    if failures:
        print(f"FAIL: torch_train {variant} ({len(failures)} failures)")
        return 1
    print(f"PASS: torch_train {variant} ({steps} steps)")
    return 0


if __name__ == "__main__":
    run_main(main, "torch_train")
