"""Attention as a differentiable function: three autograd.Functions over the ops of `ops`.

    Attention          forward -> out          backward: AttentionBackward       jvp: Tangent
    AttentionBackward  forward -> dq, dk, ...  backward: the double_backward op  jvp: the backward_jvp op
    Tangent            forward -> out_t = J t  backward: the backward_with_jvp op (the gradient through a JVP)

Where forward mode alone differentiates a call (torch.func.jvp, or a dual level, with no
reverse mode tracking its tensors), `attention` runs the forward_jvp op instead of the
Function: the forward and its JVP in one pass, 6 matrix products where the two take 7.

Where forward mode and reverse mode both see a Function (a Hessian-vector product,
torch.func.jvp of torch.func.grad; a dual level over tensors that require grad), its forward
leaves its results to its jvp, which makes them with their tangents in one pass
(`hvp_fusion.Deferred`): forward_jvp for `Attention`, backward_with_jvp for
`AttentionBackward`, 19 matrix products where the four passes take 22. The forward's pass
also leaves each row's centre rowsum(P * S') and the output's tangent
(`hvp_fusion.ForwardSums`), from which the backward's pass, for the same tangents, runs on
the backward's tiles rather than on whole rows.

Under Dynamo (torch.compile, torch.export) a call is the operator `attngrad::attention`
(`traced_op`), whose autograd and torch.func kernels come back to `differentiable_attention`
while AOTAutograd makes the graph: the Functions then give the compiled graph its passes,
forward mode included. Which path a call takes is decided in `differentiable_attention`,
from one `regime.Regime`.

Because the first backward and the JVP are themselves differentiable Functions, double
backward (create_graph=True), Hessian-vector products, torch.func.hessian, and reverse mode
over forward mode (torch.func.vjp of torch.func.jvp, jacrev(jacfwd(f))) work; a third
derivative raises.

No ctx keeps a tensor that holds its own Function's outputs: autograd's graph is C++, and a
cycle through it is one Python's collector cannot free (`hvp_fusion.Deferred.settle`).
(torch.library's own register_autograd would be the shorter spelling, but the wrapper it
generates in torch 2.13 has no setup_context, and torch.func refuses it: pytorch#170834.)

The forward saves the call's tensors, out, and per query row the score maximum and the
inverse softmax denominator: O(L). `out`, the row statistics and `seed` reach
AttentionBackward as caches: its derivatives are taken through q, k, v, bias and dout
alone, which determine them. A Function takes the call whole, as its options (the call
without its tensors), and the call's tensors positionally after it (autograd and torch.func
track tensors among positional arguments only): `options.with_tensors(tensors)` is the call
again, on the tensors autograd or a transform hands the Function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.autograd.forward_ad as forward_ad
from torch import Tensor

from .. import regime
from ..regime import Mode, Regime
from . import traced_op
from .call import TENSOR_SLOTS, AttentionCall
from .hvp_fusion import Deferred, ForwardSums
from .ops import run_op

_Q, _K, _V, _BIAS, _SINKS = (TENSOR_SLOTS.index(name) for name in ("q", "k", "v", "bias", "sinks"))
_DIFFERENTIABLE = ("q", "k", "v", "bias", "sinks")  # the call's tensors with derivatives
_OPTIONS = 2  # a Function's arguments before the tensors it differentiates: the call's options and `deferred`

_BACKWARD_INPUTS = ("dout", "out", "row_max", "inv_sum", "bias_grad")  # AttentionBackward's, before the call's

THIRD_ORDER = "attngrad attention has derivatives up to second order; a third was asked for"


class _Function(torch.autograd.Function):
    """A Function whose apply skips `torch.autograd.Function.apply`'s binding of default
    arguments (inspect.signature on every call: about a third of a small call's time, torch
    2.13); these forwards have none to bind. Under torch.func transforms it goes straight to
    what PyTorch's apply calls there (`custom_function_call`); while a graph is made,
    PyTorch's own apply runs."""

    @classmethod
    def apply(cls, *args: Any) -> Any:
        # (Dynamo never traces a Function's apply: under Dynamo a call is the operator, so a
        # DYNAMO reading here is Dynamo's flag outliving its trace, and the work is eager)
        if regime.mode() is Mode.TRACING:
            return super().apply(*args)
        if regime.transforms_active():
            if regime.custom_function_call is None:  # pragma: no cover
                return super().apply(*args)
            return regime.custom_function_call(cls, *args)  # what PyTorch's apply calls there
        args = regime.unwrap_dead_wrappers(args)
        return super(torch.autograd.Function, cls).apply(*args)  # autograd's own node, no binding


