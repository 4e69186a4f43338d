"""The structure of a call's scores, in one place: which keys each query row may see, and
which blocks of the score matrix are empty, partly or wholly visible.

Two rules decide it, and every structured mask becomes them (`structured`):
    the causal diagonal c   row i sees keys j <= i + c (0 top-left, Lk - Lq bottom-right)
    key bounds              row i of batch entry b sees keys [lo, hi) (padding, windows,
                            documents: (1 or B, Lq, 2) int64)
Together each row sees one interval, [lo_i, min(hi_i, i + c + 1)) (`row_intervals`). A
boolean mask and a float bias may exclude more, entry by entry; the block map does not
read them.

`BlockMap` classifies the (query block, key block) tiles of a tiling from the intervals,
in the manner of FlexAttention's block mask: EMPTY (no row sees a key of it: skipped),
FULL (every row sees every key: no structural mask to apply), PARTIAL. The backends read
the rules here: the torch-ops kernels' key range per block (`key_range`) and excluded
entries (`excluded`), the ring's units (`classify`), the counts the tests check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

EMPTY, PARTIAL, FULL = 0, 1, 2


def causal_keys(causal: Optional[int], stop: int, len_k: int) -> int:
    """How many keys (a prefix) rows ..stop - 1 may see under the causal diagonal `causal`."""
    return len_k if causal is None else min(len_k, max(0, stop + causal))


def row_intervals(len_q: int, len_k: int, causal: Optional[int], bounds: Optional[Tensor],
                  device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """(lo, hi), each (1 or B, Lq) int64: row i sees keys [lo_i, hi_i) (lo = hi: none)."""
    rows = torch.arange(len_q, device=device)
    lo = torch.zeros(1, len_q, dtype=torch.int64, device=device)
    hi = torch.full((1, len_q), len_k, dtype=torch.int64, device=device)
    if bounds is not None:
        lo, hi = bounds[..., 0].clamp(0, len_k), bounds[..., 1].clamp(0, len_k)
    if causal is not None:
        hi = torch.minimum(hi, (rows + causal + 1).clamp(0, len_k))
    return lo, torch.maximum(lo, hi)


def key_range(start: int, stop: int, len_k: int, causal: Optional[int], lows: Optional[list],
              highs: Optional[list]) -> tuple[int, int]:
    """(first, keys): the keys rows start:stop may see, between the smallest lower and the
    largest upper bound of any of their rows (`lows`, `highs`: per row, over the batch, or
    None without bounds); first = keys where they see none."""
    keys, first = causal_keys(causal, stop, len_k), 0
    if lows is not None:
        keys, first = min(keys, max(highs[start:stop])), min(lows[start:stop])
    return min(first, keys), keys


def excluded(start: int, stop: int, first: int, keys: int, causal: Optional[int], bounds: Optional[Tensor],
             device: torch.device | str) -> Optional[Tensor]:
    """(1 or B, R, keys - first) boolean: the entries of rows start:stop and keys first:keys
    that the causal diagonal or the key bounds exclude; None where none is excluded."""
    rows = torch.arange(start, stop, device=device)[:, None]
    key = torch.arange(first, keys, device=device)[None, :]
    out = None
    if causal is not None and keys > start + causal + 1:
        out = (key > rows + causal)[None]
    if bounds is not None:
        row_bounds = bounds[:, start:stop, None, :]  # (b, R, 1, 2)
        outside = (key < row_bounds[..., 0]) | (key >= row_bounds[..., 1])
        out = outside if out is None else out | outside
    return out


def classify(lo: Tensor, hi: Tensor, first: int, keys: int) -> int:
    """EMPTY, PARTIAL or FULL: the tile of keys first:keys for rows of intervals [lo, hi)."""
    lo, hi = lo.clamp(first, keys), hi.clamp(first, keys)
    if bool((lo >= hi).all()):
        return EMPTY
    if bool(((lo == first) & (hi == keys)).all()):
        return FULL
    return PARTIAL


@dataclass(frozen=True)
class BlockMap:
    """The tiles of block_rows x block_keys over (Lq, Lk), per batch entry of the bounds:
    `state` (1 or B, query blocks, key blocks) of EMPTY, PARTIAL, FULL."""

    block_rows: int
    block_keys: int
    state: Tensor

    @classmethod
    def build(cls, len_q: int, len_k: int, causal: Optional[int], bounds: Optional[Tensor], block_rows: int,
              block_keys: int) -> BlockMap:
        lo, hi = row_intervals(len_q, len_k, causal, bounds)
        n_q, n_k = -(-len_q // block_rows), -(-len_k // block_keys)
        state = torch.empty(lo.shape[0], n_q, n_k, dtype=torch.int8)
        for b in range(lo.shape[0]):
            for i in range(n_q):
                rows = slice(i * block_rows, min(len_q, (i + 1) * block_rows))
                for j in range(n_k):
                    state[b, i, j] = classify(lo[b, rows], hi[b, rows], j * block_keys, min(len_k, (j + 1) * block_keys))
        return cls(block_rows, block_keys, state)

    def count(self, kind: int) -> int:
        return int((self.state == kind).sum())
