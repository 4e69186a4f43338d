"""Multi-head attention (torch.nn.MultiheadAttention semantics), forward and backward.

Shape legend
    B batch, Lq query length, Lk key length, E embed_dim, H heads, dh = E / H,
    Hkv key/value heads (Hkv = H unless grouped-query), kdim/vdim key/value input widths.

Forward, batch-first:
    Q = query W^Q^T + b^Q            # (B, Lq, E)   -> heads (B, H, Lq, dh)
    K = key   W^K^T + b^K            # (B, Lk, Ekv) -> heads (B, Hkv, Lk, dh)
    V = value W^V^T + b^V            # (B, Lk, Ekv) -> heads (B, Hkv, Lk, dh)
    A = sdpa(Q, K, V, masks, bias)   # (B, H, Lq, dh), scale 1/sqrt(dh)
    C = concat_h A                   # (B, Lq, E)
    Y = C W^O^T + b^O                # (B, Lq, E)

Backward, last line first: dC = dY W^O, dW^O = dY^T C, db^O = sum dY; dA = split(dC);
(dQ, dK, dV, dbias) = sdpa_backward(dA); then each input projection's linear backward.
The input gradients come back separately for query, key and value; when one tensor fed
several of them (self-attention) its gradient is their sum (see `flavors`).

Masks, as torch.nn.MultiheadAttention takes them:
    key_padding_mask (B, Lk) boolean, True = padding, ignored.
    attn_mask boolean (True = NOT allowed) or float (added to the scores, a learned bias
        whose gradient is returned in its own shape), of shape (Lq, Lk), (B*H, Lq, Lk),
        or anything broadcastable to (B, H, Lq, Lk).
    is_causal: apply the causal mask (torch's module needs it spelled out in attn_mask too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from typing_extensions import Unpack  # typing's from Python 3.11

from .linear import LinearCache, linear_backward, linear_forward, merge_heads, split_heads
from .params import MHAParams
from .sdpa import DropoutOptions, SDPACache, sdpa_backward, sdpa_forward
from .validate import as_bool_array, as_float_array, common_dtype, require_broadcastable, require_ndim


class MHAGrads(NamedTuple):
    dquery: np.ndarray  # (B, Lq, E)
    dkey: np.ndarray  # (B, Lk, kdim)
    dvalue: np.ndarray  # (B, Lk, vdim)
    params: MHAParams  # gradient of every parameter, same shapes
    dattn_mask: np.ndarray | None  # the float attn_mask's own shape; None otherwise


@dataclass(frozen=True)
class MHACache:
    num_heads: int
    q_proj: LinearCache
    k_proj: LinearCache
    v_proj: LinearCache
    attention: SDPACache
    out_proj: LinearCache
    attn_mask_shape: tuple[int, ...] | None  # float attn_mask's shape as given

    @property
    def attn_weights(self) -> np.ndarray:
        """Per-head attention weights P before dropout, (B, H, Lq, Lk)."""
        return self.attention.probs


def _check_params(params: MHAParams, num_heads: int) -> tuple[MHAParams, int]:
    """Validate the parameter shapes against each other; return (params as arrays, Hkv)."""
    if not isinstance(params, MHAParams):
        raise TypeError(f"params must be an MHAParams; got {type(params).__name__}")
    if not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive integer; got {num_heads!r}")
    arrays = {name: as_float_array(f"params.{name}", value) for name, value in params.items()}
    present = {name for name in arrays if name.startswith("b_")}
    if present and len(present) != 4:
        raise ValueError(f"params must have all four biases or none; has {sorted(present)}")
    p = MHAParams(**arrays)
    for name in ("w_q", "w_k", "w_v", "w_o"):
        require_ndim(f"params.{name}", arrays[name], 2, "(out_features, in_features)")
    embed = p.w_q.shape[0]
    if p.w_q.shape != (embed, embed) or p.w_o.shape != (embed, embed):
        raise ValueError(f"params.w_q and params.w_o must be (E, E); got {p.w_q.shape} and {p.w_o.shape}")
    if embed % num_heads:
        raise ValueError(f"embed_dim E={embed} is not divisible by num_heads={num_heads}")
    head_dim = embed // num_heads
    kv_width = p.w_k.shape[0]
    if p.w_v.shape[0] != kv_width or kv_width == 0 or kv_width % head_dim or num_heads % (kv_width // head_dim):
        raise ValueError(
            f"params.w_k {p.w_k.shape} and params.w_v {p.w_v.shape} must both have Hkv * dh rows, with "
            f"dh = E / num_heads = {head_dim} and num_heads={num_heads} a multiple of Hkv"
        )
    if p.has_bias:
        for name, width in (("b_q", embed), ("b_k", kv_width), ("b_v", kv_width), ("b_o", embed)):
            if arrays[name].shape != (width,):
                raise ValueError(f"params.{name} must have shape ({width},); got {arrays[name].shape}")
    return p, kv_width // head_dim


def _attn_mask_to_4d(attn_mask: np.ndarray, batch: int, heads: int, len_q: int, len_k: int) -> np.ndarray:
    """torch's (Lq, Lk) and (B*H, Lq, Lk) layouts, or a 4-D broadcastable one, as 4-D."""
    full = (batch, heads, len_q, len_k)
    if attn_mask.ndim == 3:
        if attn_mask.shape != (batch * heads, len_q, len_k):
            raise ValueError(
                f"a 3-D attn_mask must have shape (B*H, Lq, Lk) = {(batch * heads, len_q, len_k)}; got {attn_mask.shape}"
            )
        return attn_mask.reshape(full)
    if attn_mask.ndim not in (2, 4):
        raise ValueError(f"attn_mask must be (Lq, Lk), (B*H, Lq, Lk) or 4-D; got shape {attn_mask.shape}")
    require_broadcastable("attn_mask", attn_mask, full, "(B, H, Lq, Lk)")
    return attn_mask


