"""float32 accuracy with a float mask that requires grad (issue 58), against PyTorch's own.

For the output and every gradient (the mask's included), the error
    max|x - truth| / max|truth|
against the truth, autograd in float64 of the definition softmax(scale q k^T + mask) v on
the same (float32-rounded) inputs, driven by a random dout. Candidates, each in float32:
attngrad on the "tiles" and the "torch-ops" backends, PyTorch's math path and its default
SDPA (which, with a float mask that requires grad, runs the math path on the CPU, torch
2.13: its output's autograd node is the math path's last matmul, UnsafeViewBackward0, not
the flash kernel's, and every result is bit-equal to the math path's; the program prints
both facts per case). Printed per case and result: ours, PyTorch's (the better of its two)
and the ratio; a ratio above 2 is marked.

The fixed cases, from peers' test grids:
    alibi-mqa   ALiBi, Lq=113, Lk=211, d=64, B=2, H=8, Hkv=1
    alibi-gqa   ALiBi, Lq=1024, Lk=1023, d=40, B=2, H=8, Hkv=2
    keys        a mask (1, 514): one number per key, Lq=267, Lk=514, d=64, B=2, H=4
    rows        a mask (267, 1): one number per query row, the same sizes (its gradient is 0
                in exact arithmetic: there the absolute error is printed)
    batch-keys  a mask (2, 1, 1, 514): per batch entry and key, the same sizes
The ALiBi bias (H, Lq, Lk), one per head and shared by the batch entries, as flash-attn's
tests build it without causal, -slope_h |i + Lk - Lq - j|, with the standard slopes
2^(-8 (h + 1) / H); B=2 and H=8 (MQA: 8 query heads on 1 key/value head, GQA: on 2). The
other masks are standard normal, B=2 and H=4. Then `--random` cases draw a mask shape among (Lk,), (Lq, 1), (1, Lk), (H, 1, Lk),
(B, 1, 1, Lk), (1, H, Lq, 1), (H, Lq, Lk), (B, H, Lq, Lk), and Lq, Lk in 1..600, d, H and
Hkv at random.

    python benchmarks/float32_mask_grads.py              # the five cases and 8 random ones
    python benchmarks/float32_mask_grads.py --random 0 --backends tiles
"""

from __future__ import annotations

import argparse
import contextlib
import random

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attngrad.torch import scaled_dot_product_attention, use_backend

NAMES = ("out", "dq", "dk", "dv", "dmask")
RANDOM_SHAPES = ("Lk", "Lq,1", "1,Lk", "H,1,Lk", "B,1,1,Lk", "1,H,Lq,1", "H,Lq,Lk", "B,H,Lq,Lk")


def alibi(heads: int, len_q: int, len_k: int) -> torch.Tensor:
    """The ALiBi bias (H, Lq, Lk) of flash-attn's tests (non-causal), the standard slopes."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1, dtype=torch.float64) / heads)
    i = torch.arange(len_q, dtype=torch.float64)[:, None]
    j = torch.arange(len_k, dtype=torch.float64)[None, :]
    return -slopes[:, None, None] * (i + len_k - len_q - j).abs()


def make_case(batch, heads, kv_heads, len_q, len_k, dim, mask, seed):
    """q, k, v, dout and the mask, rounded to float32 (the truth starts from the same numbers)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, len_q, dim, generator=g)
    k = torch.randn(batch, kv_heads, len_k, dim, generator=g)
    v = torch.randn(batch, kv_heads, len_k, dim, generator=g)
    dout = torch.randn(batch, heads, len_q, dim, generator=g)
    if not isinstance(mask, torch.Tensor):  # a shape: standard normal entries
        mask = torch.randn(mask, generator=g)
    return dict(q=q, k=k, v=v, mask=mask.float(), dout=dout)


def definition(q, k, v, mask):
    """softmax(scale q k^T + mask) v, GQA's heads repeated: the truth's definition."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + mask
    return torch.softmax(scores, dim=-1) @ v


def pytorch_default(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def pytorch_math(q, k, v, mask):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def ours(q, k, v, mask):
    return scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def results(fn, case, dtype, backend=None):
    """(out, dq, dk, dv, dmask) of fn in `dtype`, and out's autograd node's name; with
    `backend`, the forward and the backward both on that one of attngrad's."""
    leaves = [case[n].to(dtype).requires_grad_() for n in ("q", "k", "v", "mask")]
    with use_backend(backend) if backend else contextlib.nullcontext():
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, case["dout"].to(dtype))
    return [t.detach() for t in (out, *grads)], type(out.grad_fn).__name__


