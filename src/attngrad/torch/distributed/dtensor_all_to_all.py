"""A pass op on sequence-sharded DTensors by trading the sequence for heads (DeepSpeed
Ulysses), where PyTorch's context parallelism rotates by all-to-all
(`set_rotate_method("alltoall")`): every input shaped per query row or per key goes to this
rank's head group over the whole sequence (`ulysses._Trade`, one all-to-all each), the
one-process pass runs there, and its results come back to this rank's rows and keys.

    q, out, dout, tangents, cotangents (B, H, L / P, .)  -->  (B, H / P, L, .)
    row statistics (B, H, L / P)                          -->  (B, H / P, L)
    a mask or bias of this rank's rows (B, H or 1, L / P, L) -->  (B, H / P or 1, L, L)
    one the same for every row (B, H or 1, 1, L)          -->  this rank's heads of it

The same numbers as the ring (`dtensor_passes`); what travels is each input and result
once, not the keys and values round the ring. A call whose heads (or key/value heads) do
not split over the ranks, or with dropout, takes the ring (`takes`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..op import ops
from ..op.call import FIELDS, PASSES, AttentionCall, ScoreMasks
from .ulysses import _Trade

SEQUENCE = 2


def takes(local: AttentionCall, world: int) -> bool:
    """Whether the heads split over the `world` ranks: q's and k's, and a mask's or bias's
    where it has one per head; and no dropout (whose draws follow each head's place)."""
    heads = local.q.shape[1]
    if heads % world or local.k.shape[1] % world or local.dropout_p:
        return False
    return all(t is None or t.shape[1] in (1, heads) for t in (local.mask, local.bias))


class _Traded:
    """One pass's trade: each tensor to this rank's head group over the whole sequence, and
    each result back, by what it is shaped like (`FIELDS`' and `PASSES`' like)."""

    def __init__(self, local: AttentionCall, group: torch.distributed.ProcessGroup, layout: str) -> None:
        self.trade = _Trade(group, layout, local.q.shape[SEQUENCE])
        self.world, self.rank = self.trade.world, torch.distributed.get_rank(group)
        self.heads = local.q.shape[1]
        self.bias_rows = local.bias is not None and local.bias.shape[-2] != 1  # this rank's rows, not shared

    def to_heads(self, t: Optional[Tensor], like: Optional[str]) -> Optional[Tensor]:
        if t is None or like is None:
            return t
        if like == "rows":
            return self.trade.to_heads(t.unsqueeze(-1)).squeeze(-1)
        if like == "bias":
            return self._score_to_heads(t)
        return self.trade.to_heads(t)

    def _score_to_heads(self, t: Tensor) -> Tensor:
        """A mask or bias (or a bias's tangent or cotangent): this rank's rows over every row,
        for this rank's heads; one shared by every row, this rank's heads of it."""
        group = self.heads // self.world
        if t.shape[-2] == 1:
            return t if t.shape[1] == 1 else t[:, self.rank * group:(self.rank + 1) * group]
        boolean = t.dtype == torch.bool
        t = t.to(torch.uint8) if boolean else t  # the collectives take bytes
        if t.shape[1] == 1:  # the same for every head: each rank gets every row of it
            whole = self.trade.to_heads(t.expand(t.shape[0], self.world, *t.shape[2:]))
        else:
            whole = self.trade.to_heads(t)
        return whole.to(torch.bool) if boolean else whole

    def to_sequence(self, t: Optional[Tensor], like: str, given: Optional[Tensor]) -> Optional[Tensor]:
        """A result of the pass on this rank's head group back to this rank's rows or keys;
        a bias's gradient shaped as `given`, the bias this rank was given; None for a result
        the pass leaves empty (absent)."""
        if t is None or t.numel() == 0:
            return None
        if like == "rows":
            return self.trade.to_sequence(t.unsqueeze(-1)).squeeze(-1)
        if like != "bias":
            return self.trade.to_sequence(t)
        if given.shape[-2] == 1:  # shared by every row: this rank's heads' part, Partial over the ranks
            if given.shape[1] == 1:
                return t
            whole = t.new_zeros(t.shape[0], self.heads, *t.shape[2:])
            group = self.heads // self.world
            whole[:, self.rank * group:(self.rank + 1) * group] = t
            return whole
        if given.shape[1] == 1:  # every head group's part of this rank's rows, summed
            return self.trade.to_sequence(t).sum(1, keepdim=True)
        return self.trade.to_sequence(t)


def run(pass_name: str, local: AttentionCall, inputs: dict, group: torch.distributed.ProcessGroup,
        layout: str) -> tuple:
    """The pass on local shards by the trade, its results as the op's."""
    traded = _Traded(local, group, layout)
    masks = ScoreMasks(mask=traded.to_heads(local.mask, "bias"), bias=traded.to_heads(local.bias, "bias"),
                       bounds=local.bounds, causal=local.causal, softcap=local.softcap, sink=local.sink)
    whole = AttentionCall(traded.to_heads(local.q, "q"), traded.to_heads(local.k, "k"), traded.to_heads(local.v, "v"),
                          masks, local.seed, local.scale, local.dropout_p)
    given = {name: traded.to_heads(value, FIELDS[name].like) if isinstance(value, Tensor) else value
             for name, value in inputs.items()}
    results = ops.run_pass(pass_name, whole, given)
    results = (results,) if isinstance(results, Tensor) else results
    back = tuple(traded.to_sequence(r, output.like, local.bias) for output, r in zip(PASSES[pass_name].outputs, results))
    return back[0] if len(back) == 1 else back
