"""Forward-mode (JVP) and second-order (Hessian-vector product) attention, in NumPy.

A tangent is a direction of change of the inputs, written with a prime: Q', K', V',
bias' (and dO' for the upstream gradient). Each function below differentiates one
forward or backward line of `sdpa` / `mha` along that direction, the line restated above.

Shape legend as in `sdpa`: B, H, Hkv, Lq, Lk, dk, dv; P, S, Z = keep / (1 - p) are
(B, H, Lq, Lk); P' = P * Z is the dropped-out P. rowsum sums over keys, keeping the axis.

JVP, the tangent O' of the output:
    S'  = scale (Q' K~^T + Q K~'^T) + bias'
    P'  = P * (S' - rowsum(P * S'))            # the softmax Jacobian applied to S'
    O'  = (P' * Z) V~ + (P * Z) V~'

HVP: the tangent of the backward pass (dQ, dK, dV, dbias) along (Q', K', V', bias', dO').
For the loss l = sum(dO * O) with dO fixed (dO' = 0) it is the Hessian of l times the
tangent; for another loss f(O), pass dO' = (d^2 f / dO^2) O' and it is again f's Hessian
times the tangent (the Gauss-Newton part plus the attention-curvature part).
    dP    = (dO V~^T) * Z,       dP~  = (dO' V~^T + dO V~'^T) * Z      # dP~ is dP's tangent
    D     = rowsum(P * dP),      D~   = rowsum(P' * dP + P * dP~)
    dS    = P * (dP - D),        dS~  = P' * (dP - D) + P * (dP~ - D~)
    dV~~  = (P' * Z)^T dO + (P * Z)^T dO'
    dQ~   = scale (dS~ K~ + dS K~'),   dK~~ = scale (dS~^T Q + dS^T Q')
    dbias~ = dS~ summed over the bias's broadcast axes
A masked entry has P = 0, so P' = 0 and dS~ = 0 there; an empty row gets 0 everywhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .linear import LinearCache, LinearGrads, merge_heads, split_heads
from .mha import MHACache, MHAGrads
from .params import MHAParams
from .sdpa import SDPACache, SDPAGrads, _sum_groups, sdpa_backward
from .validate import as_float_array, sum_to_shape


def _tangent(name: str, value: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
    """A tangent as an array of exactly `shape` (None stays None: a zero tangent)."""
    if value is None:
        return None
    arr = as_float_array(name, value)
    if arr.shape != shape:
        raise ValueError(f"the tangent {name} must have its primal's shape {shape}; got {arr.shape}")
    return arr.astype(dtype, copy=False)


def _repeat_heads(t: np.ndarray | None, groups: int) -> np.ndarray | None:
    """K~' = repeat(K', G): a tangent repeats as its primal does."""
    return t if t is None or groups == 1 else np.repeat(t, groups, axis=1)


def _add(*terms: np.ndarray | None) -> np.ndarray | None:
    """Sum of the terms that are present (None is a zero tangent)."""
    present = [t for t in terms if t is not None]
    return None if not present else sum(present[1:], present[0])


class _SDPATangents:
    """The tangents of one SDPA call, checked and repeated over GQA groups."""

    def __init__(self, cache: SDPACache, query: Any, key: Any, value: Any, bias: Any) -> None:
        dtype = cache.q.dtype
        kv_shape = (cache.k_rep.shape[0], cache.k_rep.shape[1] // cache.groups, *cache.k_rep.shape[2:])
        v_shape = (*kv_shape[:3], cache.v_rep.shape[3])
        self.q = _tangent("query", query, cache.q.shape, dtype)
        self.k = _tangent("key", key, kv_shape, dtype)
        self.v = _tangent("value", value, v_shape, dtype)
        if bias is not None and cache.bias_shape is None:
            raise ValueError("a bias tangent was given but the forward had no bias")
        self.bias = None if bias is None else _tangent("bias", bias, cache.bias_shape, dtype)
        self.k_rep = _repeat_heads(self.k, cache.groups)  # (B, H, Lk, dk)
        self.v_rep = _repeat_heads(self.v, cache.groups)  # (B, H, Lk, dv)

    def scores(self, cache: SDPACache) -> np.ndarray:
        """S' = scale (Q' K~^T + Q K~'^T) + bias', (B, H, Lq, Lk)."""
        s = np.zeros(cache.probs.shape, dtype=cache.q.dtype)
        if self.q is not None:
            s += cache.scale * (self.q @ cache.k_rep.swapaxes(-1, -2))
        if self.k_rep is not None:
            s += cache.scale * (cache.q @ self.k_rep.swapaxes(-1, -2))
        if self.bias is not None:
            s += self.bias
        return s


def _probs_tangent(cache: SDPACache, scores_tangent: np.ndarray) -> np.ndarray:
    """forward: P = softmax(S)  ->  P' = P * (S' - rowsum(P * S'))."""
    p = cache.probs
    return p * (scores_tangent - np.sum(p * scores_tangent, axis=-1, keepdims=True))


def _dropped(cache: SDPACache, probs: np.ndarray) -> np.ndarray:
    """forward: P' = P * Z (identity without dropout)."""
    return probs if cache.keep_scaled is None else probs * cache.keep_scaled


def sdpa_jvp(cache: SDPACache, *, query: Any = None, key: Any = None, value: Any = None, bias: Any = None) -> np.ndarray:
    """The tangent O' (B, H, Lq, dv) of `sdpa_forward`'s output along the given tangents.

    Tangents have their primal's shape (key and value (B, Hkv, Lk, .), bias the bias's own
    shape); an omitted one is zero. Dropout uses the forward's keep-mask from the cache.
    """
    t = _SDPATangents(cache, query, key, value, bias)
    # forward: P = softmax(scale Q K~^T + bias)
    probs_t = _probs_tangent(cache, t.scores(cache))  # (B, H, Lq, Lk)
    # forward: O = (P * Z) V~
    out_t = _dropped(cache, probs_t) @ cache.v_rep  # (B, H, Lq, dv)
    if t.v_rep is not None:
        out_t += cache.probs_dropped @ t.v_rep
    return out_t


def sdpa_hvp(
    dout: Any, cache: SDPACache, *, query: Any = None, key: Any = None, value: Any = None, bias: Any = None,
    dout_tangent: Any = None,
) -> SDPAGrads:
    """The tangent of `sdpa_backward(dout, cache)` along (query', key', value', bias', dout').

    With dout_tangent omitted this is the Hessian-vector product of sum(out * dout); see the
    module docstring for other losses. Returned like the gradients: SDPAGrads in the
    inputs' shapes (dbias in the bias's shape, None without a bias).
    """
    grads = sdpa_backward(dout, cache)  # checks dout's shape
    do = as_float_array("dout", dout).astype(cache.q.dtype, copy=False)
    t = _SDPATangents(cache, query, key, value, bias)
    do_t = _tangent("dout_tangent", dout_tangent, do.shape, cache.q.dtype)
    p = cache.probs
    probs_t = _probs_tangent(cache, t.scores(cache))  # P', (B, H, Lq, Lk)

    # backward: dP = (dO V~^T) * Z
    dprobs = _dropped(cache, do @ cache.v_rep.swapaxes(-1, -2))
    dprobs_t = _add(
        None if do_t is None else do_t @ cache.v_rep.swapaxes(-1, -2),
        None if t.v_rep is None else do @ t.v_rep.swapaxes(-1, -2),
    )
    dprobs_t = np.zeros_like(p) if dprobs_t is None else _dropped(cache, dprobs_t)
    # backward: dS = P * (dP - D), D = rowsum(P * dP)
    delta = np.sum(p * dprobs, axis=-1, keepdims=True)  # (B, H, Lq, 1)
    delta_t = np.sum(probs_t * dprobs + p * dprobs_t, axis=-1, keepdims=True)
    dscores = p * (dprobs - delta)
    dscores_t = probs_t * (dprobs - delta) + p * (dprobs_t - delta_t)  # (B, H, Lq, Lk)
    # backward: dV~ = (P * Z)^T dO
    dv_t = _dropped(cache, probs_t).swapaxes(-1, -2) @ do  # (B, H, Lk, dv)
    if do_t is not None:
        dv_t += cache.probs_dropped.swapaxes(-1, -2) @ do_t
    # backward: dQ = scale dS K~,  dK~ = scale dS^T Q
    dq_t = cache.scale * (dscores_t @ cache.k_rep)  # (B, H, Lq, dk)
    dk_t = cache.scale * (dscores_t.swapaxes(-1, -2) @ cache.q)  # (B, H, Lk, dk)
    if t.k_rep is not None:
        dq_t += cache.scale * (dscores @ t.k_rep)
    if t.q is not None:
        dk_t += cache.scale * (dscores.swapaxes(-1, -2) @ t.q)
    # backward: dbias = dS summed over the broadcast axes
    dbias_t = None if grads.dbias is None else sum_to_shape(dscores_t, cache.bias_shape)
    return SDPAGrads(dq_t, _sum_groups(dk_t, cache.groups), _sum_groups(dv_t, cache.groups), dbias_t)


# --- multi-head attention: the same through the four projections -------------------------


def _linear_jvp(cache: LinearCache, x_t: np.ndarray | None, w_t: np.ndarray | None, b_t: np.ndarray | None) -> np.ndarray:
    """forward: y = x W^T + b  ->  y' = x' W^T + x W'^T + b'."""
    out = np.zeros((*cache.x.shape[:-1], cache.w.shape[0]), dtype=cache.x.dtype)
    if x_t is not None:
        out += x_t @ cache.w.T
    if w_t is not None:
        out += cache.x @ w_t.T
    if b_t is not None:
        out += b_t
    return out


def _linear_backward_jvp(
    dy: np.ndarray, dy_t: np.ndarray, cache: LinearCache, x_t: np.ndarray | None, w_t: np.ndarray | None
) -> LinearGrads:
    """backward: dx = dy W, dW = dy^T x, db = sum dy  ->  their tangents."""
    rows = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731  (..., D) -> (N, D)
    dx_t = dy_t @ cache.w if w_t is None else dy_t @ cache.w + dy @ w_t
    dw_t = rows(dy_t).T @ rows(cache.x)
    if x_t is not None:
        dw_t = dw_t + rows(dy).T @ rows(x_t)
    db_t = rows(dy_t).sum(axis=0) if cache.has_bias else None
    return LinearGrads(dx_t, dw_t, db_t)


class _MHATangents:
    """Checked tangents of one MHA call; an omitted one is zero."""

    def __init__(self, cache: MHACache, query: Any, key: Any, value: Any, params: MHAParams | None, attn_mask: Any) -> None:
        dtype = cache.q_proj.x.dtype
        self.query = _tangent("query", query, cache.q_proj.x.shape, dtype)
        self.key = _tangent("key", key, cache.k_proj.x.shape, dtype)
        self.value = _tangent("value", value, cache.v_proj.x.shape, dtype)
        self.params = {}
        if params is not None:
            if not isinstance(params, MHAParams):
                raise TypeError(f"the params tangent must be an MHAParams; got {type(params).__name__}")
            shapes = {"w_q": cache.q_proj.w.shape, "w_k": cache.k_proj.w.shape, "w_v": cache.v_proj.w.shape, "w_o": cache.out_proj.w.shape}
            shapes.update({"b_" + n[-1]: (shapes[n][0],) for n in list(shapes)})
            if params.has_bias and not cache.q_proj.has_bias:
                raise ValueError("the params tangent has biases but the layer has none")
            for name, arr in params.items():
                self.params[name] = _tangent(f"params.{name}", arr, shapes[name], dtype)
        if attn_mask is not None and cache.attn_mask_shape is None:
            raise ValueError("an attn_mask tangent was given but the forward had no float attn_mask")
        self.bias = None
        if attn_mask is not None:
            bias_t = _tangent("attn_mask", attn_mask, tuple(cache.attn_mask_shape), dtype)
            self.bias = bias_t.reshape(cache.attention.bias_shape)  # torch's 3-D layout -> 4-D

    def projections(self, cache: MHACache) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Q', K', V' split into heads."""
        p = self.params.get
        heads = cache.num_heads
        kv_heads = heads // cache.attention.groups
        q_t = _linear_jvp(cache.q_proj, self.query, p("w_q"), p("b_q"))  # (B, Lq, E)
        k_t = _linear_jvp(cache.k_proj, self.key, p("w_k"), p("b_k"))  # (B, Lk, Ekv)
        v_t = _linear_jvp(cache.v_proj, self.value, p("w_v"), p("b_v"))  # (B, Lk, Ekv)
        return split_heads(q_t, heads), split_heads(k_t, kv_heads), split_heads(v_t, kv_heads)


def mha_jvp(
    cache: MHACache, *, query: Any = None, key: Any = None, value: Any = None, params: MHAParams | None = None,
    attn_mask: Any = None,
) -> np.ndarray:
    """The tangent (B, Lq, E) of `mha_forward`'s output along tangents of the inputs, the
    parameters (an MHAParams of tangents) and a float attn_mask; an omitted one is zero."""
    t = _MHATangents(cache, query, key, value, params, attn_mask)
    q_t, k_t, v_t = t.projections(cache)
    # forward: A = sdpa(Q, K, V)
    attn_t = sdpa_jvp(cache.attention, query=q_t, key=k_t, value=v_t, bias=t.bias)  # (B, H, Lq, dh)
    # forward: Y = concat_h(A) W^O^T + b^O
    return _linear_jvp(cache.out_proj, merge_heads(attn_t), t.params.get("w_o"), t.params.get("b_o"))


def mha_hvp(
    dout: Any, cache: MHACache, *, query: Any = None, key: Any = None, value: Any = None,
    params: MHAParams | None = None, attn_mask: Any = None, dout_tangent: Any = None,
) -> MHAGrads:
    """The tangent of `mha_backward(dout, cache)` along the given tangents: with dout_tangent
    omitted, the Hessian of sum(out * dout) times (query', key', value', params', attn_mask')."""
    dtype = cache.q_proj.x.dtype
    do = as_float_array("dout", dout).astype(dtype, copy=False)
    if do.shape != cache.q_proj.x.shape:
        raise ValueError(f"dout must have the output's shape (B, Lq, E) = {cache.q_proj.x.shape}; got {do.shape}")
    t = _MHATangents(cache, query, key, value, params, attn_mask)
    do_t = _tangent("dout_tangent", dout_tangent, do.shape, dtype)
    do_t = np.zeros_like(do) if do_t is None else do_t
    q_t, k_t, v_t = t.projections(cache)
    heads = cache.num_heads

    # backward of Y = C W^O^T + b^O, and its tangent (C' from the forward's JVP)
    attn_t = sdpa_jvp(cache.attention, query=q_t, key=k_t, value=v_t, bias=t.bias)
    g_out = _linear_backward_jvp(do, do_t, cache.out_proj, merge_heads(attn_t), t.params.get("w_o"))
    d_attn = split_heads(do @ cache.out_proj.w, heads)  # dA, (B, H, Lq, dh)
    # backward of A = sdpa(Q, K, V): the gradients and their tangents
    grads = sdpa_backward(d_attn, cache.attention)
    grads_t = sdpa_hvp(
        d_attn, cache.attention, query=q_t, key=k_t, value=v_t, bias=t.bias, dout_tangent=split_heads(g_out.dx, heads)
    )
    # backward of Q = query W^Q^T + b^Q, and likewise K and V
    projections = []
    for grad, grad_t, proj, x_t, w_name in (
        (grads.dq, grads_t.dq, cache.q_proj, t.query, "w_q"),
        (grads.dk, grads_t.dk, cache.k_proj, t.key, "w_k"),
        (grads.dv, grads_t.dv, cache.v_proj, t.value, "w_v"),
    ):
        projections.append(_linear_backward_jvp(merge_heads(grad), merge_heads(grad_t), proj, x_t, t.params.get(w_name)))
    g_q, g_k, g_v = projections
    dattn_mask = None if grads_t.dbias is None else grads_t.dbias.reshape(cache.attn_mask_shape)
    params_t = MHAParams(g_q.dw, g_k.dw, g_v.dw, g_out.dw, g_q.db, g_k.db, g_v.db, g_out.db)
    return MHAGrads(g_q.dx, g_k.dx, g_v.dx, params_t, dattn_mask)
