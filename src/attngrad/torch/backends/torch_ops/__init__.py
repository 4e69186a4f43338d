"""The "torch-ops" backend: PyTorch operators over score tiles (`first_order`, `higher_order`).
Every call on any device, every pass; also a part of each row's keys with the whole rows'
sums given (`row_sums`), which the ring's higher passes need. Registered last: the one that
takes what no other does. Each pass is its kernel, called `pass(call, **inputs)`: it reads
what it needs from the call and the inputs by name."""

from __future__ import annotations

from typing import Optional

from ...op import dispatch
from ...op.call import AttentionCall, RingSums
from . import first_order, higher_order


def _refuses(call: AttentionCall, pass_name: str, inputs: dict) -> Optional[str]:
    """A ring step's rows' sums alone: a Hessian-vector product's (`HvpSums`) name the same
    rows' sums differently (t - c beside the peak c), and read as a ring step's they would be
    wrong."""
    row_sums = inputs.get("row_sums")
    if row_sums is not None and not isinstance(row_sums, RingSums):
        return f"it takes a ring step's rows' sums (RingSums), not a {type(row_sums).__name__}"
    return None


BACKEND = dispatch.register(dispatch.Backend(
    name="torch-ops",
    passes=dict(forward=first_order.attention_forward, backward=first_order.attention_backward,
                jvp=higher_order.attention_jvp, backward_jvp=higher_order.attention_backward_jvp,
                double_backward=higher_order.attention_double_backward,
                double_backward_row_sums=higher_order.double_backward_row_sums),
    row_sums=True,
    refuses=_refuses,
    description="PyTorch operators over score tiles: every call, on any device",
))
