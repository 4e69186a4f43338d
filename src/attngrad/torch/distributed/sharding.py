"""How a sequence is split over the ranks of a group, and back.

The sequence is cut into equal chunks. "contiguous": P chunks, rank r holds chunk r.
"zigzag": 2P chunks, rank r holds chunks r and 2P - 1 - r, so that under a causal mask
every rank has the same work (an early chunk sees few keys, its partner many). A rank's
shard is its chunks in sequence order, joined along the sequence axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Sharding:
    """The chunks of a sequence of `length` over `world` ranks in `layout`."""

    layout: str
    world: int
    length: int

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}; got {self.layout!r}")
        if self.length % self.pieces:
            raise ValueError(f"a sequence of {self.length} does not split into {self.pieces} equal chunks "
                             f"(layout {self.layout!r}, {self.world} ranks): pad it to a multiple of {self.pieces}")

    @property
    def pieces(self) -> int:
        """How many chunks the sequence is cut into."""
        return self.world * (2 if self.layout == "zigzag" else 1)

    @property
    def chunk(self) -> int:
        """The length of one chunk."""
        return self.length // self.pieces

    def chunks(self, rank: int) -> tuple[int, ...]:
        """The chunks rank `rank` holds, in sequence order."""
        if self.layout == "zigzag":
            return (rank, 2 * self.world - 1 - rank)
        return (rank,)

    def starts(self, rank: int) -> tuple[int, ...]:
        """The sequence positions at which rank `rank`'s chunks start."""
        return tuple(c * self.chunk for c in self.chunks(rank))

    def positions(self, rank: int, device: Optional[torch.device] = None) -> Tensor:
        """The sequence position of every element of rank `rank`'s shard, (L / P,) int64."""
        return torch.cat([torch.arange(s, s + self.chunk, device=device) for s in self.starts(rank)])


def group_of(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("attngrad.torch.distributed needs an initialised process group "
                           "(torch.distributed.init_process_group)")
    return group if group is not None else dist.group.WORLD


def shard_sequence(x: Tensor, *, group: Optional[dist.ProcessGroup] = None, layout: str = "contiguous",
                   dim: int = 1) -> Tensor:
    """This rank's shard of `x`, the whole sequence along `dim` (the same on every rank):
    (B, L, ...) hidden states, input ids, position ids and labels with the default dim=1;
    dim=-2 for (B, H, L, E) attention inputs. Differentiable: a view for "contiguous"."""
    group = group_of(group)
    sharding = Sharding(layout, dist.get_world_size(group), x.shape[dim])
    pieces = [x.narrow(dim, start, sharding.chunk) for start in sharding.starts(dist.get_rank(group))]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def gather_sequence(x: Tensor, *, group: Optional[dist.ProcessGroup] = None, layout: str = "contiguous",
                    dim: int = 1) -> Tensor:
    """The whole sequence from every rank's shard `x` (the inverse of `shard_sequence`), on
    every rank. Differentiable: the gradient of a rank's shard is the sum of every rank's
    gradient for it (torch.distributed.nn's all_gather)."""
    group = group_of(group)
    world = dist.get_world_size(group)
    if x.requires_grad and torch.is_grad_enabled():
        from torch.distributed.nn.functional import all_gather
        shards = list(all_gather(x.contiguous(), group=group))
    else:
        shards = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
        dist.all_gather(shards, x.contiguous(), group=group)
    sharding = Sharding(layout, world, x.shape[dim] * world)
    pieces: list[Optional[Tensor]] = [None] * sharding.pieces
    for rank, shard in enumerate(shards):
        for i, c in enumerate(sharding.chunks(rank)):
            pieces[c] = shard.narrow(dim, i * sharding.chunk, sharding.chunk)
    return torch.cat(pieces, dim)
