"""torch_overflow_sum: PyTorch tensors of about 1.3x the GPU, every one summed on the GPU, under
the hook with VMMHOOK_OVERFLOW=host (docs/OVERFLOW.md, issue 29).

The whole GPU, no holder: tensors of 4 GiB (int64, deterministic values) fill the free device
memory and spill past it, as much as the host allows (at most 0.3x the free device memory and
0.3x the host's memory: the overflow budget is half of the host, and an eighth stays free);
then every tensor is summed on the GPU (torch.sum: the sums' outputs and workspaces are the
program's small, short-lived allocations), all sums queued and one synchronize, best of 3
passes, and each sum is compared with its exact value. int64, not int32: PyTorch sums int32
into int64 through a widened copy of the whole tensor (8 GiB here, measured on the H200 at
41ce327: an allocation of 8589934592 bytes per sum), which measures the copy, not the reads.

    torch_overflow_sum.py cache     PyTorch's caching allocator on (the default)
    torch_overflow_sum.py nocache   PYTORCH_NO_CUDA_MEMORY_CACHING=1: every tensor, the sums'
                                    outputs included, is a cudaMalloc and a cudaFree
Prints "T sum_rate_<mode> <GiB/s> GiB/s 100 MET|MISS" (the rate over all tensors, issue 29's
target, reported, not judged), I lines (spilled bytes, spills, spills of small allocations),
and a PASS or FAIL line: FAIL when a sum is wrong, nothing spilled (the GPU was not full), or a
tensor could not be made. Exit 0 pass, 1 fail, 77 skip (no torch, no GPU, not hooked with
VMMHOOK_OVERFLOW=host)."""
import ctypes
import json
import os
import sys
import time

from torch_overflow import cuda_torch  # beside this file: on sys.path when run as a script

GiB = 1 << 30
TENSOR = 4 * GiB
PERIOD = 251  # element k of tensor i holds k % PERIOD + i


def exact_sum(n, i):
    full, rest = divmod(n, PERIOD)
    return full * (PERIOD * (PERIOD - 1) // 2) + rest * (rest - 1) // 2 + n * i


def stats():
    """The library's statistics (vmm_stats_json of the preloaded library: no package needed)."""
    lib = ctypes.CDLL(None)
    if not hasattr(lib, "vmm_stats_json"):
        return None
    lib.vmm_stats_json.restype = ctypes.c_int
    buf = ctypes.create_string_buffer(1 << 16)
    n = lib.vmm_stats_json(buf, len(buf))
    return json.loads(buf.value.decode()) if 0 < n < len(buf) else None


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "cache"
    if mode not in ("cache", "nocache"):
        print(f"usage: {sys.argv[0]} cache|nocache")
        return 2
    if mode == "nocache":
        os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"  # read at PyTorch's first allocation
    torch = cuda_torch()
    if torch is None:
        return 77
    if os.environ.get("VMMHOOK_OVERFLOW") != "host" or stats() is None:
        print("SKIP: needs the hook with VMMHOOK_OVERFLOW=host (natively out of memory)")
        return 77
    free, total = torch.cuda.mem_get_info()
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    spill = min(0.3 * free, 0.3 * host)
    count = int((free + spill) // TENSOR)
    n = TENSOR // 8
    print(f"I mode {mode}: {free / GiB:.1f} GiB free of {total / GiB:.1f}, host {host / GiB:.0f} "
          f"GiB: {count} tensors of {TENSOR // GiB} GiB ({count * TENSOR / free:.2f}x the free "
          "memory)")
    tensors = []
    t0 = time.time()
    try:
        for i in range(count):
            t = torch.arange(n, device="cuda", dtype=torch.int64)
            t.remainder_(PERIOD).add_(i)
            tensors.append(t)
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError as e:
        print(f"FAIL tensor {len(tensors)} of {count}: out of memory ({str(e)[:200]})")
        return 1
    print(f"I made {count} tensors in {time.time() - t0:.1f} s")
    st = stats()
    spilled = st["gauges"]["bytes_spilled"]["current"]
    print(f"I spilled {spilled / GiB:.2f} GiB; spills {st['counters'].get('spills')}, "
          f"of them small {st['counters'].get('spills_small')}")
    status = 0
    if spilled <= 0:
        print("FAIL nothing spilled: the GPU was not full")
        status = 1
    best, sums = 0.0, None
    small_before = st["counters"].get("spills_small", 0)
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.time()
        out = [t.sum() for t in tensors]
        torch.cuda.synchronize()
        dt = time.time() - t0
        best = max(best, count * TENSOR / GiB / dt)
        sums = [s.item() for s in out]
        del out
    wrong = [i for i, s in enumerate(sums) if s != exact_sum(n, i)]
    for i in wrong[:5]:
        print(f"FAIL tensor {i}: sum {sums[i]}, exact {exact_sum(n, i)}")
    if wrong:
        status = 1
    st = stats()
    print(f"I the sums' small allocations spilled: "
          f"{st['counters'].get('spills_small', 0) - small_before}")
    print(f"R {count} sums exact: {not wrong}")
    print(f"T sum_rate_{mode} {best:.1f} GiB/s 100 {'MET' if best >= 100 else 'MISS'}")
    print(("PASS" if status == 0 else "FAIL") + f": torch_overflow_sum {mode}")
    return status


if __name__ == "__main__":
    sys.exit(main())
