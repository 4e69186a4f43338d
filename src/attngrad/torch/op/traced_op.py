"""`attngrad::attention`: a whole differentiable call as one PyTorch operator, for graphs.

Dynamo cannot trace an autograd.Function that defines a jvp (torch 2.13 breaks the graph on
it), and where it inlines one instead, forward mode is lost. So where Dynamo traces a call
(`regime.Mode.DYNAMO`), the call becomes this operator: a leaf of Dynamo's graph, whose
kernels AOTAutograd (or make_fx) runs while it makes the compiled graph, under the
torch.func transforms and forward-mode levels that the graph opens. They apply the
Functions of `autograd` (at autograd's key, and at functorch's own entry, so that each
transform takes them as PyTorch's apply gives them to it), whose forward, backward and jvp
call the passes' ops (`ops`): those are what the compiled graph holds. So every derivative
a Function gives eagerly, a compiled graph gives too: reverse mode, torch.func.grad, jvp, a
dual level, an HVP, reverse over forward, vmap of any of them.

Where nothing differentiates a call while the graph is made, the graph keeps the forward
alone, as `attngrad::attention_in_graph`, which refuses, when the graph runs, a dual tensor,
a tensor that requires grad or a transform: the graph's other kernels may have dropped their
tangents or gradients, and a partial tangent would be silently wrong. A dual tensor is
taken where the graph runs op by op (`aot_eager`): there every tangent reaches the call.

Their schema is the forward pass's arguments (`call.CALL_FIELDS`) with the output alone as
the result; below autograd they run the forward pass; their fake says the output's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import regime
from .call import FIELDS, AttentionCall, empty_like_field
from .checks import check_fields
from .ops import ARGUMENTS, DEFAULTS, run_pass

NAMES = ARGUMENTS["forward"]  # the call's fields, in schema order
LIBRARY = torch.library.Library("attngrad", "FRAGMENT")
_SCHEMA = f"({', '.join(FIELDS[name].declaration() for name in NAMES)}) -> Tensor"
LIBRARY.define("attention" + _SCHEMA)
# what a graph keeps of a call that nothing differentiated while the graph was made
LIBRARY.define("attention_in_graph" + _SCHEMA)
OP = torch.ops.attngrad.attention.default
IN_GRAPH = torch.ops.attngrad.attention_in_graph.default

UNDIFFERENTIATED = (
    "attngrad: {what} reached attention inside a torch.compile'd graph that was made without it (nothing "
    "differentiated the call while the graph was traced), and the graph's own kernels may have dropped the "
    "tangents or gradients of the tensors they computed: the result would be silently wrong (PyTorch's fusing "
    "kernels drop them too). Apply the transform inside the compiled function (torch.compile(lambda x: "
    "torch.func.jvp(f, (x,), (t,)))), or make the dual tensors inside it.")


def as_call(args: tuple, kwargs: dict) -> AttentionCall:
    """The op's arguments as the call (the dispatcher leaves out trailing defaults)."""
    return AttentionCall.from_fields({**DEFAULTS, **dict(zip(NAMES, args)), **kwargs})


def apply(call: AttentionCall, op: Any = OP) -> Tensor:
    """The call through the operator (or `IN_GRAPH`): what Dynamo puts in its graph."""
    fields = call.fields()
    return op(*(fields[name] for name in NAMES))


def _below_autograd(*args: Any, **kwargs: Any) -> Tensor:
    return run_pass("forward", as_call(args, kwargs), {})[0]


def _fake(*args: Any, **kwargs: Any) -> Tensor:
    call = as_call(args, kwargs)
    check_fields(call, {})
    return empty_like_field("out", call)


def _in_graph(*args: Any, **kwargs: Any) -> Tensor:
    """`IN_GRAPH` above autograd when the graph runs: the forward, unless a tangent or a
    gradient would be asked of it, which the graph cannot give exactly."""
    call = as_call(args, kwargs)
    tensors = (call.q, call.k, call.v, call.bias, call.sinks)
    if any(regime.carries_tangent(t) for t in tensors):
        if regime.called_by_a_graph_run_op_by_op():  # every tangent reached it: the whole call
            return apply(call)
        raise NotImplementedError(UNDIFFERENTIATED.format(what="a dual tensor (forward_ad)"))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise NotImplementedError(UNDIFFERENTIATED.format(what="a tensor that requires grad"))
    with regime.below_autograd():
        return apply(call, IN_GRAPH)


def _in_graph_transformed(*args: Any, **kwargs: Any) -> Tensor:
    raise NotImplementedError(UNDIFFERENTIATED.format(what="a torch.func transform"))


for _name in ("attention", "attention_in_graph"):
    LIBRARY.impl(_name, _below_autograd, "CompositeExplicitAutograd")
    torch.library.register_fake(f"attngrad::{_name}", _fake, lib=LIBRARY)
LIBRARY.impl("attention_in_graph", _in_graph, "Autograd")
LIBRARY.impl("attention_in_graph", _in_graph_transformed, "FuncTorchDynamicLayerFrontMode")


def register_autograd(differentiable: Callable[[AttentionCall, bool], Tensor]) -> None:
    """Make `differentiable(call, True)` the operator's kernel for autograd and for torch.func
    (`autograd` gives it its Functions; this module imports nothing of theirs).

    For torch.func the kernel sits at functorch's own entry (FuncTorchDynamicLayerFrontMode),
    before functorch's generic handling of an operator would bring the call to the level's
    autograd: there the Functions are applied as PyTorch's apply does under a transform
    (`custom_function_call`, which takes each level in turn, their vmap rules included)."""

    @regime.outside_dynamo  # a kernel: run, never traced (where Dynamo compiles nested frames)
    def kernel(*args: Any, **kwargs: Any) -> Tensor:
        return differentiable(as_call(args, kwargs), True)

    LIBRARY.impl("attention", kernel, "Autograd")
    LIBRARY.impl("attention", kernel, "FuncTorchDynamicLayerFrontMode")
