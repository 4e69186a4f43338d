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
from .structured import structure

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _causal_bias_type() -> Optional[type]:
    try:
        from torch.nn.attention.bias import CausalBias
    except ImportError:  # older torch: no such masks exist there
        return None
    return CausalBias


def _shapes(query: Tensor, key: Tensor, value: Tensor) -> str:
    return f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"


def _check_tensors(query: Tensor, key: Tensor, value: Tensor, dropout_p: float) -> None:
    shapes = _shapes(query, key, value)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dtype not in FLOATS:
            raise TypeError(f"{name} must be a floating tensor; got {t.dtype} ({shapes})")
        if t.dim() < 2:
            raise ValueError(f"query, key and value must have at least 2 dimensions (..., L, E); got {shapes}")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"query, key and value must share a dtype; got {query.dtype}, {key.dtype}, {value.dtype}")
    if not query.device == key.device == value.device:
        raise ValueError(f"query, key and value must be on one device; got {query.device}, {key.device}, {value.device}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key and value must have the same length Lk (dimension -2); got {shapes}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must share their last dimension E; got {shapes}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1]; got {dropout_p}")


class _Layout:
    """How (..., H, L, E) inputs of any rank map onto the op's (B, H, L, E): the leading
    dimensions broadcast among query, key and value and fold into one batch axis; the
    heads axis (-3) broadcasts too, or groups query heads over key/value heads (GQA)."""

    def __init__(self, query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool) -> None:
        shapes = _shapes(query, key, value)
        self.flat = max(t.dim() for t in (query, key, value)) == 2  # (L, E) inputs: no heads axis
        heads = [t.shape[-3] if t.dim() >= 3 else 1 for t in (query, key, value)]
        try:
            self.batch = torch.broadcast_shapes(*(t.shape[:-3] for t in (query, key, value)))
        except RuntimeError:
            raise ValueError(f"the batch dimensions of query, key and value do not broadcast; got {shapes}") from None
        h_q, h_k, h_v = heads
        if enable_gqa and h_q != h_k:
            if h_k != h_v:
                raise ValueError(f"with enable_gqa, key and value must have the same number of heads; got {shapes}")
            if h_k == 0 or h_q % h_k:
                raise ValueError(f"the number of query heads must be a multiple of key/value heads; got {shapes}")
            self.heads, kv_heads = h_q, h_k
        else:
            try:
                self.heads = torch.broadcast_shapes((h_q,), (h_k,), (h_v,))[0]
            except RuntimeError:
                hint = "; pass enable_gqa=True" if h_k == h_v and h_k and h_q % h_k == 0 else ""
                raise ValueError(f"query has {h_q} heads but key/value {h_k}, {h_v}{hint} ({shapes})") from None
            # key and value heads broadcast over the query's: GQA with one group, no copy
            kv_heads = 1 if h_k == h_v == 1 and h_q > 1 else self.heads
        self.shapes = shapes
        self.len_q, self.len_k = query.shape[-2], key.shape[-2]
        self.q = self._fold(query, self.heads)
        self.k = self._fold(key, kv_heads)
        self.v = self._fold(value, kv_heads)

    def _fold(self, t: Tensor, heads: int) -> Tensor:
        """t as (B, heads, L, E): broadcast to the batch and heads, batch axes flattened."""
        while t.dim() < 3:
            t = t.unsqueeze(0)
        t = t.expand(*self.batch, heads, *t.shape[-2:])
        return t.reshape(math.prod(self.batch), *t.shape[-3:]) if len(self.batch) != 1 else t

    @property
    def target(self) -> tuple:
        """The full score shape a mask must broadcast to: (..., H, Lq, Lk)."""
        return self.target_with(self.len_k)

    def target_with(self, len_k: int) -> tuple:
        """`target` for Lk keys (a ring's local queries see the whole sequence's keys)."""
        return (*self.batch, self.heads, self.len_q, len_k) if not self.flat else (self.len_q, len_k)

    def fold_mask(self, mask: Tensor, name: str, len_k: Optional[int] = None) -> Tensor:
        """A mask or bias broadcastable to `target` (with `len_k` keys, if given), as one
        broadcastable to (B, H, Lq, Lk)."""
        target = self.target_with(self.len_k if len_k is None else len_k)
        try:
            ok = mask.dim() <= len(target) and torch.broadcast_shapes(mask.shape, target) == torch.Size(target)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"{name} of shape {tuple(mask.shape)} does not broadcast to the scores' shape {target} "
                             f"({self.shapes})")
        mask = mask[(None,) * max(0, 4 - mask.dim())]  # at least (b, h, lq, lk)
        if len(self.batch) <= 1:  # the batch axis is the op's as it is
            return mask
        lead = mask.shape[:-3]
        if all(size == 1 for size in lead):
            return mask.reshape(1, *mask.shape[-3:])
        return mask.expand(*self.batch, *mask.shape[-3:]).reshape(math.prod(self.batch), *mask.shape[-3:])

    def unfold(self, out: Tensor) -> Tensor:
        """(B, H, Lq, Ev) back to the inputs' layout (..., H, Lq, Ev)."""
        if self.flat:
            return out.reshape(out.shape[-2:])
        return out.reshape(*self.batch, *out.shape[1:])


