"""The "tiles" backend: the compiled C++ tiles (`native`), every pass on the CPU in float32
or float64 (float16 computed in float32, bfloat16's products in bfloat16 with float32 sums;
results returned in the inputs' dtypes). Registered first: where it takes a call, it is the fast one. It refuses tensors on
other devices, an empty dimension, and of the passes given rows' sums (`row_sums`) all but
two: the backward's JVP given each row's centre and D' (a ring step's), or the centre, its
peak and O' (a Hessian-vector product's, from the forward's JVP; D' made here), both
`native.attention_backward_jvp_given_sums`, without a bias gradient; and the forward's JVP
asked for each row's centre (`centre_sums`), in float32 and float64;
there the fused passes (forward_jvp, backward_with_jvp) also take the tensors to write their
primal results into (`results`: a Hessian-vector product's Functions returned them before
the pass ran). It is unavailable where the tiles cannot be built (`native.build_info.reason`
says why)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor
from typing_extensions import Unpack  # typing's from Python 3.11; attngrad takes 3.10

from ... import regime
from ...op import dispatch, dropout
from ...op.call import HVP_SUMS, AttentionCall, HvpSums, PassInputs, RingSums
from ...precision import FLOATS
from . import native


def _unavailable() -> Optional[str]:
    return None if native.library() is not None else native.build_info.reason


# The ring's rows' sums the tiles take, by pass: a forward JVP's centre written, the
# backward's JVP given the centre and D'
_RING_SUMS = {"forward_jvp": {"centre_sums"}, "backward_jvp": {"centre", "delta_t"},
              "backward_with_jvp": {"centre", "delta_t"}}


def _refuses(call: AttentionCall, pass_name: str, inputs: dict) -> Optional[str]:
    if not all(t.is_cpu for t in call.tensors()):
        return f"it runs on the CPU; the call is on {call.q.device}"
    if call.q.dtype not in FLOATS:
        return f"it takes floating tensors; got {call.q.dtype}"
    if min(call.q.shape) == 0 or min(call.k.shape) == 0 or min(call.v.shape) == 0:
        return "it takes no empty dimension"
    row_sums = inputs.get("row_sums")
    if row_sums is not None:
        if not isinstance(row_sums, (RingSums, HvpSums)):
            return f"it takes a ring step's or an HVP's rows' sums (RingSums, HvpSums), not a {type(row_sums).__name__}"
        # a ring step under torch.func may hold a transform's tensors, which the compiled
        # tiles cannot read (the ops hand them plain ones)
        held = row_sums.get("results", ())  # a fused pass's primal results, written in place
        given = (*call.tensors(),
                 *(t for t in (*inputs.values(), *row_sums.values(), *held) if isinstance(t, Tensor)))
        if any(regime.is_wrapped(t) for t in given):
            return "it reads plain tensors; this ring step holds a torch.func transform's"
        if inputs.get("sink_rows") is not None:
            return "it writes the sink's rows on whole rows alone"
        hvp = isinstance(row_sums, HvpSums)
        sums = set(row_sums) - ({"results"} if hvp else set())
        expected = HVP_SUMS.get(pass_name) if hvp else _RING_SUMS.get(pass_name)
        if expected is None or sums != expected:
            return f"it takes no rows' sums {sorted(row_sums)} in its {pass_name} pass"
        if pass_name in ("backward_jvp", "backward_with_jvp"):
            return "it takes a bias gradient on whole rows alone" if inputs.get("bias_grad") else None
        # forward_jvp: a ring step's; an HVP's in float32/64 (its peak_index left -1: the tiles
        # find the peak by its value, and make D' from O' themselves); a half-precision HVP
        # keeps whole rows
        if not hvp or call.q.dtype in (torch.float32, torch.float64):
            return None
        return f"it takes an HVP's rows' sums in float32 and float64 alone; got {call.q.dtype}"
    return None


def _in_dtypes_of(results: tuple, inputs: tuple) -> tuple:
    """The tiles' results (float32 for float16 and bfloat16 inputs) each in the dtype of the
    input it is the derivative of; None stays None."""
    return tuple(None if r is None else r.to(x.dtype) for r, x in zip(results, inputs))


def forward(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
    out, row_max, inv_sum = native.attention_forward(call)
    return out.to(call.q.dtype), row_max, inv_sum  # the statistics stay in the compute dtype


def _plannable(call: AttentionCall) -> bool:
    return call.bounds is None and call.blocks is None and not call.dropout_p and not call.sink and call.sinks is None


def plan_forward(call: AttentionCall) -> Optional[Callable[..., tuple[Tensor, Tensor, Tensor]]]:
    """The forward prepared for calls like `call` (`dispatch.plan`): those without key
    bounds, mask blocks, dropout or sinks (a mask and a bias are the plan's per call):
    run(q, k, v, mask, bias) -> (out, row_max, inv_sum)."""
    if not _plannable(call):
        return None
    prepared = native.forward_plan(call)
    dtype = call.q.dtype
    if dtype in (torch.float32, torch.float64):
        return prepared  # the tiles' output is in the input's dtype: nothing to convert

    def run(*tensors: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        out, row_max, inv_sum = prepared(*tensors)
        return (out if out.dtype == dtype else out.to(dtype)), row_max, inv_sum

    if hasattr(prepared, "publish"):  # its fast entry converts the output itself
        run.publish = prepared.publish
    return run


def plan_backward(call: AttentionCall) -> Optional[Callable[..., tuple[Tensor, Tensor, Tensor]]]:
    """The backward (dq, dk, dv) prepared for calls like `call`, as `plan_forward`, without a
    bias gradient: run(q, k, v, mask, bias, dout, out, row_max, inv_sum), each gradient in
    its input's dtype."""
    if not _plannable(call):
        return None
    prepared = native.backward_plan(call)
    dtypes = (call.q.dtype, call.k.dtype, call.v.dtype)
    if all(dtype == dtypes[0] for dtype in dtypes) and dtypes[0] in (torch.float32, torch.float64):
        return prepared

    def run(*tensors: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(g if g.dtype == dtype else g.to(dtype) for g, dtype in zip(prepared(*tensors), dtypes))

    return run


def backward(call: AttentionCall, **inputs: Unpack[PassInputs]) -> tuple:
    return _in_dtypes_of(native.attention_backward(call, inputs), (call.q, call.k, call.v, call.bias))


def jvp(call: AttentionCall, **inputs: Unpack[PassInputs]) -> Tensor:
    return native.attention_jvp(call, inputs).to(call.q.dtype)


def forward_jvp(call: AttentionCall, **inputs: Unpack[PassInputs]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """With row_sums {"centre_sums": (B, H, Lq, 1) compute dtype}, each row's centre
    rowsum(P * S') is written there too (with "peak_sums" as well, S' at the row's most
    probable key there and the centre less it in "centre_sums"), and with its "results" (out,
    row_max, inv_sum) the primal results are written into those (`native.attention_forward_jvp`)."""
    out, row_max, inv_sum, out_t = native.attention_forward_jvp(call, inputs)
    return out.to(call.q.dtype), row_max, inv_sum, out_t.to(call.q.dtype)  # the statistics in the compute dtype


def _backward_jvp(call: AttentionCall, inputs: PassInputs, with_backward: bool) -> tuple:
    """The backward's JVP (with the backward first, where asked) on whole rows, or, given the
    rows' sums {"centre", "delta_t"} ((B, H, Lq, 1), as a ring step has them; or {"centre",
    "peak", "peak_index", "out_t"}, the centre less the peak and O', as the forward's JVP
    leaves them), on the backward's tiles: no bias
    gradient there, nor its tangent. With the backward, row_sums' "results" (dq, dk, dv) take
    its results where given."""
    row_sums = inputs.get("row_sums")
    if row_sums is None:
        return native.attention_backward_jvp(call, inputs, with_backward=with_backward)
    if isinstance(row_sums, HvpSums):  # D' from the forward's O'
        inputs = {**inputs, "row_sums": {**row_sums, "delta_t": _delta_t(inputs, row_sums)}}
    results = native.attention_backward_jvp_given_sums(call, inputs, with_backward=with_backward)
    tangents = (*results[-3:], None)
    return (*results[:3], None, *tangents) if with_backward else tangents


def _delta_t(inputs: PassInputs, row_sums: dict) -> Tensor:
    """D' = rowsum(dO' * O + dO * O'), (B, H, Lq, 1) in the sums' dtype."""
    work = row_sums["centre"].dtype
    delta_t = (inputs["dout"].to(work) * row_sums["out_t"].to(work)).sum(dim=-1, keepdim=True)
    if inputs.get("tdout") is not None:
        delta_t += (inputs["tdout"].to(work) * inputs["out"].to(work)).sum(dim=-1, keepdim=True)
    return delta_t


def backward_jvp(call: AttentionCall, **inputs: Unpack[PassInputs]) -> tuple:
    """`sink_rows` (B, H, Lq), where given, takes each row's share of the sink logit's
    gradient's tangent (`sink_logits`)."""
    return _in_dtypes_of(_backward_jvp(call, inputs, False), (call.q, call.k, call.v, call.bias))


def backward_with_jvp(call: AttentionCall, **inputs: Unpack[PassInputs]) -> tuple:
    return _in_dtypes_of(_backward_jvp(call, inputs, True), (call.q, call.k, call.v, call.bias) * 2)


def double_backward(call: AttentionCall, **inputs: Unpack[PassInputs]) -> tuple:
    """`sink_rows` (B, H, Lq), where given, takes each row's share of the sink logit's gradient."""
    results = native.attention_double_backward(call, inputs)
    return _in_dtypes_of(results, (inputs["dout"], call.q, call.k, call.v, call.bias))


def _fill(out: Tensor, seed: int, row_start: int, threshold: int, value: float, key_start: int) -> Optional[Tensor]:
    """The dropout keep-scales of a contiguous float32 or float64 CPU tile, compiled, or None."""
    if out.device.type != "cpu" or out.dtype not in (torch.float32, torch.float64) or not out.is_contiguous():
        return None
    if native.library() is None:
        return None
    return native.dropout_keep_scale_into(out, seed, row_start, threshold, value, key_start)


dropout.use_compiled_fill(_fill)

BACKEND = dispatch.register(dispatch.Backend(
    name="tiles",
    passes=dict(forward=forward, backward=backward, jvp=jvp, forward_jvp=forward_jvp, backward_jvp=backward_jvp,
                backward_with_jvp=backward_with_jvp, double_backward=double_backward),
    unavailable=_unavailable,
    refuses=_refuses,
    row_sums=True,  # the backward's JVP's, and the forward's JVP's centre (`_refuses`)
    description="compiled C++ tiles: CPU, every pass",
    plans=dict(forward=plan_forward, backward=plan_backward),
), before="torch-ops" if "torch-ops" in dispatch.registered() else None)
