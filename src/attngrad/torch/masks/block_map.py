"""The structure of a call's scores, in one place: which keys each query row may see, and
which blocks of the score matrix are empty, partly or wholly visible.

Two rules decide it, and every structured mask becomes them (`structured`):
    the causal diagonal c   row i sees keys j <= i + c (0 top-left, Lk - Lq bottom-right)
    key bounds              row i of batch entry b sees keys [lo, hi) (padding, windows,
                            documents: (1 or B, Lq, 2) int64)
Together each row sees one interval, [lo_i, min(hi_i, i + c + 1)) (`row_intervals`). A
boolean mask and a float bias may exclude more, entry by entry; `BlockMap` does not read
them, `empty_tiles` does.

`BlockMap` classifies the (query block, key block) tiles of a tiling from the intervals,
in the manner of FlexAttention's block mask: EMPTY (no row sees a key of it: skipped),
FULL (every row sees every key: no structural mask to apply), PARTIAL. The backends read
the rules here: the torch-ops kernels' key range per block (`key_range`) and excluded
entries (`excluded`), the ring's units (`classify`), the counts the tests check.
`key_ranges` gives the compiled tiles each query block's keys [key0, key0 + keys), the
same ranges as `key_range`, per batch entry of the bounds. `empty_tiles` gives the
tiles a forward and backward may skip: those in which no entry takes part by the
intervals and the mask, or whose bias is -inf throughout (the entries of the tiles they
compute are masked one by one there). `tile_map`, the compiled tiles' form of it, also
marks the tiles that the mask and bias leave as they are (kept whole, 0 throughout),
which the passes compute without reading them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .blocks import MaskBlocks, blocks_all_full, blocks_with_no_entry

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


def _blocks(t: Tensor, axis: int, size: int, block: int) -> Tensor:
    """`t` with axis `axis` (of `size`) padded with False to whole blocks of `block`."""
    if size % block == 0:
        return t
    padded = t.new_zeros(*t.shape[:axis], -(-size // block) * block, *t.shape[axis + 1:])
    padded.narrow(axis, 0, size).copy_(t)
    return padded


def _whole_tiles(t: Tensor, block_rows: int, block_keys: int) -> Tensor:
    """(Bt, Ht, query blocks, R, key blocks, K): a 4-D mask or bias cut into tiles (along an
    axis of size 1: blocks of 1), the last block's missing rows and keys copies of its last
    row and key, so that a reduction over (3, 5) reads each tile's own entries alone."""
    rows, keys = t.shape[2], t.shape[3]
    br, bk = (block_rows if rows > 1 else 1), (block_keys if keys > 1 else 1)
    n_q, n_k = -(-rows // br), -(-keys // bk)
    if rows % br:
        t = t.index_select(2, torch.arange(n_q * br).clamp(max=rows - 1))
    if keys % bk:
        t = t.index_select(3, torch.arange(n_k * bk).clamp(max=keys - 1))
    return t.reshape(*t.shape[:2], n_q, br, n_k, bk)


def _bias_tiles(bias: Tensor, block_rows: int, block_keys: int,
                beyond: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(all -inf, all zero): (Ba, Hb, query blocks or 1, key blocks or 1) boolean each, the
    tiles whose bias entries are all -inf, and those where they are all 0 (adding it changes
    no score) but in the columns `beyond` marks (`_columns`). Read cheaply: a tile with
    another value in its first key column is neither (one column in block_keys read), and
    the whole bias is read only where some tile may be (a padding mask written as a bias;
    never for a dense learned bias)."""
    rows_b, keys_b = bias.shape[2], bias.shape[3]
    br, bk = (block_rows if rows_b > 1 else 1), (block_keys if keys_b > 1 else 1)
    first_column = bias[..., ::bk].contiguous()  # (Ba, Hb, rows, nk): one strided read, two compares

    def somewhere(entries: Tensor) -> Tensor:  # (Ba, Hb, nq, nk): some row of the tile
        return _blocks(entries, 2, rows_b, br).view(*bias.shape[:2], -1, br, entries.shape[-1]).any(3)

    candidates = ~somewhere(first_column != float("-inf")) | ~somewhere(first_column != 0)
    if bias.numel() == 0 or not bool(candidates.any()):
        none = torch.zeros_like(candidates)
        return none, none
    tiles = _whole_tiles(bias, block_rows, block_keys)
    top, bottom = tiles.amax(3), tiles.amin(3)  # each column's: (Ba, Hb, nq, nk, K)
    return (top == float("-inf")).all(-1), _columns((top == 0) & (bottom == 0), beyond)


def _columns(columns: Tensor, beyond: Optional[Tensor]) -> Tensor:
    """(..., query blocks, key blocks) boolean: True where `columns` (..., key blocks, K) is
    True in every column of the tile that `beyond` ((1 or B, 1, query blocks, key blocks,
    K): past the keys its query block sees, which the passes do not compute) leaves."""
    if beyond is not None and columns.shape[-1] > 1:  # K = 1: one entry for all keys
        columns = columns | beyond
    return columns.all(-1)


@dataclass(frozen=True)
class ScoreFilter:
    """What decides which of a call's (Lq, Lk) scores take part, as `empty_tiles` and
    `tile_map` read it: the causal diagonal, the key bounds (1 or B, Lq, 2), a boolean mask
    and a float bias (4-D, each axis 1 or the scores' own (B, H, Lq, Lk)) and a mask kept per
    block."""

    len_q: int
    len_k: int
    causal: Optional[int] = None
    bounds: Optional[Tensor] = None
    mask: Optional[Tensor] = None
    bias: Optional[Tensor] = None
    blocks: Optional[MaskBlocks] = None


def empty_tiles(scores: ScoreFilter, block_rows: int, block_keys: int) -> Tensor:
    """Which tiles of block_rows x block_keys the passes skip: (1 or B, 1 or H, query blocks,
    key blocks) boolean, contiguous, True where the tile is excluded. A tile is excluded
    where no entry (i, j) takes part by row i's interval (`row_intervals`: the causal
    diagonal and the key bounds) and the boolean mask together, or where the bias is -inf on
    all of it (the bias is read per tile: a tile whose only finite bias entries lie outside
    its rows' intervals is computed, and gives zeros there). `mask` and `bias` 4-D, each
    size 1 or the scores' own (B, H, Lq, Lk). The batch and head axes stay 1 where none of
    bounds, mask and bias varies along them. A mask kept per block (`blocks`) excludes the
    tiles whose blocks are all EMPTY (`mask_blocks.blocks_with_no_entry`)."""
    excluded, _ = _classified(scores, block_rows, block_keys, None, False)
    return excluded.expand(*excluded.shape[:2], -(-scores.len_q // block_rows),
                           -(-scores.len_k // block_keys)).contiguous()


def unmasked_tiles(scores: ScoreFilter, block_rows: int, block_keys: int) -> Tensor:
    """Which tiles of block_rows x block_keys need no masking: (1 or B, 1 or H, query blocks,
    key blocks) boolean, True where the tile lies wholly inside (Lq, Lk) and every entry of
    it takes part by its rows' intervals, the boolean mask and the mask kept per block. The
    bias is a value, not a mask: it is not read here (a tile the bias makes -inf throughout
    is one `empty_tiles` skips, so callers take the two together)."""
    len_q, len_k = scores.len_q, scores.len_k
    lo, hi = row_intervals(len_q, len_k, scores.causal, scores.bounds)  # (1 or B, Lq)
    n_q, n_k = -(-len_q // block_rows), -(-len_k // block_keys)
    whole = len_q // block_rows  # the query blocks with no row past Lq
    first = torch.arange(n_k) * block_keys
    lo_top = lo[:, :whole * block_rows].reshape(lo.shape[0], whole, block_rows).amax(-1)
    hi_low = hi[:, :whole * block_rows].reshape(hi.shape[0], whole, block_rows).amin(-1)
    inside = (lo_top[..., None] <= first) & (hi_low[..., None] >= first + block_keys) & (first + block_keys <= len_k)
    full = torch.zeros(lo.shape[0], 1, n_q, n_k, dtype=torch.bool)
    full[:, 0, :whole] = inside
    if scores.mask is not None:
        full = full & _whole_tiles(scores.mask, block_rows, block_keys).all(3).all(-1)
    if scores.blocks is not None:
        full = full & blocks_all_full(scores.blocks, len_q, len_k, block_rows, block_keys).cpu()
    return full


# The kinds of tile in a tile map: the mask and bias applied entry by entry, not computed,
# or computed without them
COMPUTED, SKIPPED, UNMASKED = 0, 1, 2


def tile_map(scores: ScoreFilter, block_rows: int, block_keys: int, ranges: Optional[Tensor] = None) -> Tensor:
    """The compiled tiles' map of their forward's and backward's tiles: `empty_tiles`'s shape,
    uint8, contiguous, of SKIPPED where `empty_tiles` excludes the tile, UNMASKED where the
    mask keeps every entry of it and the bias is 0 on all of them, so that the passes neither
    read nor apply them there (a padding mask written as a float mask, 0 and -inf, costs
    what a boolean one does), COMPUTED elsewhere. With the passes' key `ranges`
    (`key_ranges`), a tile's entries past its query block's keys, which they do not compute,
    do not count. The causal diagonal, the key bounds and a mask kept per block apply on
    every tile computed; without a mask or a bias no tile is UNMASKED."""
    excluded, unmasked = _classified(scores, block_rows, block_keys, ranges,
                                     scores.mask is not None or scores.bias is not None)
    kinds = torch.where(excluded, SKIPPED, torch.where(unmasked, UNMASKED, COMPUTED)).to(torch.uint8)
    return kinds.expand(*kinds.shape[:2], -(-scores.len_q // block_rows),
                        -(-scores.len_k // block_keys)).contiguous()


def _classified(scores: ScoreFilter, block_rows: int, block_keys: int, ranges: Optional[Tensor],
                unmasked: bool) -> tuple[Tensor, Tensor]:
    """(excluded, unmasked) per tile, 4-D boolean, each axis 1 or the map's own: what
    `empty_tiles` excludes, and (where asked, else False throughout) the tiles where the mask
    keeps every entry and the bias is 0, but past the ends of `ranges`."""
    len_q, len_k, mask, bias, blocks = scores.len_q, scores.len_k, scores.mask, scores.bias, scores.blocks
    excluded = _excluded_by_structure_and_mask(len_q, len_k, scores.causal, scores.bounds, mask, block_rows,
                                               block_keys)
    kept = torch.full((1, 1, 1, 1), unmasked)
    beyond = None
    if unmasked and ranges is not None:
        ends = ranges[..., 0] + ranges[..., 1]  # (1 or B, query blocks)
        width = (ends[..., None] - torch.arange(-(-len_k // block_keys)) * block_keys).clamp(0, block_keys)
        beyond = (torch.arange(block_keys) >= width[..., None])[:, None]  # (1 or B, 1, nq, nk, K)
    if unmasked and mask is not None:
        kept = kept & _columns(_whole_tiles(mask, block_rows, block_keys).all(3), beyond)
    if bias is not None:
        minus_inf, zero = _bias_tiles(bias, block_rows, block_keys, beyond)
        excluded = excluded | minus_inf
        kept = kept & zero
    if blocks is not None:
        excluded = excluded | blocks_with_no_entry(blocks, len_q, len_k, block_rows, block_keys).cpu()
    return excluded, kept


def _excluded_by_structure_and_mask(len_q: int, len_k: int, causal: Optional[int], bounds: Optional[Tensor],
                                    mask: Optional[Tensor], block_rows: int, block_keys: int) -> Tensor:
    """`empty_tiles` without the bias: exact, entry by entry.

    Vectorised: the intervals classify each tile (no row sees a key of it, every row sees
    all of its keys, or partly); the mask is reduced per whole tile, which decides the first
    two kinds; the partial tiles that hold a key taking part are gathered and their entries
    read within the intervals."""
    n_q, n_k = -(-len_q // block_rows), -(-len_k // block_keys)
    any_allowed = None
    if mask is not None:
        allowed = mask
        rows_a, keys_a = allowed.shape[2], allowed.shape[3]
        # any entry of the tile taking part by the mask and bias alone: (Ba, Ha, n_q or 1, n_k or 1)
        br, bk = (block_rows if rows_a > 1 else 1), (block_keys if keys_a > 1 else 1)
        tiles = _blocks(_blocks(allowed, 2, rows_a, br), 3, keys_a, bk)  # a size-1 axis: broadcast
        tiles = tiles.contiguous().view(*allowed.shape[:2], tiles.shape[2] // br, br, tiles.shape[3] // bk, bk)
        if bk % 8 == 0 and tiles.storage_offset() % 8 == 0:  # eight entries (bytes of 0 or 1) as one int64
            none_allowed = tiles.view(torch.int64).amax((3, 5)) == 0
        else:
            none_allowed = ~tiles.amax((3, 5))
        if causal is None and bounds is None:  # every row sees every key: the mask and bias alone decide
            return none_allowed
        any_allowed = ~none_allowed
    lo, hi = row_intervals(len_q, len_k, causal, bounds)  # (1 or B, Lq) each, lo <= hi
    start = torch.arange(n_k, dtype=torch.int64) * block_keys
    end = (start + block_keys).clamp(max=len_k)
    # each row's keys within each key block: [first, stop), first = stop where none
    first = torch.maximum(lo[..., None], start)  # (1 or B, Lq, n_k)
    stop = torch.maximum(first, torch.minimum(hi[..., None], end))
    sees = _blocks(stop > first, 1, len_q, block_rows).view(-1, n_q, block_rows, n_k)
    some = sees.any(2)  # (1 or B, n_q, n_k): some row sees a key of the tile
    if any_allowed is None:
        return (~some)[:, None]
    # every row sees every key of the tile (rows past Lq count as doing so)
    short = _blocks(stop - first != end - start, 1, len_q, block_rows)
    whole = ~short.view(-1, n_q, block_rows, n_k).any(2)
    seen = some[:, None] & any_allowed  # exact on the tiles every row sees whole, and the empty ones
    partial = some[:, None] & ~whole[:, None] & any_allowed
    if bool(partial.any()):
        b, h, qb, kb = partial.nonzero(as_tuple=True)  # h: 0 or the mask's head (any_allowed's)
        rows = qb[:, None] * block_rows + torch.arange(block_rows)  # (P, br)
        keys = kb[:, None] * block_keys + torch.arange(block_keys)  # (P, bk)
        b_bounds = b if first.shape[0] > 1 else torch.zeros_like(b)
        row_at = rows.clamp(max=len_q - 1)
        f = first[b_bounds[:, None], row_at, kb[:, None]]
        s = torch.where(rows < len_q, stop[b_bounds[:, None], row_at, kb[:, None]], f)
        inside = (keys[:, None, :] >= f[..., None]) & (keys[:, None, :] < s[..., None])  # (P, br, bk)
        b_a = b if allowed.shape[0] > 1 else torch.zeros_like(b)
        part = tiles.permute(0, 1, 2, 4, 3, 5)[b_a, h, qb if rows_a > 1 else 0 * qb, kb if keys_a > 1 else 0 * kb]
        seen[b, h, qb, kb] = (part & inside).flatten(1).any(1)
    return ~seen


def kept_keys(mask: Optional[Tensor], bias: Optional[Tensor], len_q: int, block_rows: int) -> Optional[Tensor]:
    """Where a mask or bias leaves keys to each query block of `block_rows` rows: (1 or B,
    query blocks or 1, 2) int64, [first, stop) spanning every key some row of the block and
    some head keeps (first = stop = 0 where none): a key padding mask's kept keys, or a float
    mask's (0 and -inf, per row). None where every block keeps its first and last key (a
    learned bias, a mask that narrows nothing): read from those two columns alone."""
    given = [(t, keep) for t, keep in ((mask, lambda m: m), (bias, lambda b: b != float("-inf"))) if t is not None]
    if not given or any(t.shape[3] == 1 for t, _ in given):  # one entry for all keys (a sink's bias)
        return None
    len_k = given[0][0].shape[3]
    if len_k == 0 or len_q == 0:
        return None
    br = 1 if all(t.shape[2] == 1 for t, _ in given) else block_rows  # rows all alike: blocks alike

    def per_block(columns: list[Tensor]) -> Tensor:  # (1 or B, nq or 1, C): some row of the block, some head
        kept = None
        for t, keep in columns:
            if t.shape[2] == 1:
                top = t.amax(1)
            else:  # the last block's missing rows: copies of its last row
                n_q = -(-len_q // br)
                if len_q % br:
                    t = t.index_select(2, torch.arange(n_q * br).clamp(max=len_q - 1))
                top = t.reshape(*t.shape[:2], n_q, br, t.shape[3]).amax((1, 3))
            kept = keep(top) if kept is None else kept & keep(top)
        return kept

    # the max of a bias (NaN aside) is -inf where all of it is; a mask's, False where all is
    ends = per_block([(t[..., [0, len_k - 1]], keep) for t, keep in given])  # (1 or B, nq or 1, 2)
    if bool(ends.all()):
        return None
    kept = per_block(given)  # (1 or B, nq or 1, Lk)
    positions = torch.arange(len_k, dtype=torch.int64)
    stop = torch.where(kept, positions + 1, 0).amax(-1, keepdim=True)
    first = torch.minimum(torch.where(kept, positions, len_k).amin(-1, keepdim=True), stop)
    return torch.cat([first, stop], -1)


def key_ranges(len_q: int, len_k: int, causal: Optional[int], bounds: Optional[Tensor], block_rows: int,
               kept: Optional[Tensor] = None) -> Tensor:
    """The keys each query block of `block_rows` rows may see, as the compiled tiles read
    them: (1 or B, query blocks, 2) int64, contiguous, [key0, key0 + keys) per block: the
    causal prefix of its last row (`causal_keys`), narrowed by the key bounds to between the
    smallest lower and the largest upper bound of its rows, and to the keys a mask or bias
    keeps to its rows (`kept_keys`, per block or one for all); key0 = the end where they see
    none (keys 0). `key_range` for each block of each batch entry of the bounds, at once."""
    n_q = -(-len_q // block_rows)
    stops = (torch.arange(1, n_q + 1, dtype=torch.int64) * block_rows).clamp(max=len_q)  # each block's r0 + rows
    end = torch.full((1, n_q), len_k, dtype=torch.int64)
    if causal is not None:
        end = (stops + causal).clamp(0, len_k)[None]
    first = torch.zeros_like(end)
    if bounds is not None:
        lo, hi = bounds[..., 0].clamp(0, len_k), bounds[..., 1].clamp(0, len_k)  # (1 or B, Lq)
        pad = n_q * block_rows - len_q  # rows past Lq: no lower bound below, no upper above, any real row's
        lo = torch.nn.functional.pad(lo, (0, pad), value=len_k).view(-1, n_q, block_rows).amin(2)
        hi = torch.nn.functional.pad(hi, (0, pad), value=0).view(-1, n_q, block_rows).amax(2)
        end = torch.minimum(end, hi)
        first = torch.minimum(lo, end)
    if kept is not None:
        end = torch.minimum(end, kept[..., 1])
        first = torch.minimum(torch.maximum(first, kept[..., 0]), end)
    return torch.stack([first, end - first], -1).contiguous()