def default_scale(query: Tensor, scale: Optional[float]) -> float:
    """`scale`, or PyTorch's default 1 / sqrt(E) (with E = 0 every score is 0 whatever the scale)."""
    if scale is not None:
        return float(scale)
    return 1.0 / math.sqrt(query.shape[-1]) if query.shape[-1] else 1.0


def _with_sinks(bias: Optional[Tensor], sinks: Tensor, layout: _Layout, query: Tensor) -> Tensor:
    """The bias less each head's sink logit: softmax over [S, s] equals softmax over
    [S - s, 0], so the op needs only a sink of logit 0, and s gets every derivative a bias
    gets. (H,) sinks become an (H, 1, 1) bias, or join the given one."""
    if not isinstance(sinks, Tensor) or sinks.dtype not in FLOATS:
        raise TypeError(f"sinks must be a floating tensor of shape (H,); got {getattr(sinks, 'dtype', type(sinks).__name__)}")
    if sinks.shape != (layout.heads,) or layout.flat:
        raise ValueError(f"sinks must have shape (H,) = ({layout.heads},), one logit per query head of (..., H, L, E) "
                         f"inputs; got {tuple(sinks.shape)} ({layout.shapes})")
    if sinks.device != query.device:
        raise ValueError(f"sinks is on {sinks.device} but query on {query.device}")
    shift = -sinks.to(query.dtype)[:, None, None]  # (H, 1, 1)
    return shift if bias is None else bias + shift


