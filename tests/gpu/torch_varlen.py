#!/usr/bin/env python3
"""torch_varlen: PyTorch training with random batch x sequence lengths, the hook's device memory
against PyTorch's expandable segments (issue 27).

Usage: torch_varlen.py hooked [steps=60]
       torch_varlen.py expandable [steps=60]
       torch_varlen.py compare HOOKED_OUTPUT EXPANDABLE_OUTPUT

hooked      PYTORCH_NO_CUDA_MEMORY_CACHING=1 under the hook (LD_PRELOAD, as the suite runs it):
            every tensor is a cudaMalloc/cudaFree the hook serves. Peak mapped and requested come
            from the library's statistics (python/vmmhook's memory_stats(): reserved_bytes is the
            gauge bytes_mapped, requested_bytes bytes_requested).
expandable  PyTorch natively with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: its peak is
            torch.cuda.max_memory_reserved().
compare     reads the MEM lines the two runs printed and judges the targets of issue 27.

Both runs train the same small transformer encoder on the same sequence of (batch, sequence
length) shapes drawn from a fixed seed (load phase), then run a few small steps (the load
drops), stop allocating and sleep 5 s (the hook gives idle memory back from its reclaim thread
within two windows of 1 s of its recent peak, docs/DESIGN.md "Limits that follow the program").

Lines (read by compare and by tools/gpu-suite.sh):
  MEM hooked peak_mapped <B> peak_requested <B> peak_torch_allocated <B>
  MEM expandable peak_reserved <B> peak_allocated <B>
  DROP hooked mapped <B> requested <B> ratio <x>      (5 s after the load dropped)
  DROP expandable reserved <B> allocated <B>          (INFO: PyTorch keeps its segments)
  I ...                                               information (device used from
                                                      torch.cuda.mem_get_info, shapes)
compare prints one PASS/FAIL line per target with the numbers:
  peak: the hook's peak mapped <= expandable_segments' peak reserved;
  drop: the hook's mapped <= 1.10x its requested, 5 s after the load dropped.
and a final PASS/FAIL line. Exit 0 pass, 1 fail, 77 skip (no torch, no GPU, or a run skipped:
said on a SKIP line).
"""
import os
import random
import re
import sys
import time

from torch_train import hook_lib, run_main, skip as skip_named

SEED = 2027
DROP_RATIO_MAX = 1.10
SLEEP_AFTER_DROP_S = 5.0


def skip(msg):
    skip_named(msg, "torch_varlen")


def shapes(steps, rng, batch, seq):
    """The (batch, sequence length) of each step: uniform over the ranges, from rng."""
    return [(rng.randint(*batch), rng.randint(*seq)) for _ in range(steps)]


def train(torch, model, head, opt, plan, dev, vocab):
    for b, s in plan:
        tokens = torch.randint(0, vocab, (b, s), device=dev)
        target = torch.randint(0, vocab, (b, s), device=dev)
        opt.zero_grad(set_to_none=True)
        logits = head(model(torch.nn.functional.embedding(tokens, head.weight)))
        loss = torch.nn.functional.cross_entropy(logits.reshape(b * s, vocab),
                                                 target.reshape(b * s))
        loss.backward()
        opt.step()
        del tokens, target, logits, loss
    torch.cuda.synchronize()


def device_used(torch):
    free, total = torch.cuda.mem_get_info()
    return total - free


def run(variant, steps):
    # The allocator settings must be in the environment before torch initialises CUDA.
    if variant == "hooked":
        os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    else:
        os.environ.pop("PYTORCH_NO_CUDA_MEMORY_CACHING", None)
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure is a skip with its reason
        skip(f"no PyTorch: import torch -> {type(e).__name__}: {e}")
    if not torch.cuda.is_available():
        skip(f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__})")

    hook = hook_lib()
    expect = os.environ.get("GPUTEST_EXPECT_HOOK") == "1"
    if variant == "hooked" and not hook:
        if expect:
            print("FAIL: torch_varlen hooked: GPUTEST_EXPECT_HOOK=1 but the hook is not loaded")
            return 1
        skip("the hooked run needs the hook loaded (LD_PRELOAD=libvmmhook.so)")
    if variant == "expandable" and hook:
        print("I the hook is loaded: PyTorch's own cuMemCreate/cuMemMap pass through it")
    stats = None
    if variant == "hooked":
        try:
            import vmmhook  # python/ (the suite puts it on PYTHONPATH)
        except ImportError as e:
            print(f"FAIL: torch_varlen hooked: import vmmhook -> {e} (PYTHONPATH=python/)")
            return 1
        stats = vmmhook.memory_stats

    print(f"I torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"device {torch.cuda.get_device_name(0)}, variant {variant}, "
          f"hook {'loaded' if hook else 'absent'}")
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    dev = torch.device("cuda:0")
    vocab, d_model = 8192, 512
    layer = torch.nn.TransformerEncoderLayer(d_model, 8, 2048, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).to(dev)
    head = torch.nn.Linear(d_model, vocab, bias=False).to(dev)
    opt = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=1e-4)

    # Load phase: batches of 8-64 sequences of 32-512 tokens (up to 32k tokens a step).
    load = shapes(steps, rng, (8, 64), (32, 512))
    print(f"I load phase: {len(load)} steps, tokens per step "
          f"{min(b * s for b, s in load)}-{max(b * s for b, s in load)}")
    t0 = time.monotonic()
    train(torch, model, head, opt, load, dev, vocab)
    print(f"I load phase took {time.monotonic() - t0:.1f} s; device used {device_used(torch)} B")
    if variant == "hooked":
        s = stats()
        print(f"MEM hooked peak_mapped {s['reserved_bytes.all.peak']} "
              f"peak_requested {s['requested_bytes.all.peak']} "
              f"peak_torch_allocated {torch.cuda.max_memory_allocated()}")
    else:
        print(f"MEM expandable peak_reserved {torch.cuda.max_memory_reserved()} "
              f"peak_allocated {torch.cuda.max_memory_allocated()}")

    # The load drops: a few small steps, then nothing allocates for SLEEP_AFTER_DROP_S.
    train(torch, model, head, opt, shapes(10, rng, (1, 4), (16, 64)), dev, vocab)
    time.sleep(SLEEP_AFTER_DROP_S)
    if variant == "hooked":
        s = stats()
        mapped, requested = s["reserved_bytes.all.current"], s["requested_bytes.all.current"]
        ratio = ratio_of(mapped, requested)
        print(f"DROP hooked mapped {mapped} requested {requested} ratio {ratio:.3f}")
    else:
        print(f"DROP expandable reserved {torch.cuda.memory_reserved()} "
              f"allocated {torch.cuda.memory_allocated()}")
    print(f"I device used after the drop {device_used(torch)} B")
    print(f"PASS: torch_varlen {variant} ran ({steps} load steps; compare judges the targets)")
    return 0


