"""Scaled dot-product attention, forward and backward, in NumPy.

Shape legend
    B   batch                     Lq  query length     dk  query/key width
    H   query heads               Lk  key length       dv  value width
    Hkv key/value heads (H is a multiple of Hkv; G = H / Hkv query heads share one)

Forward (PyTorch's `scaled_dot_product_attention` semantics):
    K~, V~ = repeat(K, G), repeat(V, G)        # (B, H, Lk, dk), (B, H, Lk, dv)  GQA only
    S  = scale * Q K~^T + bias                 # (B, H, Lq, Lk)
    P  = softmax(S) over keys allowed by mask  # (B, H, Lq, Lk)  masked -> 0
    P' = P * keep / (1 - p)                    # (B, H, Lq, Lk)  dropout, keep in {0, 1}
    O  = P' V~                                 # (B, H, Lq, dv)

Backward, each line undoing one forward line, last first:
    dV~ = P'^T dO,  dP' = dO V~^T
    dP  = dP' * keep / (1 - p)
    dS  = P * (dP - rowsum(dP * P))
    dbias = dS summed over the axes the bias was broadcast along
    dQ  = scale * dS K~,  dK~ = scale * dS^T Q
    dK, dV = dK~, dV~ summed over the G query heads of each group

Masks: `mask` is boolean, True = take part (PyTorch's boolean attn_mask); `bias` is
PyTorch's float attn_mask, added to the scores (-inf excludes a key). `is_causal` lets
query i see keys j <= i, aligned to the top-left like PyTorch, also when Lq != Lk.
A query row with no key left gives output 0 and gradient 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, TypedDict

import numpy as np

from .softmax import SoftmaxCache, softmax_backward, softmax_forward
from .validate import (
    as_bool_array,
    as_float_array,
    common_dtype,
    require_broadcastable,
    require_ndim,
    sum_to_shape,
)


def causal_mask(len_q: int, len_k: int) -> np.ndarray:
    """(Lq, Lk) boolean mask, True where key j <= query i (PyTorch's top-left alignment)."""
    return np.tri(len_q, len_k, dtype=bool)


def dropout_keep_mask(shape: tuple[int, ...], dropout_p: float, seed: int | None) -> np.ndarray:
    """Draw a keep-mask (True = kept) with P(keep) = 1 - dropout_p from `seed`."""
    return np.random.default_rng(seed).random(shape) >= dropout_p


class SDPAGrads(NamedTuple):
    dq: np.ndarray  # (B, H, Lq, dk)
    dk: np.ndarray  # (B, Hkv, Lk, dk)
    dv: np.ndarray  # (B, Hkv, Lk, dv)
    dbias: np.ndarray | None  # the bias's own shape; None when no bias was given


@dataclass(frozen=True)
class SDPACache:
    q: np.ndarray  # (B, H, Lq, dk)
    k_rep: np.ndarray  # (B, H, Lk, dk)  keys repeated over each GQA group
    v_rep: np.ndarray  # (B, H, Lk, dv)
    softmax: SoftmaxCache  # holds P, (B, H, Lq, Lk)
    probs_dropped: np.ndarray  # P', (B, H, Lq, Lk); P itself without dropout
    keep_scaled: np.ndarray | None  # keep / (1 - p), (B, H, Lq, Lk); None without dropout
    scale: float
    groups: int  # G = H / Hkv
    bias_shape: tuple[int, ...] | None

    @property
    def probs(self) -> np.ndarray:
        """Attention weights P before dropout, (B, H, Lq, Lk)."""
        return self.softmax.probs


def _check_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, enable_gqa: bool) -> None:
    require_ndim("query", q, 4, "(B, H, Lq, dk)")
    require_ndim("key", k, 4, "(B, Hkv, Lk, dk)")
    require_ndim("value", v, 4, "(B, Hkv, Lk, dv)")
    shapes = f"query {q.shape}, key {k.shape}, value {v.shape}"
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"query, key and value must share the batch size B; got {shapes}")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"key and value must share Hkv and Lk; got {shapes}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"query and key must share the width dk; got {shapes}")
    if q.shape[3] == 0:
        raise ValueError(f"the width dk must be at least 1; got {shapes}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        if not enable_gqa:
            raise ValueError(
                f"query has H={heads} heads but key/value have Hkv={kv_heads}; "
                f"pass enable_gqa=True for grouped-query attention ({shapes})"
            )
        if kv_heads == 0 or heads % kv_heads:
            raise ValueError(
                f"grouped-query attention needs H a multiple of Hkv; got H={heads}, Hkv={kv_heads} ({shapes})"
            )


class DropoutOptions(TypedDict, total=False):
    """`sdpa_forward`'s dropout, as the functions built on it pass it on."""

    dropout_p: float
    dropout_seed: int | None
    keep_mask: Any


def sdpa_forward(
    query: Any,
    key: Any,
    value: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    keep_mask: Any = None,
) -> tuple[np.ndarray, SDPACache]:
    """Scaled dot-product attention. Returns (out (B, H, Lq, dv), cache).

    query (B, H, Lq, dk), key (B, Hkv, Lk, dk), value (B, Hkv, Lk, dv): float32 or float64.
    mask: boolean, broadcastable to (B, H, Lq, Lk), True = attend.
    bias: float, broadcastable to (B, H, Lq, Lk), added to the scores; its gradient comes
        back in its own shape (a learned attention bias: ALiBi, T5 relative positions, ...).
    is_causal: also apply the top-left-aligned causal mask (may be combined with `mask`).
    scale: multiplies Q K^T; default 1 / sqrt(dk).
    enable_gqa: allow H != Hkv (H a multiple of Hkv), as in PyTorch.
    dropout_p: attention dropout rate in [0, 1). The keep-mask is `keep_mask` (boolean,
        broadcastable to (B, H, Lq, Lk)) when given, else drawn from `dropout_seed`; it is
        kept in the cache, so the backward is exact.
    """
    q = as_float_array("query", query)
    k = as_float_array("key", key)
    v = as_float_array("value", value)
    _check_qkv(q, k, v, enable_gqa)
    batch, heads, len_q, width = q.shape
    len_k = k.shape[2]
    full = (batch, heads, len_q, len_k)
    layout = "(B, H, Lq, Lk)"

    b = None
    if bias is not None:
        b = as_float_array("bias", bias, allow_neg_inf=True)
        require_broadcastable("bias", b, full, layout)
    allowed = None
    if mask is not None:
        allowed = as_bool_array("mask", mask)
        require_broadcastable("mask", allowed, full, layout)
    if is_causal:
        tri = causal_mask(len_q, len_k)
        allowed = tri if allowed is None else allowed & tri

    if scale is None:
        scale = 1.0 / math.sqrt(width)
    elif not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number; got {scale!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p!r}")
    if keep_mask is not None and dropout_p == 0.0:
        raise ValueError("keep_mask was given but dropout_p is 0; pass the dropout rate it was drawn with")

    dtype = common_dtype(q, k, v, b)
    q, k, v = q.astype(dtype, copy=False), k.astype(dtype, copy=False), v.astype(dtype, copy=False)
    groups = heads // k.shape[1]
    k_rep = np.repeat(k, groups, axis=1) if groups > 1 else k  # (B, H, Lk, dk)
    v_rep = np.repeat(v, groups, axis=1) if groups > 1 else v  # (B, H, Lk, dv)

    scores = scale * (q @ k_rep.swapaxes(-1, -2))  # (B, H, Lq, Lk)
    if b is not None:
        scores = scores + b.astype(dtype, copy=False)
    probs, softmax_cache = softmax_forward(scores, allowed)  # (B, H, Lq, Lk)

    keep_scaled = None
    probs_dropped = probs
    if dropout_p > 0.0:
        if keep_mask is None:
            keep = dropout_keep_mask(full, dropout_p, dropout_seed)
        else:
            keep = as_bool_array("keep_mask", keep_mask)
            require_broadcastable("keep_mask", keep, full, layout)
        keep_scaled = np.broadcast_to(keep / dtype.type(1.0 - dropout_p), full).astype(dtype)
        probs_dropped = probs * keep_scaled  # (B, H, Lq, Lk)

    out = probs_dropped @ v_rep  # (B, H, Lq, dv)
    cache = SDPACache(
        q=q,
        k_rep=k_rep,
        v_rep=v_rep,
        softmax=softmax_cache,
        probs_dropped=probs_dropped,
        keep_scaled=keep_scaled,
        scale=float(scale),
        groups=groups,
        bias_shape=None if b is None else b.shape,
    )
    return out, cache


def _sum_groups(grad_rep: np.ndarray, groups: int) -> np.ndarray:
    """Adjoint of np.repeat(x, groups, axis=1): add the G copies of each head back up."""
    if groups == 1:
        return grad_rep
    batch, heads, length, width = grad_rep.shape
    return grad_rep.reshape(batch, heads // groups, groups, length, width).sum(axis=2)


def sdpa_backward(dout: Any, cache: SDPACache) -> SDPAGrads:
    """Gradients of sum(out * dout) with respect to query, key, value and bias."""
    expected = cache.probs_dropped.shape[:3] + cache.v_rep.shape[3:]
    do = as_float_array("dout", dout)
    if do.shape != expected:
        raise ValueError(f"dout must have the output's shape (B, H, Lq, dv) = {expected}; got {do.shape}")
    do = do.astype(cache.q.dtype, copy=False)

    # forward: O = P' V~
    dv_rep = cache.probs_dropped.swapaxes(-1, -2) @ do  # (B, H, Lk, dv)
    dprobs = do @ cache.v_rep.swapaxes(-1, -2)  # (B, H, Lq, Lk)
    # forward: P' = P * keep / (1 - p)
    if cache.keep_scaled is not None:
        dprobs = dprobs * cache.keep_scaled
    # forward: P = softmax(S)
    dscores = softmax_backward(dprobs, cache.softmax)  # (B, H, Lq, Lk)
    # forward: S = scale * Q K~^T + bias
    dbias = None if cache.bias_shape is None else sum_to_shape(dscores, cache.bias_shape)
    dq = cache.scale * (dscores @ cache.k_rep)  # (B, H, Lq, dk)
    dk_rep = cache.scale * (dscores.swapaxes(-1, -2) @ cache.q)  # (B, H, Lk, dk)
    # forward: K~, V~ = repeat(K, G), repeat(V, G)
    return SDPAGrads(dq, _sum_groups(dk_rep, cache.groups), _sum_groups(dv_rep, cache.groups), dbias)
