"""The "torch-ops" backend: PyTorch operators over score tiles (`first_order`, `higher_order`).
Every call on any device, every pass; also a part of each row's keys with the whole rows'
sums given (`row_sums`), which the ring's higher passes need. Registered last: the one that
takes what no other does. Each pass is its kernel, called `pass(call, **inputs)`: it reads
what it needs from the call and the inputs by name."""

from __future__ import annotations

from ...op import dispatch
from . import first_order, higher_order

BACKEND = dispatch.register(dispatch.Backend(
    name="torch-ops",
    passes=dict(forward=first_order.attention_forward, backward=first_order.attention_backward,
                jvp=higher_order.attention_jvp, backward_jvp=higher_order.attention_backward_jvp,
                double_backward=higher_order.attention_double_backward,
                double_backward_row_sums=higher_order.double_backward_row_sums),
    row_sums=True,
    description="PyTorch operators over score tiles: every call, on any device",
))
