#!/usr/bin/env python3
"""torch_graph: torch.cuda.graph after torch.cuda.empty_cache, PyTorch's caching allocator on.

The capture then has to allocate new segments (cudaMalloc in relaxed capture mode, legal
natively): the case where a hook that synchronizes during capture invalidates it (issue 14).
A small model (LayerNorm, Linear layers through cuBLAS, GELU, a matmul) is warmed up on a side
stream, the cache is emptied, the forward pass is captured, then replayed for four inputs and
compared with eager runs of the same inputs.

Prints "R capture ok", "R input K max_abs_diff <repr>" (0.0 natively) and "R input K sum
<repr>" (compared with the native run, bit for bit), "I ..." information and a final PASS/FAIL
line. Exit 0 pass, 1 fail, 77 skip (no torch, no GPU).
"""
import ctypes
import os
import sys


def skip(msg):
    print(f"SKIP: {msg}")
    print("SKIP: torch_graph (exit 77)")
    sys.stdout.flush()
    sys.exit(77)


def hook_loaded():
    if os.environ.get("VMMHOOK_DISABLE", "").lower() in ("1", "true", "yes", "on"):
        return False
    try:
        ctypes.CDLL(None).vmm_owns
        return True
    except (AttributeError, OSError):
        return False


def main():
    os.environ.pop("PYTORCH_NO_CUDA_MEMORY_CACHING", None)
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure is a skip with its reason
        skip(f"no PyTorch: import torch -> {type(e).__name__}: {e}")
    if not torch.cuda.is_available():
        skip("no CUDA device: torch.cuda.is_available() is False")
    hook = hook_loaded()
    failures = []
    if os.environ.get("GPUTEST_EXPECT_HOOK") == "1" and not hook:
        failures.append("GPUTEST_EXPECT_HOOK=1 but vmm_owns is not visible in the process")
    print(f"I torch {torch.__version__}, CUDA {torch.version.cuda}, hook "
          f"{'loaded' if hook else 'absent'}")
    torch.manual_seed(4321)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda:0")
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)
            self.mix = nn.Parameter(torch.randn(d, d) / d ** 0.5)

        def forward(self, x):
            h = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
            return x + h + torch.matmul(x, self.mix)

    model = nn.Sequential(*[Block(1024) for _ in range(4)]).to(dev).eval()
    static_x = torch.zeros(256, 1024, device=dev)
    gen = torch.Generator().manual_seed(7)
    inputs = [torch.randn(256, 1024, generator=gen) for _ in range(4)]

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model(static_x)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the capture must allocate new segments
        reserved_before = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                static_out = model(static_x)
            torch.cuda.synchronize()
            print("R capture ok")
        except Exception as e:  # noqa: BLE001 - the error is the result
            print(f"R capture failed: {type(e).__name__}")
            print(f"I capture error: {e}")
            failures.append(f"torch.cuda.graph failed: {type(e).__name__}: {e}")
            graph = None
        print(f"I reserved before capture {reserved_before}, after "
              f"{torch.cuda.memory_reserved()} bytes")
        if graph is not None:
            for k, xin in enumerate(inputs):
                static_x.copy_(xin.to(dev))
                graph.replay()
                got = static_out.clone()
                ref = model(xin.to(dev))
                torch.cuda.synchronize()
                diff = (got - ref).abs().max().item()
                print(f"R input {k} max_abs_diff {diff!r}")
                print(f"R input {k} sum {got.double().sum().item()!r}")
                if diff != 0.0:
                    failures.append(f"input {k}: graph replay differs from eager by {diff!r}")
    del graph, model
    torch.cuda.synchronize()
    for f in failures:
        print(f"FAIL {f}")
    if failures:
        print(f"FAIL: torch_graph ({len(failures)} failures)")
        return 1
    print("PASS: torch_graph")
    return 0


if __name__ == "__main__":
    from torch_train import run_main  # the exit convention of the tests/gpu Python checks

    run_main(main, "torch_graph")