def mha_forward(
    query: Any, key: Any, value: Any, params: MHAParams, num_heads: int, *,
    key_padding_mask: Any = None, attn_mask: Any = None, is_causal: bool = False, **dropout: Unpack[DropoutOptions],
) -> tuple[np.ndarray, MHACache]:
    """Multi-head attention. Returns (out (B, Lq, E), cache).

    query (B, Lq, E), key (B, Lk, kdim), value (B, Lk, vdim); masks as in the module
    docstring. Dropout (dropout_p, dropout_seed, keep_mask: `sdpa_forward`'s) acts on the
    attention weights, its keep-mask (B, H, Lq, Lk) given or drawn from `dropout_seed` and
    kept in the cache.
    """
    p, _ = _check_params(params, num_heads)
    q_in = as_float_array("query", query)
    k_in = as_float_array("key", key)
    v_in = as_float_array("value", value)
    require_ndim("query", q_in, 3, "(B, Lq, E)")
    require_ndim("key", k_in, 3, "(B, Lk, kdim)")
    require_ndim("value", v_in, 3, "(B, Lk, vdim)")
    shapes = f"query {q_in.shape}, key {k_in.shape}, value {v_in.shape}"
    if not q_in.shape[0] == k_in.shape[0] == v_in.shape[0] or k_in.shape[1] != v_in.shape[1]:
        raise ValueError(f"query, key and value must share B, and key and value Lk; got {shapes}")
    for name, arr, width, what in (("query", q_in, p.embed_dim, "E"), ("key", k_in, p.kdim, "kdim"), ("value", v_in, p.vdim, "vdim")):
        if arr.shape[2] != width:
            raise ValueError(f"{name} has width {arr.shape[2]} but the parameters expect {what}={width} ({shapes})")
    batch, len_q, _ = q_in.shape
    len_k = k_in.shape[1]

    mask = None
    if key_padding_mask is not None:
        kpm = as_bool_array("key_padding_mask", key_padding_mask)
        if kpm.shape != (batch, len_k):
            raise ValueError(f"key_padding_mask must have shape (B, Lk) = {(batch, len_k)}; got {kpm.shape}")
        mask = ~kpm[:, None, None, :]  # (B, 1, 1, Lk), True = attend
    bias = None
    if attn_mask is not None:
        am = np.asarray(attn_mask.detach().cpu() if hasattr(attn_mask, "detach") else attn_mask)
        if am.dtype == np.bool_:
            allowed = ~_attn_mask_to_4d(am, batch, num_heads, len_q, len_k)
            mask = allowed if mask is None else mask & allowed
        else:
            bias = _attn_mask_to_4d(as_float_array("attn_mask", am, allow_neg_inf=True), batch, num_heads, len_q, len_k)

    dtype = common_dtype(q_in, k_in, v_in, *(a for _, a in p.items()))
    p = MHAParams(**{name: a.astype(dtype, copy=False) for name, a in p.items()})
    q_in, k_in, v_in = (a.astype(dtype, copy=False) for a in (q_in, k_in, v_in))

    q, q_cache = linear_forward(q_in, p.w_q, p.b_q)  # (B, Lq, E)
    k, k_cache = linear_forward(k_in, p.w_k, p.b_k)  # (B, Lk, Ekv)
    v, v_cache = linear_forward(v_in, p.w_v, p.b_v)  # (B, Lk, Ekv)
    head_dim = p.embed_dim // num_heads
    kv_heads = k.shape[-1] // head_dim
    attn, attn_cache = sdpa_forward(
        split_heads(q, num_heads),  # (B, H, Lq, dh)
        split_heads(k, kv_heads),  # (B, Hkv, Lk, dh)
        split_heads(v, kv_heads),  # (B, Hkv, Lk, dh)
        mask=mask,
        bias=bias,
        is_causal=is_causal,
        enable_gqa=kv_heads != num_heads,
        **dropout,
    )  # (B, H, Lq, dh)
    out, out_cache = linear_forward(merge_heads(attn), p.w_o, p.b_o)  # (B, Lq, E)
    cache = MHACache(num_heads=num_heads, q_proj=q_cache, k_proj=k_cache, v_proj=v_cache, attention=attn_cache,
                     out_proj=out_cache, attn_mask_shape=None if bias is None else np.shape(attn_mask))
    return out, cache


