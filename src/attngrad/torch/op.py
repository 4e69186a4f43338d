"""The tiled kernels as PyTorch operators, with autograd: a thin wrapper over `kernels`.

Two custom ops, `attngrad::attention_forward` and `attngrad::attention_backward`, so that
torch.compile treats each pass as one opaque operator (their Python loops are not traced),
and torch.func and autograd see an ordinary differentiable op. The forward saves only
q, k, v, the masks, out and the logsumexp (O(L)); the backward recomputes the rest.

`seed` is a 0-d int64 tensor (drawn by the caller from PyTorch's generator) so that a
compiled graph can draw it too.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import kernels


@torch.library.custom_op("attngrad::attention_forward", mutates_args=())
def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor], seed: Tensor,
    is_causal: bool, scale: float, dropout_p: float,
) -> tuple[Tensor, Tensor]:
    return kernels.attention_forward(q, k, v, mask, bias, int(seed), is_causal, scale, dropout_p)


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, mask, bias, seed, is_causal, scale, dropout_p):
    batch, heads, len_q, _ = q.shape
    out = q.new_empty(batch, heads, len_q, v.shape[-1])
    lse = q.new_empty(batch, heads, len_q, dtype=kernels.compute_dtype(q.dtype))
    return out, lse


@torch.library.custom_op("attngrad::attention_backward", mutates_args=())
def attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor], seed: Tensor,
    out: Tensor, lse: Tensor, is_causal: bool, scale: float, dropout_p: float, bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, dbias = kernels.attention_backward(
        dout, q, k, v, mask, bias, int(seed), out, lse, is_causal, scale, dropout_p, bias_grad
    )
    return dq, dk, dv, dbias if dbias is not None else q.new_empty(0)  # ops return tensors, not None


@attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, mask, bias, seed, out, lse, is_causal, scale, dropout_p, bias_grad):
    dbias = bias.new_empty(bias.shape) if bias_grad else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, mask, bias, seed, is_causal, scale, dropout_p = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, mask, bias, seed, out, lse)
    ctx.options = (is_causal, scale, dropout_p)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout: Tensor, _dlse: Tensor):
    q, k, v, mask, bias, seed, out, lse = ctx.saved_tensors
    is_causal, scale, dropout_p = ctx.options
    bias_grad = bias is not None and ctx.needs_input_grad[4]
    dq, dk, dv, dbias = attention_backward(
        dout.contiguous(), q, k, v, mask, bias, seed, out, lse, is_causal, scale, dropout_p, bias_grad
    )
    return dq, dk, dv, None, dbias if bias_grad else None, None, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)
