"""`scaled_dot_product_attention` with PyTorch's signature and semantics, exact and O(L) memory.

On top of PyTorch's function: the gradient with respect to a float `attn_mask` that
requires grad (a learned attention bias), reduced to the mask's own broadcast shape, and
dropout whose mask is regenerated in the backward from a seed drawn from PyTorch's
generator (so `torch.manual_seed` makes runs repeat).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .op import attention as attention_op

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
           is_causal: bool, enable_gqa: bool, mask_name: str = "attn_mask") -> None:
    shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dtype not in FLOATS:
            raise TypeError(f"{name} must be a floating tensor; got {t.dtype} ({shapes})")
    if not query.dim() == key.dim() == value.dim() or query.dim() not in (3, 4):
        raise ValueError(f"query, key and value must all be (B, H, L, E) or (B, L, E); got {shapes}")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"query, key and value must share a dtype; got {query.dtype}, {key.dtype}, {value.dtype}")
    if not query.device == key.device == value.device:
        raise ValueError(f"query, key and value must be on one device; got {query.device}, {key.device}, {value.device}")
    if query.shape[0] != key.shape[0] or key.shape[0] != value.shape[0]:
        raise ValueError(f"query, key and value must share the batch size; got {shapes}")
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(f"key and value must share all but their last dimension; got {shapes}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must share their last dimension E; got {shapes}")
    if query.dim() == 4 and query.shape[1] != key.shape[1]:
        if not enable_gqa:
            raise ValueError(f"query has {query.shape[1]} heads but key/value {key.shape[1]}; pass enable_gqa=True ({shapes})")
        if query.shape[1] % key.shape[1]:
            raise ValueError(f"the number of query heads must be a multiple of key/value heads; got {shapes}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")
    if attn_mask is not None:
        if is_causal:
            raise ValueError("pass either attn_mask or is_causal=True, not both (as in PyTorch)")
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in FLOATS:
            raise TypeError(f"{mask_name} must be boolean or floating; got {attn_mask.dtype}")
        if attn_mask.device != query.device:
            raise ValueError(f"{mask_name} is on {attn_mask.device} but query on {query.device}")
        target = (*query.shape[:-1], key.shape[-2])
        try:
            ok = attn_mask.dim() <= len(target) and torch.broadcast_shapes(attn_mask.shape, target) == torch.Size(target)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"{mask_name} of shape {tuple(attn_mask.shape)} does not broadcast to {target}")


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Drop-in for `torch.nn.functional.scaled_dot_product_attention`.

    query (B, H, Lq, E), key (B, Hkv, Lk, E), value (B, Hkv, Lk, Ev), or the same without H.
    attn_mask: boolean (True = take part) or float (added to the scores; its gradient is
    returned when it requires grad), broadcastable to (B, H, Lq, Lk). is_causal: the
    top-left-aligned causal mask. enable_gqa: H a multiple of Hkv.
    Returns (B, H, Lq, Ev). Memory beyond inputs and outputs is O(Lq + Lk), apart from a
    float mask's gradient, which has the mask's own size.
    """
    _check(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    mask = bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            mask = attn_mask
        else:
            bias = attn_mask
    return _run(query, key, value, mask, bias, dropout_p, is_causal, scale)


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    attn_bias: Optional[Tensor] = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Tensor:
    """attngrad's own entry point: a boolean `attn_mask` (True = take part), a float
    `attn_bias` (learned or not) and `is_causal`, in any combination.

    PyTorch's signature takes one mask and refuses is_causal beside it, so a causal model
    with a learned bias must spell the causal mask into the bias with -inf, and then no
    kernel can skip the masked half. Here the causal blocks are skipped whatever else is given.
    """
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise TypeError(f"attn_mask must be boolean here; pass a float mask as attn_bias (got {attn_mask.dtype})")
    if attn_bias is not None and attn_bias.dtype == torch.bool:
        raise TypeError("attn_bias must be floating; pass a boolean mask as attn_mask")
    _check(query, key, value, attn_mask, dropout_p, False, enable_gqa)
    if attn_bias is not None:
        _check(query, key, value, attn_bias, dropout_p, False, enable_gqa, mask_name="attn_bias")
    return _run(query, key, value, attn_mask, attn_bias, dropout_p, is_causal, scale)


def _run(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], bias: Optional[Tensor],
         dropout_p: float, is_causal: bool, scale: Optional[float]) -> Tensor:
    squeeze = query.dim() == 3
    if squeeze:  # (B, L, E): one head
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        mask = mask.unsqueeze(1) if mask is not None and mask.dim() == 3 else mask
        bias = bias.unsqueeze(1) if bias is not None and bias.dim() == 3 else bias
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if dropout_p > 0.0:
        seed = torch.randint(0, 2**62, (), dtype=torch.int64)  # from PyTorch's default generator
    else:
        seed = torch.zeros((), dtype=torch.int64)
    out = attention_op(query, key, value, mask, bias, seed, is_causal, float(scale), float(dropout_p))
    return out.squeeze(1) if squeeze else out
