"""Repeated eager calls run from a plan: a decode loop's steps, an evaluation's layers, and a
small model's training steps.

The first call of a signature (the inputs' sizes, strides, dtypes and device, the options,
`dispatch.state()`) goes the whole way: the public checks, the layout, the op's checks and
the backend's choice, whose errors it raises. It leaves a plan: the folding of the inputs
and the chosen backends' prepared forward and backward (`dispatch.plan`). Later calls of the
signature run the plan alone. That is all a plan skips: checks whose verdict the signature
fixes, and decisions made from it. A forward's Python took 13 us where the full path's took
48; after a decode step has streamed its whole cache through the CPU's caches, 72 us
against 161 (Intel Xeon).

Only plain calls have plans: q, k, v, is_causal, scale, enable_gqa and a boolean
`attn_mask` or float `attn_bias` alone (`KEYED`; every other option absent or at its
default: no structured mask, soft cap, sinks or dropout), a bias that no gradient is asked
of, on plain tensors, eagerly (no torch.compile, torch.func transform, function or dispatch
mode, forward-mode level). A mask's sizes, strides, dtype and device belong to the
signature; its values do not: its tile map and key ranges are made from it at each call,
and kept while it lives (`masks.version_cache`), as a model's layers share one mask. A call
that reverse mode tracks runs through `_Planned`, a Function whose backward is the prepared
backward pass (the same tiles, the same bits) and, where that backward is itself
differentiated (create_graph), the full path's (`autograd.differentiable_backward`).
Everything else takes the full path, as does a backend without a plan.

A backend's prepared forward may also publish itself in a fast entry of its own, keyed by
the public call's arguments (the tiles' C++ table, `csrc/fast_entry.cpp`): then a repeated
scaled_dot_product_attention call without a mask or dropout, that nothing differentiates,
on (B, H, L, E) tensors of one dtype, is found and run there (`unmasked`), at about
PyTorch's own cost: the same op, the same bits.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from . import regime
from .arguments import ATTENTION, DEFAULTS, AttentionOptions, build_call
from .layout import fold, fold_mask, unfold
from .op import dispatch
from .op.autograd import differentiable_backward
from .op.call import AttentionCall
from .op.checks import check_fields

KEPT = 64  # signatures kept, least recently used first out
KEYED = frozenset({"is_causal", "scale", "enable_gqa", "attn_mask", "attn_bias"})  # the options a plan takes
_USUAL = KEYED | {"dropout_p"}  # scaled_dot_product_attention's, which a plain call passes
_plans: collections.OrderedDict = collections.OrderedDict()
_NO_PLAN = object()  # the signature's backend has none: the full path, without asking again


def _plain(tensors: tuple) -> bool:
    """Whether nothing but reverse mode would see a call on these inputs (None: absent; see
    the module)."""
    for t in tensors:
        if type(t) is not Tensor and t is not None:
            return False
    return regime.unseen(tensors) and not regime.forward_level_open()


def _score_mask_key(mask: Optional[Tensor], bias: Optional[Tensor]) -> Optional[tuple]:
    """What a plan's signature holds of a call's mask and bias: None without either, else
    each one's sizes, strides, dtype and device; False where the call has no plan (a mask
    not a boolean tensor, a bias not a floating one or one whose gradient is asked for: the
    full path says or does what is needed)."""
    if mask is None and bias is None:
        return None
    if not isinstance(mask, (Tensor, type(None))) or not isinstance(bias, (Tensor, type(None))):
        return False
    if mask is not None and mask.dtype != torch.bool or bias is not None and not bias.dtype.is_floating_point:
        return False
    if bias is not None and bias.requires_grad and torch.is_grad_enabled():
        return False
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in (mask, bias))


class _Planned(torch.autograd.Function):
    """out = the plan's forward(q, k, v, mask, bias) (folded tensors), its backward the
    plan's: the gradients of q, k and v (the mask and bias take none)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor],
                plan: _Plan) -> Tensor:
        out, row_max, inv_sum = plan.forward(q, k, v, mask, bias)
        ctx.save_for_backward(q, k, v, mask, bias, out, row_max, inv_sum)
        ctx.plan = plan  # its prepared passes and options: no tensor of this Function's
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple:
        q, k, v, mask, bias, out, row_max, inv_sum = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the gradients are differentiated again
            grads = differentiable_backward(ctx.plan.call(q, k, v, mask, bias), dout, out, row_max, inv_sum)
            return (*grads[:3], None, None, None)
        return (*ctx.plan.backward(q, k, v, mask, bias, dout.contiguous(), out, row_max, inv_sum), None, None, None)


def _planned(*arguments: Any) -> Tensor:
    """`_Planned` applied by autograd's own apply: PyTorch's binds default arguments first (a
    few us), and no transform is active here (`_plain`)."""
    return super(torch.autograd.Function, _Planned).apply(*arguments)


