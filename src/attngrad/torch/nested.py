"""Nested jagged tensors (`torch.nested`, layout=torch.jagged) as packed sequences.

PyTorch's `scaled_dot_product_attention` takes q, k, v of shape (B, H, j, E) whose length j
differs per batch entry: (B, j, H, E) jagged tensors transposed. Here each is read as its
packed values (1, H, total, E) and its offsets, and every query row of entry b sees the
keys of entry b alone: per-row key bounds [k_offsets[b], k_offsets[b + 1]), narrowed by the
causal diagonal within the entry. No padding, nothing total x total, every derivative; the
output goes back as a jagged tensor on the queries' offsets.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from typing_extensions import Unpack  # typing's from Python 3.11

from .arguments import ATTENTION, AttentionOptions
from .masks.functions import EvaluatedMask

# The options a jagged call takes: each sequence's own. Every other one masks tokens, and
# the sequences are the mask already.
PER_SEQUENCE = frozenset({"is_causal", "softcap", "sinks", "dropout_p", "scale", "enable_gqa"})


def is_jagged(t: Any) -> bool:
    return isinstance(t, Tensor) and t.is_nested and t.layout == torch.jagged


def _packed(t: Tensor, name: str) -> tuple[Tensor, Tensor]:
    """A (B, H, j, E) jagged tensor as (1, H, total, E) values (a view) and (B + 1,) offsets."""
    if not is_jagged(t):
        raise TypeError(f"{name} must be a nested jagged tensor like query (torch.nested, layout=torch.jagged); "
                        f"got {'a strided nested tensor' if isinstance(t, Tensor) and t.is_nested else type(t).__name__}")
    if t.dim() != 4 or t._ragged_idx != 2:
        raise ValueError(f"{name} must be (B, H, j, E), a (B, j, H, E) jagged tensor transposed as PyTorch's "
                         f"scaled_dot_product_attention takes it; got shape {tuple(t.shape)} ragged in dimension "
                         f"{t._ragged_idx}")
    rows = t.transpose(1, 2)  # (B, j, H, E): its values are (total, H, E)
    if rows.lengths() is not None:
        raise ValueError(f"{name} has holes between its sequences (lengths beside offsets); pass a contiguous one")
    return rows.values().transpose(0, 1).unsqueeze(0), rows.offsets()


def row_bounds(q_offsets: Tensor, k_offsets: Tensor, causal: bool) -> Tensor:
    """(1, total_q, 2) int64: query row r of entry b sees keys [k_offsets[b], k_offsets[b + 1]),
    with `causal` those up to its own position within the entry (top-left, as PyTorch's)."""
    q_offsets, k_offsets = q_offsets.long(), k_offsets.long()
    lengths = q_offsets[1:] - q_offsets[:-1]
    entry = torch.repeat_interleave(torch.arange(len(lengths), device=q_offsets.device), lengths)
    lo, hi = k_offsets[entry], k_offsets[entry + 1]
    if causal:
        position = torch.arange(int(q_offsets[-1]), device=q_offsets.device) - q_offsets[entry]
        hi = torch.minimum(hi, lo + position + 1)
    return torch.stack([lo, hi], -1)[None]


def jagged_attention(query: Tensor, key: Tensor, value: Tensor, *, attend: Any,
                     **options: Unpack[AttentionOptions]) -> Tensor:
    """`attend(q, k, v, block_mask=..., **options)` (attngrad's `attention`) on the packed
    values of jagged (B, H, j, E) query, key and value, each sequence's rows seeing its own
    keys (`row_bounds`); the result as a jagged (B, H, j, Ev) tensor on query's offsets. A
    ValueError names an option that is not `PER_SEQUENCE`, or a causal mask other than each
    sequence's top-left one."""
    options = ATTENTION.with_defaults(options)
    is_causal = options["is_causal"]
    given = [name for name, value in options.items() if name not in PER_SEQUENCE and value is not None]
    if given or is_causal not in (False, True, "top_left"):
        raise ValueError(f"with nested jagged inputs each sequence sees its own keys, causal or not (top-left); "
                         f"{', '.join(given) or f'is_causal={is_causal!r}'} cannot be added to that")
    q, q_offsets = _packed(query, "query")
    k, k_offsets = _packed(key, "key")
    v, v_offsets = _packed(value, "value")
    if len(q_offsets) != len(k_offsets) or not torch.equal(k_offsets, v_offsets):
        raise ValueError(f"key and value must hold the same sequences, as many as query's: query has "
                         f"{len(q_offsets) - 1}, key lengths {k_offsets.diff().tolist()}, "
                         f"value lengths {v_offsets.diff().tolist()}")
    bounds = row_bounds(q_offsets, k_offsets, bool(is_causal))
    shape = (1, 1, q.shape[-2], k.shape[-2])
    per_sequence = {name: options[name] for name in PER_SEQUENCE if name != "is_causal"}  # causal: in the bounds
    block_mask = EvaluatedMask(shape, bounds=bounds.to(q.device))
    out = attend(q, k, v, block_mask=block_mask, **per_sequence)  # (1, H, total, Ev)
    values = out.squeeze(0).transpose(0, 1)  # (total, H, Ev)
    return torch.nested.nested_tensor_from_jagged(values, q_offsets).transpose(1, 2)
