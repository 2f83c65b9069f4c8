#!/usr/bin/env python3
"""torch_step: PyTorch training step time, with the hook's synchronizations per step (issue 14).

Usage: torch_step.py [nocache|cache] [steps=65] [big|small]

big (the default): a 6-layer transformer encoder (d_model 1024, 16 heads, feed-forward 4096,
sequence 256, batch 32) trained with AdamW, about 100 ms a step on an H200. small: the same
with d_model 512, 8 heads, feed-forward 2048, batch 16 (about 20 ms a step: the model of issue
21's report, where the library's own cost per allocation shows most). nocache sets PYTORCH_NO_CUDA_MEMORY_CACHING=1 (every tensor is a
cudaMalloc/cudaFree: what the hook serves); cache keeps PyTorch's caching allocator. The suite
runs nocache under the hook, cache natively and nocache natively, one after the other, alone on
the GPU.

Prints (machine lines, read by tools/gpu-suite.sh):
  STEP median_ms <x> p10_ms <x> p90_ms <x> steps <n>   (steps after 5 warm-up steps; each step
                                                        timed to its end with a synchronize)
  MEM peak_requested <bytes> peak_device <bytes> source <text>
  SYNC <counter> <per step> ...   (under the hook, from vmm_stats_json before and after the timed
                                   steps: every counter whose name has "sync" or "wait" in it;
                                   absent when the loaded library has no vmm_stats_json)
  CALLS app_per_alloc <x> allocs_per_step <x>   (under the hook: driver calls made on the
                                   program's threads (all but driver_calls_background) per served
                                   allocation in the timed steps: the steady state's cost)
"I ..." information and a final PASS/FAIL line. Exit 0 pass, 1 fail, 77 skip.
"""
import ctypes
import json
import os
import statistics
import sys
import time


def skip(msg):
    print(f"SKIP: {msg}")
    print("SKIP: torch_step (exit 77)")
    sys.stdout.flush()
    sys.exit(77)


def hook_stats_fn():
    """vmm_stats_json of the loaded hook as a function returning a dict, or None."""
    if os.environ.get("VMMHOOK_DISABLE", "").lower() in ("1", "true", "yes", "on"):
        return None
    try:
        lib = ctypes.CDLL(None)
        fn = lib.vmm_stats_json
    except (AttributeError, OSError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]

    def stats():
        size = 1 << 16
        for _ in range(4):
            buf = ctypes.create_string_buffer(size)
            n = fn(buf, size)
            if 0 <= n < size:
                try:
                    return json.loads(buf.value.decode())
                except ValueError as e:
                    print(f"I vmm_stats_json: not JSON ({e})")
                    return None
            if n < 0:
                return None
            size = n + 1
        return None
    return stats


def sync_counters(j):
    """Every counter whose name contains "sync" or "wait" (flat or under "counters"): the
    library's synchronizations, blocking or in the background, whatever their final names."""
    if not isinstance(j, dict):
        return {}
    src = j.get("counters") if isinstance(j.get("counters"), dict) else j
    return {k: v for k, v in src.items()
            if ("sync" in k or "wait" in k) and isinstance(v, (int, float))}


def gauge_peak(j, name):
    g = (j or {}).get("gauges") or {}
    v = g.get(name)
    return v.get("peak") if isinstance(v, dict) else None


