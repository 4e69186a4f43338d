"""A boolean mask kept per block: what a mask with holes inside its rows, or heads that
differ, becomes, so that no Lq x Lk tensor is ever held for it (`masks.functions`).

FlexAttention's block mask lists which blocks of the score matrix are empty, full or
partial and calls mask_mod inside the partial ones; here the partial blocks' entries are
evaluated once and kept:

    index  (1 or B, 1 or H, ceil(Lq / R), ceil(Lk / K)) int32: block (i, j) of head (b, h)
           is tiles[index[b, h, i, j]]
    tiles  (T, R, K) bool, T >= 2: tiles[0] keeps no entry (EMPTY), tiles[1] every entry
           (FULL), tiles[2:] the partial blocks' own entries, each distinct pattern once

Entry (i, j) takes part when tiles[index[b, h, i // R, j // K], i % R, j % K]: the rule
every backend reads (the compiled tiles, the Triton kernels, the torch-ops kernels through
`entries`). A block past the edge of the scores keeps its rows past Lq and keys past Lk
False; nothing reads them. The memory is 4 bytes per block plus R K bytes per distinct
partial pattern: a block-sparse mask of whole blocks holds no partial tile at all, a
dilated one a handful, a random one at most what the dense mask would. Making it holds no
more on top than the rows read at a time and `BLOCKING().tiles_at_once` partial tiles (`from_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..tuning import Tuning

EMPTY, FULL = 0, 1  # the tiles every MaskBlocks holds first
BLOCK = (128, 128)  # (R, K) where the mask does not say: FlexAttention's default


@dataclass(frozen=True)
class Blocking:
    """`tiles_at_once`: partial tiles copied out and de-duplicated at a time (1 MiB of 128 x 128)."""

    tiles_at_once: int = 64


BLOCKING: Tuning[Blocking] = Tuning("attngrad_mask_blocking", Blocking())


@dataclass(frozen=True)
class MaskBlocks:
    """A boolean mask as per-block tile indices and the tiles (see the module's docstring)."""

    index: Tensor  # (1 or B, 1 or H, query blocks, key blocks) int32
    tiles: Tensor  # (T, R, K) bool

    @property
    def block(self) -> tuple[int, int]:
        """(R, K): the rows and keys of a block."""
        return int(self.tiles.shape[1]), int(self.tiles.shape[2])

    def entries(self, start: int, stop: int, first: int, keys: int) -> Tensor:
        """(1 or B, 1 or H, stop - start, keys - first) bool: rows start:stop, keys first:keys."""
        r, k = self.block
        rows = torch.arange(start, stop, device=self.index.device)
        cols = torch.arange(first, keys, device=self.index.device)
        which = self.index[:, :, rows // r][..., cols // k].long()  # (b, h, R', K')
        return self.tiles[which, (rows % r)[:, None], (cols % k)[None, :]]

    def dense(self, len_q: int, len_k: int) -> Tensor:
        """The mask written out, (1 or B, 1 or H, Lq, Lk): for tests and inspection."""
        return self.entries(0, len_q, 0, len_k)

    def nbytes(self) -> int:
        return self.index.numel() * self.index.element_size() + self.tiles.numel()

    def to(self, device: torch.device | str) -> MaskBlocks:
        return MaskBlocks(self.index.to(device), self.tiles.to(device))


def _numbered(tiles: Tensor, kept: list[Tensor], places: dict[bytes, int]) -> Tensor:
    """The place (P,) int64 of each of `tiles` (P, R, K) among the distinct partial tiles met
    so far, numbered in the order of their first appearance. `places` maps each distinct
    tile's entries, packed 8 to a byte, to its place (exact, and an eighth of the tiles'
    bytes); `kept` gains a copy (n, R, K) of the n new ones."""
    packed = np.packbits(tiles.reshape(len(tiles), -1).cpu().numpy(), axis=1)  # (P, R K / 8)
    place, new = [], []
    for i, bits in enumerate(packed):
        key = bits.tobytes()
        if key not in places:
            places[key] = len(places)
            new.append(i)
        place.append(places[key])
    if new:
        kept.append(tiles[new])
    return torch.tensor(place, dtype=torch.int64, device=tiles.device)


def from_rows(rows_of: Callable[[int, int], Tensor], shape: tuple, len_q: int, len_k: int, rows_per_chunk: int,
              block: tuple[int, int] = BLOCK, device: torch.device | str = "cpu") -> MaskBlocks:
    """The mask whose rows start:stop `rows_of(start, stop)` gives ((b, h, stop - start, Lk)
    bool, b and h of `shape`), read a whole number of block rows at a time (about
    `rows_per_chunk` rows), each block classified EMPTY, FULL or partial. The partial blocks'
    tiles are copied out and matched against the distinct ones so far `BLOCKING().tiles_at_once` at a
    time, so that, beyond the rows read and the distinct tiles, no step holds more."""
    r, k = block
    n_q, n_k = -(-len_q // r), -(-len_k // k)
    index = torch.empty(shape[0], shape[1], n_q, n_k, dtype=torch.int32, device=device)
    kept: list[Tensor] = []  # the distinct partial tiles in the order of their first appearance, a few at a time
    places: dict[bytes, int] = {}
    step = max(1, rows_per_chunk // r) * r
    for start in range(0, len_q, step):
        stop = min(len_q, start + step)
        rows = rows_of(start, stop).expand(shape[0], shape[1], stop - start, len_k)
        blocks_q = -(-(stop - start) // r)
        padded = rows.new_zeros(shape[0], shape[1], blocks_q * r, n_k * k)
        padded[..., : stop - start, :len_k] = rows
        tiles = padded.view(shape[0], shape[1], blocks_q, r, n_k, k).transpose(3, 4)  # (b, h, nq, nk, R, K)
        taken = tiles.sum((-1, -2), dtype=torch.int32)
        rows_in = (torch.arange(blocks_q, device=device) * r + r).clamp(max=stop - start) - \
            torch.arange(blocks_q, device=device) * r
        keys_in = (torch.arange(n_k, device=device) * k + k).clamp(max=len_k) - torch.arange(n_k, device=device) * k
        whole = taken == (rows_in[:, None] * keys_in[None, :]).to(torch.int32)
        part = (taken > 0) & ~whole
        chunk = torch.where(whole, FULL, EMPTY).to(torch.int32)
        partial = part.nonzero(as_tuple=True)  # in order: entry, head, block row, block column
        at_once = BLOCKING().tiles_at_once
        for first in range(0, len(partial[0]), at_once):
            some = tuple(p[first: first + at_once] for p in partial)
            chunk[some] = (_numbered(tiles[some], kept, places) + 2).to(torch.int32)  # after EMPTY and FULL
        index[:, :, start // r: start // r + blocks_q] = chunk
    fixed = torch.zeros(2, r, k, dtype=torch.bool, device=device)
    fixed[FULL] = True
    return MaskBlocks(index.contiguous(), torch.cat([fixed, *kept]))


def from_dense(mask: Tensor, block: tuple[int, int] = BLOCK) -> MaskBlocks:
    """A (b, h, Lq, Lk) boolean mask kept per block (tests; a mask already written out)."""
    b, h, len_q, len_k = mask.shape
    return from_rows(lambda start, stop: mask[:, :, start:stop], (b, h), len_q, len_k, len_q, block, mask.device)


def blocks_with_no_entry(blocks: MaskBlocks, len_q: int, len_k: int, block_rows: int, block_keys: int) -> Tensor:
    """(1 or B, 1 or H, query blocks, key blocks) bool for tiles of block_rows x block_keys:
    True where every block of the mask the tile overlaps is EMPTY (so no entry of it takes
    part). Exact on the blocks' classes."""
    return _every_block_is(EMPTY, blocks, len_q, len_k, block_rows, block_keys)


def blocks_all_full(blocks: MaskBlocks, len_q: int, len_k: int, block_rows: int, block_keys: int) -> Tensor:
    """`blocks_with_no_entry`'s twin: True where every block the tile overlaps is FULL (so
    every entry of it takes part, and the mask need not be read there)."""
    return _every_block_is(FULL, blocks, len_q, len_k, block_rows, block_keys)


def _every_block_is(kind: int, blocks: MaskBlocks, len_q: int, len_k: int, block_rows: int,
                    block_keys: int) -> Tensor:
    """Per tile of block_rows x block_keys, whether every block of the mask it overlaps has
    class `kind`: the others counted over each tile's rectangle of blocks by a summed-area
    table, O(blocks) whatever the tiles' sizes."""
    r, k = blocks.block
    other = (blocks.index != kind).to(torch.int32)
    table = torch.nn.functional.pad(other.cumsum(2).cumsum(3), (1, 0, 1, 0))  # (b, h, nq + 1, nk + 1)
    n_q, n_k = -(-len_q // block_rows), -(-len_k // block_keys)
    q0 = torch.arange(n_q) * block_rows
    k0 = torch.arange(n_k) * block_keys
    q_lo, q_hi = q0 // r, (torch.minimum(q0 + block_rows, torch.tensor(len_q)) - 1) // r + 1
    k_lo, k_hi = k0 // k, (torch.minimum(k0 + block_keys, torch.tensor(len_k)) - 1) // k + 1
    total = table[:, :, q_hi][..., k_hi] - table[:, :, q_lo][..., k_hi] - table[:, :, q_hi][..., k_lo] + \
        table[:, :, q_lo][..., k_lo]
    return total == 0
