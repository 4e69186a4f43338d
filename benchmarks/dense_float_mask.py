"""A float mask that every tile reads, over the plain call: fwd+bwd of attngrad's attention
with a dense (1, 1, L, L) float mask (no gradient, no tile it could skip) beside the same
call without it, interleaved round by round in one process (the order alternating), float32,
B=1, H=8, d=64. Prints the median ratio over the rounds and their range.

    python benchmarks/dense_float_mask.py [--length 1024] [--rounds 9]

(`attngrad bench`'s float-mask case excludes a quarter of the keys, whose tiles the
passes skip: this one keeps every tile, so the ratio is the cost of reading the mask.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attngrad.torch import attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, args.length, 64, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 8, args.length, 64)
    bias = torch.randn(1, 1, args.length, args.length)

    def plain() -> None:
        torch.autograd.grad(attention(q, k, v), (q, k, v), dout)

    def masked() -> None:
        torch.autograd.grad(attention(q, k, v, attn_bias=bias), (q, k, v), dout)

    for run in (plain, masked, plain, masked):  # warm: the tiles built, the buffers sized
        run()
    ratios = []
    for r in range(args.rounds):
        times = {}
        for run in (plain, masked) if r % 2 == 0 else (masked, plain):
            start = time.perf_counter()
            run()
            times[run] = time.perf_counter() - start
        ratios.append(times[masked] / times[plain])
    print(f"dense float mask over plain, L={args.length} fwd+bwd, {torch.get_num_threads()} threads: median "
          f"{statistics.median(ratios):.3f} over {args.rounds} rounds, range {min(ratios):.3f}-{max(ratios):.3f}")


if __name__ == "__main__":
    main()
