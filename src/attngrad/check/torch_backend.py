"""`attngrad check --backend torch`: every case of the table through `attngrad.torch` too,
in both implementations (the compiled tiles and the torch-ops kernels), to first and
second order, against autograd of the same computation on PyTorch's math attention, and
to first order against attngrad's NumPy reference.

Each case is spelled in torch ops (`torch_oracle.computation`) twice, once with PyTorch's
math SDPA and once with `attngrad.torch.attention` in its place; for each implementation:

    gradient         out and every input's gradient of <out, dout>; also against the reference
    jvp              torch.func.jvp along random tangents of every input
    double backward  the gradient of <gradients, w> for random w (reverse over reverse)

With dropout, attngrad draws its keep-mask from its coordinate-keyed generator; the math
path and the reference are handed that same mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..torch.arguments import build_call
from ..torch.op import dropout as attngrad_dropout
from ..torch.op.autograd import differentiable_attention
from ..torch.op.dispatch import list_backends, use_backend
from .cases import Case
from .torch_oracle import AttendOptions, computation

DERIVATIVES = ("gradient", "jvp", "double backward")
SEED = 20261123  # attngrad's dropout seed in the check


@dataclass(frozen=True)
class BackendRow:
    """One case, one implementation, one derivative: the worst relative error over its tensors."""

    flavor: str
    variant: str
    implementation: str
    derivative: str
    vs_math: float
    vs_reference: Optional[float]  # first order only
    passed: bool


def _attngrad_attention(q, k, v, options: AttendOptions):
    call, layout = build_call(q, k, v, attn_mask=options.allowed, attn_bias=options.bias, dropout_p=options.dropout_p,
                              is_causal=options.is_causal, enable_gqa=options.enable_gqa, seed=torch.tensor(SEED))
    return layout.unfold(differentiable_attention(call))


def _with_attngrad_dropout(case: Case) -> Case:
    """The case with attngrad's own keep-mask in place of its drawn one."""
    if not case.fixed.get("dropout_p"):
        return case
    shape = case.fixed["keep_mask"].shape
    keep = attngrad_dropout.keep_scale_torch(torch.empty(shape, dtype=torch.float64), SEED, 0, case.fixed["dropout_p"]) > 0
    return dataclasses.replace(case, fixed={**case.fixed, "keep_mask": keep.numpy()})


def _worst(ours: list, theirs: list, floors: list[float]) -> float:
    worst = 0.0
    for a, b, floor in zip(ours, theirs, floors):
        a, b = np.asarray(a), np.asarray(b)
        scale = max(float(np.max(np.abs(b))) if b.size else 0.0, floor)
        worst = max(worst, float(np.max(np.abs(a - b))) / scale if scale > 0 else float(np.max(np.abs(a - b), initial=0.0)))
    return worst


def _derivatives(fn: Callable, primals: list[torch.Tensor], dout: torch.Tensor, tangents: list[torch.Tensor],
                 weights: list[torch.Tensor]) -> dict[str, list]:
    leaves = [p.detach().requires_grad_() for p in primals]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, dout, create_graph=True, allow_unused=True, materialize_grads=True)
    penalty = sum((g * w).sum() for g, w in zip(grads, weights))
    second = torch.autograd.grad(penalty, leaves, allow_unused=True, materialize_grads=True)
    out_t = torch.func.jvp(fn, tuple(p.detach() for p in primals), tuple(tangents))[1]
    numpy = lambda ts: [t.detach().numpy() for t in ts]  # noqa: E731
    return {"gradient": numpy([out, *grads]), "jvp": numpy([out_t]), "double backward": numpy(second)}


