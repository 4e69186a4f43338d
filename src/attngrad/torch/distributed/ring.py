"""`ring_attention`: exact attention over a sequence sharded across the ranks of a group,
with every derivative of the one-process op.

Two autograd.Functions join the passes of `ring_passes`, as `autograd` joins the ops:

    RingAttention          forward -> out         backward: RingAttentionBackward   jvp: RingTangent
    RingAttentionBackward  forward -> dq, dk, ... backward: ring_double_backward    jvp: ring_backward_jvp
    RingTangent            forward -> out_t       backward: ring_backward, ring_backward_jvp

so backward, the gradient of a bias, forward mode, double backward, Hessian-vector
products and the gradient through a JVP all run round the ring; a third derivative raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor
from typing_extensions import Unpack  # typing's from Python 3.11

from ..arguments import STRUCTURED, check_sinks
from ..layout import Layout, default_scale
from ..masks.structured import structure
from ..op import sink_logits
from ..op.autograd import THIRD_ORDER, Final
from ..op.call import ScoreMasks
from .call_checks import SHARDED, ShardedOptions, start_call
from .ring_comm import Ring
from .ring_passes import ring_backward, ring_backward_jvp, ring_double_backward, ring_forward, ring_jvp
from .ring_plan import RingPlan
from .sharding import Sharding, group_of


def _sinks_grad(sinks: Optional[Tensor], per_row: Optional[Tensor]) -> Optional[Tensor]:
    return None if sinks is None or per_row is None else sink_logits.to_sinks(per_row, sinks)


def _final(ring_pass: Callable, plan: RingPlan, q: Tensor, k: Tensor, v: Tensor, **inputs: Any) -> Any:
    """`ring_pass(plan, q, k, v, **inputs)` as a leaf of differentiation (`Final`: a derivative
    of its results raises), with every input handed to it as an argument, in autograd's sight."""
    names = tuple(inputs)

    def run(q: Tensor, k: Tensor, v: Tensor, *values: Any) -> Any:
        return ring_pass(plan, q, k, v, **dict(zip(names, values)))

    return Final.apply(run, THIRD_ORDER, q, k, v, *inputs.values())


class RingAttention(torch.autograd.Function):
    """out = attention of this rank's queries to the whole sequence's keys. `bias` holds the
    sink logits (the ring's steps take a sink of logit 0), out of autograd's sight: every
    derivative of `sinks` comes from these Functions in closed form (`sink_logits`)."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], sinks: Optional[Tensor], plan: RingPlan):
        return ring_forward(plan, q, k, v)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, k, v, bias, sinks, plan = inputs
        out, row_max, inv_sum = output
        ctx.save_for_backward(q, k, v, bias, sinks, out, row_max, inv_sum)
        ctx.save_for_forward(q, k, v, bias, sinks, out, row_max, inv_sum)
        ctx.plan = plan

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dmax: Tensor, _dinv: Tensor):
        q, k, v, bias, sinks, out, row_max, inv_sum = ctx.saved_tensors
        bias_grad = bias is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dbias, dsinks = RingAttentionBackward.apply(
            dout.contiguous(), q, k, v, bias, sinks, out.detach(), row_max.detach(), inv_sum.detach(), ctx.plan,
            bias_grad)
        return dq, dk, dv, dbias if bias_grad else None, dsinks if sinks is not None else None, None

    @staticmethod
    def jvp(ctx: Any, tq, tk, tv, tbias, tsinks, _tplan):
        q, k, v, bias, sinks, out, row_max, inv_sum = ctx.saved_tensors
        out_t = RingTangent.apply(q, k, v, bias, sinks, out.detach(), row_max.detach(), inv_sum.detach(), tq, tk, tv,
                                  tbias if bias is not None else None, tsinks if sinks is not None else None, ctx.plan)
        return out_t, torch.zeros_like(row_max), torch.zeros_like(inv_sum)


def _bias_tangent(bias: Optional[Tensor], tbias: Optional[Tensor], tsinks: Optional[Tensor]) -> Optional[Tensor]:
    """The steps' bias's tangent (or cotangent): the bias's, less the logits'."""
    return tbias if tsinks is None else sink_logits.joined(tbias, tsinks, bias.shape)


class RingTangent(torch.autograd.Function):
    """out_t = J t round the ring, differentiable once in reverse mode as `autograd.Tangent`
    is: for the cotangent c, the tangents get the ring's backward of c, and q, k, v, the
    bias and the sinks that backward's JVP along t. out and the row statistics are caches."""

    @staticmethod
    def forward(*inputs: Any):  # autograd takes the tensors one by one
        q, k, v, bias, sinks, out, row_max, inv_sum, tq, tk, tv, tbias, tsinks, plan = inputs
        return ring_jvp(plan, q, k, v, out=out, row_max=row_max, inv_sum=inv_sum, tq=tq, tk=tk, tv=tv,
                        tbias=_bias_tangent(bias, tbias, tsinks))[0]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        *tensors, ctx.plan = inputs
        ctx.save_for_backward(*tensors)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, c: Optional[Tensor]):
        q, k, v, bias, sinks, out, row_max, inv_sum, tq, tk, tv, tbias, tsinks = ctx.saved_tensors
        if c is None:
            return (None,) * 14
        c = c.contiguous()
        bias_grad = bias is not None and (ctx.needs_input_grad[3] or ctx.needs_input_grad[11])
        backward = dict(dout=c, out=out, row_max=row_max, inv_sum=inv_sum, bias_grad=bias_grad)
        dq, dk, dv, dbias = _final(ring_backward, ctx.plan, q, k, v, **backward)
        tdq, tdk, tdv, tdbias, sink_rows = _final(ring_backward_jvp, ctx.plan, q, k, v, **backward, tdout=None, tq=tq,
                                                  tk=tk, tv=tv, tbias=_bias_tangent(bias, tbias, tsinks))
        dsinks = None if sinks is None else sink_logits.grad(sinks, c, out, row_max, inv_sum)
        return (tdq, tdk, tdv, tdbias if bias_grad else None, _sinks_grad(sinks, sink_rows), None, None, None,
                dq if tq is not None else None, dk if tk is not None else None, dv if tv is not None else None,
                dbias if bias_grad and tbias is not None else None, dsinks if tsinks is not None else None, None)


