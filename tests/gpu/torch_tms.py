#!/usr/bin/env python3
"""torch_tms: a program written for torch_memory_saver (TMS), run with TMS itself or with
libvmmhook's drop-in; only its import differs (issue 22).

    torch_tms.py HOOK_MODE IMPL        HOOK_MODE: preload | torch;  IMPL: vmmhook | tms

IMPL vmmhook: `from vmmhook import torch_memory_saver` (the package from python/ of this tree
when it is not installed; LIBVMMHOOK may name the library); tms: `from torch_memory_saver import
torch_memory_saver` (TMS installed in this Python). In "preload" mode the program re-runs itself
under configure_subprocess() (both have it), as TMS's own tests do.

What it does, with TMS's names only (TMS's examples simple.py, cpu_backup.py, cuda_graph.py and
nested_region.py, together):
  1. a tensor outside every region (never paused); tag "kv": 16 x 64 MiB, no backup; tag "w"
     with CPU backup: a 6-layer MLP and a 256 MiB tensor; inside "w", a nested region "grad"
     without backup;
  2. a CUDA graph of the forward pass (weights and kv read, output written), captured with
     torch_memory_saver.cuda_graph(tag="graph") in preload mode, torch.cuda.graph in torch mode
     (TMS supports the former in preload mode only); replayed, output kept on the host;
  3. pause("kv"): more than 90% of its bytes back to the driver (cudaMemGetInfo); resume("kv");
     pause(): every region's tag paused, get_cpu_backup of the 256 MiB tensor equals its contents;
     meanwhile another tensor takes most of the freed memory and is freed again;
  4. resume(): the same addresses, the weights bit-identical, kv refilled, the graph replayed:
     its output bit-identical to step 2; the tensor outside regions intact;
  5. pause("grad") gives back only grad's memory; resume("grad");
  6. three pause/resume cycles of a tag "bench" with CPU backup (TMS_BENCH_GIB, default 8 GiB,
     in 22.7 MiB tensors, as issue 22's measurement; retain_cpu_backup on) and of "kv": I lines
     with times and rates.
Prints R lines (outcomes: the same for both IMPLs when the drop-in means what TMS means),
I lines (figures) and PASS/FAIL. Exit 0 pass, 1 fail, 77 skip (no torch, no GPU, IMPL missing).
"""
import os
import subprocess
import sys
import time

MiB = 1 << 20
GiB = 1 << 30


def skip(msg):
    print(f"SKIP: {msg}")
    print(f"SKIP: {os.path.basename(sys.argv[0])} (exit 77)")
    sys.stdout.flush()
    sys.exit(77)


def import_impl(impl):
    if impl == "vmmhook":
        here = os.path.dirname(os.path.abspath(__file__))
        src = os.path.join(here, "..", "..", "python")
        try:
            import vmmhook  # installed, or on PYTHONPATH
        except ImportError:
            sys.path.insert(0, src)
            import vmmhook
        from vmmhook import torch_memory_saver

        return torch_memory_saver, vmmhook.configure_subprocess
    import torch_memory_saver as tms_module
    from torch_memory_saver import torch_memory_saver

    return torch_memory_saver, tms_module.configure_subprocess


def used(torch):
    free, total = torch.cuda.mem_get_info()
    return total - free


