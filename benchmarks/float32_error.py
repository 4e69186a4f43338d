"""float32 error of the passes beyond fwd+bwd, against PyTorch's on the same inputs.

For each result, the normwise error against the float64 truth (PyTorch's math backend in
float64), attngrad's over PyTorch's: below 1 is more accurate. PyTorch's side is the
backend it picks by default; it refuses forward mode on the CPU, so for the JVP and the
HVP it is its math backend, which runs them.

    bias-grad  fwd+bwd with a learned (H, L, L) bias: out, dq, dk, dv, dbias
    jvp        torch.func.jvp for tangents of q, k, v: the output's tangent
    hvp        torch.func.jvp of torch.func.grad of <dO, out>: the tangents of dq, dk, dv
    sinks      fwd+bwd with a learned logit per head (GPT-OSS's sinks): out, dq, dk, dv, dsinks
    sinks-hvp  the HVP with the sinks among the primals: the tangents of dq, dk, dv, dsinks

PyTorch's SDPA has no sinks: there its side is autograd of the definition in PyTorch
operators (softmax over the scores and one more column of the sink's logit, that column
dropped before multiplying by V).

    python benchmarks/float32_error.py            # B=2, H=4, L=1024, d=64, 4 seeds
    python benchmarks/float32_error.py --quick    # L=256, 2 seeds
    python benchmarks/float32_error.py --cases sinks sinks-hvp
    TRITON_INTERPRET=1 python benchmarks/float32_error.py --implementation triton --quick --cases sinks-hvp

Prints, per case and result, the smallest and largest ratio over the seeds.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attngrad.torch import attention, use_backend


def math_sdpa(*args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


def error(result: torch.Tensor, truth: torch.Tensor) -> float:
    truth = truth.detach()
    return float((result.detach().double() - truth).norm() / truth.norm())


def bias_grad_results(sdpa: Callable, inputs: dict, causal: bool, dtype: torch.dtype, ours: bool) -> tuple:
    """(out, dq, dk, dv, dbias) in `dtype`; PyTorch's function takes the causal mask spelled into the bias."""
    leaves = [inputs[n].to(dtype).requires_grad_() for n in ("q", "k", "v", "bias")]
    q, k, v, bias = leaves
    if ours:
        out = attention(q, k, v, attn_bias=bias, is_causal=causal)
    else:
        length = q.shape[-2]
        allowed = torch.ones(length, length, dtype=torch.bool).tril()
        out = sdpa(q, k, v, attn_mask=bias.masked_fill(~allowed, float("-inf")) if causal else bias)
    return (out, *torch.autograd.grad(out, leaves, inputs["dout"].to(dtype)))


def tangent_results(sdpa: Callable, inputs: dict, causal: bool, dtype: torch.dtype, hvp: bool) -> tuple:
    """The output's tangent (jvp) or the tangents of dq, dk, dv (hvp), in `dtype`."""
    primals = tuple(inputs[n].to(dtype) for n in ("q", "k", "v"))
    tangents = tuple(inputs[n].to(dtype) for n in ("tq", "tk", "tv"))

    def forward(q, k, v):
        return sdpa(q, k, v, is_causal=causal)

    if not hvp:
        return (torch.func.jvp(forward, primals, tangents)[1],)

    def loss(q, k, v):
        return (forward(q, k, v) * inputs["dout"].to(dtype)).sum()

    return torch.func.jvp(torch.func.grad(loss, argnums=(0, 1, 2)), primals, tangents)[1]


