"""What `attngrad bench` measures: the cases, the implementations, the FLOP convention."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

IMPLEMENTATIONS = ("attngrad", "torch-default", "torch-math")


@dataclass(frozen=True)
class BenchCase:
    """Forward + backward of one attention call: (B, H, L, d) float32 q, k, v."""

    length: int
    causal: bool = False
    bias_grad: bool = False  # a float (H, L, L) attention bias that requires grad
    dropout: float = 0.0
    batch: int = 1
    heads: int = 8
    dim: int = 64

    @property
    def name(self) -> str:
        parts = ["causal" if self.causal else "full"]
        if self.bias_grad:
            parts.append("bias-grad")
        if self.dropout:
            parts.append(f"dropout{self.dropout:g}")
        return "+".join(parts)

    @property
    def flops(self) -> float:
        """FlashAttention's convention: forward 4 B H L^2 d, backward 2.5x that; causal halves it."""
        forward = 4.0 * self.batch * self.heads * self.length * self.length * self.dim
        return 3.5 * forward / (2.0 if self.causal else 1.0)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "name": self.name}


def default_cases(lengths: tuple[int, ...]) -> list[BenchCase]:
    cases = []
    for length in lengths:
        cases += [
            BenchCase(length),
            BenchCase(length, causal=True),
            BenchCase(length, bias_grad=True),
            BenchCase(length, causal=True, bias_grad=True),
            BenchCase(length, dropout=0.1),
        ]
    return cases


def make_inputs(case: BenchCase, seed: int = 0) -> dict[str, Any]:
    """Identical float32 inputs for every implementation (and a random upstream gradient)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (case.batch, case.heads, case.length, case.dim)
    tensors = {name: torch.randn(shape, generator=g) for name in ("q", "k", "v", "dout")}
    if case.bias_grad:
        tensors["bias"] = torch.randn(case.heads, case.length, case.length, generator=g)
    return tensors


def step(implementation: str, case: BenchCase) -> Callable[[dict[str, Any]], None]:
    """One forward + backward of `implementation` on the case's inputs."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..torch import attention
    from ..torch import scaled_dot_product_attention as ours

    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r}; choose from {IMPLEMENTATIONS}")

    def run(inputs: dict[str, Any]) -> None:
        leaves = [inputs[n].detach().requires_grad_() for n in ("q", "k", "v")]
        bias = inputs["bias"].detach().requires_grad_() if case.bias_grad else None
        kwargs = dict(attn_mask=bias, is_causal=case.causal, dropout_p=case.dropout)
        if case.causal and bias is not None:
            if implementation == "attngrad":  # its own entry point takes both, and skips the causal half
                out = attention(*leaves, attn_bias=bias, is_causal=True, dropout_p=case.dropout)
                out.backward(inputs["dout"])
                return
            # PyTorch's function refuses both: the causal mask is spelled into the bias
            tri = torch.ones(case.length, case.length, dtype=torch.bool).tril()
            kwargs.update(attn_mask=bias.masked_fill(~tri, float("-inf")), is_causal=False)
        if implementation == "attngrad":
            out = ours(*leaves, **kwargs)
        elif implementation == "torch-default":
            out = F.scaled_dot_product_attention(*leaves, **kwargs)
        else:
            with sdpa_kernel(SDPBackend.MATH):
                out = F.scaled_dot_product_attention(*leaves, **kwargs)
        out.backward(inputs["dout"])

    return run
