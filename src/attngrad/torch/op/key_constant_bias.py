"""The gradient of a bias constant along the keys (a sink's logit, or any (..., Lq, 1) bias)
in closed form.

Such a bias shifts every score of its row alike, and softmax is blind to that shift but for a
sink's fixed exp(0). So with dS = P (dP - D), D = rowsum(dO * O),

    sum_j dS_ij = D_i (1 - sum_j P_ij) = D_i P_sink,i,    P_sink,i = exp(-m_i) / l_i,

and 0 without a sink. Summing the row's dS instead, as the backends do for any other bias,
adds terms of size P dP whose sum cancels down to D P_sink: in float32 that left a sink's
gradient 7-2700x less accurate than PyTorch's on the same inputs (the smaller the sink's
share, the worse), and it is a pass over every score. The closed form has no such
cancellation. It holds with masks, a soft cap and dropout (O is the dropped output), and
needs each row's whole keys (a ring step's rows are parts). `ops.run_pass` asks the backward
for no bias gradient where it applies and computes this one.
"""

from __future__ import annotations

import torch
from torch import Tensor


def is_key_constant(bias: Tensor | None) -> bool:
    """Whether `bias` (broadcast to (B, H, Lq, Lk)) is constant along the keys."""
    return bias is not None and bias.shape[-1] == 1


def fixed_order_sum(x: Tensor) -> Tensor:
    """x summed over its last axis by halves, pairwise: elementwise additions alone, so the
    bits do not depend on the thread count (a reduction's split does)."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        pairs = x[..., :half] + x[..., half:2 * half]
        x = torch.cat([pairs, x[..., 2 * half:]], dim=-1) if x.shape[-1] % 2 else pairs
    return x[..., 0]


def sink_share(row_max: Tensor, inv_sum: Tensor) -> Tensor:
    """(B, H, Lq) each row's P_sink = exp(-m) / l in float64, from the forward's statistics
    (with a sink, inv_sum includes its term); 0 on a row that saw no key (1/l = 0; a row
    that a NaN reached has 1/l NaN, and so P_sink NaN)."""
    seen = inv_sum != 0
    return torch.where(seen, torch.exp(torch.log(torch.where(seen, inv_sum, 1).double()) - row_max.double()), 0.0)


def sum_to_shape(t: Tensor, shape: tuple, dtype: torch.dtype) -> Tensor:
    """`t` summed over the leading axes along which `shape` (4-D or fewer, right-aligned to
    t's) is 1 and t is not, by halves (`fixed_order_sum`), in `shape` and `dtype`."""
    if t.numel() == 0:  # no entry (an empty batch, head or query axis): nothing to sum
        return torch.zeros(shape, dtype=dtype, device=t.device)
    target = (1,) * (t.dim() - len(shape)) + tuple(shape)
    summed = [axis for axis in range(t.dim()) if target[axis] == 1 and t.shape[axis] > 1]
    if summed:
        kept = [axis for axis in range(t.dim()) if axis not in summed]
        t = fixed_order_sum(t.permute(*kept, *summed).reshape(*(t.shape[a] for a in kept), -1))
    return t.reshape(shape).to(dtype)


def rows_to_bias(per_row: Tensor, bias: Tensor, dtype: torch.dtype) -> Tensor:
    """A (B, H, Lq) per-row quantity summed over the axes along which `bias` (constant along
    the keys) broadcasts, in the bias's shape and `dtype` (`sum_to_shape`)."""
    padded = (1,) * (4 - bias.dim()) + tuple(bias.shape)
    return sum_to_shape(per_row[..., None], padded, dtype).reshape(bias.shape)


def key_constant_bias_grad(bias: Tensor, sink: bool, dout: Tensor, out: Tensor, row_max: Tensor,
                           inv_sum: Tensor, like: Tensor) -> Tensor:
    """d bias for a `bias` constant along the keys, in the shape and dtype of `like` (the
    op's result): sum over the axes the bias broadcasts along of D P_sink, from the
    forward's output and row statistics (B, H, Lq)."""
    if not sink:
        return torch.zeros_like(like)
    # D = rowsum(dO * O), summed in float64 from products in the inputs' precision, at least
    # float32 (exact for half inputs; for float32 one more rounding of each product, beside O's
    # own): float64 copies of (B, H, Lq, dv) tensors would cost more than the rest of it
    wide = [t if t.dtype in (torch.float32, torch.float64) else t.float() for t in (dout, out)]
    per_row = torch.mul(*wide).sum(dim=-1, dtype=torch.float64) * sink_share(row_max, inv_sum)
    return rows_to_bias(per_row, bias, like.dtype)
