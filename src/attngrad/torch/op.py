"""The tiled kernels as PyTorch operators, with autograd: a thin wrapper over `native`
(the compiled tiles of every pass, where they apply), `kernels` and `kernels_higher`.

Each pass is a custom op (`attngrad::attention_forward`, `..._backward`, `..._jvp`,
`..._backward_jvp`, `..._double_backward`), so that torch.compile treats it as one opaque
operator (the Python loops are not traced). Two autograd.Functions with a separate
setup_context join them, so that autograd, torch.compile(fullgraph=True) and torch.func
all see differentiable ops:

    Attention          forward -> out          backward: AttentionBackward    jvp: attention_jvp
    AttentionBackward  forward -> dq, dk, ...  backward: double_backward      jvp: backward_jvp

Because the first backward is itself a differentiable Function, double backward
(create_graph=True), Hessian-vector products and torch.func.hessian work; a third
derivative raises. (torch.library's own register_autograd would be the shorter spelling,
but the wrapper it generates in torch 2.13 has no setup_context, and torch.func refuses
it: pytorch#170834.)

Each op also has a batching rule (`vmap_rules`), so torch.func.vmap, jacrev and hessian
run it once over the folded batch.

The forward saves q, k, v, the masks, out, and per query row the score maximum and the
inverse softmax denominator: O(L). Everything else is recomputed block by block.
`out`, the row statistics and `seed` reach AttentionBackward as caches: its derivatives
are taken through q, k, v, bias and dout alone, which determine them.
`seed` is a 0-d int64 tensor (drawn by the caller from PyTorch's generator) so that a
compiled graph can draw it too; or (5,), a `dropout.Placement`, for a call on a part of a
longer sequence or of more heads, whose dropout masks must be the whole's, and whose
keys may be only a part of each row's. `causal` is the causal diagonal: None, or c such that key
j is visible to query i when j <= i + c (0: top-left, Lk - Lq: bottom-right). `sink` (the
forward's, and the double backward's) adds exp(0) to every row's softmax denominator
(`_add_sink`): attention sinks, their logits moved into the bias.

Every op checks its arguments (`op_checks`) before any kernel reads them, and returns
contiguous tensors, as its fake implementation says it will.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from . import kernels, kernels_higher, native, vmap_rules
from .dropout import Placement
from .implementation import choose
from .op_checks import check_call


@torch.library.custom_op("attngrad::attention_forward", mutates_args=())
def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor], bounds: Optional[Tensor], seed: Tensor,
    causal: Optional[int], scale: float, softcap: float, dropout_p: float, sink: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    check_call(q, k, v, mask, bias, bounds, seed, causal, dropout_p, softcap=softcap)
    if sink:
        _whole_rows(seed, "a sink")
    if choose("forward", q, k, v, mask, bias) == "tiles":
        out, row_max, inv_sum = native.attention_forward(q, k, v, causal, scale, softcap=softcap, mask=mask, bias=bias, seed=Placement.of(seed),
                                                         dropout_p=dropout_p, bounds=bounds)
        out = out.to(q.dtype)  # the statistics stay in the compute dtype
    else:
        out, row_max, inv_sum = kernels.attention_forward(q, k, v, mask, bias, Placement.of(seed), causal, scale, softcap, dropout_p, bounds)
    return _add_sink(out, row_max, inv_sum) if sink else (out, row_max, inv_sum)


def _add_sink(out: Tensor, row_max: Tensor, inv_sum: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The rows with a sink: one more term, exp(0), in every row's softmax denominator, a
    key of score 0 and value 0 (GPT-OSS's sinks with the learned logit s moved into the
    bias as -s: softmax is blind to a shift of a whole row). With Z = sum_j exp(S_ij) the
    rows' weight Z / (Z + 1) = sigmoid(log Z) scales O and 1/l; every later pass then reads
    the sink's share from 1/l alone. A row that sees no key stays 0."""
    seen = inv_sum > 0
    log_z = row_max - torch.log(torch.where(seen, inv_sum, 1.0))  # log Z = m + log l
    kept = torch.where(seen, torch.sigmoid(log_z), 0.0)  # Z / (Z + 1)
    return (out * kept[..., None].to(out.dtype)).contiguous(), row_max, inv_sum * kept


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, mask, bias, bounds, seed, causal, scale, softcap, dropout_p, sink=False):
    check_call(q, k, v, mask, bias, bounds, seed, causal, dropout_p, softcap=softcap)
    batch, heads, len_q, _ = q.shape
    stats = dict(dtype=kernels.compute_dtype(q.dtype))
    return q.new_empty(batch, heads, len_q, v.shape[-1]), q.new_empty(batch, heads, len_q, **stats), q.new_empty(batch, heads, len_q, **stats)