def main():
    variant = sys.argv[1] if len(sys.argv) > 1 else "nocache"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 65
    size = sys.argv[3] if len(sys.argv) > 3 else "big"
    if size not in ("big", "small"):
        print(f"FAIL: torch_step: unknown size {size!r} (big or small)")
        return 1
    d_model, heads, ff, batch = (1024, 16, 4096, 32) if size == "big" else (512, 8, 2048, 16)
    if variant not in ("nocache", "cache"):
        print(f"FAIL: torch_step: unknown variant {variant!r} (nocache or cache)")
        return 1
    if variant == "nocache":
        os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    else:
        os.environ.pop("PYTORCH_NO_CUDA_MEMORY_CACHING", None)
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        skip(f"no PyTorch: import torch -> {type(e).__name__}: {e}")
    if not torch.cuda.is_available():
        skip("no CUDA device: torch.cuda.is_available() is False")
    stats = hook_stats_fn()
    hooked = False
    try:
        ctypes.CDLL(None).vmm_owns
        hooked = os.environ.get("VMMHOOK_DISABLE", "") == ""
    except (AttributeError, OSError):
        pass
    failures = []
    if os.environ.get("GPUTEST_EXPECT_HOOK") == "1" and not hooked:
        failures.append("GPUTEST_EXPECT_HOOK=1 but the hook is not loaded")
    print(f"I torch {torch.__version__}, variant {variant}, size {size}, hook {'loaded' if hooked else 'absent'}"
          f", vmm_stats_json {'found' if stats else 'absent'}")

    torch.manual_seed(0)
    dev = torch.device("cuda:0")
    layer = torch.nn.TransformerEncoderLayer(d_model=d_model, nhead=heads, dim_feedforward=ff,
                                             dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False).to(dev)
    head = torch.nn.Linear(d_model, d_model).to(dev)
    params = list(model.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(batch, 256, d_model, generator=gen) for _ in range(4)]
    warm = 5
    times = []
    before = None
    torch.cuda.synchronize()
    for step in range(steps):
        if step == warm:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = stats() if stats else None
        t0 = time.perf_counter()
        x = xs[step % 4].to(dev, non_blocking=True)
        out = head(model(x))
        loss = (out.float() ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        if step >= warm:
            times.append((time.perf_counter() - t0) * 1000.0)
        del x, out, loss
    after = stats() if stats else None
    n = len(times)
    q = statistics.quantiles(times, n=10) if n >= 2 else [float("nan")] * 9
    print(f"STEP median_ms {statistics.median(times):.3f} p10_ms {q[0]:.3f} p90_ms {q[8]:.3f} "
          f"steps {n}")
    if after is not None:
        b, a = sync_counters(before), sync_counters(after)
        if a:
            print("SYNC " + " ".join(f"{k} {(a[k] - b.get(k, 0)) / n:.2f}" for k in sorted(a)))
        else:
            print("I vmm_stats_json has no counter named *sync* or *wait*")
        ca, cb = after.get("counters", {}), before.get("counters", {})
        dc = {k: ca.get(k, 0) - cb.get(k, 0) for k in
              ("driver_calls", "driver_calls_background", "served_allocs")}
        if dc["served_allocs"] > 0:
            print(f"CALLS app_per_alloc "
                  f"{(dc['driver_calls'] - dc['driver_calls_background']) / dc['served_allocs']:.4f}"
                  f" allocs_per_step {dc['served_allocs'] / n:.1f}")
        print("COUNTS " + " ".join(f"{k} {(v - cb.get(k, 0)) / n:.2f}" for k, v in sorted(ca.items())
                                   if isinstance(v, (int, float))))
        pr, pm = gauge_peak(after, "bytes_requested"), gauge_peak(after, "bytes_mapped")
        if pr and pm:
            print(f"MEM peak_requested {pr} peak_device {pm} source hook-gauges(whole-run)")
    elif hooked:
        print("I no live statistics: the suite takes the syncs from the exit JSON")
    if variant == "cache" or not hooked:
        print(f"MEM peak_requested {torch.cuda.max_memory_allocated()} peak_device "
              f"{torch.cuda.max_memory_reserved()} source torch(timed-steps)")
    free, total = torch.cuda.mem_get_info()
    print(f"I device used at the end {(total - free) >> 20} MiB (cudaMemGetInfo)")
    for f in failures:
        print(f"FAIL {f}")
    if failures:
        print(f"FAIL: torch_step {variant}")
        return 1
    print(f"PASS: torch_step {variant} ({n} timed steps)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        print(f"FAIL: torch_step: {type(e).__name__}: {e}")
        sys.stdout.flush()
        sys.exit(1)
