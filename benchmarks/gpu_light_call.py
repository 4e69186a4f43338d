"""The call the GPU programs time: a light call (no bias, mask tensor, softcap or dropout)
in bfloat16 on CUDA, B = 4, L = 4096, H * d = 2048 (the bars of docs/gpu.md)."""

from __future__ import annotations

from collections.abc import Callable

B, L, WIDTH = 4, 4096, 2048


def inputs(d: int) -> tuple[list, object]:
    """q, k, v as leaves that need their gradients, and an upstream gradient: random, seeded."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, dout = (torch.randn(B, WIDTH // d, L, d, generator=g, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    return [t.clone().requires_grad_() for t in (q, k, v)], dout


def triton_backward(d: int, causal: bool) -> Callable[[], tuple]:
    """A function that runs the backward of one such call through attngrad's Triton backend
    (its forward run once, here) and returns the gradients of q, k and v."""
    import torch

    from attngrad.torch import scaled_dot_product_attention, use_backend

    leaves, dout = inputs(d)
    with use_backend("triton"):
        out = scaled_dot_product_attention(*leaves, is_causal=causal)

    def backward() -> tuple:
        with use_backend("triton"):
            return torch.autograd.grad(out, leaves, dout, retain_graph=True)

    return backward