@torch.library.custom_op("attngrad::attention_backward", mutates_args=())
def attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor], bounds: Optional[Tensor], seed: Tensor,
    out: Tensor, row_max: Tensor, inv_sum: Tensor, causal: Optional[int], scale: float, softcap: float, dropout_p: float, bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_backward(dout, q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum, causal, dropout_p, bias_grad, softcap=softcap)
    if choose("backward", q, k, v, mask, bias) == "tiles":
        dq, dk, dv, dbias = native.attention_backward(
            dout, q, k, v, out, row_max, inv_sum, causal, scale, softcap=softcap, mask=mask, bias=bias, seed=Placement.of(seed),
            dropout_p=dropout_p, bias_grad=bias_grad, bounds=bounds,
        )
        dq, dk, dv, dbias = _in_dtypes_of((dq, dk, dv, dbias), (q, k, v, bias))
    else:
        dq, dk, dv, dbias = kernels.attention_backward(
            dout, q, k, v, mask, bias, Placement.of(seed), out, row_max, inv_sum, causal, scale, softcap, dropout_p, bias_grad, bounds
        )
    return dq, dk, dv, dbias if dbias is not None else q.new_empty(0)  # ops return tensors, not None


def _check_backward(dout, q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum, causal, dropout_p, bias_grad,
                    softcap=0.0, **sides):
    check_call(q, k, v, mask, bias, bounds, seed, causal, dropout_p, softcap=softcap, dout=dout, out=out, row_max=row_max, inv_sum=inv_sum,
               bias_grad=bias_grad, **sides)


def _new(like: Tensor) -> Tensor:
    """An uninitialised contiguous tensor of like's shape and dtype: what the kernels return
    (empty_like would copy a transposed input's strides)."""
    return like.new_empty(like.shape)


@attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum, causal, scale, softcap, dropout_p, bias_grad):
    _check_backward(dout, q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum, causal, dropout_p, bias_grad, softcap=softcap)
    dbias = _new(bias) if bias_grad else q.new_empty(0)
    return _new(q), _new(k), _new(v), dbias


def _in_dtypes_of(results: tuple, inputs: tuple) -> tuple:
    """The tiles' results (float32 for float16 and bfloat16 inputs) each in the dtype of the
    input it is the derivative of; None stays None."""
    return tuple(None if r is None else r.to(x.dtype) for r, x in zip(results, inputs))


def _whole_rows(seed: Tensor, name: str) -> None:
    """The higher passes sum over each row's keys: they refuse a call whose keys are a part
    of each row's (a ring step runs them by `kernels_higher` with the whole rows' sums)."""
    if seed.dim() and Placement.of(seed).partial_rows:
        raise ValueError(f"attngrad attention op: {name} needs each row's whole keys; its seed says they are a part")


def _maybe_empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    return t if t is not None else like.new_empty(0)  # ops return tensors, not None


@torch.library.custom_op("attngrad::attention_jvp", mutates_args=())
def attention_jvp(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor], bounds: Optional[Tensor], seed: Tensor,
    row_max: Tensor, inv_sum: Tensor, causal: Optional[int], scale: float, softcap: float, dropout_p: float,
    tq: Optional[Tensor], tk: Optional[Tensor], tv: Optional[Tensor], tbias: Optional[Tensor],
) -> Tensor:
    _check_jvp(q, k, v, mask, bias, bounds, seed, row_max, inv_sum, causal, dropout_p, tq, tk, tv, tbias, softcap)
    _whole_rows(seed, "attention_jvp")
    if choose("jvp", q, k, v, mask, bias) == "tiles":
        out_t = native.attention_jvp(q, k, v, row_max, inv_sum, causal, scale, tq, tk, tv, softcap=softcap, mask=mask, bias=bias,
                                     tbias=tbias, seed=Placement.of(seed), dropout_p=dropout_p, bounds=bounds)
        return out_t.to(q.dtype)
    return kernels_higher.attention_jvp(
        q, k, v, mask, bias, Placement.of(seed), row_max, inv_sum, causal, scale, softcap, dropout_p, tq, tk, tv, tbias, bounds
    )