class Final(_Function):
    """Runs one function as a leaf of differentiation: differentiating its results raises.

    Autograd and torch.func transforms call a Function's backward and jvp on tensors that an
    outer transform may still track (torch.func always builds the graph of a backward).
    Calling the function inside this Function's forward hands it plain tensors, and a
    derivative asked of its results gets a clear error instead of a silent zero."""

    generate_vmap_rule = True  # vmap runs the op once per batched slice

    @staticmethod
    @regime.outside_dynamo
    def forward(fn: Callable, refusal: str, *args: Any):
        return fn(*args)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.refusal = inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: Any):
        raise NotImplementedError(ctx.refusal)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any):
        raise NotImplementedError(ctx.refusal)


def _bound(pass_name: str, options: AttentionCall, slots: list, deferred: Optional[Deferred],
           sums: Optional[ForwardSums], inputs: dict) -> tuple[Callable[..., Any], list[Tensor]]:
    """The op of `pass_name` as a function of the call's and the inputs' tensors alone, and
    those tensors: torch.func's Function calls walk every argument at every level, so the
    call's options and absent inputs ride in the closure. With `deferred`, the op is a fused
    pass: its primal results fill `deferred`, and the rest are returned. With `sums`,
    forward_jvp makes them where a backend can, and backward_with_jvp takes them
    (`ForwardSums.run`)."""
    names, values = tuple(inputs), [*slots, *inputs.values()]
    at = [i for i, value in enumerate(values) if isinstance(value, Tensor)]

    def run(*tensors: Tensor) -> Any:
        args = list(values)
        for i, t in zip(at, tensors):
            args[i] = t
        call, given = options.with_tensors(args[:len(TENSOR_SLOTS)]), dict(zip(names, args[len(TENSOR_SLOTS):]))
        results = None
        if sums is not None:
            results = sums.run(pass_name, call, given, deferred.results)
        if results is None:
            results = run_op(pass_name, call, **given)
        if deferred is None:
            return results
        deferred.fill(results)
        return deferred.rest(results)

    return run, [values[i] for i in at]


def _final(pass_name: str, refusal: str, options: AttentionCall, slots: list, deferred: Optional[Deferred] = None,
           sums: Optional[ForwardSums] = None, **inputs: Any) -> Any:
    """The op of `pass_name` as a leaf of differentiation (`Final`), every tensor handed to
    it as an argument, so that a torch.func transform unwraps each (`_bound`)."""
    run, tensors = _bound(pass_name, options, slots, deferred, sums, inputs)
    return Final.apply(run, refusal, *tensors)