def _causal_offset(is_causal: bool | int | str, len_q: int, len_k: int) -> Optional[int]:
    """The op's causal diagonal for `is_causal`: None, 0 (top-left), Lk - Lq (bottom-right)
    or the int given."""
    if isinstance(is_causal, int) and not isinstance(is_causal, bool):
        return is_causal
    if is_causal is False:
        return None
    if is_causal is True or is_causal == "top_left":
        return 0
    if is_causal == "bottom_right":
        return len_k - len_q
    raise ValueError(f"is_causal must be True, False, 'top_left', 'bottom_right' or an int diagonal; got {is_causal!r}")


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

    query (..., H, Lq, E), key (..., Hkv, Lk, E), value (..., Hkv, Lk, Ev): the leading
    dimensions broadcast, as in PyTorch. attn_mask: boolean (True = take part), float
    (added to the scores; its gradient is returned when it requires grad), broadcastable
    to (..., H, Lq, Lk), or a `torch.nn.attention.bias.CausalBias` (either alignment).
    is_causal: the top-left-aligned causal mask. enable_gqa: H a multiple of Hkv.
    Returns (..., H, Lq, Ev). Memory beyond inputs and outputs is O(Lq + Lk), apart from a
    float mask's gradient, which has the mask's own size.
    """
    causal_bias = _causal_bias_type()
    if causal_bias is not None and isinstance(attn_mask, causal_bias):
        if is_causal:
            raise ValueError("pass either a CausalBias attn_mask or is_causal=True, not both (as in PyTorch)")
        if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (query.shape[-2], key.shape[-2]):
            raise ValueError(f"attn_mask is a CausalBias for (Lq, Lk) = ({attn_mask.seq_len_q}, {attn_mask.seq_len_kv}) "
                             f"but {_shapes(query, key, value)}")
        # its storage is not the mask: only its variant and sizes are
        lower_right = attn_mask.variant.name == "LOWER_RIGHT"
        return attention(query, key, value, is_causal="bottom_right" if lower_right else "top_left",
                         dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None and is_causal:
        raise ValueError("pass either attn_mask or is_causal=True, not both (as in PyTorch)")
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype not in FLOATS:
        raise TypeError(f"attn_mask must be boolean or floating; got {attn_mask.dtype}")
    boolean = attn_mask is not None and attn_mask.dtype == torch.bool
    return attention(query, key, value, attn_mask=attn_mask if boolean else None,
                     attn_bias=None if boolean else attn_mask, is_causal=bool(is_causal), dropout_p=dropout_p,
                     scale=scale, enable_gqa=enable_gqa)


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    attn_bias: Optional[Tensor] = None,
    is_causal: bool | int | str = False,
    key_padding: Optional[Tensor] = None,
    window: Optional[tuple[Optional[int], Optional[int]]] = None,
    document_ids: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Tensor:
    """attngrad's own entry point: a boolean `attn_mask` (True = take part), a float
    `attn_bias` (learned or not), the causal mask and the structured masks below, in any
    combination. Shapes as in `scaled_dot_product_attention`.

    is_causal: False; True or "top_left" (query i sees keys j <= i, PyTorch's `is_causal`);
    or "bottom_right" (j <= i + Lk - Lq: the last query sees every key, flash-attn's
    convention and PyTorch's `causal_lower_right`). Rows that see no key give 0.

    Structured masks, none of which builds an Lq x Lk tensor (`structured`):
    key_padding: (..., Lk) boolean, True = padding (as in PyTorch's modules), or (...,)
    integer lengths (keys 0..length - 1 take part). window=(left, right): query i sees keys
    i + c - left .. i + c + right, c the causal alignment (0, or Lk - Lq with "bottom_right");
    None leaves a side open, so window=(255, None) with is_causal=True is a causal sliding
    window of 256 keys. document_ids: (..., L) integers, each document contiguous, or
    cu_seqlens: (D + 1,) cumulative lengths (flash-attn's varlen convention): packed
    sequences, each query sees its own document's keys (needs Lq = Lk).

    softcap: c > 0 caps the scores as Gemma 2 does, S = c tanh(scale Q K^T / c) + bias,
    with the bias and masks added after the cap; every derivative takes the cap's slope
    and, to second order, its curvature.

    sinks: (H,) logits, one per query head, of an extra key that every query sees and whose
    value is 0 (GPT-OSS's attention sinks): each row's softmax gains exp(s_h) in its
    denominator, so a row may give weight to nothing. Learned: it gets its gradient, JVP and
    second derivatives like a bias. A row that sees no real key still gives 0.

    is_causal may also be an int c, the diagonal itself: key j is visible to query i when
    j <= i + c (a cache whose queries start c - Lk + Lq keys before the end).

    PyTorch's signature takes one mask and refuses is_causal beside it, so a causal model
    with a learned bias must spell the causal mask into the bias with -inf, and then no
    kernel can skip the masked half. Here the tiles that the causal or a structured mask
    excludes are skipped whatever else is given: a window of w keys costs O(L w).
    """
    return _run(query, key, value, attn_mask, attn_bias, dropout_p, is_causal, scale, enable_gqa,
                structured=dict(key_padding=key_padding, window=window, document_ids=document_ids,
                                cu_seqlens=cu_seqlens), softcap=softcap, sinks=sinks)


def _run(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], bias: Optional[Tensor],
         dropout_p: float, is_causal: bool | int | str, scale: Optional[float], enable_gqa: bool,
         seed: Optional[Tensor] = None, structured: Optional[dict] = None, softcap: Optional[float] = None,
         sinks: Optional[Tensor] = None) -> Tensor:
    """Check, fold to (B, H, L, E), run the op, unfold. `seed` (a 0-d int64 tensor) fixes
    the dropout draw; by default it comes from PyTorch's generator. `structured`: the
    structured masks' keywords of `structured.structure`."""
    _check_tensors(query, key, value, dropout_p)
    if softcap is not None and not (isinstance(softcap, (int, float)) and 0.0 < softcap < math.inf):
        raise ValueError(f"softcap must be a positive finite number (or None); got {softcap!r}")
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"attn_mask must be boolean here; pass a float mask as attn_bias (got {mask.dtype})")
    if bias is not None and bias.dtype not in FLOATS:
        raise TypeError(f"attn_bias must be floating; pass a boolean mask as attn_mask (got {bias.dtype})")
    for name, t in (("attn_mask", mask), ("attn_bias", bias)):
        if t is not None and t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query on {query.device}")
    layout = _Layout(query, key, value, enable_gqa)
    if sinks is not None:
        bias = _with_sinks(bias, sinks, layout, query)
    mask = None if mask is None else layout.fold_mask(mask, "attn_mask")
    bias = None if bias is None else layout.fold_mask(bias, "attn_bias")
    causal = _causal_offset(is_causal, layout.len_q, layout.len_k)
    bounds = None
    if structured and any(value is not None for value in structured.values()):
        batch = () if layout.flat else tuple(layout.batch)
        bounds, keep = structure(batch, layout.len_q, layout.len_k, causal, query.device, **structured)
        if keep is not None:  # padding with holes: a (B, 1, 1, Lk) mask beside any other
            mask = keep if mask is None else mask & keep
    scale = default_scale(query, scale)
    if seed is None:
        if dropout_p > 0.0:
            seed = torch.randint(0, 2**62, (), dtype=torch.int64)  # from PyTorch's default generator
        else:
            seed = torch.zeros((), dtype=torch.int64)
    out = attention_op(layout.q, layout.k, layout.v, mask, bias, bounds, seed, causal, float(scale), float(softcap or 0.0),
                       float(dropout_p), sinks is not None)
    return layout.unfold(out)
