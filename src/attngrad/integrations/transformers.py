"""attngrad inside Hugging Face transformers: `attn_implementation="attngrad"`.

    from attngrad.integrations.transformers import register
    register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attngrad")

`register()` adds two functions to transformers' interfaces under one name:
- a mask function (`AttentionMaskInterface`), which reads the model's mask into attngrad's
  structured masks (`transformers_masks`): causal with any cache offset, sliding windows,
  packed sequences from position ids, and padding from the 2-D attention_mask, as a
  `CompactMask` of O(B L) memory instead of a (B, 1, L, L) tensor; any other mask function
  (or_masks for image tokens, Llama 4's chunks, a model's own) is evaluated a few rows at
  a time into per-row key bounds, still nothing L x L;
- an attention function (`AttentionInterface`), which runs `attngrad.torch.attention` on
  it, with GQA without repeating heads, T5's relative position bias as a bias with its
  gradient, Gemma 2's soft cap and GPT-OSS's sinks.

Every model that calls the attention interface then runs on attngrad: exact in float64,
O(L) memory, and with forward-mode AD and double backward through the whole model. An
option attngrad cannot serve raises `UnsupportedMask` or ValueError naming it.

Under `torch.compile` (fullgraph included) every mask function is evaluated, since Dynamo
cannot read a closure, into key bounds whose form follows the shapes alone; so are the
masks generate() makes ahead of each forward for a static cache, so that one compiled
graph serves every decoding step.
"""

from __future__ import annotations

from typing import Any, Optional, TypedDict

import torch
from torch import Tensor
from typing_extensions import Unpack

from ..torch import attention
from .transformers_masks import (
    MASK_DEFAULTS,
    CompactMask,
    MaskArguments,
    UnsupportedMask,
    compact_mask,
    evaluate_mask_function,
    read_mask_function,
)

__all__ = ["NAME", "CompactMask", "UnsupportedMask", "attention_for_transformers", "mask_for_attngrad", "register"]

NAME = "attngrad"


def mask_for_attngrad(**arguments: Unpack[MaskArguments]) -> CompactMask:
    """transformers' mask interface: the model's mask as a CompactMask, read or evaluated
    (nothing Lq x Lk where its rows are intervals)."""
    # what attngrad reads of what transformers passes, its own defaults for what it left out
    arguments = {**MASK_DEFAULTS, **{n: a for n, a in arguments.items() if n in MaskArguments.__annotations__}}
    batch_size, q_length, kv_length = arguments["batch_size"], arguments["q_length"], arguments["kv_length"]
    q_offset, kv_offset = arguments["q_offset"], arguments["kv_offset"]
    mask_function, attention_mask = arguments["mask_function"], arguments["attention_mask"]
    if isinstance(attention_mask, CompactMask):  # made before (generate() with a static cache): as it is
        if (attention_mask.q_length, attention_mask.kv_length) != (q_length, kv_length):
            raise ValueError(f"the attngrad mask passed in was made for (Lq, Lk) = ({attention_mask.q_length}, "
                             f"{attention_mask.kv_length}), but this call has ({q_length}, {kv_length})")
        return attention_mask
    if mask_function is None:
        raise UnsupportedMask("attn_implementation='attngrad' needs the model's mask_function")
    # Compiled, the function is evaluated: Dynamo cannot read a closure. A static cache
    # (q_offset a tensor) asks for masks of one form at every step, so one graph serves all.
    fixed_form = torch.compiler.is_compiling() or isinstance(q_offset, Tensor)
    if not fixed_form:
        try:
            pattern = read_mask_function(mask_function)
            return compact_mask(q_length, kv_length, q_offset, kv_offset, pattern, attention_mask, batch_size)
        except UnsupportedMask:  # or_masks, chunks, image blocks, a model's own function: evaluated
            pass
    return evaluate_mask_function(arguments, fixed_form)


def _needed_bias(position_bias: Optional[Tensor]) -> Optional[Tensor]:
    """T5's position bias, or None for the all-zero one its layers without a relative bias
    pass (cross-attention): adding zeros would cost a bias pass for nothing."""
    if position_bias is None:
        return None
    if torch.compiler.is_compiling():  # whether it is all zero is a value a graph cannot branch on
        return position_bias
    if not position_bias.requires_grad and not bool(position_bias.any()):
        return None
    return position_bias


class AttentionArguments(TypedDict, total=False):
    """What transformers' attention interface passes by name beside q, k, v and the mask, and
    attngrad reads (models pass more: position ids, ..., which it does not need)."""

    dropout: float
    scaling: Optional[float]
    is_causal: Optional[bool]  # None: the module's own is_causal
    softcap: Optional[float]  # Gemma 2's logit soft cap
    s_aux: Optional[Tensor]  # GPT-OSS's sinks, one logit per head
    position_bias: Optional[Tensor]  # T5's relative position bias
    sliding_window: Optional[int]


def attention_for_transformers(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                               **arguments: Unpack[AttentionArguments]) -> tuple[Tensor, None]:
    """transformers' attention interface: query (B, H, Lq, D), key and value (B, Hkv, Lk, D)
    -> ((B, Lq, H, Dv), None). The attention weights are never formed, so none are returned."""
    dropout, scaling, is_causal = arguments.get("dropout", 0.0), arguments.get("scaling"), arguments.get("is_causal")
    softcap, s_aux, position_bias = arguments.get("softcap"), arguments.get("s_aux"), arguments.get("position_bias")
    sliding_window = arguments.get("sliding_window")
    options: dict = {}
    bias = _needed_bias(position_bias)
    if isinstance(attention_mask, CompactMask):
        if (attention_mask.q_length, attention_mask.kv_length) != (query.shape[-2], key.shape[-2]):
            raise ValueError(f"the attngrad mask was made for (Lq, Lk) = ({attention_mask.q_length}, "
                             f"{attention_mask.kv_length}), but query has {query.shape[-2]} and key {key.shape[-2]}")
        options.update(attention_mask.arguments())
    elif isinstance(attention_mask, Tensor):  # a 4-D mask the caller built: transformers passes it as it is
        if attention_mask.dtype == torch.bool:
            options["attn_mask"] = attention_mask
        else:
            bias = attention_mask if bias is None else bias + attention_mask
    elif attention_mask is None:
        # no mask was made (a model without mask creation): SDPA's rule, causal for more than one query
        if sliding_window is not None:  # the window lives in the mask this call did not get
            raise UnsupportedMask("attn_implementation='attngrad' got sliding_window without a mask from its mask "
                                  "function; the window reaches it through the model's mask")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
        options["is_causal"] = bool(causal) and query.shape[-2] > 1
    else:
        raise UnsupportedMask(f"attn_implementation='attngrad' got an attention_mask of type "
                              f"{type(attention_mask).__name__}; it takes the masks its own mask function makes")
    out = attention(
        query, key, value, attn_bias=bias, softcap=softcap or None, sinks=s_aux, dropout_p=dropout, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1], **options,
    )
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME) -> str:
    """Make `attn_implementation=name` ("attngrad") run attngrad in every transformers model
    that uses the attention interface. Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_for_transformers)
    AttentionMaskInterface.register(name, mask_for_attngrad)
    return name
