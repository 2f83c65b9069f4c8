"""torch_overflow: a PyTorch program whose tensors need 1.3x the GPU's memory (docs/OVERFLOW.md).

The GPU is made smaller by a second process that holds all but FREE GiB of it (tests/gpu
overflow_gpu --hold, native). The program then keeps weights that fit (40% of FREE) and builds a
cache of blocks up to 1.3 x FREE in total, each block computed from the weights, and ends with a
checksum of every block (R lines, float64 sums of deterministic elementwise kernels).

    torch_overflow.py large        no holder: the GPU is large enough; the reference R lines
    torch_overflow.py small        with the holder, natively: out of memory (the R line says so)
    torch_overflow.py small-hook   with the holder, under the hook with VMMHOOK_OVERFLOW=host:
                                   must print the reference's R lines, then moves the cache back
                                   with vmmhook.prefetch_tag once the holder is gone
Options: --free GiB (default 8), --holder PATH (overflow_gpu, default beside this file in the
build: $OVERFLOW_GPU). Exit 0 pass, 1 fail, 77 skip (no torch, no GPU, no holder)."""
import os
import subprocess
import sys
import time


def cuda_torch():
    """PyTorch with a CUDA device, or None once the SKIP line is printed (torch_overflow_sum
    uses it too)."""
    try:
        import torch
    except ImportError as e:
        print(f"SKIP: no PyTorch: {e}")
        return None
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return None
    return torch


def main():
    args = sys.argv[1:]
    mode = args[0] if args else "large"
    free_gib = float(args[args.index("--free") + 1]) if "--free" in args else 8.0
    holder = args[args.index("--holder") + 1] if "--holder" in args else os.environ.get(
        "OVERFLOW_GPU", "")
    torch = cuda_torch()
    if torch is None:
        return 77
    GiB = 1 << 30
    hold = None
    if mode.startswith("small"):
        if not holder or not os.access(holder, os.X_OK):
            print("SKIP: no holder program (set OVERFLOW_GPU to tests/gpu's overflow_gpu)")
            return 77
        free, total = torch.cuda.mem_get_info()
        want = int(free - free_gib * GiB)
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "VMMHOOK_OVERFLOW")}
        hold = subprocess.Popen([holder, "--hold", str(want)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, text=True)
        line = hold.stdout.readline()
        if not line.startswith("holding"):
            print(f"FAIL the holder did not start: {line!r}")
            return 1
    print(f"I free now {torch.cuda.mem_get_info()[0] / GiB:.1f} GiB, mode {mode}")
    block = 256 << 20  # bytes per cache block
    n_w = int(0.4 * free_gib * GiB) // 4
    n_blocks = int(1.3 * free_gib * GiB) // block
    status = 0
    try:
        torch.manual_seed(1)
        w = torch.arange(n_w, device="cuda", dtype=torch.float32).remainder_(9973).mul_(1e-3)
        cache = []
        t0 = time.time()
        for i in range(n_blocks):
            b = w[: block // 4] * (i + 1) + (i % 7)
            cache.append(b)
        torch.cuda.synchronize()
        print(f"I built {n_blocks} blocks of {block >> 20} MiB in {time.time() - t0:.2f} s")
        for i in range(0, n_blocks, max(1, n_blocks // 16)):
            print(f"R block {i} sum {cache[i].double().sum().item():.6f}")
        print(f"R total blocks {len(cache)}")
    except torch.cuda.OutOfMemoryError:
        print("R out of memory")
        status = 0 if mode == "small" else 1
        if mode != "small":
            print("FAIL out of memory")
        cache = []
    if mode == "small-hook" and cache:
        import vmmhook

        st = vmmhook.stats()
        spilled = st["gauges"].get("bytes_spilled", {}).get("current", 0)
        print(f"I spilled {spilled / GiB:.2f} GiB")
        if spilled <= 0:
            print("FAIL nothing spilled: the GPU was not full")
            status = 1
        hold.stdin.close()
        hold.wait()
        hold = None
        del cache[: n_blocks // 2]  # room on the device for the rest
        torch.cuda.empty_cache()  # the caching allocator's free segments go back to the hook
        t0 = time.time()
        try:
            vmmhook.prefetch_tag()
            dt = time.time() - t0
            left = vmmhook.stats()["gauges"].get("bytes_spilled", {}).get("current", 0)
            print(f"I prefetch_tag moved {(spilled - left) / GiB:.2f} GiB in {dt:.3f} s")
        except vmmhook.VmmError as e:
            print(f"I prefetch_tag: {e}")
        for i in range(0, len(cache), max(1, len(cache) // 4)):
            print(f"I after the move: block {i + n_blocks // 2} sum "
                  f"{cache[i].double().sum().item():.6f}")
    if hold:
        hold.stdin.close()
        hold.wait()
    print(("PASS" if status == 0 else "FAIL") + f": torch_overflow {mode}")
    return status


if __name__ == "__main__":
    sys.exit(main())
