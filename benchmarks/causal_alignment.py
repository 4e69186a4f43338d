"""Bottom-right causal attention against top-left `is_causal`, fwd+bwd, float32, B=1, H=8, d=64.

Both alignments skip the blocks above their diagonal, so at Lq = Lk they do the same work;
with Lq < Lk (decoding with a cache) bottom-right sees more keys per row. Also timed: the
same bottom-right mask written out as a dense boolean tensor (what users had to pass
before), and PyTorch's `causal_lower_right` CausalBias through attngrad. Runs alternate in
one process; the figure is the median of each over the repeats.

    python benchmarks/causal_alignment.py [--length 2048] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.nn.attention.bias import causal_lower_right

from attngrad.bench.runner import cpu_name
from attngrad.torch import attention, scaled_dot_product_attention


def step(fn, q, k, v, dout):
    start = time.perf_counter()
    out = fn(q, k, v)
    torch.autograd.grad(out, (q, k, v), dout)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    length = args.length
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, load {os.getloadavg()[0]:.2f}")
    for len_q in (length, length // 2):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 8, len_q, 64, generator=g, requires_grad=True)
        k, v = (torch.randn(1, 8, length, 64, generator=g, requires_grad=True) for _ in range(2))
        dout = torch.randn(1, 8, len_q, 64, generator=g)
        dense = torch.ones(len_q, length, dtype=torch.bool).tril(length - len_q)
        fns = {
            "is_causal=True (top-left)": lambda q, k, v: attention(q, k, v, is_causal=True),
            'is_causal="bottom_right"': lambda q, k, v: attention(q, k, v, is_causal="bottom_right"),
            "CausalBias lower_right": lambda q, k, v: scaled_dot_product_attention(
                q, k, v, attn_mask=causal_lower_right(len_q, length)),
            "dense boolean bottom-right mask": lambda q, k, v: attention(q, k, v, attn_mask=dense),
        }
        for fn in fns.values():  # warm-up
            step(fn, q, k, v, dout)
        times = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                times[name].append(step(fn, q, k, v, dout))
        base = statistics.median(times['is_causal="bottom_right"'])
        top_left = statistics.median(times["is_causal=True (top-left)"])
        print(f"\nLq={len_q}, Lk={length}: fwd+bwd median of {args.repeats}")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"  {name:34s} {median * 1e3:8.1f} ms   {median / base:5.2f}x bottom-right   "
                  f"{median / top_left:5.2f}x top-left")


if __name__ == "__main__":
    main()
