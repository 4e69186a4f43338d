"""Input checks shared by the reference layers.

Every public forward checks its arguments here first, so that bad input fails at the
boundary with a message naming the argument and its shape, never deep inside a matmul.
"""

from __future__ import annotations

from typing import Any

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def as_float_array(name: str, value: Any, *, allow_neg_inf: bool = False) -> np.ndarray:
    """Return `value` as a float32/float64 array, or raise TypeError/ValueError naming it.

    Python floats become float64. Integer, boolean, complex and float16 arrays are refused
    rather than silently cast: the gradient of an integer tensor is meaningless, and a
    silent cast would hide a caller's mistake.
    NaN and +-Inf are refused; `allow_neg_inf` admits -inf, the additive-mask spelling of
    "this key is excluded".
    """
    if hasattr(value, "detach"):  # a torch tensor: take its values, not its graph
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a real floating array (float32 or float64); "
            f"got dtype {arr.dtype} with shape {arr.shape}"
        )
    finite = np.isfinite(arr)
    if not finite.all():
        bad = ~finite
        if allow_neg_inf:
            bad &= ~np.isneginf(arr)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            what = "NaN" if np.isnan(arr[where]) else "Inf"
            allowed = " (-inf is allowed and means 'excluded')" if allow_neg_inf else ""
            raise ValueError(
                f"{name} contains {what} at index {where} (shape {arr.shape}){allowed}"
            )
    return arr


def as_bool_array(name: str, value: Any) -> np.ndarray:
    """Return a boolean mask array, refusing float/int masks whose meaning would be ambiguous."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.dtype != np.bool_:
        raise TypeError(
            f"{name} must be a boolean array; got dtype {arr.dtype} with shape {arr.shape}"
            " (an additive float mask is passed as a bias instead)"
        )
    return arr


def require_ndim(name: str, arr: np.ndarray, ndim: int, layout: str) -> None:
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have shape {layout}; got shape {arr.shape}")


def require_broadcastable(name: str, arr: np.ndarray, target: tuple[int, ...], layout: str) -> None:
    """Raise unless `arr` broadcasts to `target` without growing it."""
    try:
        ok = arr.ndim <= len(target) and np.broadcast_shapes(arr.shape, target) == target
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name} with shape {arr.shape} does not broadcast to {layout} = {target}")


def common_dtype(*arrays: np.ndarray | None) -> np.dtype:
    """float64 if any input is float64, else float32 (NumPy's promotion, restricted to floats)."""
    return np.result_type(*(a.dtype for a in arrays if a is not None))


def sum_to_shape(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Reduce a broadcast gradient back to the shape of the array that was broadcast.

    The adjoint of broadcasting is summation over every axis that was added or stretched.
    """
    extra = grad.ndim - len(shape)
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if stretched:
        grad = grad.sum(axis=stretched, keepdims=True)
    return grad
