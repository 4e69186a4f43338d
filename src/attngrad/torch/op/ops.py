"""The passes of attention as PyTorch operators: `attngrad::attention_forward`,
`..._backward`, `..._jvp`, `..._forward_jvp` (the forward and its JVP together),
`..._backward_jvp`, `..._backward_with_jvp` (the backward and its JVP together),
`..._double_backward`.

Each is a `torch.library.custom_op` whose schema, fake implementation, argument checks and
batching rule come from the tables of `call` (FIELDS, PASSES): one generic implementation
builds the `AttentionCall`, checks it, and hands the pass to the backend registry
(`dispatch.run`). So torch.compile sees one opaque operator per pass, torch.func.vmap runs
it once over a folded batch (`vmap_rules`), and a new option touches no op.

Every op checks its arguments (`checks`) before any kernel reads them, and returns
contiguous tensors, as its fake says it will. The higher passes refuse a call whose seed
says its keys are a part of each row's: a ring step runs them through `dispatch.run` with
the whole rows' sums instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import regime
from . import dispatch, sink_logits, vmap_rules
from .call import (
    CALL_FIELDS,
    FIELDS,
    PASSES,
    REQUIRED,
    AttentionCall,
    argument_names,
    empty_like_field,
    present,
    schema,
)
from .checks import check_block_values, check_fields
from .key_constant_bias import is_key_constant, key_constant_bias_grad

CALL_NAMES = tuple(f.name for f in CALL_FIELDS)
ARGUMENTS = {pass_name: argument_names(pass_name) for pass_name in PASSES}  # in schema order
DEFAULTS = {f.name: f.default for f in FIELDS.values() if f.default is not REQUIRED}
# where each pass's results hold the sinks' derivatives
_SINK_OUTPUTS = {name: at for name, p in PASSES.items() if (at := [i for i, o in enumerate(p.outputs) if o.like == "sinks"])}


def split_fields(pass_name: str, args: tuple, kwargs: dict) -> tuple[AttentionCall, dict[str, Any]]:
    """The op's arguments as (the call, the pass's own inputs by name)."""
    # the dispatcher leaves out trailing arguments that equal their defaults
    fields = {**DEFAULTS, **dict(zip(ARGUMENTS[pass_name], args)), **kwargs}
    call = AttentionCall.from_fields(fields)
    return call, {name: fields[name] for name in PASSES[pass_name].inputs}


def add_sink(out: Tensor, row_max: Tensor, inv_sum: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The rows with a sink: one more term, exp(0), in every row's softmax denominator, a
    key of score 0 and value 0 (GPT-OSS's sinks with the learned logit s moved into the
    bias as -s: softmax is blind to a shift of a whole row). With Z = sum_j exp(S_ij) the
    rows' weight Z / (Z + 1) = sigmoid(log Z) scales O and 1/l; every later pass then reads
    the sink's share from 1/l alone. A row that sees no key (1/l = 0) stays 0; one that a
    NaN reached (1/l NaN) stays NaN."""
    seen = inv_sum != 0
    log_z = row_max - torch.log(torch.where(seen, inv_sum, 1.0))  # log Z = m + log l
    kept = torch.where(seen, torch.sigmoid(log_z), 0.0)  # Z / (Z + 1)
    return (out * kept[..., None].to(out.dtype)).contiguous(), row_max, inv_sum * kept


@regime.outside_dynamo
def run_pass(pass_name: str, call: AttentionCall, inputs: dict[str, Any]) -> Any:
    """What the op of `pass_name` does: check the call and the pass's inputs, and run the pass
    on the backend the registry chooses (a call with sinks through `sink_logits`)."""
    check_fields(call, inputs)
    check_block_values(call)
    if pass_name not in ("forward", "backward") and call.partial_rows:
        raise ValueError(f"attngrad attention op: attention_{pass_name} needs each row's whole keys; its seed says "
                         "they are a part")
    if call.sinks is not None:
        if call.partial_rows:
            raise ValueError("attngrad attention op: sinks need each row's whole keys; its seed says they are a part")
        return _as_op_results(pass_name, sink_logits.run(pass_name, call, inputs, _run_lowered), call)
    results = _run_lowered(pass_name, call, {n: v for n, v in inputs.items() if n not in ("tsinks", "gsinks")})
    if pass_name in _SINK_OUTPUTS:  # no sinks: their derivatives' places stay empty
        results = list(results)
        for i in _SINK_OUTPUTS[pass_name]:
            results.insert(i, None)
    return _as_op_results(pass_name, results, call)



