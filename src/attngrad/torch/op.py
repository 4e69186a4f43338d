"""The tiled kernels as PyTorch operators, with autograd: a thin wrapper over `kernels`.

Two custom ops, `attngrad::attention_forward` and `attngrad::attention_backward`, so that
torch.compile treats each pass as one opaque operator (their Python loops are not traced).
`Attention`, an autograd.Function with a separate setup_context, joins them, so that
autograd, torch.compile(fullgraph=True) and torch.func all see one differentiable op.
(torch.library's own register_autograd would be the shorter spelling, but the wrapper it
generates in torch 2.13 has no setup_context, and torch.func refuses it: pytorch#170834.)

The forward saves q, k, v, the masks, out, and per query row the score maximum and the
inverse softmax denominator: O(L). The backward recomputes the rest block by block.
`seed` is a 0-d int64 tensor (drawn by the caller from PyTorch's generator) so that a
compiled graph can draw it too.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from . import kernels


@torch.library.custom_op("attngrad::attention_forward", mutates_args=())
def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor], seed: Tensor,
    is_causal: bool, scale: float, dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor]:
    return kernels.attention_forward(q, k, v, mask, bias, int(seed), is_causal, scale, dropout_p)


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, mask, bias, seed, is_causal, scale, dropout_p):
    batch, heads, len_q, _ = q.shape
    stats = dict(dtype=kernels.compute_dtype(q.dtype))
    return q.new_empty(batch, heads, len_q, v.shape[-1]), q.new_empty(batch, heads, len_q, **stats), q.new_empty(batch, heads, len_q, **stats)


@torch.library.custom_op("attngrad::attention_backward", mutates_args=())
def attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor], seed: Tensor,
    out: Tensor, row_max: Tensor, inv_sum: Tensor, is_causal: bool, scale: float, dropout_p: float, bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, dbias = kernels.attention_backward(
        dout, q, k, v, mask, bias, int(seed), out, row_max, inv_sum, is_causal, scale, dropout_p, bias_grad
    )
    return dq, dk, dv, dbias if dbias is not None else q.new_empty(0)  # ops return tensors, not None


@attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, mask, bias, seed, out, row_max, inv_sum, is_causal, scale, dropout_p, bias_grad):
    dbias = bias.new_empty(bias.shape) if bias_grad else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias


def _nested_functorch_level() -> bool:
    """True inside two or more torch.func transforms (one grad level runs at level 1)."""
    level = torch._C._functorch.maybe_current_level()
    return level is not None and level >= 2


class Attention(torch.autograd.Function):
    """out = attention(q, k, v; mask, bias, dropout) with the tiled backward."""

    @staticmethod
    def forward(q, k, v, mask, bias, seed, is_causal: bool, scale: float, dropout_p: float):
        return attention_forward(q, k, v, mask, bias, seed, is_causal, scale, dropout_p)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, k, v, mask, bias, seed, is_causal, scale, dropout_p = inputs
        out, row_max, inv_sum = output
        ctx.save_for_backward(q, k, v, mask, bias, seed, out, row_max, inv_sum)
        ctx.options = (is_causal, scale, dropout_p)
        ctx.mark_non_differentiable(row_max, inv_sum)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: Tensor, _dmax: Tensor, _dinv: Tensor):
        q, k, v, mask, bias, seed, out, row_max, inv_sum = ctx.saved_tensors
        if _nested_functorch_level():
            # an outer torch.func transform would differentiate this backward, which has no
            # derivative yet; running on would hand it a silent zero
            raise NotImplementedError("attngrad attention has no second derivative yet (nested torch.func transforms)")
        is_causal, scale, dropout_p = ctx.options
        bias_grad = bias is not None and ctx.needs_input_grad[4]
        dq, dk, dv, dbias = attention_backward(
            dout.contiguous(), q, k, v, mask, bias, seed, out, row_max, inv_sum, is_causal, scale, dropout_p, bias_grad
        )
        return dq, dk, dv, None, dbias if bias_grad else None, None, None, None, None


def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor], seed: Tensor,
    is_causal: bool, scale: float, dropout_p: float,
) -> Tensor:
    """The differentiable op on (B, H, L, E) tensors; inputs already checked."""
    return Attention.apply(q, k, v, mask, bias, seed, is_causal, scale, dropout_p)[0]