class Tangent(_Function):
    """out_t = J t, the JVP of attention at the call along the tangents t of q, k, v and the
    bias, differentiable once in reverse mode (the gradient through a JVP: sliced score
    matching, Jacobian penalties, jacrev(jacfwd(f))).

    With c the cotangent of out_t, <c, J t> is linear in t, so t gets J^T c, the backward's
    gradients for upstream gradient c; q, k, v and the bias get d/dθ <J^T c, t>, the JVP of
    that backward along t. The fused backward_with_jvp pass gives both at once (with no
    tangent of c), in O(L) memory. out, row_max and inv_sum enter as the forward's caches.

    Arguments: the pass's function of the tensors (`_bound`), the call's options and where
    in the tensors the call's own, the caches and the tangents lie (`layout`), then the
    tensors."""

    generate_vmap_rule = True

    @staticmethod
    @regime.outside_dynamo
    def forward(run: Callable[..., Any], layout: dict, *tensors: Tensor):
        return run(*(t for i, t in enumerate(tensors) if i not in layout["caches_only"]))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.layout = inputs[1]
        ctx.save_for_backward(*inputs[2:])
        ctx.set_materialize_grads(False)

    @staticmethod
    @regime.outside_dynamo
    def backward(ctx: Any, c: Optional[Tensor]):
        saved, layout = ctx.saved_tensors, ctx.layout
        grads: list[Optional[Tensor]] = [None] * len(saved)
        if c is None:
            return (None, None, *grads)
        if regime.forward_level_open() and not regime.transforms_active():
            # a backward inside the eager dual level of the tangent it differentiates: the
            # tangents of its results would be third derivatives, which nothing asked for
            saved = tuple(None if t is None else forward_ad.unpack_dual(t).primal for t in saved)
            c = forward_ad.unpack_dual(c).primal
        slots = [None if i is None else saved[i] for i in layout["slots"]]
        out, row_max, inv_sum = (saved[i] for i in layout["caches"])
        tangents = {name: None if i is None else saved[i] for name, i in layout["tangents"].items()}
        # the bias, even without a tangent of its own, shapes J; its tangent gets J^T c's part
        bias_grad = any(i is not None and ctx.needs_input_grad[2 + i]
                        for i in (layout["slots"][_BIAS], layout["tangents"]["tbias"]))
        dq, dk, dv, dbias, dsinks, tdq, tdk, tdv, tdbias, tdsinks = _final(
            "backward_with_jvp", THIRD_ORDER, layout["options"], slots, dout=c.contiguous(), out=out, row_max=row_max,
            inv_sum=inv_sum, bias_grad=bias_grad, tdout=None, **tangents)
        for name, grad, grad_t in (("q", tdq, dq), ("k", tdk, dk), ("v", tdv, dv), ("bias", tdbias, dbias),
                                   ("sinks", tdsinks, dsinks)):
            at, tangent_at = layout["slots"][TENSOR_SLOTS.index(name)], layout["tangents"]["t" + name]
            if name == "bias" and not bias_grad:
                continue
            if at is not None:
                grads[at] = grad  # d/dθ <c, J(θ) t>: the backward's JVP along t
            if tangent_at is not None:
                grads[tangent_at] = grad_t  # J^T c
        return (None, None, *grads)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any):
        raise NotImplementedError(THIRD_ORDER)


def _tangent(pass_name: str, options: AttentionCall, slots: list, caches: tuple, deferred: Optional[Deferred] = None,
             sums: Optional[ForwardSums] = None, **inputs: Any) -> Tensor:
    """The op of `pass_name`, the jvp or the fused forward_jvp, whose last result is out_t,
    as a `Tangent`: out_t differentiable in reverse mode. `caches` are out, row_max and
    inv_sum (with `deferred`, the held results the pass fills), detached."""
    run, tensors = _bound(pass_name, options, slots, deferred, sums, inputs)
    # where each argument lies among `tensors`, by position (a tangent may be the very
    # tensor of its primal: ids would merge the two)
    values = [*slots, *inputs.values()]
    position = {i: n for n, i in enumerate(i for i, value in enumerate(values) if isinstance(value, Tensor))}
    names = tuple(inputs)
    layout = {"options": options, "slots": [position.get(i) for i in range(len(slots))],
              "tangents": {name: position.get(len(slots) + names.index(name)) for name in names if name[0] == "t"},
              "caches": [], "caches_only": set()}
    given = {id(inputs[name]): position[len(slots) + names.index(name)] for name in ("row_max", "inv_sum")
             if isinstance(inputs.get(name), Tensor)}
    for cache in caches:
        if id(cache) not in given:  # not an input of the pass itself: the backward's alone
            given[id(cache)] = len(tensors)
            layout["caches_only"].add(len(tensors))
            tensors.append(cache)
        layout["caches"].append(given[id(cache)])
    return Tangent.apply(run, layout, *tensors)


def _tangents_of(slots: list, tangents: tuple) -> dict[str, Optional[Tensor]]:
    """The tangents of the call's differentiable tensors, by the passes' names (tq, ...); None
    for a tensor the call lacks."""
    return {"t" + name: tangents[i] if slots[i] is not None else None
            for name, i in zip(_DIFFERENTIABLE, (_Q, _K, _V, _BIAS, _SINKS))}


