"""float32 error on random shapes, attngrad's over PyTorch's default backend's.

Each case draws Lq and Lk from 1 to 300 (no multiple of a tile needed), d from 16, 59, 64
and 128, and one of: no mask, causal (top-left or bottom-right), a boolean mask, a learned
float bias (with its gradient), causal with a bias. For the output and every gradient, the
normwise error against the float64 truth (PyTorch's math backend in float64) is taken for
attngrad and for PyTorch's default backend, both in float32 on the same inputs; the ratio
is ours over theirs (below 1: attngrad is more accurate). Printed: the median and the
worst ratio over the cases, per result, and the worst cases.

    python benchmarks/float32_random.py              # 60 cases, about a minute on 2 cores
    python benchmarks/float32_random.py --cases 12   # a quick look
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attngrad.torch import attention

KINDS = ("none", "causal", "bottom-right", "mask", "bias", "causal+bias")
DIMS = (16, 59, 64, 128)


def normwise(x: torch.Tensor, truth: torch.Tensor) -> float:
    scale = float(truth.norm())
    return float((x.double() - truth).norm()) / scale if scale else float((x.double() - truth).norm())


def run(fn, q, k, v, mask, bias, dout, dtype):
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    extra = [] if bias is None else [bias.to(dtype).requires_grad_()]
    out = fn(*leaves, mask, *(extra or [None]))
    grads = torch.autograd.grad(out, leaves + extra, dout.to(dtype))
    names = ["out", "dq", "dk", "dv"] + (["dbias"] if extra else [])
    return dict(zip(names, [t.detach() for t in (out, *grads)]))


def case(rng: random.Random, seed: int) -> tuple[dict, dict, str]:
    len_q, len_k, dim = rng.randint(1, 300), rng.randint(1, 300), rng.choice(DIMS)
    kind = rng.choice(KINDS)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 4, n, dim, generator=g, dtype=torch.float64) for n in (len_q, len_k, len_k))
    dout = torch.randn(2, 4, len_q, dim, generator=g, dtype=torch.float64)
    mask = bias = None
    causal: bool | str = False
    if kind == "mask":
        mask = torch.rand(len_q, len_k, generator=g) > 0.3
        mask[:, 0] = True  # every row sees a key (PyTorch's default gives NaN to a row that sees none)
    if kind in ("bias", "causal+bias"):
        bias = torch.randn(4, len_q, len_k, generator=g, dtype=torch.float64)
    if kind in ("causal", "causal+bias"):
        causal = True
    if kind == "bottom-right":
        causal = "bottom_right"

    def ours(q, k, v, mask, bias):
        return attention(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=causal)

    def pytorch(q, k, v, mask, bias, math=False):
        allowed = mask
        if causal:
            offset = len_k - len_q if causal == "bottom_right" else 0
            tri = torch.ones(len_q, len_k, dtype=torch.bool).tril(offset)
            allowed = tri if allowed is None else allowed & tri
        attn = bias if allowed is None else (
            allowed if bias is None else bias.masked_fill(~allowed, float("-inf")))
        if math:
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn)

    if causal == "bottom_right" and len_q > len_k:  # rows that see no key: attngrad gives 0, PyTorch NaN
        causal = True
    truth = run(lambda *a: pytorch(*a, math=True), q, k, v, mask, bias, dout, torch.float64)
    ratios = {}
    mine = run(ours, q, k, v, mask, bias, dout, torch.float32)
    theirs = run(pytorch, q, k, v, mask, bias, dout, torch.float32)
    for name in truth:
        ratios[name] = normwise(mine[name], truth[name]) / max(normwise(theirs[name], truth[name]), 1e-30)
    return ratios, {"Lq": len_q, "Lk": len_k, "d": dim}, kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    by_result: dict[str, list[tuple[float, str]]] = {}
    for i in range(args.cases):
        ratios, shape, kind = case(rng, args.seed * 10_000 + i)
        for name, ratio in ratios.items():
            by_result.setdefault(name, []).append((ratio, f"{kind} {shape}"))
    print(f"float32 normwise error, attngrad over PyTorch's default backend, {args.cases} random cases "
          f"({torch.get_num_threads()} threads, torch {torch.__version__})")
    for name, values in by_result.items():
        ratios = [r for r, _ in values]
        worst = max(values)
        print(f"{name:6s} median {statistics.median(ratios):.2f}x  worst {worst[0]:.2f}x ({worst[1]})  "
              f"cases {len(values)}")


if __name__ == "__main__":
    main()
