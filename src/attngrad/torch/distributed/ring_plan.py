"""What a ring call computes at each step: the units of work, each the attention of one of
this rank's query chunks to one chunk of the key block it holds, at known sequence
positions. A unit is an ordinary call of attngrad's ops on those chunks:

    causal alone      c = q_start - k_start: key j is visible to query i when j <= i + c
                      (top-left over the whole sequence); a unit that sees every key drops
                      it, a unit that sees none is left out
    structured masks  the whole sequence's key bounds of the unit's rows, shifted by
                      -k_start and clamped to the chunk (`structured`: the causal diagonal,
                      windows, documents and padding lengths are all bounds)
    mask, bias        the unit's rows and keys of the rank's (local rows, all keys) tensor
    dropout           the seed with the unit's row and key offsets, so that its masks are
                      the whole sequence's (`dropout.Placement`)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..masks.block_map import EMPTY, FULL, classify, row_intervals
from ..op.call import AttentionCall, ScoreMasks
from ..op.dropout import Placement
from .ring_comm import Ring
from .sharding import Sharding


def piece(t: Optional[Tensor], rows: slice, cols: slice) -> Optional[Tensor]:
    """Rows `rows` and keys `cols` of a (b, h, Lq, Lk) mask, bias or its gradient, where it
    does not broadcast along that axis (a view)."""
    if t is None:
        return None
    if t.shape[-2] != 1:
        t = t[..., rows, :]
    if t.shape[-1] != 1:
        t = t[..., cols]
    return t


@dataclass
class Unit:
    """Query chunk `i` of this rank against key chunk `j` of the block held at the step."""

    i: int
    j: int
    rows: slice  # the query chunk's rows in this rank's shard
    cols: slice  # the key chunk's positions in the whole sequence
    masks: ScoreMasks  # its pieces of the rank's: key bounds (1 or B, C, 2) in the chunk's keys, or a diagonal
    dropout: Placement

    @property
    def seed(self) -> Tensor:
        return self.dropout.tensor()


class RingPlan:
    """Every step's units for this rank, and the options every unit shares.

    `masks` are this rank's rows' against the whole sequence's keys: `mask` and `bias` folded
    to (b, h, L / P, L), or None; `bounds` (1 or B, L / P, 2) the whole sequence's key bounds,
    or None; `causal` 0 (top-left over the whole sequence) or None; `softcap`; and `sink`:
    each row's softmax has a zero-logit sink, merged in once the rows are whole (the steps
    have none). `seed` is rank 0's dropout seed."""

    def __init__(self, ring: Ring, sharding: Sharding, masks: ScoreMasks, seed: int, scale: float,
                 dropout_p: float) -> None:
        self.ring, self.sharding, self.masks = ring, sharding, masks
        self.scale, self.dropout_p = scale, dropout_p
        self.chunks = len(sharding.chunks(ring.rank))
        self.units = [self._units(step, seed) for step in range(ring.size)]

    def _units(self, step: int, seed: int) -> list[Unit]:
        size, masks = self.sharding.chunk, self.masks
        partial = int(self.sharding.pieces > 1)  # each row's keys are in more than one unit
        units = []
        for i, q_start in enumerate(self.sharding.starts(self.ring.rank)):
            rows = slice(i * size, (i + 1) * size)
            for j, k_start in enumerate(self.sharding.starts(self.ring.owner(step))):
                cols = slice(k_start, k_start + size)
                diagonal, unit_bounds = None, None
                if masks.bounds is not None:  # the causal diagonal among them
                    unit_bounds = (masks.bounds[:, rows] - k_start).clamp_(0, size)
                    state = classify(unit_bounds[..., 0], unit_bounds[..., 1], 0, size)
                    if state == EMPTY:
                        continue  # no row sees a key of this chunk
                    unit_bounds = None if state == FULL else unit_bounds.contiguous()
                elif masks.causal is not None:
                    diagonal = q_start - k_start + masks.causal
                    state = classify(*row_intervals(size, size, diagonal, None), 0, size)
                    if state == EMPTY:
                        continue  # even the chunk's last row is before its first key
                    if state == FULL:
                        diagonal = None  # even the first row is past its last key
                unit_masks = ScoreMasks(mask=piece(masks.mask, rows, cols), bias=piece(masks.bias, rows, cols),
                                        bounds=unit_bounds, causal=diagonal, softcap=masks.softcap)
                units.append(Unit(i, j, rows, cols, unit_masks, Placement(seed, q_start, k_start, 0, partial)))
        return units

    def call(self, unit: Unit, q: Tensor, k: Tensor, v: Tensor) -> AttentionCall:
        """The attention call of `unit` on its query chunk `q` and key chunks `k`, `v`."""
        return AttentionCall(q, k, v, unit.masks, unit.seed, self.scale, self.dropout_p)

    def split(self, t: Optional[Tensor]) -> Optional[list[Tensor]]:
        """A (B, H, L / P, .) shard as its chunks: views (a step's op copies what it needs
        contiguous, for as long as it runs; a block sent on is copied once)."""
        if t is None:
            return None
        size = self.sharding.chunk
        return [t[:, :, i * size:(i + 1) * size] for i in range(self.chunks)]

    @staticmethod
    def join(chunks: list[Tensor]) -> Tensor:
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)
