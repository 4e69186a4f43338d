"""Full Jacobians of attention, built from the closed-form backward passes.

A backward pass is a vector-Jacobian product: given dout it returns dout^T J. Feeding it
each standard basis vector e_o of the output gives row o of J exactly, with no finite
differences: J[o, :] = backward(e_o). One backward per output element, so this is for
small problems: it is how a learner sees the whole Jacobian, and how the tests hold every
entry of it against autograd's.

Shapes: the Jacobian of out (shape O) with respect to an input Z, or a selection Z[select]
such as one row or column (shape Zs), has shape O + Zs: J[o..., z...] = d out[o] / d Z[z].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .mha import mha_backward, mha_forward
from .sdpa import sdpa_backward, sdpa_forward

SDPA_INPUTS = ("query", "key", "value", "bias")


def jacobian_from_vjp(vjp: Callable[[np.ndarray], np.ndarray], out_shape: tuple[int, ...], dtype: Any = np.float64) -> np.ndarray:
    """J of shape out_shape + input shape, whose row o is vjp(e_o)."""
    size = int(np.prod(out_shape))
    rows = []
    for o in range(size):
        basis = np.zeros(size, dtype=dtype)
        basis[o] = 1.0
        rows.append(vjp(basis.reshape(out_shape)))
    return np.stack(rows).reshape(tuple(out_shape) + rows[0].shape) if rows else np.zeros(out_shape)


def _selected(grad: np.ndarray | None, name: str, select: Any) -> np.ndarray:
    if grad is None:
        raise ValueError(f"there is no gradient with respect to {name!r} here (was it given?)")
    return grad if select is None else grad[select]


def sdpa_jacobian(query: Any, key: Any, value: Any, *, wrt: str = "query", select: Any = None, **options: Any) -> np.ndarray:
    """d out / d wrt for scaled dot-product attention (options as in `sdpa_forward`).

    wrt: "query", "key", "value" or "bias". select: an index into that input, e.g.
    np.s_[0, 1, :, 2] for one column of one head; default the whole input.
    Shape: (B, H, Lq, dv) + wrt[select].shape.
    """
    if wrt not in SDPA_INPUTS:
        raise ValueError(f"wrt must be one of {SDPA_INPUTS}; got {wrt!r}")
    out, cache = sdpa_forward(query, key, value, **options)
    index = SDPA_INPUTS.index(wrt)
    return jacobian_from_vjp(lambda d: _selected(sdpa_backward(d, cache)[index], wrt, select), out.shape, out.dtype)


def mha_jacobian(
    query: Any, key: Any, value: Any, params: Any, num_heads: int, *, wrt: str = "query", select: Any = None, **options: Any
) -> np.ndarray:
    """d out / d wrt for multi-head attention (options as in `mha_forward`).

    wrt: "query", "key", "value", "attn_mask", or a parameter: "w_q", "w_k", "w_v", "w_o",
    "b_q", "b_k", "b_v", "b_o". Shape: (B, Lq, E) + wrt[select].shape.
    """
    out, cache = mha_forward(query, key, value, params, num_heads, **options)
    inputs = {"query": 0, "key": 1, "value": 2}

    def vjp(dout: np.ndarray) -> np.ndarray:
        grads = mha_backward(dout, cache)
        if wrt in inputs:
            return _selected(grads[inputs[wrt]], wrt, select)
        if wrt == "attn_mask":
            return _selected(grads.dattn_mask, wrt, select)
        if wrt in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"):
            return _selected(getattr(grads.params, wrt), wrt, select)
        raise ValueError(f"wrt must be query, key, value, attn_mask or a parameter name; got {wrt!r}")

    return jacobian_from_vjp(vjp, out.shape, out.dtype)