def mem_line(path, key):
    """The fields of the line starting with `key` in a run's output, as a dict of ints/floats,
    or None (with the run's SKIP or FAIL line, if any, as the second value)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        return None, f"cannot read {path}: {e}"
    why = None
    for line in text.splitlines():
        if line.startswith(key + " "):
            words = line.split()[len(key.split()):]
            return {k: float(v) for k, v in zip(words[::2], words[1::2])}, None
        if re.match(r"^(SKIP|FAIL)[: ]", line) and why is None:
            why = line
    return None, why or f"no '{key}' line in {path}"


def mib(b):
    return f"{b / 2**20:.0f} MiB"


def ratio_of(a, b):
    return a / b if b else float("inf")


def verdict(target, met, text):
    """Prints the target's PASS/FAIL line; 1 when missed."""
    print(f"{'PASS' if met else 'FAIL'} {target}: {text}")
    return 0 if met else 1


def compare(hooked_out, expandable_out):
    peak_h, why_h = mem_line(hooked_out, "MEM hooked")
    peak_e, why_e = mem_line(expandable_out, "MEM expandable")
    drop_h, why_d = mem_line(hooked_out, "DROP hooked")
    for why in (why_h, why_e):
        if why and why.startswith("SKIP"):
            print(f"SKIP: torch_varlen compare: a run skipped: {why}")
            return 77
    failures = 0
    if peak_h is None or peak_e is None:
        print(f"FAIL peak: figures missing (hooked: {why_h or 'ok'}; expandable: {why_e or 'ok'})")
        failures += 1
    else:
        ratio = ratio_of(peak_h["peak_mapped"], peak_e["peak_reserved"])
        failures += verdict("peak", ratio <= 1.0,
                            f"the hook's peak mapped {mib(peak_h['peak_mapped'])}, "
                            f"expandable_segments' peak reserved {mib(peak_e['peak_reserved'])} "
                            f"(ratio {ratio:.3f}, target <= 1.000; peak requested: hook "
                            f"{mib(peak_h['peak_requested'])}, expandable allocated "
                            f"{mib(peak_e['peak_allocated'])})")
    if drop_h is None:
        print(f"FAIL drop: figures missing ({why_d})")
        failures += 1
    else:
        ratio = ratio_of(drop_h["mapped"], drop_h["requested"])
        failures += verdict("drop", ratio <= DROP_RATIO_MAX,
                            f"{SLEEP_AFTER_DROP_S:.0f} s after the load dropped the hook maps "
                            f"{mib(drop_h['mapped'])} for {mib(drop_h['requested'])} requested "
                            f"(ratio {ratio:.3f}, target <= {DROP_RATIO_MAX:.2f})")
    if failures:
        print(f"FAIL: torch_varlen ({failures} of 2 targets missed)")
        return 1
    print("PASS: torch_varlen (both targets met)")
    return 0


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "hooked"
    if mode == "compare":
        if len(sys.argv) != 4:
            print("FAIL: torch_varlen compare HOOKED_OUTPUT EXPANDABLE_OUTPUT")
            return 1
        return compare(sys.argv[2], sys.argv[3])
    if mode not in ("hooked", "expandable"):
        print(f"FAIL: torch_varlen: unknown mode {mode!r} (hooked, expandable, compare)")
        return 1
    return run(mode, int(sys.argv[2]) if len(sys.argv) > 2 else 60)


if __name__ == "__main__":
    run_main(main, "torch_varlen")
