"""Affine layer and head split/merge, as forward/backward pairs.

Shape legend: B batch, L length, Din input width, Dout output width, H heads, dh head width.

linear:  y = x W^T + b   (PyTorch's layout: W is (Dout, Din))
    dx = dy W,  dW = sum_{B,L} dy^T x,  db = sum_{B,L} dy
split_heads: (B, L, H*dh) -> (B, H, L, dh); its backward is merge_heads and vice versa.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class LinearCache(NamedTuple):
    x: np.ndarray  # (..., Din)
    w: np.ndarray  # (Dout, Din)
    has_bias: bool


class LinearGrads(NamedTuple):
    dx: np.ndarray  # (..., Din)
    dw: np.ndarray  # (Dout, Din)
    db: np.ndarray | None  # (Dout,)


def linear_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> tuple[np.ndarray, LinearCache]:
    """y = x W^T + b over the last axis of x."""
    y = x @ w.T  # (..., Dout)
    if b is not None:
        y = y + b
    return y, LinearCache(x, w, b is not None)


def linear_backward(dy: np.ndarray, cache: LinearCache) -> LinearGrads:
    # forward: y = x W^T + b
    x, w = cache.x, cache.w
    dx = dy @ w  # (..., Din)
    dw = dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])  # (Dout, Din)
    db = dy.reshape(-1, dy.shape[-1]).sum(axis=0) if cache.has_bias else None  # (Dout,)
    return LinearGrads(dx, dw, db)


def split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """(B, L, H*dh) -> (B, H, L, dh)."""
    batch, length, width = x.shape
    return x.reshape(batch, length, heads, width // heads).transpose(0, 2, 1, 3)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """(B, H, L, dh) -> (B, L, H*dh)."""
    batch, heads, length, width = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch, length, heads * width)