def _check_jvp(q, k, v, mask, bias, bounds, seed, row_max, inv_sum, causal, dropout_p, tq, tk, tv, tbias, softcap):
    check_call(q, k, v, mask, bias, bounds, seed, causal, dropout_p, softcap=softcap, row_max=row_max, inv_sum=inv_sum,
               query_side=(("tq", tq),), key_side=(("tk", tk),), value_side=(("tv", tv),), bias_like=(("tbias", tbias),))


@attention_jvp.register_fake
def _attention_jvp_fake(q, k, v, mask, bias, bounds, seed, row_max, inv_sum, causal, scale, softcap, dropout_p, tq, tk, tv, tbias):
    _check_jvp(q, k, v, mask, bias, bounds, seed, row_max, inv_sum, causal, dropout_p, tq, tk, tv, tbias, softcap)
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@torch.library.custom_op("attngrad::attention_backward_jvp", mutates_args=())
def attention_backward_jvp(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor], bounds: Optional[Tensor], seed: Tensor,
    out: Tensor, row_max: Tensor, inv_sum: Tensor, causal: Optional[int], scale: float, softcap: float, dropout_p: float, bias_grad: bool,
    tdout: Optional[Tensor], tq: Optional[Tensor], tk: Optional[Tensor], tv: Optional[Tensor], tbias: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_backward(dout, q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum, causal, dropout_p, bias_grad, softcap=softcap,
                    **_second_order_sides("t", tdout, tq, tk, tv, tbias))
    _whole_rows(seed, "attention_backward_jvp")
    if choose("backward_jvp", q, k, v, mask, bias) == "tiles":
        dq, dk, dv, dbias = native.attention_backward_jvp(
            dout, q, k, v, out, row_max, inv_sum, causal, scale, tdout, tq, tk, tv, softcap=softcap, mask=mask, bias=bias,
            tbias=tbias, seed=Placement.of(seed), dropout_p=dropout_p, bias_grad=bias_grad, bounds=bounds,
        )
        dq, dk, dv, dbias = _in_dtypes_of((dq, dk, dv, dbias), (q, k, v, bias))
    else:
        dq, dk, dv, dbias = kernels_higher.attention_backward_jvp(
            dout, q, k, v, mask, bias, Placement.of(seed), out, row_max, inv_sum, causal, scale, softcap, dropout_p, bias_grad,
            tdout, tq, tk, tv, tbias, bounds,
        )
    return dq, dk, dv, _maybe_empty(dbias, q)


def _second_order_sides(prefix: str, xdout, xq, xk, xv, xbias) -> dict:
    """check_call's keywords for the tangents (prefix "t") or cotangents ("g") of a second-order op."""
    return dict(out_side=((f"{prefix}dout", xdout),), query_side=((f"{prefix}q", xq),), key_side=((f"{prefix}k", xk),),
                value_side=((f"{prefix}v", xv),), bias_like=((f"{prefix}bias", xbias),))


@attention_backward_jvp.register_fake
def _attention_backward_jvp_fake(dout, q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum, causal, scale, softcap,
                                 dropout_p, bias_grad, tdout, tq, tk, tv, tbias):
    _check_backward(dout, q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum, causal, dropout_p, bias_grad, softcap=softcap,
                    **_second_order_sides("t", tdout, tq, tk, tv, tbias))
    dbias = _new(bias) if bias_grad else q.new_empty(0)
    return _new(q), _new(k), _new(v), dbias


