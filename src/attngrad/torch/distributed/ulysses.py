"""`all_to_all_attention` (DeepSpeed Ulysses): trade the sequence shard for a head group by
one all-to-all, attend over the whole sequence with attngrad's own op, trade back.

    (B, H, L / P, E) per rank --all-to-all--> (B, H / P, L, E) --attention--> (B, H / P, L, Ev)
                             --all-to-all--> (B, H, L / P, Ev)

The all-to-all is linear, so its derivatives are all-to-alls too (`_AllToAll`: each way
is the other's backward and its own JVP), and everything the one-process
op has (backward, a bias's gradient, JVP, double backward, HVP) carries over.
(torch.distributed.nn.functional.all_to_all_single has no forward mode.)
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import Unpack  # typing's from Python 3.11

from ..arguments import ATTENTION, build_call
from ..layout import Layout
from ..op.autograd import differentiable_attention
from ..op.dropout import Placement
from .call_checks import SHARDED, ShardedOptions, start_call
from .ring_comm import waited
from .sharding import Sharding, group_of


class _Trade:
    """The sequence order of a group's shards: rank-major after an all-to-all, chunk by
    chunk in sequence order for attention."""

    def __init__(self, group: dist.ProcessGroup, layout: str, shard: int) -> None:
        self.group, self.world = group, dist.get_world_size(group)
        self.sharding = Sharding(layout, self.world, shard * self.world)
        held = [c for rank in range(self.world) for c in self.sharding.chunks(rank)]  # chunk at each slot
        self.sequence_order = [held.index(c) for c in range(len(held))]  # slot of each chunk
        self.rank_order = held

    def _exchange(self, received: Tensor, send: Tensor) -> None:
        start = time.perf_counter()
        dist.all_to_all_single(received, send, group=self.group)
        waited[0] += time.perf_counter() - start

    def _reorder(self, x: Tensor, order: list[int]) -> Tensor:
        if order == list(range(len(order))):
            return x
        b, h, length, w = x.shape
        return x.view(b, h, len(order), length // len(order), w)[:, :, order].reshape(b, h, length, w)

    def to_heads(self, x: Tensor) -> Tensor:
        """(B, H, L / P, W) shards -> this rank's head group over the whole sequence (B, H / P, L, W)."""
        b, h, shard, w = x.shape
        send = x.reshape(b, self.world, h // self.world, shard, w).transpose(0, 1).contiguous()
        received = torch.empty_like(send)  # [s]: rank s's shard of this rank's heads
        self._exchange(received, send)
        whole = received.permute(1, 2, 0, 3, 4).reshape(b, h // self.world, self.world * shard, w)
        return self._reorder(whole, self.sequence_order)

    def to_sequence(self, x: Tensor) -> Tensor:
        """The inverse of `to_heads`: (B, H / P, L, W) -> (B, H, L / P, W)."""
        b, group_heads, length, w = x.shape
        shard = length // self.world
        ranked = self._reorder(x, self.rank_order)
        send = ranked.reshape(b, group_heads, self.world, shard, w).permute(2, 0, 1, 3, 4).contiguous()
        received = torch.empty_like(send)  # [s]: this rank's shard of rank s's heads
        self._exchange(received, send)
        return received.transpose(0, 1).reshape(b, self.world * group_heads, shard, w)


class _AllToAll(torch.autograd.Function):
    """`_Trade.to_heads` (to_heads=True) or `to_sequence`: each the other's backward, and
    its own JVP (it is linear)."""

    @staticmethod
    def forward(x: Tensor, trade: _Trade, to_heads: bool) -> Tensor:
        return trade.to_heads(x) if to_heads else trade.to_sequence(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.trade, ctx.to_heads = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        return _AllToAll.apply(grad, ctx.trade, not ctx.to_heads), None, None

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor, _ttrade: Any, _tdirection: Any) -> Tensor:
        return _AllToAll.apply(tangent, ctx.trade, ctx.to_heads)  # differentiable: the gradient through a JVP


def _heads_of(t: Tensor, heads: int, world: int) -> Tensor:
    """A (b, h, ., .) tensor whose h splits into `world` groups: as it is, or its heads
    repeated to `heads` (GQA's key/value heads, or a broadcast head axis)."""
    if t.shape[1] % world == 0:
        return t
    return t.expand(t.shape[0], heads, *t.shape[2:]) if t.shape[1] == 1 else t.repeat_interleave(heads // t.shape[1], dim=1)


def _rows_to_heads(t: Optional[Tensor], trade: _Trade, heads: int, rank: int) -> Optional[Tensor]:
    """A (b, h, L / P or 1, L or 1) mask or bias of this rank's rows as this rank's head
    group's over all rows."""
    if t is None:
        return None
    if t.shape[-2] == 1:  # the same for every row: only the heads change hands
        if t.shape[1] == 1:
            return t
        group = t.shape[1] // trade.world
        return t[:, rank * group:(rank + 1) * group]
    t = _heads_of(t, heads, trade.world)
    if t.dtype == torch.bool:  # not differentiable; the collectives take bytes
        return trade.to_heads(t.to(torch.uint8)).to(torch.bool)
    return _AllToAll.apply(t, trade, True)


@SHARDED.signed
def all_to_all_attention(query: Tensor, key: Tensor, value: Tensor, **options: Unpack[ShardedOptions]) -> Tensor:
    """`ring_attention`'s arguments and result, computed by trading sequence shards for
    head groups (Ulysses): H (and Hkv, or else key and value repeat to H heads) must be a
    multiple of the world size P. Each rank holds (B, H / P, L, E) during the attention:
    the same size as its shard of all heads; a bias with rows is traded to
    (b, H / P, L, L). Two all-to-alls per call each way, none per step. `sinks` (H,): as in
    `attngrad.torch.attention`; each rank takes its head group's."""
    options = SHARDED.complete("all_to_all_attention", options)
    group = group_of(options["group"])
    seed = start_call("all_to_all_attention", group, query, key, value, options)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    folded = Layout(query, key, value, options["enable_gqa"])
    if folded.heads % world:  # every rank raises alike: they agreed on the shapes
        raise ValueError(f"all_to_all_attention splits the {folded.heads} query heads over {world} ranks: "
                         f"they must be a multiple of it (query {tuple(query.shape)}); use ring_attention")
    trade = _Trade(group, options["layout"], query.shape[-2])
    length = trade.sharding.length
    q, k, v = folded.q, folded.k, folded.v
    k, v = _heads_of(k, folded.heads, world), _heads_of(v, folded.heads, world)
    attn_mask, attn_bias, sinks = options["attn_mask"], options["attn_bias"], options["sinks"]
    mask = None if attn_mask is None else _rows_to_heads(folded.fold_mask(attn_mask, "attn_mask", length), trade,
                                                        folded.heads, rank)
    bias = None if attn_bias is None else _rows_to_heads(folded.fold_mask(attn_bias, "attn_bias", length), trade,
                                                        folded.heads, rank)
    q, k, v = (_AllToAll.apply(t, trade, True) for t in (q, k, v))
    head_offset = rank * (folded.heads // world)
    heads_here = folded.heads // world
    # the one-process call's options (not the group's nor the layout), on this rank's head group
    here = {name: value for name, value in options.items() if name in ATTENTION.names}
    here.update(attn_mask=mask, attn_bias=bias, enable_gqa=k.shape[1] != q.shape[1],
                sinks=None if sinks is None else sinks[head_offset:head_offset + heads_here])
    call, _ = build_call(q, k, v, seed=Placement(seed, 0, 0, head_offset).tensor(), **here)
    return folded.unfold(_AllToAll.apply(differentiable_attention(call), trade, False))