def every_derivative(fn: Callable, primals: tuple, seed: int,
                     names: tuple[str, ...] = ("q", "k", "v", "extra")) -> dict[str, torch.Tensor]:
    """Output, gradients, JVP, double backward (dO's too), forward-over-reverse HVP and reverse
    over forward (the gradient through the JVP, `rof_`, for the primals and their tangents) of `fn`
    at `primals` (q, k, v and an optional fourth, "extra"; or as `names` says), each pass run
    once or twice.
    Tangents, dO and the HVP's dO' are drawn in float64 from `seed` on the CPU, then cast to
    each primal's dtype and device, so every dtype and device sees the same numbers."""
    def like(t: torch.Tensor, s: int) -> torch.Tensor:
        draw = torch.randn(*t.shape, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
        return draw.to(device=t.device, dtype=t.dtype)

    tangents = tuple(like(p, seed + i) for i, p in enumerate(primals))
    leaves = [p.clone().requires_grad_() for p in primals]
    out = fn(*leaves)
    dout = like(out, seed + 10).requires_grad_()
    grads = torch.autograd.grad(out, leaves, dout, create_graph=True)
    inner = sum((g * c).sum() for g, c in zip(grads, tangents))
    second = torch.autograd.grad(inner, leaves + [dout])
    _, out_t = torch.func.jvp(fn, primals, tangents)
    vjp = lambda *x: torch.func.vjp(fn, *x[:-1])[1](x[-1])  # noqa: E731
    _, hvp = torch.func.jvp(vjp, primals + (dout.detach(),), tangents + (like(out, seed + 20),))
    # reverse over forward: the gradient of <c, J t> with respect to the primals and the tangents
    cotangent, n = like(out, seed + 30), len(primals)
    weighted_jvp = lambda *x: (torch.func.jvp(fn, x[:n], x[n:])[1] * cotangent).sum()  # noqa: E731
    rof = torch.func.grad(weighted_jvp, argnums=tuple(range(2 * n)))(*primals, *tangents)
    names = list(names[: len(primals)])
    return {"out": out.detach(), **{f"d{n}": g.detach() for n, g in zip(names, grads)}, "jvp": out_t.detach(),
            **{f"gg_{n}": g for n, g in zip(names + ["dout"], second)}, **{f"hvp_{n}": h for n, h in zip(names, hvp)},
            **{f"rof_{n}": g for n, g in zip(names + [f"t{n}" for n in names], rof)}}


def check_backend(case: Case, tol: float) -> list[BackendRow]:
    """Judge attngrad.torch on one case (float64), each implementation and derivative."""
    case = _with_attngrad_dropout(case)
    names = list(case.inputs)
    rng = np.random.default_rng([case.config.seed, 104729])
    primals = [torch.tensor(case.inputs[n]) for n in names]
    out_np = case.forward(case.inputs)
    dout_np = rng.standard_normal(out_np.shape)
    ref_out, ref_grads = case.gradients(case.inputs, dout_np)
    dout = torch.tensor(dout_np)
    tangents = [torch.tensor(rng.standard_normal(p.shape)) for p in primals]
    weights = [torch.tensor(rng.standard_normal(p.shape)) for p in primals]
    math = _derivatives(computation(case), primals, dout, tangents, weights)
    # a gradient that is 0 in exact arithmetic (b^K's) is judged against the case's others
    scale = max(float(np.max(np.abs(g))) for g in math["gradient"][1:])
    zero = [n in case.exact_zeros for n in names]
    floors = {"gradient": [0.0] + [scale if z else 0.0 for z in zero], "jvp": [0.0],
              "double backward": [max(float(np.max(np.abs(g))) for g in math["double backward"]) if z else 0.0
                                  for z in zero]}
    rows = []
    # Every backend that runs here, on the check's CPU tensors: Triton's only in its
    # interpreter, far too slow for every case (tests/attngrad_torch/backends/triton/test_passes.py holds it to
    # the math path instead).
    for implementation in [b.name for b in list_backends() if b.available and b.name != "triton"]:
        with use_backend(implementation):
            ours = _derivatives(computation(case, _attngrad_attention), primals, dout, tangents, weights)
        for derivative in DERIVATIVES:
            vs_math = _worst(ours[derivative], math[derivative], floors[derivative])
            vs_reference = None
            if derivative == "gradient":
                vs_reference = _worst(ours[derivative], [ref_out, *(ref_grads[n] for n in names)], floors[derivative])
            passed = vs_math <= tol and (vs_reference is None or vs_reference <= tol)
            rows.append(BackendRow(case.flavor, case.variant, implementation, derivative, vs_math, vs_reference, passed))
    return rows
