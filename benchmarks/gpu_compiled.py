"""A Llama-style block on the Triton backend, compiled: graph breaks, host synchronisations
and the training step's time eager, under `torch.compile(fullgraph=True)` and under CUDA
graphs (`mode="reduce-overhead"`), interleaved. A program for a lent GPU (issue 60, item 8).

    python benchmarks/gpu_compiled.py --out DIR          # bfloat16, B=4, L=2048, d=128, causal
    python benchmarks/gpu_compiled.py --interpret        # a dry run on the CPU (interpreter, tiny)

For each way of running the block it prints:
    graph breaks   `torch._dynamo.explain` over one step (0 is the bar)
    syncs          whether a step after the first, with the same masks, ran without a host
                   synchronisation (`torch.cuda.set_sync_debug_mode("error")`: the first
                   one raises), which CUDA graphs need
    step           median ms of a forward and backward over interleaved rounds
    gradients      the largest relative difference of the parameters' gradients from eager's
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional


def block_class():
    import torch
    from torch import nn

    from attngrad.torch import scaled_dot_product_attention

    class Block(nn.Module):
        """RMSNorm, grouped-query causal self-attention, RMSNorm, a SwiGLU MLP: the attention
        through attngrad's scaled_dot_product_attention."""

        def __init__(self, width: int, heads: int, kv_heads: int) -> None:
            super().__init__()
            self.heads, self.kv_heads, self.d = heads, kv_heads, width // heads
            self.norm1, self.norm2 = nn.RMSNorm(width), nn.RMSNorm(width)
            self.wq = nn.Linear(width, width, bias=False)
            self.wkv = nn.Linear(width, 2 * kv_heads * self.d, bias=False)
            self.wo = nn.Linear(width, width, bias=False)
            hidden = 2 * width
            self.up = nn.Linear(width, 2 * hidden, bias=False)  # the gate and the up projection
            self.down = nn.Linear(hidden, width, bias=False)

        def forward(self, x):  # x (B, L, width)
            b, length, width = x.shape
            h = self.norm1(x)
            q = self.wq(h).view(b, length, self.heads, self.d).transpose(1, 2)  # (B, H, L, d)
            k, v = self.wkv(h).view(b, length, 2, self.kv_heads, self.d).permute(2, 0, 3, 1, 4)  # (B, Hkv, L, d)
            a = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.wo(a.transpose(1, 2).reshape(b, length, width))
            gate, up = self.up(self.norm2(x)).chunk(2, -1)
            return x + self.down(torch.nn.functional.silu(gate) * up)

    return Block


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interpret", action="store_true", help="CPU tensors in Triton's interpreter (no GPU)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None, help="a folder for compiled.json")
    args = parser.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
        args.batch, args.length, args.width, args.heads, args.kv_heads, args.rounds = 1, 40, 64, 4, 2, 1
    import torch
    import torch._dynamo

    from attngrad.torch import use_backend
    from attngrad.torch.op import dispatch

    device = "cpu" if args.interpret else "cuda"
    dtype = torch.float64 if args.interpret else torch.bfloat16
    torch.manual_seed(0)
    model = block_class()(args.width, args.heads, args.kv_heads).to(device, dtype)
    x = torch.randn(args.batch, args.length, args.width, device=device, dtype=dtype)
    dy = torch.randn_like(x)

    def step(fn) -> list:
        model.zero_grad(set_to_none=True)
        fn(x).backward(dy)
        return [p.grad.clone() for p in model.parameters()]

    ways = {"eager": model,
            "compiled": torch.compile(model, fullgraph=True),
            "reduce-overhead": torch.compile(model, fullgraph=True, mode="reduce-overhead")}
    results: dict = {}
    with use_backend("triton"):
        explained = torch._dynamo.explain(model)(x)
        reference = step(model)
        for name, fn in ways.items():
            before = dict(dispatch.ran)
            grads = step(fn)  # the first step: compiles, and makes the block map once
            step(fn)  # reduce-overhead records its graph on a later step
            ran = {key[1] for key, n in dispatch.ran.items() if n > before.get(key, 0)}
            synced = None
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    step(fn)
                    synced = False
                except RuntimeError as error:
                    synced = str(error).splitlines()[0]
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            error = max(float((g - r).abs().max() / r.abs().max().clamp_min(1e-30)) for g, r in zip(grads, reference))
            results[name] = dict(backends=sorted(ran), sync=synced, gradient_error=error, times=[])
        for _ in range(args.rounds):
            for name, fn in ways.items():
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(3):
                    step(fn)
                if device == "cuda":
                    torch.cuda.synchronize()
                results[name]["times"].append((time.perf_counter() - start) / 3 * 1e3)
    where = "CPU, Triton's interpreter" if device == "cpu" else torch.cuda.get_device_name()
    print(f"{where}; a Llama-style block, {dtype}, B={args.batch}, L={args.length}, width={args.width}, "
          f"heads={args.heads}/{args.kv_heads}; graph breaks over one step: {explained.graph_break_count}")
    for name, r in results.items():
        times = sorted(r["times"])
        r["median_ms"] = times[len(times) // 2]
        sync = "n/a (CPU)" if r["sync"] is None else "none" if r["sync"] is False else f"yes: {r['sync']}"
        print(f"{name:16s} step {r['median_ms']:9.2f} ms   syncs after the first step: {sync:10s}   "
              f"gradients vs eager {r['gradient_error']:.1e}   backends {r['backends']}")
    if args.out:
        with open(os.path.join(args.out, "compiled.json"), "w") as fh:
            json.dump(dict(device=where, graph_breaks=explained.graph_break_count, **results), fh, indent=1)
    return 0 if explained.graph_break_count == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