def _save(ctx: Any, options: AttentionCall, slots: tuple, *extra: Tensor) -> None:
    """Keep the call's options, and save its tensors and `extra` through autograd."""
    ctx.options = options
    ctx.save_for_backward(*slots, *extra)
    ctx.save_for_forward(*slots, *extra)


def _saved(ctx: Any) -> tuple[list, tuple]:
    """The call's tensors (`TENSOR_SLOTS` order) and the extra tensors `_save` kept."""
    saved = ctx.saved_tensors
    return list(saved[:len(TENSOR_SLOTS)]), saved[len(TENSOR_SLOTS):]


class Attention(_Function):
    """out = attention(call) with the tiled backward. Arguments: the call's options, a
    `Deferred` or None, then the call's tensors (`TENSOR_SLOTS`)."""

    generate_vmap_rule = True  # vmap runs the custom ops once per batched slice

    @staticmethod
    @regime.outside_dynamo
    def forward(options: AttentionCall, deferred: Optional[Deferred], *slots: Optional[Tensor]):
        call = options.with_tensors(slots)
        if deferred is not None:
            return deferred.hold(call, {})
        return run_op("forward", call)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.deferred = inputs[1]
        _save(ctx, inputs[0], inputs[_OPTIONS:], *output)
        # row_max and inv_sum are not marked non-differentiable: under vmap, torch.func's
        # generated rule loses that mark and then refuses the None tangent (torch 2.13).
        # They get zero tangents, and their incoming gradients are ignored.

    @staticmethod
    @regime.outside_dynamo
    def backward(ctx: Any, dout: Tensor, _dmax: Tensor, _dinv: Tensor):
        slots, (out, row_max, inv_sum) = _saved(ctx)
        bias_grad = slots[_BIAS] is not None and ctx.needs_input_grad[_OPTIONS + _BIAS]
        # the sinks' gradient is a row sum of what the pass has: made whether asked or not
        # out and the statistics enter as caches, detached: the second derivatives are taken
        # through q, k, v and bias, and a graph edge back into this node would only make
        # autograd rerun this backward on zeros
        inputs = (dout.contiguous(), out.detach(), row_max.detach(), inv_sum.detach(), bias_grad)
        now = Regime.now()
        if now.untracked((inputs[0], *slots)):  # no create_graph: the backward pass alone
            dq, dk, dv, dbias, dsinks = run_op("backward", ctx.options.with_tensors(slots),
                                               **dict(zip(_BACKWARD_INPUTS, inputs)))
        else:
            sums = ctx.deferred.sums if ctx.deferred is not None else None
            deferred = Deferred("backward", sums) if now.defers() else None
            dq, dk, dv, dbias, dsinks = AttentionBackward.apply(ctx.options, deferred, *inputs, *slots)
            if deferred is not None:
                deferred.settle(ctx.options, slots, **dict(zip(_BACKWARD_INPUTS, inputs)))
        grads = [None] * len(slots)
        grads[_Q], grads[_K], grads[_V], grads[_BIAS] = dq, dk, dv, dbias if bias_grad else None
        grads[_SINKS] = dsinks if slots[_SINKS] is not None else None
        return (None, None, *grads)  # none for the options and `deferred`

    @staticmethod
    @regime.outside_dynamo
    def jvp(ctx: Any, _options: None, _deferred: None, *tangents: Any):
        slots, (_out, row_max, inv_sum) = _saved(ctx)
        along = _tangents_of(slots, tangents)
        if ctx.deferred is not None:  # the forward's results with the tangent, one pass
            ctx.deferred.sums = ForwardSums(tuple(along.values()))
            caches = tuple(t.detach() for t in ctx.deferred.results)  # filled by the pass, before the backward reads them
            out_t = _tangent("forward_jvp", ctx.options, slots, caches, ctx.deferred, ctx.deferred.sums, **along)
        else:
            caches = (_out.detach(), row_max.detach(), inv_sum.detach())
            out_t = _tangent("jvp", ctx.options, slots, caches, row_max=caches[1], inv_sum=caches[2], **along)
        return out_t, torch.zeros_like(row_max), torch.zeros_like(inv_sum)


