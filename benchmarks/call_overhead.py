"""What a call costs beyond its arithmetic: attngrad's scaled_dot_product_attention beside
PyTorch's, side by side in one process, interleaved (the median of --repeats rounds, each
the median of --calls calls), float32:

    tiny forward    no gradient, q (1, 1, 1, 64) against 16 keys: almost nothing but the call
    tiny fwd+bwd    (1, 1, 16, 64), forward and backward
    masked          (1, 4, 32, 32) fwd+bwd with a (B, 1, L, L) boolean mask, as a transformers
                    layer passes causal and padding masks
    decode          no gradient, q (4, 8, 1, 64) against 4096 keys (the bench's decode case)
    causal B=4      fwd+bwd at (4, 8, L, 64), L = 128 and 256 (the bench's "small" cases)

and, for the two tiny calls, attngrad's time less PyTorch's: the overhead per call.
Prints one line per case and the machine; --quick runs fewer calls for a smoke run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from attngrad.bench.runner import cpu_name
from attngrad.torch import scaled_dot_product_attention


def _step(fn, q, k, v, dout, is_causal: bool, mask=None):
    """One call of `fn`, with its backward where dout is given."""
    options = {"attn_mask": mask} if mask is not None else {"is_causal": is_causal}
    if dout is None:
        def forward():
            with torch.no_grad():
                fn(q, k, v, **options)

        return forward
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def run():
        fn(*leaves, **options).backward(dout)

    return run


def _median_us(step, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _compare(name: str, shapes: tuple, grad: bool, is_causal, repeats: int, calls: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    (b, h, lq, lk, d) = shapes
    q = torch.randn(b, h, lq, d, generator=g)
    k, v = (torch.randn(b, h, lk, d, generator=g) for _ in range(2))
    dout = torch.randn(b, h, lq, d, generator=g) if grad else None
    mask = None
    if is_causal == "mask":  # as a transformers layer passes it: causal and padding in one (B, 1, Lq, Lk) boolean
        mask = torch.ones(lq, lk, dtype=torch.bool).tril().expand(b, 1, lq, lk).clone()
        mask[:, :, :, :2] = False  # two padded keys
        mask[:, :, :, 0] |= torch.eye(lq, lk, dtype=torch.bool)[:, 0]  # the first query keeps a key
    steps = {"attngrad": _step(scaled_dot_product_attention, q, k, v, dout, is_causal, mask),
             "torch": _step(F.scaled_dot_product_attention, q, k, v, dout, is_causal, mask)}
    for step in steps.values():  # warm: the tiles' first build, caches, the allocator
        for _ in range(max(3, calls // 10)):
            step()
    rounds = {impl: [] for impl in steps}
    for _ in range(repeats):
        for impl, step in steps.items():
            rounds[impl].append(_median_us(step, calls))
    ours, theirs = (statistics.median(rounds[impl]) for impl in ("attngrad", "torch"))
    return name, ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200, help="calls per round of the tiny cases")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    calls = 20 if args.quick else args.calls
    repeats = 2 if args.quick else args.repeats
    cases = [("tiny forward, no grad", (1, 1, 1, 16, 64), False, False, calls),
             ("tiny fwd+bwd", (1, 1, 16, 16, 64), True, False, calls),
             ("(1, 4, 32, 32) masked fwd+bwd", (1, 4, 32, 32, 32), True, "mask", calls),
             ("decode B=4 Lk=4096, no grad", (4, 8, 1, 4096, 64), False, False, max(5, calls // 10)),
             ("causal B=4 L=128 fwd+bwd", (4, 8, 128, 128, 64), True, True, max(5, calls // 10)),
             ("causal B=4 L=256 fwd+bwd", (4, 8, 256, 256, 64), True, True, max(5, calls // 20))]
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'case':32} {'attngrad':>12} {'torch':>12} {'ratio':>7} {'overhead':>10}")
    for name, shapes, grad, is_causal, n in cases:
        name, ours, theirs = _compare(name, shapes, grad, is_causal, repeats, n)
        extra = f"{ours - theirs:8.0f} us" if name.startswith("tiny") else ""
        print(f"{name:32} {ours:9.0f} us {theirs:9.0f} us {ours / theirs:6.2f}x {extra:>10}")


if __name__ == "__main__":
    main()