class RingAttentionBackward(torch.autograd.Function):
    """(dq, dk, dv, dbias, dsinks) = the backward of `RingAttention`, itself differentiable
    once more."""

    @staticmethod
    def forward(*inputs: Any):  # autograd takes the tensors one by one
        dout, q, k, v, bias, sinks, out, row_max, inv_sum, plan, bias_grad = inputs
        dq, dk, dv, dbias = ring_backward(plan, q, k, v, dout=dout, out=out, row_max=row_max, inv_sum=inv_sum,
                                          bias_grad=bias_grad)
        dsinks = q.new_empty(0) if sinks is None else sink_logits.grad(sinks, dout, out, row_max, inv_sum)
        return dq, dk, dv, dbias if dbias is not None else q.new_empty(0), dsinks

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        dout, q, k, v, bias, sinks, out, row_max, inv_sum, plan, bias_grad = inputs
        ctx.save_for_backward(dout, q, k, v, out, row_max, inv_sum, bias, sinks)
        ctx.save_for_forward(dout, q, k, v, out, row_max, inv_sum, bias, sinks)
        ctx.plan, ctx.bias_grad = plan, bias_grad
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, gq: Tensor, gk: Tensor, gv: Tensor, gbias: Tensor, gsinks: Tensor):
        dout_grad = ctx.needs_input_grad[0]
        dout, q, k, v, out, row_max, inv_sum, bias, sinks = ctx.saved_tensors
        gsinks = gsinks if sinks is not None else None
        # a cotangent of the logits' gradient reaches the steps' bias, whose gradient then gives theirs
        g_bias_asked = ctx.bias_grad or gsinks is not None
        g_dout, g_q, g_k, g_v, g_bias, sink_rows = _final(
            ring_double_backward, ctx.plan, q, k, v, dout=dout, out=out, row_max=row_max, inv_sum=inv_sum,
            bias_grad=g_bias_asked, dout_grad=dout_grad, gq=gq, gk=gk, gv=gv,
            gbias=_bias_tangent(bias, gbias if ctx.bias_grad else None, gsinks))
        return (g_dout if dout_grad else None, g_q, g_k, g_v, g_bias if ctx.bias_grad else None,
                _sinks_grad(sinks, sink_rows), None, None, None, None, None)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any):  # one per input of forward
        tdout, tq, tk, tv, tbias, tsinks = tangents[:6]
        dout, q, k, v, out, row_max, inv_sum, bias, sinks = ctx.saved_tensors
        tsinks = tsinks if sinks is not None else None
        dq_t, dk_t, dv_t, dbias_t, sink_rows = _final(
            ring_backward_jvp, ctx.plan, q, k, v, dout=dout, out=out, row_max=row_max, inv_sum=inv_sum,
            bias_grad=ctx.bias_grad, tdout=tdout, tq=tq, tk=tk, tv=tv,
            tbias=_bias_tangent(bias, tbias if bias is not None else None, tsinks))
        dsinks_t = _sinks_grad(sinks, sink_rows)
        return (dq_t, dk_t, dv_t, dbias_t if dbias_t is not None else dq_t.new_empty(0),
                dsinks_t if dsinks_t is not None else dq_t.new_empty(0))