class AttentionBackward(_Function):
    """(dq, dk, dv, dbias, dsinks) = the backward of `Attention`, itself differentiable once
    more. Arguments: the call's options, a `Deferred` or None, dout, out, row_max, inv_sum,
    bias_grad, then the call's tensors (`TENSOR_SLOTS`)."""

    generate_vmap_rule = True

    @staticmethod
    @regime.outside_dynamo
    def forward(options: AttentionCall, deferred: Optional[Deferred], dout: Tensor, out: Tensor, row_max: Tensor,
                inv_sum: Tensor, bias_grad: bool, *slots: Optional[Tensor]):
        call = options.with_tensors(slots)
        if deferred is not None:
            return deferred.hold(call, {"bias_grad": bias_grad})
        return run_op("backward", call, dout=dout, out=out, row_max=row_max, inv_sum=inv_sum, bias_grad=bias_grad)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        options, deferred, dout, out, row_max, inv_sum, bias_grad, *slots = inputs
        _save(ctx, options, tuple(slots), dout, out, row_max, inv_sum)
        ctx.bias_grad, ctx.deferred = bias_grad, deferred
        ctx.set_materialize_grads(False)  # a gradient nobody used arrives as None: no work for it

    @staticmethod
    @regime.outside_dynamo
    def backward(ctx: Any, gq: Tensor, gk: Tensor, gv: Tensor, gbias: Tensor, gsinks: Tensor):
        slots, (dout, out, row_max, inv_sum) = _saved(ctx)
        dout_grad = ctx.needs_input_grad[_OPTIONS]  # a gradient penalty's dout is a constant
        with_sinks = slots[_SINKS] is not None
        g_dout, g_q, g_k, g_v, g_bias, g_sinks = _final(
            "double_backward", THIRD_ORDER, ctx.options, slots, dout=dout, out=out, row_max=row_max, inv_sum=inv_sum,
            bias_grad=ctx.bias_grad, dout_grad=dout_grad, gq=gq, gk=gk, gv=gv, gbias=gbias if ctx.bias_grad else None,
            gsinks=gsinks if with_sinks else None)
        grads = [None] * len(slots)
        grads[_Q], grads[_K], grads[_V], grads[_BIAS] = g_q, g_k, g_v, g_bias if ctx.bias_grad else None
        grads[_SINKS] = g_sinks if with_sinks else None
        return (None, None, g_dout if dout_grad else None, None, None, None, None, *grads)

    @staticmethod
    @regime.outside_dynamo
    def jvp(ctx: Any, *tangents: Any):
        # the options, `deferred`, out, row_max, inv_sum and bias_grad have none that counts
        _options, _deferred, tdout, _tout, _tmax, _tinv, _tbias_grad, *slot_tangents = tangents
        slots, (dout, out, row_max, inv_sum) = _saved(ctx)
        along = _tangents_of(slots, slot_tangents)
        # without a bias gradient, the last result is the empty placeholder; a deferred forward's
        # results come from the same pass (backward_with_jvp)
        pass_name = "backward_jvp" if ctx.deferred is None else "backward_with_jvp"
        # along the forward's own tangents, its pass's row sums put this one on the backward's tiles
        sums = ctx.deferred.sums if ctx.deferred is not None else None
        if sums is None or ctx.bias_grad or not sums.along(tuple(along.values())):
            sums = None
        return _final(pass_name, THIRD_ORDER, ctx.options, slots, ctx.deferred, sums, dout=dout, out=out,
                      row_max=row_max, inv_sum=inv_sum, bias_grad=ctx.bias_grad, tdout=tdout, **along)


