"""A model run twice, under `replace_sdpa()` and on PyTorch's math path, to first and second
order: the tests of models that call `scaled_dot_product_attention` themselves share it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from attngrad.torch import SDPACalls, replace_sdpa


def _weights(shape: torch.Size, seed: int) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def first_and_second_order(forward: Callable[..., Tensor], inputs: dict[str, Tensor], model: nn.Module) -> dict:
    """forward(**inputs)'s output; the gradient of <W, output> with respect to every parameter
    and every floating input; its JVP along random tangents of the floating inputs; and every
    parameter's gradient of the gradient penalty sum |d<W, output>/d input|^2. The seed is
    reset before each forward, so that a model drawing random numbers (DiT's label dropout)
    draws the same ones every time."""
    floats = [name for name, t in inputs.items() if t.is_floating_point()]
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def run(**changed: Tensor) -> Tensor:
        torch.manual_seed(7)
        return forward(**{**inputs, **changed})

    leaves = {name: inputs[name].detach().requires_grad_() for name in floats}
    out = run(**leaves)
    w = _weights(out.shape, 1)
    every = list(leaves.values()) + [p for _, p in params]
    # allow_unused: a parameter the inputs never reach (a pooled projection a config leaves out)
    grads = torch.autograd.grad((out * w).sum(), every, create_graph=True, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, every)]
    penalty = sum((g * g).sum() for g in grads[:len(floats)])
    second = torch.autograd.grad(penalty, [p for _, p in params], allow_unused=True)
    tangents = tuple(_weights(inputs[name].shape, 2 + i) for i, name in enumerate(floats))
    _, out_t = torch.func.jvp(lambda *xs: run(**dict(zip(floats, xs))),
                              tuple(inputs[name].detach() for name in floats), tangents)
    results = {"output": out, "jvp": out_t}
    results.update({f"grad {n}": g for n, g in zip(floats + [n for n, _ in params], grads)})
    results.update({f"penalty grad {n}": torch.zeros_like(p) if g is None else g for (n, p), g in zip(params, second)})
    return {name: t.detach() for name, t in results.items()}


def replaced_and_math(forward: Callable[..., Tensor], inputs: dict[str, Tensor],
                      model: nn.Module) -> tuple[dict, dict, SDPACalls]:
    """first_and_second_order under replace_sdpa(strict=True) and on PyTorch's math path,
    with the SDPA calls the first one saw."""
    with replace_sdpa(strict=True) as calls:
        ours = first_and_second_order(forward, inputs, model)
    with sdpa_kernel(SDPBackend.MATH):
        theirs = first_and_second_order(forward, inputs, model)
    return ours, theirs, calls