def mha_backward(dout: Any, cache: MHACache) -> MHAGrads:
    """Gradients of sum(out * dout) with respect to query, key, value, every parameter and
    a float attn_mask."""
    do = as_float_array("dout", dout)
    expected = cache.q_proj.x.shape
    if do.shape != expected:
        raise ValueError(f"dout must have the output's shape (B, Lq, E) = {expected}; got {do.shape}")
    do = do.astype(cache.q_proj.x.dtype, copy=False)

    # forward: Y = C W^O^T + b^O
    g_out = linear_backward(do, cache.out_proj)
    # forward: C = concat_h A  (merge_heads)
    d_attn = split_heads(g_out.dx, cache.num_heads)  # (B, H, Lq, dh)
    # forward: A = sdpa(Q, K, V)
    g_attn = sdpa_backward(d_attn, cache.attention)
    # forward: Q, K, V heads = split_heads(projections)
    # forward: Q = query W^Q^T + b^Q, and likewise K and V
    g_q = linear_backward(merge_heads(g_attn.dq), cache.q_proj)
    g_k = linear_backward(merge_heads(g_attn.dk), cache.k_proj)
    g_v = linear_backward(merge_heads(g_attn.dv), cache.v_proj)

    dattn_mask = None
    if cache.attn_mask_shape is not None:
        dattn_mask = g_attn.dbias.reshape(cache.attn_mask_shape)
    params = MHAParams(g_q.dw, g_k.dw, g_v.dw, g_out.dw, g_q.db, g_k.db, g_v.db, g_out.db)
    return MHAGrads(g_q.dx, g_k.dx, g_v.dx, params, dattn_mask)