class _Plan(NamedTuple):
    """A signature's prepared passes: forward(q, k, v, mask, bias) -> (out, row_max, inv_sum)
    and, where its backend has one, backward(q, k, v, mask, bias, dout, out, row_max,
    inv_sum) -> (dq, dk, dv), on folded tensors; call(q, k, v, mask, bias), the signature's
    call on them; the inputs' batch dimensions, and their folding."""

    forward: Callable[..., tuple]
    backward: Optional[Callable[..., tuple]]
    call: Callable[..., AttentionCall]
    batch: torch.Size
    fold: Optional[tuple]  # (heads, kv_heads, flat), or None for (B, H, L, E) inputs

    def run(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
        differentiated = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if differentiated and self.backward is None:
            return None
        batch = self.batch
        if self.fold is not None:
            heads, kv_heads, _ = self.fold
            q, k, v = fold(q, batch, heads), fold(k, batch, kv_heads), fold(v, batch, kv_heads)
        if mask is not None:
            mask = fold_mask(mask, batch)
        if bias is not None:
            bias = fold_mask(bias, batch)
        out = _planned(q, k, v, mask, bias, self) if differentiated else self.forward(q, k, v, mask, bias)[0]
        return out if self.fold is None else unfold(out, batch, self.fold[2])


def _plain_options(options: AttentionOptions) -> bool:
    """Whether a call's options are those a plan takes: any of `KEYED`, and every other one
    declared and None or, where its default is not None (dropout_p's 0), falsy. An unknown
    name is not: the full path names it. (`forward` tries the usual call first.)"""
    for name, value in options.items():
        if name in KEYED:
            continue
        if name not in ATTENTION.names or value is not None and not (name in DEFAULTS and not value):
            return False
    return True


def _make(query: Tensor, key: Tensor, value: Tensor, options: dict, bias_name: str) -> Any:
    """The plan of this call's signature, or _NO_PLAN; the full path's errors for a bad call.
    `options`: the call's `KEYED` ones."""
    call, layout = build_call(query, key, value, bias_name=bias_name, **options)
    check_fields(call, {})
    forward = dispatch.plan("forward", call)
    if forward is None:
        return _NO_PLAN
    same = layout.q is query and layout.k is key and layout.v is value  # (B, H, L, E): nothing to fold
    # kept without the first call's tensors
    options = dataclasses.replace(call, q=None, k=None, v=None, masks=dataclasses.replace(call.masks, mask=None,
                                                                                          bias=None))

    def make_call(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor]) -> AttentionCall:
        return dataclasses.replace(options, q=q, k=k, v=v, masks=dataclasses.replace(options.masks, mask=mask,
                                                                                     bias=bias))

    return _Plan(forward, dispatch.plan("backward", call), make_call, layout.batch,
                 None if same else (layout.heads, layout.kv_heads, layout.flat))


def forward(query: Tensor, key: Tensor, value: Tensor, options: AttentionOptions,
            bias_name: str = "attn_bias") -> Optional[Tensor]:
    """attention(query, key, value, **options) from the plan of its signature, made at its
    first call; None where the call has no plan (the caller takes the full path).
    `bias_name`: what the user called attn_bias, for the first call's errors
    (`build_call`'s)."""
    get = options.get
    # the usual call's options are checked without a loop: a tiny call's time counts
    if not (_USUAL.issuperset(options) and not get("dropout_p") or _plain_options(options)):
        return None
    mask, bias = get("attn_mask"), get("attn_bias")
    masks = _score_mask_key(mask, bias)
    if masks is False or not _plain((query, key, value) if masks is None else (query, key, value, mask, bias)):
        return None
    is_causal, enable_gqa = get("is_causal", DEFAULTS["is_causal"]), get("enable_gqa", DEFAULTS["enable_gqa"])
    scale = get("scale")
    if type(is_causal) not in (bool, int, str) or not (scale is None or type(scale) in (float, int)):
        return None  # options of other types: the full path's checks say what is wrong
    signature = (query.shape, query.stride(), key.shape, key.stride(), value.shape, value.stride(), query.dtype,
                 key.dtype, value.dtype, query.device, type(is_causal), is_causal, scale, bool(enable_gqa), masks,
                 dispatch.state())
    plan = _plans.get(signature)
    if plan is None:
        keyed = dict(is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, attn_mask=mask, attn_bias=bias)
        plan = _plans[signature] = _make(query, key, value, keyed, bias_name)
        while len(_plans) > KEPT:
            _plans.popitem(last=False)
        if plan is not _NO_PLAN:
            _publish(plan, query, key, value, keyed)
    else:
        _plans.move_to_end(signature)
    if plan is _NO_PLAN:
        return None
    return plan.run(query, key, value, mask, bias)


def unmasked(query: Tensor, key: Tensor, value: Tensor, is_causal: bool, scale: Optional[float],
             enable_gqa: bool) -> Optional[Tensor]:
    """scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale,
    enable_gqa=enable_gqa) from a published forward (see the module), or None: the caller
    takes `forward`."""
    fast = _fast
    if fast is None or type(query) is not Tensor or type(key) is not Tensor or type(value) is not Tensor:
        return None
    if (query.requires_grad or key.requires_grad or value.requires_grad) and torch.is_grad_enabled():
        return None  # reverse mode tracks it: the entry would say so only after the call into it (2 us)
    if type(is_causal) is not bool or not (scale is None or type(scale) is float) or not regime.quiet():
        return None
    return fast(query, key, value, is_causal, scale, bool(enable_gqa), dispatch.state())


_fast: Optional[Callable[..., Optional[Tensor]]] = None  # the fast entry plans are published in


def _publish(plan: _Plan, query: Tensor, key: Tensor, value: Tensor, keyed: dict) -> None:
    """Publish the plan's forward for `unmasked` where it can be: a call it would take (no
    mask or bias, a bool is_causal, a float scale or none), on unfolded inputs."""
    global _fast
    publish = getattr(plan.forward, "publish", None)
    if publish is None or plan.fold is not None or keyed["attn_mask"] is not None or keyed["attn_bias"] is not None:
        return
    is_causal, scale = keyed["is_causal"], keyed["scale"]
    if type(is_causal) is bool and (scale is None or type(scale) is float):
        _fast = publish(query, key, value, is_causal, scale, bool(keyed["enable_gqa"]), dispatch.state())


def clear() -> None:
    """Forget every plan."""
    global _fast
    _plans.clear()
    if _fast is not None:
        _fast.clear()
    _fast = None