@SHARDED.signed
def ring_attention(query: Tensor, key: Tensor, value: Tensor, **options: Unpack[ShardedOptions]) -> Tensor:
    """Attention of this rank's queries to the whole sequence, whose shards the ranks of
    `group` hold (`shard_sequence` with `layout`); the same on every rank of the group.

    query (..., H, L / P, E), key and value (..., Hkv, L / P, E or Ev): this rank's shards,
    in `layout` ("contiguous", or "zigzag" to balance causal work). Key and value blocks
    travel round the ring; each rank keeps O(L / P) besides the blocks in flight.

    attn_bias (float, learned or not) and attn_mask (boolean, True = take part) are this
    rank's query rows of the whole (..., H, L, L) one: broadcastable to (..., H, L / P, L),
    keys in sequence order. A bias's gradient is this rank's part of it: a bias shared by
    the ranks needs its gradients summed (all_reduce), as a replicated parameter does; so do
    `sinks`' gradients.

    is_causal, key_padding, window, document_ids, cu_seqlens, softcap, sinks, dropout_p, scale
    and enable_gqa: as in `attngrad.torch.attention`, over the whole sequence (key_padding and
    document_ids of the whole sequence, (..., L)); dropout masks equal the one-process
    call's on the whole sequence with the seed of rank 0.
    """
    options = SHARDED.complete("ring_attention", options)
    group = group_of(options["group"])
    seed = start_call("ring_attention", group, query, key, value, options)
    ring = Ring(group)
    sharding = Sharding(options["layout"], ring.size, query.shape[-2] * ring.size)
    folded = Layout(query, key, value, options["enable_gqa"])
    length = sharding.length
    attn_bias, logits = options["attn_bias"], None
    if options["sinks"] is not None:  # the steps take a zero-logit sink, the logits in the bias out of autograd's sight
        logits = check_sinks(options["sinks"], folded, query)
        shift = -logits[0].detach().to(query.dtype)[:, None, None]  # (H, 1, 1)
        attn_bias = shift if attn_bias is None else attn_bias + shift
    mask = None if options["attn_mask"] is None else folded.fold_mask(options["attn_mask"], "attn_mask", length)
    bias = None if attn_bias is None else folded.fold_mask(attn_bias, "attn_bias", length)
    causal = 0 if options["is_causal"] else None  # top-left over the whole sequence: Lq = Lk
    structured = {name: options[name] for name in STRUCTURED}
    bounds = None
    if any(x is not None for x in structured.values()):
        batch = () if folded.flat else tuple(folded.batch)
        bounds, keep = structure(batch, length, length, causal, query.device, **structured)
        if bounds is not None:  # this rank's rows
            bounds = bounds[:, sharding.positions(ring.rank, bounds.device)]
        if keep is not None:
            mask = keep if mask is None else mask & keep
    masks = ScoreMasks(mask=mask, bias=bias, bounds=bounds, causal=causal, softcap=float(options["softcap"] or 0.0),
                       sink=logits is not None)
    plan = RingPlan(ring, sharding, masks, seed, default_scale(query, options["scale"]), float(options["dropout_p"]))
    out = RingAttention.apply(folded.q, folded.k, folded.v, bias, logits, plan)[0]
    return folded.unfold(out)