@torch.library.custom_op("attngrad::attention_double_backward", mutates_args=())
def attention_double_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor], bounds: Optional[Tensor], seed: Tensor,
    out: Tensor, row_max: Tensor, inv_sum: Tensor, causal: Optional[int], scale: float, softcap: float, dropout_p: float, bias_grad: bool,
    dout_grad: bool, gq: Optional[Tensor], gk: Optional[Tensor], gv: Optional[Tensor], gbias: Optional[Tensor], sink: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_backward(dout, q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum, causal, dropout_p, bias_grad, softcap=softcap,
                    **_second_order_sides("g", None, gq, gk, gv, gbias))
    _whole_rows(seed, "attention_double_backward")
    if choose("double_backward", q, k, v, mask, bias) == "tiles":
        g_dout, g_q, g_k, g_v, g_bias = _in_dtypes_of(native.attention_double_backward(
            dout, q, k, v, out, row_max, inv_sum, causal, scale, dout_grad, gq, gk, gv, softcap=softcap, mask=mask, bias=bias,
            gbias=gbias, seed=Placement.of(seed), dropout_p=dropout_p, bias_grad=bias_grad, bounds=bounds, sink=sink,
        ), (dout, q, k, v, bias))
        return _maybe_empty(g_dout, q), g_q, g_k, g_v, _maybe_empty(g_bias, q)
    g_dout, g_q, g_k, g_v, g_bias = kernels_higher.attention_double_backward(
        dout, q, k, v, mask, bias, Placement.of(seed), out, row_max, inv_sum, causal, scale, softcap, dropout_p, bias_grad,
        dout_grad, gq, gk, gv, gbias, bounds, sink=sink,
    )
    return _maybe_empty(g_dout, q), g_q, g_k, g_v, _maybe_empty(g_bias, q)


@attention_double_backward.register_fake
def _attention_double_backward_fake(dout, q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum, causal, scale,
                                    softcap, dropout_p, bias_grad, dout_grad, gq, gk, gv, gbias, sink=False):
    _check_backward(dout, q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum, causal, dropout_p, bias_grad, softcap=softcap,
                    **_second_order_sides("g", None, gq, gk, gv, gbias))
    g_dout = _new(dout) if dout_grad else q.new_empty(0)
    g_bias = _new(bias) if bias_grad else q.new_empty(0)
    return g_dout, _new(q), _new(k), _new(v), g_bias


def _register_batching_rules() -> None:
    forward_args = ["q", "k", "v", "mask", "bias", "bounds", "seed", "causal", "scale", "softcap", "dropout_p", "sink"]
    backward_args = ["dout", "q", "k", "v", "mask", "bias", "bounds", "seed", "out", "row_max", "inv_sum",
                     "causal", "scale", "softcap", "dropout_p", "bias_grad"]
    jvp_args = ["q", "k", "v", "mask", "bias", "bounds", "seed", "row_max", "inv_sum", "causal", "scale", "softcap", "dropout_p",
                "tq", "tk", "tv", "tbias"]
    for op, names, bias_output in (
        (attention_forward, forward_args, False),
        (attention_backward, backward_args, True),
        (attention_jvp, jvp_args, False),
        (attention_backward_jvp, backward_args + ["tdout", "tq", "tk", "tv", "tbias"], True),
        (attention_double_backward, backward_args + ["dout_grad", "gq", "gk", "gv", "gbias", "sink"], True),
    ):
        op.register_vmap(vmap_rules.make_rule(op, names, bias_output))


_register_batching_rules()


THIRD_ORDER = "attngrad attention has derivatives up to second order; a third was asked for"
REVERSE_OVER_FORWARD = (
    "attngrad attention's JVP has no reverse-mode derivative; for Hessian-vector products take "
    "forward over reverse (torch.func.jvp of torch.func.grad) or reverse over reverse (double backward)"
)


class _Final(torch.autograd.Function):
    """Runs one kernel op as a leaf of differentiation: differentiating its results raises.

    Autograd and torch.func transforms call a Function's backward and jvp on tensors that an
    outer transform may still track (torch.func always builds the graph of a backward).
    Calling the op inside this Function's forward hands it plain tensors, and a derivative
    asked of its results gets a clear error instead of a silent zero."""

    generate_vmap_rule = True  # vmap runs the op once per batched slice

    @staticmethod
    def forward(op: Callable, refusal: str, *args: Any):
        return op(*args)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.refusal = inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: Any):
        raise NotImplementedError(ctx.refusal)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any):
        raise NotImplementedError(ctx.refusal)


