"""The public functions' arguments checked and folded into the op's call: q, k, v of any
rank onto (B, H, L, E) (`layout`), the masks and structured masks into `ScoreMasks`, the
dropout seed drawn; every error names the user's arguments."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from .layout import FLOATS, Layout, check_optional_tensors, check_tensors, default_scale, describe_shapes, is_number
from .masks.functions import evaluated_mask
from .masks.structured import join_bounds, structure
from .op.call import AttentionCall, ScoreMasks


def check_sinks(sinks: Tensor, layout: Layout, query: Tensor) -> Tensor:
    """(H,) sink logits checked, as the op's (1, H)."""
    if not isinstance(sinks, Tensor) or sinks.dtype not in FLOATS:
        raise TypeError(f"sinks must be a floating tensor of shape (H,); got {getattr(sinks, 'dtype', type(sinks).__name__)}")
    if sinks.shape != (layout.heads,) or layout.flat:
        raise ValueError(f"sinks must have shape (H,) = ({layout.heads},), one logit per query head of (..., H, L, E) "
                         f"inputs; got {tuple(sinks.shape)} ({layout.shapes})")
    if sinks.device != query.device:
        raise ValueError(f"sinks is on {sinks.device} but query on {query.device}")
    readable = (type(sinks) is Tensor and sinks.device.type != "meta" and not torch.compiler.is_compiling()
                and not torch._C._are_functorch_transforms_active())
    if readable and not bool(torch.isfinite(sinks).all()):  # -inf would shift the scores by +inf: NaN
        raise ValueError(f"sinks must be finite logits; got {sinks.tolist()}")
    return sinks[None]


def _causal_offset(is_causal: bool | int | str, len_q: int, len_k: int) -> Optional[int]:
    """The causal diagonal for `is_causal`: None, 0 (top-left), Lk - Lq (bottom-right) or
    the int given (which also aligns a window: see `_op_diagonal` for the op's)."""
    if isinstance(is_causal, int) and not isinstance(is_causal, bool):
        return is_causal
    if is_causal is False:
        return None
    if is_causal is True or is_causal == "top_left":
        return 0
    if is_causal == "bottom_right":
        return len_k - len_q
    raise ValueError(f"is_causal must be True, False, 'top_left', 'bottom_right' or an int diagonal; got {is_causal!r}")


def _op_diagonal(causal: Optional[int], len_q: int, len_k: int) -> Optional[int]:
    """The causal diagonal as the op takes it: clamped to [-Lq, Lk], past which a diagonal
    sees the same keys (none, or all), so that no arithmetic on it nears int64's limits."""
    return None if causal is None else max(-len_q, min(len_k, causal))


def build_call(query: Tensor, key: Tensor, value: Tensor, *, mask: Optional[Tensor] = None,
               bias: Optional[Tensor] = None, dropout_p: float = 0.0, is_causal: bool | int | str = False,
               scale: Optional[float] = None, enable_gqa: bool = False, seed: Optional[Tensor] = None,
               key_padding: Optional[Tensor] = None, window: Optional[tuple] = None,
               document_ids: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None,
               softcap: Optional[float] = None, sinks: Optional[Tensor] = None, mask_mod: Optional[Callable] = None,
               block_mask: Any = None, bias_name: str = "attn_bias") -> tuple[AttentionCall, Layout]:
    """Check the public arguments and fold them into the op's call on (B, H, L, E), with the
    layout that unfolds its output. `seed` (a 0-d int64 tensor, or a `dropout.Placement`'s)
    fixes the dropout draw; by default it comes from PyTorch's generator. The rest as in
    `attention` (mask: boolean, bias: float). `bias_name` is the argument the caller's user
    passed the bias as, for the errors: scaled_dot_product_attention's float attn_mask."""
    check_tensors(query, key, value, dropout_p)
    check_optional_tensors(attn_mask=mask, key_padding=key_padding, document_ids=document_ids, cu_seqlens=cu_seqlens)
    check_optional_tensors(**{bias_name: bias})
    if softcap is not None and not (is_number(softcap) and 0.0 < softcap < math.inf):
        raise ValueError(f"softcap must be a positive finite number (or None); got {softcap!r}")
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"attn_mask must be boolean here; pass a float mask as attn_bias (got {mask.dtype})")
    if bias is not None and bias.dtype not in FLOATS:
        raise TypeError(f"attn_bias must be floating; pass a boolean mask as attn_mask (got {bias.dtype})")
    for name, t in (("attn_mask", mask), (bias_name, bias)):
        if t is not None and t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query on {query.device}")
    layout = Layout(query, key, value, enable_gqa)
    sinks = None if sinks is None else check_sinks(sinks, layout, query)
    mask = None if mask is None else layout.fold_mask(mask, "attn_mask")
    bias = None if bias is None else layout.fold_mask(bias, bias_name)
    causal = _causal_offset(is_causal, layout.len_q, layout.len_k)
    bounds, blocks = None, None
    structured = dict(key_padding=key_padding, window=window, document_ids=document_ids, cu_seqlens=cu_seqlens)
    if any(value is not None for value in structured.values()):
        batch = () if layout.flat else tuple(layout.batch)
        bounds, keep = structure(batch, layout.len_q, layout.len_k, causal, query.device, **structured)
        if keep is not None:  # padding with holes: a (B, 1, 1, Lk) mask beside any other
            mask = keep if mask is None else mask & keep
    causal = _op_diagonal(causal, layout.len_q, layout.len_k)  # the window's alignment is done with it
    if mask_mod is not None or block_mask is not None:
        if query.dim() != 4 or layout.flat:
            raise ValueError(f"mask_mod and block_mask take (B, H, L, E) inputs, as FlexAttention does; got "
                             f"{describe_shapes(query, key, value)}")
        evaluated = evaluated_mask(mask_mod, block_mask, layout.batch[0], layout.heads, layout.len_q, layout.len_k,
                                   query.device)
        if evaluated.causal is not None:  # two causal diagonals: the lower one holds
            causal = evaluated.causal if causal is None else min(causal, evaluated.causal)
        if evaluated.bounds is not None:
            parts = [evaluated.bounds] if bounds is None else [bounds, evaluated.bounds]
            bounds = join_bounds(parts, layout.len_q, layout.len_k, causal, query.device)
        if evaluated.mask is not None:
            mask = evaluated.mask if mask is None else mask & evaluated.mask
        blocks = evaluated.blocks
    if seed is None:
        if dropout_p > 0.0:
            seed = torch.randint(0, 2**62, (), dtype=torch.int64)  # from PyTorch's default generator
        else:
            seed = torch.zeros((), dtype=torch.int64)
    masks = ScoreMasks(mask=mask, bias=bias, bounds=bounds, causal=causal, softcap=float(softcap or 0.0),
                       blocks=blocks, sinks=sinks)
    call = AttentionCall(layout.q, layout.k, layout.v, masks, seed, float(default_scale(query, scale)), float(dropout_p))
    return call, layout
