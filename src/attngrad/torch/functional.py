"""`scaled_dot_product_attention` with PyTorch's signature and semantics, exact and O(L) memory.

On top of PyTorch's function: the gradient with respect to a float `attn_mask` that
requires grad (a learned attention bias), reduced to the mask's own broadcast shape, and
dropout whose mask is regenerated in the backward from a seed drawn from PyTorch's
generator (so `torch.manual_seed` makes runs repeat).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from typing_extensions import Unpack  # typing's from Python 3.11

from . import eager_plans, regime
from .arguments import ATTENTION, AttentionOptions, build_call
from .layout import FLOATS, describe_shapes
from .nested import is_jagged, jagged_attention
from .op.autograd import differentiable_attention


def _causal_bias_type() -> Optional[type]:
    try:
        from torch.nn.attention.bias import CausalBias
    except ImportError:  # older torch: no such masks exist there
        return None
    return CausalBias


JIT_TRACE = ("attngrad's {} does not run under torch.jit.trace (TorchScript, which PyTorch deprecates): a trace "
             "would hold a call made for the traced sizes alone. torch.compile and torch.export take attngrad's "
             "operator whole, every derivative included")
_CAUSAL_BIAS = _causal_bias_type()  # once: the import statement took 0.8 us of every call


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
    if regime.jit_tracing():
        raise NotImplementedError(JIT_TRACE.format("scaled_dot_product_attention"))
    if not isinstance(is_causal, (bool, torch.SymBool)):  # as PyTorch: a truthy string is no alignment
        raise TypeError(f"is_causal must be a bool, as in PyTorch; got {is_causal!r}. A bottom-right causal mask: "
                        f"attn_mask=torch.nn.attention.bias.causal_lower_right(Lq, Lk), or attngrad.torch.attention("
                        f"..., is_causal='bottom_right')")
    causal_bias = _CAUSAL_BIAS
    if attn_mask is not None and not isinstance(attn_mask, (Tensor, *(() if causal_bias is None else (causal_bias,)))):
        raise TypeError(f"attn_mask must be a torch.Tensor or a CausalBias (or None); got {type(attn_mask).__name__}")
    if is_jagged(query):
        if attn_mask is not None:
            raise ValueError("attn_mask is not taken with nested jagged inputs (nor by PyTorch); their sequences "
                             "are the mask, with is_causal inside each")
        return attention(query, key, value, is_causal=bool(is_causal), dropout_p=dropout_p, scale=scale,
                         enable_gqa=enable_gqa)
    if causal_bias is not None and isinstance(attn_mask, causal_bias):
        if is_causal:
            raise ValueError("pass either a CausalBias attn_mask or is_causal=True, not both (as in PyTorch)")
        if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (query.shape[-2], key.shape[-2]):
            raise ValueError(f"attn_mask is a CausalBias for (Lq, Lk) = ({attn_mask.seq_len_q}, {attn_mask.seq_len_kv}) "
                             f"but {describe_shapes(query, key, value)}")
        # its storage is not the mask: only its variant and sizes are
        lower_right = attn_mask.variant.name == "LOWER_RIGHT"
        return attention(query, key, value, is_causal="bottom_right" if lower_right else "top_left",
                         dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None and is_causal:
        raise ValueError("pass either attn_mask or is_causal=True, not both (as in PyTorch)")
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype not in FLOATS:
        raise TypeError(f"attn_mask must be boolean or floating; got {attn_mask.dtype}")
    if attn_mask is None:
        if not dropout_p:
            out = eager_plans.unmasked(query, key, value, is_causal, scale, enable_gqa)
            if out is not None:
                return out
        options = dict(is_causal=bool(is_causal), dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)
        planned = eager_plans.forward(query, key, value, options)  # attention()'s first step, without its call
        return planned if planned is not None else attention(query, key, value, **options)
    # attention()'s own path for a mask, save that a float mask's errors name it attn_mask, as
    # the user passed it, not attention()'s attn_bias
    boolean = attn_mask.dtype == torch.bool
    given = dict(attn_mask=attn_mask) if boolean else dict(attn_bias=attn_mask)
    planned = eager_plans.forward(query, key, value, dict(given, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa),
                                  bias_name="attn_mask")
    if planned is not None:  # a repeated call that nothing differentiates, or reverse mode alone
        return planned
    call, layout = build_call(query, key, value, attn_mask=attn_mask if boolean else None,
                              attn_bias=None if boolean else attn_mask, dropout_p=dropout_p, scale=scale,
                              enable_gqa=enable_gqa, bias_name="attn_mask")
    return layout.unfold(differentiable_attention(call))


# The options are declared once, in `arguments.AttentionOptions`; the signature that help()
# and inspect show lists them from there.
@ATTENTION.signed
def attention(query: Tensor, key: Tensor, value: Tensor, **options: Unpack[AttentionOptions]) -> Tensor:
    """attngrad's own entry point: a boolean `attn_mask` (True = take part), a float
    `attn_bias` (learned or not), the causal mask and the structured masks below, in any
    combination. Shapes as in `scaled_dot_product_attention`. The options, keyword-only,
    are those `arguments.AttentionOptions` declares, with `arguments.DEFAULTS`.

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
    second derivatives like a bias. A row that sees no real key still gives 0. The logits
    must be finite; they shift the scores (S - s_h), so in float32 a sink far below the
    scores (-1e4) costs their precision.

    mask_mod: FlexAttention's mask function, (b, h, q_idx, kv_idx) -> True where query q_idx
    of batch entry b and head h sees key kv_idx, evaluated under vmap for every entry and
    head of this call (query (B, H, Lq, E)) and kept for later calls while what it reads
    stays the same (`mask_memo`). block_mask: the same made once for many calls,
    by `attngrad.torch.create_block_mask` or FlexAttention's `create_block_mask` (whose
    block structure counts too: FlexAttention's rule). A mask whose every row sees one
    interval of keys (causal, windows, chunks, documents, prefix-LM, ...) becomes key
    bounds, nothing Lq x Lk; any other is written out as a boolean mask
    (`masks.functions`). Both combine with every other mask here.

    Nested jagged query, key and value ((B, H, j, E), as PyTorch's SDPA takes them) are
    packed sequences: each sees its own keys (causal within it with is_causal), no padding,
    every derivative; the result is jagged too (`nested`).

    is_causal may also be an int c, the diagonal itself: key j is visible to query i when
    j <= i + c (a cache whose queries start c - Lk + Lq keys before the end).

    PyTorch's signature takes one mask and refuses is_causal beside it, so a causal model
    with a learned bias must spell the causal mask into the bias with -inf, and then no
    kernel can skip the masked half. Here the tiles that the causal or a structured mask
    excludes are skipped whatever else is given: a window of w keys costs O(L w).
    """
    if regime.jit_tracing():
        raise NotImplementedError(JIT_TRACE.format("attention"))
    out = eager_plans.forward(query, key, value, options)  # a repeated call that nothing differentiates
    if out is not None:  # its options were all declared ones
        return out
    ATTENTION.check("attention", options)  # here, for the error to name attention()
    if is_jagged(query):
        return jagged_attention(query, key, value, attend=attention, **options)
    call, layout = build_call(query, key, value, **options)
    return layout.unfold(differentiable_attention(call))