class Attention(torch.autograd.Function):
    """out = attention(q, k, v; mask, bias, dropout) with the tiled backward."""

    generate_vmap_rule = True  # vmap runs the custom ops once per batched slice

    @staticmethod
    def forward(q, k, v, mask, bias, bounds, seed, causal: Optional[int], scale: float, softcap: float, dropout_p: float,
                sink: bool):
        return attention_forward(q, k, v, mask, bias, bounds, seed, causal, scale, softcap, dropout_p, sink)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, k, v, mask, bias, bounds, seed, causal, scale, softcap, dropout_p, sink = inputs
        out, row_max, inv_sum = output
        ctx.save_for_backward(q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum)
        ctx.save_for_forward(q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum)
        ctx.options = (causal, scale, softcap, dropout_p)
        ctx.sink = sink
        # row_max and inv_sum are not marked non-differentiable: under vmap, torch.func's
        # generated rule loses that mark and then refuses the None tangent (torch 2.13).
        # They get zero tangents, and their incoming gradients are ignored.

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dmax: Tensor, _dinv: Tensor):
        q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum = ctx.saved_tensors
        bias_grad = bias is not None and ctx.needs_input_grad[4]
        # out and the statistics enter as caches, detached: the second derivatives are taken
        # through q, k, v and bias, and a graph edge back into this node would only make
        # autograd rerun this backward on zeros
        dq, dk, dv, dbias = AttentionBackward.apply(
            dout.contiguous(), q, k, v, mask, bias, bounds, seed, out.detach(), row_max.detach(), inv_sum.detach(),
            *ctx.options, bias_grad, ctx.sink,
        )
        return dq, dk, dv, None, dbias if bias_grad else None, None, None, None, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, tq, tk, tv, _tmask, tbias, _tbounds, _tseed, *_options):
        q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum = ctx.saved_tensors
        tbias = tbias if bias is not None else None
        out_t = _Final.apply(
            attention_jvp, REVERSE_OVER_FORWARD, q, k, v, mask, bias, bounds, seed, row_max, inv_sum, *ctx.options, tq, tk, tv, tbias
        )
        return out_t, torch.zeros_like(row_max), torch.zeros_like(inv_sum)


class AttentionBackward(torch.autograd.Function):
    """(dq, dk, dv, dbias) = the backward of `Attention`, itself differentiable once more."""

    generate_vmap_rule = True

    @staticmethod
    def forward(dout, q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum, causal, scale, softcap, dropout_p, bias_grad,
                sink):
        return attention_backward(dout, q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum, causal, scale, softcap, dropout_p, bias_grad)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        dout, q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum, causal, scale, softcap, dropout_p, bias_grad, sink = inputs
        ctx.save_for_backward(dout, q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum)
        ctx.save_for_forward(dout, q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum)
        ctx.options = (causal, scale, softcap, dropout_p, bias_grad)
        ctx.sink = sink  # only the double backward needs it: the rest read the sink's share from 1/l
        ctx.set_materialize_grads(False)  # a gradient nobody used arrives as None: no work for it

    @staticmethod
    def backward(ctx: Any, gq: Tensor, gk: Tensor, gv: Tensor, gbias: Tensor):
        bias_grad = ctx.options[4]
        dout_grad = ctx.needs_input_grad[0]  # a gradient penalty's dout is a constant
        g_dout, g_q, g_k, g_v, g_bias = _Final.apply(
            attention_double_backward, THIRD_ORDER, *ctx.saved_tensors, *ctx.options, dout_grad, gq, gk, gv,
            gbias if bias_grad else None, ctx.sink,
        )
        return (g_dout if dout_grad else None, g_q, g_k, g_v, None, g_bias if bias_grad else None,
                None, None, None, None, None, None, None, None, None, None, None)

    @staticmethod
    def jvp(ctx: Any, tdout, tq, tk, tv, _tmask, tbias, _tbounds, _tseed, _tout, _tmax, _tinv, *_options):
        saved = ctx.saved_tensors
        tbias = tbias if saved[5] is not None else None
        dq_t, dk_t, dv_t, dbias_t = _Final.apply(
            attention_backward_jvp, THIRD_ORDER, *saved, *ctx.options, tdout, tq, tk, tv, tbias
        )
        return dq_t, dk_t, dv_t, dbias_t  # without a bias gradient: the empty placeholder


class _AttentionTraced(Attention):
    """Attention as torch.compile sees it: Dynamo refuses autograd.Functions that define jvp
    (torch 2.13), so a compiled graph gets this twin without forward mode."""

    jvp = torch.autograd.Function.jvp


def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor], bounds: Optional[Tensor], seed: Tensor,
    causal: Optional[int], scale: float, softcap: float, dropout_p: float, sink: bool = False,
) -> Tensor:
    """The differentiable op on (B, H, L, E) tensors. `sink`: every row's softmax has one
    more term, exp(0) (`_add_sink`)."""
    function = _AttentionTraced if torch.compiler.is_compiling() else Attention
    return function.apply(q, k, v, mask, bias, bounds, seed, causal, scale, softcap, dropout_p, sink)[0]
