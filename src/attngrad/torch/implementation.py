"""Which implementation runs a call, decided in one place, seen and chosen by the user.

Two implementations compute every pass, and agree to rounding:
    "tiles"      the compiled C++ tiles (`native`): CPU, float32 and float64 (float16 and
                 bfloat16 computed in float32); every pass (forward, backward, JVP, the
                 backward's JVP, double backward) with masks, a bias and its gradient,
                 dropout and GQA: the calls `native.supports` accepts; fast
    "torch-ops"  PyTorch operators over score tiles (`kernels`, `kernels_higher`): every
                 call, on any device; the portable one

By default a call takes the tiles where they apply and the torch-ops kernels otherwise.
`use_implementation(...)`, in the manner of `torch.nn.attention.sdpa_kernel`, restricts the
choice while it is active; a call that none of the allowed implementations can run raises
instead of silently taking another. `ran` counts what ran, per pass and implementation
(`attngrad bench` records it).

    with use_implementation("torch-ops"):
        out = scaled_dot_product_attention(q, k, v)
    ran.most_common()  # [(('forward', 'torch-ops'), 1)]
"""

from __future__ import annotations

import collections
from contextlib import contextmanager
from typing import Iterator, Optional

from torch import Tensor

from . import native

IMPLEMENTATIONS = ("tiles", "torch-ops")
# The passes; each has compiled tiles and torch-ops kernels.
PASSES = ("forward", "backward", "double_backward", "jvp", "backward_jvp")

_allowed: tuple[str, ...] = IMPLEMENTATIONS
ran: collections.Counter = collections.Counter()  # (pass, implementation) -> calls


@contextmanager
def use_implementation(*names: str) -> Iterator[None]:
    """Allow only the implementations `names` ("tiles", "torch-ops") inside the block.
    Like PyTorch's `sdpa_kernel`, the choice is global (autograd's backward runs the passes
    later, and may run them on another thread), so it also governs backward passes run
    inside the block."""
    global _allowed
    unknown = [name for name in names if name not in IMPLEMENTATIONS]
    if unknown or not names:
        raise ValueError(f"use_implementation takes one or more of {IMPLEMENTATIONS}; got {names}")
    previous, _allowed = _allowed, tuple(names)
    try:
        yield
    finally:
        _allowed = previous


def allowed() -> tuple[str, ...]:
    """The implementations a call may take now."""
    return _allowed


def choose(pass_name: str, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor]) -> str:
    """The implementation that runs this pass of this call, counted in `ran`."""
    if pass_name not in PASSES:
        raise ValueError(f"unknown pass {pass_name!r}; the passes are {PASSES}")
    tiles = native.supports(q, k, v, mask, bias)
    if tiles and "tiles" in _allowed:
        choice = "tiles"
    elif "torch-ops" in _allowed:
        choice = "torch-ops"
    else:
        why = (f"the compiled tiles are unavailable ({native.build_info.reason})" if native.library() is None
               else f"the compiled tiles do not take this {pass_name} call ({q.dtype} on {q.device}, or an "
               "empty dimension)")
        raise RuntimeError(f"attngrad: no allowed implementation runs this call: only {_allowed} are allowed, and {why}")
    ran[(pass_name, choice)] += 1
    return choice
