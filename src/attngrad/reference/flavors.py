"""The three attention flavors of "Attention Is All You Need", as named entry points.

Shape legend: B batch, Lq decoder (target) length, Lk encoder (source) length,
E embed_dim, H heads.

    encoder self-attention          x (B, Lk, E) is query, key and value
    decoder masked self-attention   x (B, Lq, E) is query, key and value; causal mask
    encoder-decoder attention       x (B, Lq, E) is the query; the encoder output
                                    memory (B, Lk, E) is key and value

When one tensor feeds several roles, its gradient is the sum over the roles (the
multivariate chain rule): in self-attention dx = dx_via_query + dx_via_key + dx_via_value;
in encoder-decoder attention the memory gets dmemory_via_key + dmemory_via_value and the
decoder stream x gets only the query path. The grads keep each path so this is visible.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from typing_extensions import Unpack  # typing's from Python 3.11

from .mha import MHACache, mha_backward, mha_forward
from .params import MHAParams
from .sdpa import DropoutOptions


class SelfAttentionGrads(NamedTuple):
    dx: np.ndarray  # (B, L, E) = dx_via_query + dx_via_key + dx_via_value
    dx_via_query: np.ndarray  # (B, L, E)
    dx_via_key: np.ndarray  # (B, L, E)
    dx_via_value: np.ndarray  # (B, L, E)
    params: MHAParams
    dattn_mask: np.ndarray | None


class CrossAttentionGrads(NamedTuple):
    dx: np.ndarray  # (B, Lq, E), the decoder stream: query path only
    dmemory: np.ndarray  # (B, Lk, E) = dmemory_via_key + dmemory_via_value
    dmemory_via_key: np.ndarray  # (B, Lk, E)
    dmemory_via_value: np.ndarray  # (B, Lk, E)
    params: MHAParams
    dattn_mask: np.ndarray | None


class CrossOptions(DropoutOptions, total=False):
    """The options of `mha_forward` that every flavor passes on as given (each flavor's
    masks of its own aside); `mha_forward` says what each does."""

    attn_mask: Any  # (Lq, Lk) or (B * H, Lq, Lk): boolean (True = blocked) or float (added)


class SelfOptions(CrossOptions, total=False):
    """A self-attention flavor's options: the shared ones and its own key padding."""

    key_padding_mask: Any  # (B, L), True = padding


def self_attention_forward(
    x: Any, params: MHAParams, num_heads: int, *, is_causal: bool = False, **options: Unpack[SelfOptions]
) -> tuple[np.ndarray, MHACache]:
    """Self-attention: x (B, L, E) is query, key and value. Options as in `mha_forward`."""
    if params.kdim != params.embed_dim or params.vdim != params.embed_dim:
        raise ValueError(
            f"self-attention needs kdim = vdim = E; the parameters have E={params.embed_dim}, "
            f"kdim={params.kdim}, vdim={params.vdim}"
        )
    return mha_forward(x, x, x, params, num_heads, is_causal=is_causal, **options)


def encoder_self_attention_forward(
    x: Any, params: MHAParams, num_heads: int, **options: Unpack[SelfOptions]
) -> tuple[np.ndarray, MHACache]:
    """Encoder self-attention: every position of x (B, L, E) attends to every unpadded one."""
    return self_attention_forward(x, params, num_heads, is_causal=False, **options)


def decoder_self_attention_forward(
    x: Any, params: MHAParams, num_heads: int, **options: Unpack[SelfOptions]
) -> tuple[np.ndarray, MHACache]:
    """Decoder masked self-attention: position i of x (B, L, E) attends to positions j <= i."""
    return self_attention_forward(x, params, num_heads, is_causal=True, **options)


def self_attention_backward(dout: Any, cache: MHACache) -> SelfAttentionGrads:
    """Backward of either self-attention flavor: dx sums the query, key and value paths."""
    g = mha_backward(dout, cache)
    return SelfAttentionGrads(g.dquery + g.dkey + g.dvalue, g.dquery, g.dkey, g.dvalue, g.params, g.dattn_mask)


encoder_self_attention_backward = self_attention_backward
decoder_self_attention_backward = self_attention_backward


def encoder_decoder_attention_forward(
    x: Any, memory: Any, params: MHAParams, num_heads: int, *, memory_key_padding_mask: Any = None,
    **options: Unpack[CrossOptions]
) -> tuple[np.ndarray, MHACache]:
    """Encoder-decoder (cross) attention: decoder states x (B, Lq, E) query the encoder
    output memory (B, Lk, kdim); `memory_key_padding_mask` (B, Lk) marks source padding."""
    if params.kdim != params.vdim:
        raise ValueError(
            f"the memory feeds both key and value, so kdim must equal vdim; got kdim={params.kdim}, vdim={params.vdim}"
        )
    return mha_forward(x, memory, memory, params, num_heads, key_padding_mask=memory_key_padding_mask, **options)


def encoder_decoder_attention_backward(dout: Any, cache: MHACache) -> CrossAttentionGrads:
    """Backward of encoder-decoder attention: x gets the query path, memory the key and value paths."""
    g = mha_backward(dout, cache)
    return CrossAttentionGrads(g.dquery, g.dkey + g.dvalue, g.dkey, g.dvalue, g.params, g.dattn_mask)