def _as_op_results(pass_name: str, results: Any, call: AttentionCall) -> Any:
    if isinstance(results, Tensor):
        return results
    return tuple(call.q.new_empty(0) if r is None else r for r in results)  # ops return tensors, not None


def _run_lowered(pass_name: str, call: AttentionCall, inputs: dict[str, Any]) -> Any:
    """A pass of a call without sinks (a zero-logit `sink` at most) on the backends."""
    if pass_name in dispatch.OPTIONAL_PASSES and not dispatch.offered(pass_name, call, inputs):
        return _composed(pass_name, call, inputs)
    # a bias constant along the keys takes its gradient in closed form (key_constant_bias):
    # the backward is not asked for the backends' sum over every score, which cancels; the
    # fused backward and JVP still is, for the tangent of that gradient it gives in closed form
    closed_form = pass_name in ("backward", "backward_with_jvp") and inputs["bias_grad"] \
        and is_key_constant(call.bias) and not call.partial_rows
    asked = {**inputs, "bias_grad": False} if closed_form and pass_name == "backward" else inputs
    results = dispatch.run(pass_name, call, **asked)
    if pass_name == "forward" and call.sink:
        results = add_sink(*results)
    if closed_form:
        results = list(results)
        results[3] = key_constant_bias_grad(call.bias, call.sink, inputs["dout"], inputs["out"], inputs["row_max"],
                                            inputs["inv_sum"], empty_like_field("bias", call))
    return results


def _composed(pass_name: str, call: AttentionCall, inputs: dict[str, Any]) -> tuple:
    """A fused pass that no allowed backend runs, as its two passes in turn."""
    if pass_name == "forward_jvp":
        out, row_max, inv_sum = _run_lowered("forward", call, {})
        return out, row_max, inv_sum, _run_lowered("jvp", call, {"row_max": row_max, "inv_sum": inv_sum, **inputs})
    grads = _run_lowered("backward", call, {name: inputs[name] for name in PASSES["backward"].inputs})
    return (*grads, *_run_lowered("backward_jvp", call, inputs))


def _implementation(pass_name: str) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        return run_pass(pass_name, *split_fields(pass_name, args, kwargs))

    return run


def empty_results(pass_name: str, call: AttentionCall, inputs: dict[str, Any]) -> tuple[Tensor, ...]:
    """Uninitialised results of the pass, as its op returns them (its fake's)."""
    return tuple(empty_like_field(output.like, call) if present(output, call, inputs) else call.q.new_empty(0)
                 for output in PASSES[pass_name].outputs)


def _fake(pass_name: str) -> Callable[..., Any]:
    def fake(*args: Any, **kwargs: Any) -> Any:
        call, inputs = split_fields(pass_name, args, kwargs)
        check_fields(call, inputs)
        results = empty_results(pass_name, call, inputs)
        return results[0] if len(results) == 1 else results

    return fake


def _define(pass_name: str) -> Any:
    op = torch.library.custom_op(f"attngrad::attention_{pass_name}", _implementation(pass_name), mutates_args=(),
                                 schema=schema(pass_name))
    op.register_fake(_fake(pass_name))
    op.register_vmap(vmap_rules.make_rule(op, pass_name, ARGUMENTS[pass_name]))
    return op


OPS = {pass_name: _define(pass_name) for pass_name in PASSES}
attention_forward, attention_backward, attention_jvp, attention_forward_jvp, attention_backward_jvp, \
    attention_backward_with_jvp, attention_double_backward = (
        OPS[name] for name in ("forward", "backward", "jvp", "forward_jvp", "backward_jvp", "backward_with_jvp",
                               "double_backward"))


def run_op(pass_name: str, call: AttentionCall, **inputs: Any) -> Any:
    """Call the op of `pass_name` on `call` and the pass's inputs (by name; handed to the op
    in schema order, which Dynamo traces where it does not trace every keyword)."""
    # where nothing would see the op called, its own work, without the dispatcher's trip
    # (about 35 us of a 200 us small call, torch 2.13)
    if regime.unseen((*call.tensors(), call.seed), inputs.values()):
        return run_pass(pass_name, call, inputs)
    fields = {**call.fields(), **inputs}
    return OPS[pass_name](*(fields[name] for name in ARGUMENTS[pass_name]))
