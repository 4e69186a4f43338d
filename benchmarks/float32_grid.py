"""float32 accuracy on flash-attn's test grid, by flash-attn's own rule.

flash-attn's tests accept a low-precision kernel when, for the output and each gradient,
    max|kernel - truth| <= 2 * max|baseline - truth|,
where the baseline is a plain implementation in the same precision. Here the precision is
float32, the truth is that plain implementation in float64, and the candidates are
attngrad, PyTorch's math backend (the control) and PyTorch's default CPU kernel. The grid
follows flash-attn's test_flash_attn_output: its seqlen pairs, head dims from 32 to 256
(59 and 111 included), MHA / GQA / MQA, causal (bottom-right, flash-attn's alignment) or not.

    python benchmarks/float32_grid.py            # the grid below, a few minutes on 2 cores
    python benchmarks/float32_grid.py --quick    # a handful of cases

Prints one line per failing case and a count per candidate.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attngrad.torch import attention

SEQLENS = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1023, 1024)]
HEAD_DIMS = [32, 59, 64, 111, 128, 256]
KV_HEADS = {"mha": 6, "gqa": 2, "mqa": 1}


def plain(q, k, v, allowed):
    """The baseline: softmax(q k^T / sqrt(d)) v, spelled out, rows with no key giving 0."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return p @ v


def math_sdpa(q, k, v, allowed):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)


def default_sdpa(q, k, v, allowed):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)


def ours(q, k, v, allowed):
    return attention(q, k, v, is_causal="bottom_right" if allowed is not None else False, enable_gqa=True)


CANDIDATES = {"attngrad": ours, "torch math": math_sdpa, "torch default": default_sdpa}


def results(fn, leaves, dout, allowed):
    leaves = [t.detach().requires_grad_() for t in leaves]
    out = fn(*leaves, allowed)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


def max_err(a, b):
    return float((a.double() - b).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a handful of cases")
    args = parser.parse_args()
    grid = list(itertools.product(SEQLENS, HEAD_DIMS, KV_HEADS, (False, True)))
    if args.quick:
        grid = grid[::23]
    failures = {name: 0 for name in CANDIDATES}
    start = time.perf_counter()
    for (len_q, len_k), dim, kind, causal in grid:
        g = torch.Generator().manual_seed(len_q * 7 + dim)
        q = torch.randn(2, 6, len_q, dim, generator=g, dtype=torch.float64)
        k = torch.randn(2, KV_HEADS[kind], len_k, dim, generator=g, dtype=torch.float64)
        v = torch.randn(2, KV_HEADS[kind], len_k, dim, generator=g, dtype=torch.float64)
        dout = torch.randn(2, 6, len_q, dim, generator=g, dtype=torch.float64)
        allowed = torch.ones(len_q, len_k, dtype=torch.bool).tril(len_k - len_q) if causal else None
        truth = results(plain, (q, k, v), dout, allowed)
        low = [t.float() for t in (q, k, v)]
        baseline = [max_err(a, b) for a, b in zip(results(plain, low, dout.float(), allowed), truth)]
        for name, fn in CANDIDATES.items():
            errors = [max_err(a, b) for a, b in zip(results(fn, low, dout.float(), allowed), truth)]
            bad = [t for t, e, b in zip(("out", "dq", "dk", "dv"), errors, baseline) if e > 2 * b]
            if bad:
                failures[name] += 1
                detail = ", ".join(f"{t} {e:.1e} vs 2 x {b:.1e}" for t, e, b in zip(("out", "dq", "dk", "dv"), errors, baseline)
                                   if t in bad)
                print(f"FAIL {name:13s} Lq={len_q} Lk={len_k} d={dim} {kind} causal={causal}: {detail}")
    seconds = time.perf_counter() - start
    print(f"\n{len(grid)} cases, float32 against float64, 2x rule, {seconds:.0f} s, {torch.get_num_threads()} threads:")
    for name, count in failures.items():
        print(f"  {name:13s} fails {count}")


if __name__ == "__main__":
    main()