def run(hook_mode, impl):
    import torch

    torch_memory_saver, _ = import_impl(impl)
    torch_memory_saver.hook_mode = hook_mode
    failures = []

    def check(name, ok, detail=""):
        print(f"R {name}: {bool(ok)}")
        if not ok:
            failures.append(f"{name} {detail}".strip())

    dev = torch.device("cuda:0")
    torch.manual_seed(5)
    torch.backends.cuda.matmul.allow_tf32 = False
    nn = torch.nn
    # TMS_SCALE divides every size (tests/python runs this program on the simulated driver
    # with a stand-in torch at 16); 1 on a GPU.
    scale = int(os.environ.get("TMS_SCALE", "1"))
    U = MiB // scale
    d = max(64, 2048 // int(scale ** 0.5))
    outside = torch.full((32 * U,), 7, dtype=torch.uint8, device=dev)
    with torch_memory_saver.region(tag="kv"):
        kv = [torch.full((64 * U,), 1, dtype=torch.uint8, device=dev) for _ in range(16)]
        kvf = torch.zeros(256, d, device=dev)
    with torch_memory_saver.region(tag="w", enable_cpu_backup=True):
        model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(d, d), nn.GELU())]).to(dev)
        blob = torch.randint(0, 255, (256 * U,), dtype=torch.uint8, device=dev)
        with torch_memory_saver.region(tag="grad", enable_cpu_backup=False):
            grad = torch.full((128 * U,), 3, dtype=torch.uint8, device=dev)
        after_nested = torch.full((8 * U,), 9, dtype=torch.uint8, device=dev)  # "w" again
    torch.cuda.synchronize()
    kv_bytes = sum(t.numel() for t in kv)
    addrs = [t.data_ptr() for t in kv] + [blob.data_ptr(), grad.data_ptr()] + \
        [p.data_ptr() for p in model.parameters()]
    w_host = [p.detach().cpu() for p in model.parameters()]
    blob_host = blob.cpu()

    x = torch.randn(256, d, device=dev)

    def forward():
        return model(x) + kvf

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        ctx = (torch_memory_saver.cuda_graph(g, tag="graph") if hook_mode == "preload"
               else torch.cuda.graph(g))
        with ctx:
            out = forward()
        kvf.fill_(0.25)
        g.replay()
        out0 = out.cpu()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()

    # 3. pause
    before = used(torch)
    t0 = time.perf_counter()
    torch_memory_saver.pause("kv")
    t1 = time.perf_counter()
    freed_kv = before - used(torch)
    print(f"I pause kv ({kv_bytes >> 20} MiB, no backup) {1000 * (t1 - t0):.1f} ms, "
          f"freed {freed_kv >> 20} MiB")
    check("kv: more than 90% of its memory back while paused", freed_kv > 0.9 * kv_bytes,
          f"({freed_kv} of {kv_bytes})")
    # (TMS's pause(None) exits the process when any allocation is paused already: resume first.)
    torch_memory_saver.resume("kv")
    t0 = time.perf_counter()
    torch_memory_saver.pause()
    t1 = time.perf_counter()
    freed_all = before - used(torch)
    rest = blob.numel() + grad.numel() + after_nested.numel() + \
        sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"I pause all (w with backup, grad, graph) {1000 * (t1 - t0):.1f} ms, "
          f"freed in all {freed_all >> 20} MiB")
    check("all: the regions' memory back while paused", freed_all > 0.9 * (kv_bytes + rest),
          f"({freed_all} of {kv_bytes + rest})")
    backup = torch_memory_saver.get_cpu_backup(blob)
    check("get_cpu_backup while paused equals the contents",
          backup is not None and torch.equal(backup, blob_host))
    free_now, _ = torch.cuda.mem_get_info()
    other = torch.full((int(free_now * 0.6),), 0xA5, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    del other
    torch.cuda.empty_cache()

    # 4. resume
    t0 = time.perf_counter()
    torch_memory_saver.resume()
    t1 = time.perf_counter()
    print(f"I resume all {1000 * (t1 - t0):.1f} ms")
    now = [t.data_ptr() for t in kv] + [blob.data_ptr(), grad.data_ptr()] + \
        [p.data_ptr() for p in model.parameters()]
    check("addresses kept", now == addrs)
    check("weights bit-identical after a backed-up pause",
          all(torch.equal(p.detach().cpu(), h) for p, h in zip(model.parameters(), w_host)))
    check("backed-up tensor identical", torch.equal(blob.cpu(), blob_host))
    check("tensor of the outer region after the nested one kept",
          bool((after_nested == 9).all().item()))
    check("tensor outside regions intact", bool((outside == 7).all().item()))
    with torch.no_grad():
        for t in kv:
            t.fill_(1)
        kvf.fill_(0.25)
        g.replay()
        out1 = out.cpu()
    check("CUDA graph replayed after resume, bit-identical", torch.equal(out0, out1))

    # 5. one tag alone
    before = used(torch)
    torch_memory_saver.pause("grad")
    freed = before - used(torch)
    check("pause(grad) gives back grad's memory", freed > 0.9 * grad.numel(), f"({freed})")
    # (Not an R line: a pause may also give back idle cached memory, TMS's none, the hook's
    # up to VMMHOOK_CACHE_LIMIT.)
    print(f"I pause(grad) freed {freed >> 20} MiB (grad {grad.numel() >> 20} MiB)")
    torch_memory_saver.resume("grad")
    grad.fill_(4)
    check("grad usable after resume", bool((grad == 4).all().item()))

    # 6. timing: three cycles, a backed-up tag of TMS_BENCH_GIB in 22.7 MiB tensors, and kv.
    gib = float(os.environ.get("TMS_BENCH_GIB", "8"))
    n = max(1, int(gib * GiB / (22.7 * MiB)))
    with torch_memory_saver.region(tag="bench", enable_cpu_backup=True):
        bench = [torch.full((int(22.7 * MiB),), i & 255, dtype=torch.uint8, device=dev)
                 for i in range(n)]
    nbytes = sum(t.numel() for t in bench)
    torch.cuda.synchronize()
    # Host copies kept between cycles (both TMS and the drop-in give them back at each resume
    # otherwise): the later cycles measure the repeat rates. torch_tms_settings.py measures
    # the other settings.
    torch_memory_saver.retain_cpu_backup = True
    for cycle in range(3):
        t0 = time.perf_counter()
        torch_memory_saver.pause("bench")
        t1 = time.perf_counter()
        torch_memory_saver.resume("bench")
        t2 = time.perf_counter()
        torch_memory_saver.pause("kv")
        t3 = time.perf_counter()
        torch_memory_saver.resume("kv")
        t4 = time.perf_counter()
        print(f"I cycle {cycle}: backup {nbytes / GiB:.2f} GiB in {n} tensors: pause "
              f"{nbytes / GiB / (t1 - t0):.2f} GiB/s, resume {nbytes / GiB / (t2 - t1):.2f} GiB/s; "
              f"kv {kv_bytes >> 20} MiB: pause {1000 * (t3 - t2):.1f} ms, resume "
              f"{1000 * (t4 - t3):.1f} ms")
    torch_memory_saver.retain_cpu_backup = False
    check("bench tensors restored after 3 backed-up cycles",
          all(bool((t == (i & 255)).all().item()) for i, t in enumerate(bench)))
    del bench, g, out, kv, blob, grad
    torch.cuda.synchronize()
    for f in failures:
        print(f"FAIL {f}")
    if failures:
        print(f"FAIL: torch_tms {hook_mode} {impl} ({len(failures)} failures)")
        return 1
    print(f"PASS: torch_tms {hook_mode} {impl}")
    return 0


def launch(program, run_fn):
    """The command line of a program of this kind (torch_tms.py, torch_tms_settings.py):
    PROGRAM HOOK_MODE IMPL; skips (77) without torch, a GPU or IMPL; in "preload" mode re-runs
    `program` in a child under IMPL's configure_subprocess(), as TMS's tests do; then
    run_fn(hook_mode, impl) is the exit code."""
    name = os.path.basename(program)
    if len(sys.argv) != 3 or sys.argv[1] not in ("preload", "torch") or \
            sys.argv[2] not in ("vmmhook", "tms"):
        print(f"usage: {name} preload|torch vmmhook|tms", file=sys.stderr)
        return 2
    hook_mode, impl = sys.argv[1:]
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        skip(f"no PyTorch: import torch -> {type(e).__name__}: {e}")
    if not torch.cuda.is_available():
        skip("no CUDA device: torch.cuda.is_available() is False")
    try:
        _, configure_subprocess = import_impl(impl)
    except ImportError as e:
        skip(f"{impl} is not importable: {e}")
    if hook_mode == "preload" and os.environ.get("TORCH_TMS_CHILD") != "1":
        # As TMS's tests: the program itself runs in a child with the hook preloaded.
        with configure_subprocess():
            env = dict(os.environ, TORCH_TMS_CHILD="1")
            print(f"I running under LD_PRELOAD={env.get('LD_PRELOAD')}")
            sys.stdout.flush()
            return subprocess.run([sys.executable, os.path.abspath(program), hook_mode, impl],
                                  env=env).returncode
    return run_fn(hook_mode, impl)


def main():
    return launch(__file__, run)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        print(f"FAIL: torch_tms: {type(e).__name__}: {e}")
        sys.stdout.flush()
        sys.exit(1)
