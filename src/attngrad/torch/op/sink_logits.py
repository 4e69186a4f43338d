"""Sinks as their own field of the call: one learned logit s per query head (GPT-OSS's
attention sinks, (1 or B, H) in the op) of an extra key with value 0 that every row sees.

The backends take a sink of logit 0 (`ScoreMasks.sink`): softmax over [S, s] equals softmax
over [S - s, 0], so a call runs on them with each head's logit taken out of its bias
(`lowered`). Its derivatives come here in closed form from per-row quantities, never as a
sum over the bias's gradient, whose terms cancel down to them (in float64 that sum left the
sink's gradient 4e-10 to 1e-8 off beside a bias that varies along the keys). With
P_sink = exp(s - m) / l, D = rowsum(dO * O), and dO/ds = -P_sink O on each row:

    d s            = -sum over b, i of P_sink D
    its tangent    = -sum of P_sink (D' - t D),   t = rowsum(P S') with s' in S' as -s'
                     (the backward's JVP writes each row's term: `sink_rows`)
    s's tangent    joins the bias's as -s'
    double backward: g_s joins the bias gradient's cotangent as -g_s, and s's gradient of
                     <g, grads> is -sum of rowsum(g_S) = -sum of P_sink (u - t D)
                     (the double backward writes each row's term: `sink_rows`)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from .call import AttentionCall, empty_like_field
from .key_constant_bias import rows_to_bias, sink_share, sum_to_shape

_SINK_INPUTS = ("tsinks", "gsinks")


def lowered(call: AttentionCall) -> AttentionCall:
    """The call as the backends run it: the bias less each head's logit ((1 or B, H, 1, 1),
    or joined with the bias given) and a sink of logit 0."""
    shift = -call.sinks.to(call.q.dtype)[:, :, None, None]
    bias = shift if call.bias is None else call.bias + shift
    return dataclasses.replace(call, masks=dataclasses.replace(call.masks, bias=bias, sinks=None, sink=True))


def joined(bias_part: Optional[Tensor], sinks_part: Optional[Tensor], shape: torch.Size) -> Optional[Tensor]:
    """A tangent or cotangent of the bias and of the logits as the lowered bias's: bias_part
    less each head's sinks_part, in the lowered bias's `shape`; None where both are (the
    ring's Functions use it too)."""
    parts = [p for p in (bias_part, None if sinks_part is None else -sinks_part[:, :, None, None]) if p is not None]
    if not parts:
        return None
    joined = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    return joined.expand(shape).contiguous()


def _to_bias(grad: Optional[Tensor], bias: Tensor) -> Optional[Tensor]:
    """The lowered bias's gradient summed, in a fixed order, over the axes it gained from the
    logits: the bias's own gradient, in its shape."""
    return None if grad is None else sum_to_shape(grad, tuple(bias.shape), bias.dtype)


def to_sinks(per_row: Tensor, sinks: Tensor) -> Tensor:
    """-sum of a (B, H, Lq) per-row term over the rows (and the batch, for (1, H) logits):
    the logits' share of a result whose rows' terms `sink_rows` holds."""
    return -rows_to_bias(per_row.double(), sinks[:, :, None, None], sinks.dtype).reshape(sinks.shape)


def grad(sinks: Tensor, dout: Tensor, out: Tensor, row_max: Tensor, inv_sum: Tensor) -> Tensor:
    """d s = -sum P_sink D from the forward's results, D summed in float64 (as
    `key_constant_bias_grad`'s)."""
    wide = [t if t.dtype in (torch.float32, torch.float64) else t.float() for t in (dout, out)]
    per_row = torch.mul(*wide).sum(dim=-1, dtype=torch.float64) * sink_share(row_max, inv_sum)
    return to_sinks(per_row, sinks)


def run(pass_name: str, call: AttentionCall, inputs: dict[str, Any],
        run_lowered: Callable[[str, AttentionCall, dict[str, Any]], Any]) -> Any:
    """Pass `pass_name` of a call with sinks, through `run_lowered(pass_name, call, inputs)`
    on the lowered call; the results in the op's order, the logits' derivatives among them."""
    low = lowered(call)
    shape = low.bias.shape
    given = {name: value for name, value in inputs.items() if name not in _SINK_INPUTS}
    if "tbias" in given:
        given["tbias"] = joined(given["tbias"], inputs["tsinks"], shape)
    gsinks = inputs.get("gsinks")
    if "gbias" in given:
        # the lowered bias's gradient is asked for whenever a cotangent reaches it
        given["gbias"] = joined(given["gbias"], gsinks, shape)
        given["bias_grad"] = inputs["bias_grad"] or gsinks is not None
    if pass_name in ("backward_jvp", "backward_with_jvp", "double_backward"):
        given["sink_rows"] = empty_like_field("rows", call)
    results = run_lowered(pass_name, low, given)
    if pass_name in ("forward", "jvp", "forward_jvp"):
        return results
    user_bias_grad = bool(inputs["bias_grad"])

    def fix(lowered_grad: Optional[Tensor]) -> Optional[Tensor]:  # the lowered bias's gradient as the bias's, if asked
        return _to_bias(lowered_grad, call.bias) if user_bias_grad else None

    def dsinks() -> Tensor:
        return grad(call.sinks, *(inputs[n] for n in ("dout", "out", "row_max", "inv_sum")))

    if pass_name == "backward":
        dq, dk, dv, dbias = results
        return dq, dk, dv, fix(dbias), dsinks()
    if pass_name == "double_backward":
        g_dout, g_q, g_k, g_v, g_bias = results
        return g_dout, g_q, g_k, g_v, fix(g_bias), to_sinks(given["sink_rows"], call.sinks)
    tangent = to_sinks(given["sink_rows"], call.sinks)
    if pass_name == "backward_jvp":
        tdq, tdk, tdv, tdbias = results
        return tdq, tdk, tdv, fix(tdbias), tangent
    dq, dk, dv, dbias, tdq, tdk, tdv, tdbias = results
    return dq, dk, dv, fix(dbias), dsinks(), tdq, tdk, tdv, fix(tdbias), tangent
