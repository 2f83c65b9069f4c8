#!/usr/bin/env python3
"""torch_idle_resume: a pause / step / resume loop whose step leaves more idle memory than the
device has free (issue 38's RL loop, reduced): a resume must give the library's idle memory back
first, whole free chunks beside live blocks included, and never fail for it.

Runs only under the hook with PyTorch's caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1,
so that the step's frees reach the hook); natively or without the package: exit 77.
  1. Tag "kv": one tensor of 55% of the device's free memory, filled with a pattern.
  2. Three rounds: pause "kv" with a backup; the step, in the default tag, allocates tensors of
     2-64 MiB up to 60% of the device and frees all but one in 32 (its survivors sit between
     freed memory: idle chunks beside live blocks); resume "kv" (timed); check its bytes.
Prints R lines (outcomes, no sizes that vary), I lines (timings, bytes) and PASS/FAIL.
Exit 0 pass, 1 fail, 77 skip.
"""
import os
import random
import sys
import time


def main():
    try:
        import torch
        import vmmhook
    except ImportError as e:
        print(f"SKIP: {e}")
        return 77
    if not torch.cuda.is_available() or not vmmhook.available():
        print("SKIP: needs a GPU and the hook preloaded")
        return 77
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1":
        print("SKIP: needs PYTORCH_NO_CUDA_MEMORY_CACHING=1 (the step's frees must reach the hook)")
        return 77
    MiB = 1 << 20
    free0, total = torch.cuda.mem_get_info()
    with vmmhook.tag("kv"):
        kv = torch.empty(int(free0 * 0.55) // 4, dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda")
    g.manual_seed(38)
    kv.random_(generator=g)

    def digest():
        return (kv.sum(dtype=torch.int64).item(), kv[::7919].sum(dtype=torch.int64).item())

    want = digest()
    rng = random.Random(38)
    ok = True
    for rnd in range(3):
        torch.cuda.synchronize()
        vmmhook.pause("kv", backup=True)
        live, kept, used = [], [], 0
        while used < total * 0.60:
            n = rng.randrange(2, 65) * MiB
            live.append(torch.ones(n // 4, dtype=torch.int32, device="cuda"))
            used += n
        for i, t in enumerate(live):
            if i % 32 == 0:
                kept.append(t)
        del live, t
        torch.cuda.synchronize()
        free_now, _ = torch.cuda.mem_get_info()
        mapped = vmmhook.stats().get("bytes_mapped", 0)
        mapped = mapped.get("current", 0) if isinstance(mapped, dict) else mapped
        t0 = time.perf_counter()
        try:
            vmmhook.resume("kv")
            res = "ok"
        except vmmhook.VmmError as e:
            res = f"failed: {e}"
        dt = (time.perf_counter() - t0) * 1e3
        print(f"R round {rnd} resume {res}")
        print(f"I round {rnd}: step used {used / 2**30:.1f} GiB, kept {len(kept)} tensors "
              f"({sum(t.numel() * 4 for t in kept) / MiB:.0f} MiB); cuMemGetInfo free "
              f"{free_now / 2**30:.1f} GiB (hook-counted), kv {kv.numel() * 4 / 2**30:.1f} GiB; "
              f"resume {dt:.1f} ms; mapped before {mapped / 2**30:.1f} GiB")
        if res != "ok":
            ok = False
            break
        good = digest() == want
        print(f"R round {rnd} kv intact {good}")
        ok = ok and good
        del kept
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