def differentiable_backward(call: AttentionCall, dout: Tensor, out: Tensor, row_max: Tensor,
                            inv_sum: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `call` (no bias, no sinks) for the upstream gradient `dout`, given the
    forward's results, differentiable once more (`AttentionBackward`): what `Attention`'s
    backward gives under create_graph, for a caller that ran the forward itself
    (`eager_plans`)."""
    dq, dk, dv, _dbias, _dsinks = AttentionBackward.apply(call.options(), None, dout.contiguous(), out.detach(),
                                                          row_max.detach(), inv_sum.detach(), False,
                                                          *call.tensor_slots())
    return dq, dk, dv


def _forward_mode_only(call: AttentionCall, now: Regime) -> Optional[tuple[AttentionCall, dict[str, Optional[Tensor]]]]:
    """Where forward mode alone differentiates `call` (`Regime.forward_mode_innermost`), no
    reverse mode tracks its tensors or their tangents, and at least one carries a tangent:
    the call on the primals and the tangents of q, k, v, bias, sinks (None: zero). Else None.

    There the forward and its JVP run as one pass (`forward_jvp`), which a Function cannot
    ask for: autograd runs its forward before it hands the jvp the tangents."""
    if not now.forward_mode_innermost():
        return None
    primals, tangents = {}, {}
    for name in _DIFFERENTIABLE:
        t = getattr(call, name)
        primals[name], tangents["t" + name] = (None, None) if t is None else forward_ad.unpack_dual(t, level=now.level)
    # reverse mode tracking a primal or a tangent (the gradient through a JVP) needs the Functions
    if now.tracks(regime.unwrapped(t) for t in (*primals.values(), *tangents.values()) if t is not None):
        return None
    if all(t is None for t in tangents.values()):
        return None
    masks = dataclasses.replace(call.masks, bias=primals["bias"], sinks=primals["sinks"])
    return dataclasses.replace(call, q=primals["q"], k=primals["k"], v=primals["v"], masks=masks), tangents


def differentiable_attention(call: AttentionCall, in_kernel: bool = False) -> Tensor:
    """The differentiable attention of `call`, on (B, H, L, E) tensors: its output. The path
    is decided here, from one `Regime`: while a graph is made, the operator (`traced_op`),
    whose Autograd kernel comes back here (`in_kernel`) and takes `_traced`'s path; eagerly,
    the op alone where nothing differentiates, the fused forward and JVP where forward mode
    alone does, else the Functions."""
    now = Regime.now(probe=_differentiable(call) if in_kernel else (), in_kernel=in_kernel)
    if not now.eager:
        return _traced(call, now) if in_kernel else traced_op.apply(call)
    if now.untracked(call.tensors()):
        return run_op("forward", call)[0]
    dual = _forward_mode_only(call, now)
    if dual is not None:
        out, _row_max, _inv_sum, out_t = run_op("forward_jvp", dual[0], **dual[1])
        return forward_ad.make_dual(out, out_t, level=now.level)
    return _through_functions(call, now)


def _through_functions(call: AttentionCall, now: Regime) -> Tensor:
    options, slots = call.options(), call.tensor_slots()
    deferred = Deferred("forward") if now.defers() else None
    out = Attention.apply(options, deferred, *slots)[0]
    if deferred is not None:
        deferred.settle(options, slots)
    return out


def _traced(call: AttentionCall, now: Regime) -> Tensor:
    """The operator's Autograd kernel while a graph is made of it: where no transform is
    active and nothing tracks or carries a tangent of its tensors, the forward alone, as the
    operator `IN_GRAPH`, which refuses when the graph runs any tangent or gradient the graph
    would not give exactly; else (a transform, tracked tensors, a dual tensor made inside the
    graph) the Functions, whose passes' ops the graph then holds."""
    if not now.transforms and not now.tracks(call.tensors()) and not _has_tangents(call, now):
        with regime.below_autograd():
            return traced_op.apply(call, traced_op.IN_GRAPH)
    return _through_functions(call, now)


def _has_tangents(call: AttentionCall, now: Regime) -> bool:
    """Whether a tensor of the call carries a tangent at the open forward-mode level."""
    return now.forward_level and any(forward_ad.unpack_dual(t, level=now.level).tangent is not None
                                     for t in _differentiable(call) if t is not None)


def _differentiable(call: AttentionCall) -> tuple:
    return call.q, call.k, call.v, call.bias, call.sinks


traced_op.register_autograd(differentiable_attention)