def with_sinks(q, k, v, sinks, causal: bool):
    """softmax([S | s_h]) without its last column, times V: the definition of sinks."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        length = q.shape[-2]
        scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    column = sinks[:, None, None].expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1] @ v


def sink_results(inputs: dict, causal: bool, dtype: torch.dtype, ours: bool, hvp: bool) -> tuple:
    """(out, dq, dk, dv, dsinks), or with `hvp` the tangents of (dq, dk, dv, dsinks), in `dtype`."""
    def forward(q, k, v, sinks):
        return attention(q, k, v, sinks=sinks, is_causal=causal) if ours else with_sinks(q, k, v, sinks, causal)

    primals = tuple(inputs[n].to(dtype) for n in ("q", "k", "v", "sinks"))
    dout = inputs["dout"].to(dtype)
    if hvp:
        tangents = tuple(inputs[n].to(dtype) for n in ("tq", "tk", "tv", "tsinks"))
        return torch.func.jvp(lambda *p: torch.func.vjp(forward, *p)[1](dout), primals, tangents)[1]
    leaves = [p.requires_grad_() for p in primals]
    out = forward(*leaves)
    return (out, *torch.autograd.grad(out, leaves, dout))


CASES = {
    "bias-grad": ("out", "dq", "dk", "dv", "dbias"),
    "jvp": ("out_t",),
    "hvp": ("dq_t", "dk_t", "dv_t"),
    "sinks": ("out", "dq", "dk", "dv", "dsinks"),
    "sinks-hvp": ("dq_t", "dk_t", "dv_t", "dsinks_t"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L=256 and 2 seeds")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), help="what to measure")
    parser.add_argument("--implementation", choices=("tiles", "torch-ops", "triton"),
                        help="attngrad's backend (default: the one its registry picks; triton on CPU tensors needs "
                             "TRITON_INTERPRET=1)")
    args = parser.parse_args()

    def allowed() -> contextlib.AbstractContextManager:
        return use_backend(args.implementation) if args.implementation else contextlib.nullcontext()

    length, seeds = (256, 2) if args.quick else (1024, 4)
    from attngrad.torch import scaled_dot_product_attention as ours_sdpa

    start = time.perf_counter()
    print(f"B=2, H=4, L={length}, d=64, {seeds} seeds; {torch.get_num_threads()} threads; "
          f"{args.implementation or 'the backend attngrad picks'}; "
          "attngrad's float32 error over PyTorch's (min-max over the seeds)")
    for case in args.cases:
        names = CASES[case]
        for causal in (False, True):
            ratios: dict[str, list[float]] = {name: [] for name in names}
            for seed in range(seeds):
                g = torch.Generator().manual_seed(seed)
                inputs = {n: torch.randn(2, 4, length, 64, generator=g, dtype=torch.float64)
                          for n in ("q", "k", "v", "dout", "tq", "tk", "tv")}
                inputs["bias"] = torch.randn(4, length, length, generator=g, dtype=torch.float64)
                inputs["sinks"], inputs["tsinks"] = 2 * torch.randn(2, 4, generator=g, dtype=torch.float64)
                if case.startswith("sinks"):
                    hvp = case == "sinks-hvp"
                    truth = sink_results(inputs, causal, torch.float64, ours=False, hvp=hvp)
                    with allowed():
                        mine = sink_results(inputs, causal, torch.float32, ours=True, hvp=hvp)
                    theirs = sink_results(inputs, causal, torch.float32, ours=False, hvp=hvp)
                elif case == "bias-grad":
                    truth = bias_grad_results(math_sdpa, inputs, causal, torch.float64, ours=False)
                    with allowed():
                        mine = bias_grad_results(ours_sdpa, inputs, causal, torch.float32, ours=True)
                    theirs = bias_grad_results(F.scaled_dot_product_attention, inputs, causal, torch.float32,
                                               ours=False)
                else:
                    hvp = case == "hvp"
                    truth = tangent_results(math_sdpa, inputs, causal, torch.float64, hvp)
                    with allowed():
                        mine = tangent_results(ours_sdpa, inputs, causal, torch.float32, hvp)
                    theirs = tangent_results(math_sdpa, inputs, causal, torch.float32, hvp)
                for name, a, b, t in zip(names, mine, theirs, truth):
                    ratios[name].append(error(a, t) / error(b, t))
            against = {"bias-grad": "default", "sinks": "definition", "sinks-hvp": "definition"}.get(case, "math")
            line = ", ".join(f"{name} {min(r):.2f}-{max(r):.2f}" for name, r in ratios.items())
            print(f"{case:9s} {'causal' if causal else 'full':6s} (vs PyTorch {against}): {line}", flush=True)
    print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