def error(x: torch.Tensor, truth: torch.Tensor) -> float:
    """max|x - truth| / max|truth|; the absolute error where the truth is rounding alone (the
    gradient of a mask constant along the keys is 0 in exact arithmetic)."""
    scale = float(truth.abs().max()) if truth.numel() else 0.0
    diff = float((x.double() - truth).abs().max()) if truth.numel() else 0.0
    return diff / scale if scale > 1e-12 else diff


def errors(case: dict, backends: list[str]) -> tuple[dict, str]:
    """{candidate: {result: error}} on one case, and what PyTorch's default ran."""
    truth, _ = results(definition, case, torch.float64)
    out, got = {}, {}
    node = ""
    for name, fn, backend in [("torch math", pytorch_math, None), ("torch default", pytorch_default, None)] + \
            [(b, ours, b) for b in backends]:
        got[name], grad_fn = results(fn, case, torch.float32, backend)
        out[name] = {r: error(x, t) for r, x, t in zip(NAMES, got[name], truth)}
        if name == "torch default":
            node = grad_fn
    same = all(torch.equal(a, b) for a, b in zip(got["torch math"], got["torch default"]))
    return out, f"{node}, {'bit-equal to' if same else 'apart from'} the math path's results"


def report(title: str, case: dict, backends: list[str], worst: dict) -> None:
    errs, node = errors(case, backends)
    print(f"{title}   (PyTorch's default ran {node})")
    print(f"  {'':6s} {'torch math':>11s} {'torch dflt':>11s}" + "".join(f" {b:>11s} {'ratio':>6s}" for b in backends))
    for r in NAMES:
        theirs = min(errs["torch math"][r], errs["torch default"][r])
        line = f"  {r:6s} {errs['torch math'][r]:11.2e} {errs['torch default'][r]:11.2e}"
        for b in backends:
            ratio = errs[b][r] / theirs if theirs else (0.0 if errs[b][r] == 0 else float("inf"))
            worst[(b, r)] = max(worst.get((b, r), (0.0, "")), (ratio, title))
            line += f" {errs[b][r]:11.2e} {ratio:6.2f}" + ("!" if ratio > 2 else " ")
        print(line)


def fixed_cases():
    yield "alibi-mqa Lq=113 Lk=211 d=64 B=2 H=8 Hkv=1 mask (8, 113, 211)", \
        make_case(2, 8, 1, 113, 211, 64, alibi(8, 113, 211), 1)
    yield "alibi-gqa Lq=1024 Lk=1023 d=40 B=2 H=8 Hkv=2 mask (8, 1024, 1023)", \
        make_case(2, 8, 2, 1024, 1023, 40, alibi(8, 1024, 1023), 2)
    for name, shape, seed in (("keys", (1, 514), 3), ("rows", (267, 1), 4), ("batch-keys", (2, 1, 1, 514), 5)):
        yield f"{name} Lq=267 Lk=514 d=64 B=2 H=4 mask {shape}", make_case(2, 4, 4, 267, 514, 64, shape, seed)


def random_cases(count: int, seed: int):
    rng = random.Random(seed)
    for index in range(count):
        batch, heads = 2, rng.choice((4, 8))
        kv_heads = rng.choice([h for h in (1, 2, heads) if heads % h == 0])
        len_q, len_k, dim = rng.randint(1, 600), rng.randint(1, 600), rng.choice((32, 40, 64, 80, 128))
        sizes = dict(B=batch, H=heads, Lq=len_q, Lk=len_k)
        kind = rng.choice(RANDOM_SHAPES)
        shape = tuple(sizes[a] if a in sizes else int(a) for a in kind.split(","))
        yield (f"random {index}: Lq={len_q} Lk={len_k} d={dim} B={batch} H={heads} Hkv={kv_heads} mask {shape}",
               make_case(batch, heads, kv_heads, len_q, len_k, dim, shape, seed * 1000 + index))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["tiles", "torch-ops"])
    parser.add_argument("--random", type=int, default=8, help="random cases after the fixed five")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="fixed cases whose title starts with one of these")
    args = parser.parse_args()
    print(f"float32 error max|x - truth| / max|truth|, truth float64; ratio: ours over PyTorch's better "
          f"({torch.get_num_threads()} threads, torch {torch.__version__})")
    worst: dict = {}
    for title, case in fixed_cases():
        if args.only is None or any(title.startswith(o) for o in args.only):
            report(title, case, args.backends, worst)
    for title, case in random_cases(args.random, args.seed):
        report(title, case, args.backends, worst)
    print("worst ratio per backend and result:")
    for (b, r), (ratio, title) in sorted(worst.items()):
        print(f"  {b:10s} {r:6s} {ratio:6.2f}  {title}")


if __name__ == "__main__":
    main()
