"""The options of the sharded entry points (`ShardedOptions`: every entry point's, the group
and the layout), and what every sharded call checks before its first exchange: its own
arguments, then that every rank of the group calls with the same shapes and options
(`agree`), which also hands every rank rank 0's dropout seed."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..arguments import DEFAULTS, Declaration, Options
from ..layout import FLOATS, check_tensors
from .ring_comm import agree
from .sharding import LAYOUTS

IS_CAUSAL = {False: 0, True: 1, "top_left": 1, "bottom_right": 1}  # Lq = Lk: both alignments agree


class ShardedOptions(Options, total=False):
    """The options of `ring_attention` and `all_to_all_attention`: those every entry point
    takes (`Options`, over the whole sequence; is_causal without an int diagonal), the group
    and the layout."""

    group: Optional[dist.ProcessGroup]  # the ranks that hold the sequence's shards; None: the default group
    layout: str  # how the sequence is sharded: "contiguous" or "zigzag" (`sharding`)


SHARDED = Declaration(ShardedOptions, {**DEFAULTS, "layout": "contiguous"})


def _shape(t: Optional[Tensor]) -> tuple:
    return () if t is None else tuple(t.shape)


def start_call(what: str, group: dist.ProcessGroup, query: Tensor, key: Tensor, value: Tensor,
               options: ShardedOptions) -> int:
    """Check the call `what` (its `options` complete: `SHARDED.complete`) here and against the
    other ranks; return the dropout seed."""
    layout, is_causal, dropout_p = options["layout"], options["is_causal"], options["dropout_p"]
    attn_mask, attn_bias, softcap = options["attn_mask"], options["attn_bias"], options["softcap"]
    check_tensors(query, key, value, dropout_p)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    if is_causal not in IS_CAUSAL:
        raise ValueError(f"is_causal must be True, False, 'top_left' or 'bottom_right'; got {is_causal!r}")
    if query.shape[-2] != key.shape[-2]:
        raise ValueError(f"{what} shards one sequence: query and key must have the same shard length; "
                         f"got query {tuple(query.shape)}, key {tuple(key.shape)}")
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise TypeError(f"attn_mask must be boolean; pass a float mask as attn_bias (got {attn_mask.dtype})")
    if attn_bias is not None and attn_bias.dtype not in FLOATS:
        raise TypeError(f"attn_bias must be floating; got {attn_bias.dtype}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and 0.0 < softcap < math.inf):
        raise ValueError(f"softcap must be a positive finite number (or None); got {softcap!r}")
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64)) if dropout_p > 0.0 else 0
    facts = dict(query=query.shape, key=key.shape, value=value.shape, attn_bias=_shape(attn_bias),
                 attn_mask=_shape(attn_mask), sinks=_shape(options["sinks"]), options=_agreed_options(query, options))
    return agree(group, what, facts, seed)


def _agreed_options(query: Tensor, options: ShardedOptions) -> tuple[int, ...]:
    """The options every rank must share, as integers (`agree`)."""
    window = options["window"]
    return (FLOATS.index(query.dtype), IS_CAUSAL[options["is_causal"]], LAYOUTS.index(options["layout"]),
            round(options["dropout_p"] * 2**32), int(options["enable_gqa"]), round((options["softcap"] or 0.0) * 2**20),
            *(w if w is not None else -1 for w in (window or (-2, -2))))
