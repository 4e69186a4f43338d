"""The "torch-ops" backend: PyTorch operators over score tiles (`first_order`, `higher_order`).
Every call on any device, every pass; also a part of each row's keys with the whole rows'
sums given (`row_sums`), which the ring's higher passes need. Registered last: the one that
takes what no other does."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from ...op import dispatch
from ...op.call import AttentionCall
from . import first_order, higher_order


def _common(call: AttentionCall) -> dict:
    """The kernels' keywords for what every pass takes."""
    return dict(q=call.q, k=call.k, v=call.v, mask=call.mask, bias=call.bias, seed=call.placement, causal=call.causal,
                scale=call.scale, softcap=call.softcap, dropout_p=call.dropout_p, bounds=call.bounds, mask_blocks=call.blocks)


def forward(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
    return first_order.attention_forward(**_common(call))


def backward(call: AttentionCall, *, dout: Tensor, out: Tensor, row_max: Tensor, inv_sum: Tensor,
             bias_grad: bool) -> tuple:
    return first_order.attention_backward(dout=dout, out=out, row_max=row_max, inv_sum=inv_sum, bias_grad=bias_grad,
                                      **_common(call))


def jvp(call: AttentionCall, *, row_max: Tensor, inv_sum: Tensor, tq: Optional[Tensor], tk: Optional[Tensor],
        tv: Optional[Tensor], tbias: Optional[Tensor], row_sums: Optional[dict] = None) -> Tensor:
    return higher_order.attention_jvp(row_max=row_max, inv_sum=inv_sum, tq=tq, tk=tk, tv=tv, tbias=tbias,
                                        sink=call.sink, **_common(call), **(row_sums or {}))


def backward_jvp(call: AttentionCall, *, dout: Tensor, out: Tensor, row_max: Tensor, inv_sum: Tensor, bias_grad: bool,
                 tdout: Optional[Tensor], tq: Optional[Tensor], tk: Optional[Tensor], tv: Optional[Tensor],
                 tbias: Optional[Tensor], row_sums: Optional[dict] = None, sink_rows: Optional[Tensor] = None) -> tuple:
    return higher_order.attention_backward_jvp(
        dout=dout, out=out, row_max=row_max, inv_sum=inv_sum, bias_grad=bias_grad, tdout=tdout, tq=tq, tk=tk, tv=tv,
        tbias=tbias, sink=call.sink, sink_rows=sink_rows, **_common(call), **(row_sums or {}))


def double_backward(call: AttentionCall, *, dout: Tensor, out: Tensor, row_max: Tensor, inv_sum: Tensor,
                    bias_grad: bool, dout_grad: bool, gq: Optional[Tensor], gk: Optional[Tensor], gv: Optional[Tensor],
                    gbias: Optional[Tensor], row_sums: Optional[dict] = None, sink_rows: Optional[Tensor] = None) -> tuple:
    return higher_order.attention_double_backward(
        dout=dout, out=out, row_max=row_max, inv_sum=inv_sum, bias_grad=bias_grad, dout_grad=dout_grad, gq=gq, gk=gk,
        gv=gv, gbias=gbias, sink=call.sink, sink_rows=sink_rows, **_common(call), **(row_sums or {}))


def double_backward_row_sums(call: AttentionCall, *, dout: Tensor, row_max: Tensor, inv_sum: Tensor, bias_grad: bool,
                             gq: Optional[Tensor], gk: Optional[Tensor], gv: Optional[Tensor], gbias: Optional[Tensor],
                             row_sums: Optional[dict] = None) -> tuple[Tensor, Tensor]:
    """The ring's first walk of the double backward: this part's shares of its row sums."""
    return higher_order.double_backward_row_sums(
        dout=dout, row_max=row_max, inv_sum=inv_sum, bias_grad=bias_grad, gq=gq, gk=gk, gv=gv, gbias=gbias,
        **_common(call))


BACKEND = dispatch.register(dispatch.Backend(
    name="torch-ops",
    passes=dict(forward=forward, backward=backward, jvp=jvp, backward_jvp=backward_jvp, double_backward=double_backward,
                double_backward_row_sums=double_backward_row_sums),
    row_sums=True,
    description="PyTorch operators over score tiles: every call, on any device",
))
