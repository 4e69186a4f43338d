"""Masks given as functions: FlexAttention's `mask_mod(b, h, q_idx, kv_idx) -> bool` (the
signature transformers' mask functions share) and FlexAttention's `BlockMask`, evaluated
into what the kernels take.

A mask function is evaluated a few rows at a time (at most `EVALUATION().entries` entries at once, so
nothing Lq x Lk is ever held), and each row is reduced to its kept keys' first, stop and
count. Where every row's keys form one interval [lo, hi) and the heads agree, the mask
becomes per-row key bounds, the form the structured masks take (`structured`,
`block_map`): O(L) memory and exact tile skipping. Causal masks, sliding windows, chunks,
documents, prefix-LM, padding and Gemma 3's bidirectional image blocks all do. Any other
mask (holes inside a row, heads that differ) is read again by a second pass into a mask
kept per block (`mask_blocks`): each R x K block empty, full or its own pattern, so that
only the partial blocks' entries are held (once per distinct pattern), never Lq x Lk.

    evaluated = create_block_mask(mask_mod, B=None, H=None, Q_LEN=L, KV_LEN=L)
    attention(q, k, v, block_mask=evaluated)    # or block_mask=FlexAttention's BlockMask,
                                                # or mask_mod=mask_mod, evaluated on the first
                                                # call and again when what it reads changes
                                                # (`mask_memo`)

Choosing among those forms reads the mask's values; under torch.compile, which cannot branch
on values, a mask function shared by the heads always becomes key bounds (checked to be
intervals when the graph runs), one whose heads differ is written out whole (the number of
partial blocks would be a shape that depends on values), and the compiled graph has no break.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from .. import regime
from ..tuning import Tuning
from . import blocks as mask_blocks
from .blocks import MaskBlocks
from .memo import remembered


@dataclass(frozen=True)
class Evaluation:
    """How a mask function is evaluated: `entries` of one chunk of rows, 4M booleans (and
    their int32 key indices)."""

    entries: int = 1 << 22


EVALUATION: Tuning[Evaluation] = Tuning("attngrad_mask_evaluation", Evaluation())

RowsOf = Callable[[int, int], Tensor]  # (start, stop) -> kept keys of rows start:stop


@dataclass(frozen=True)
class EvaluatedMask:
    """A mask function's result for one (B, H, Lq, Lk) (B, H = 1 where it is shared): a
    causal diagonal where that is all it is (no mask at all where every key is seen), else
    per-row key bounds where every row is one interval, else the mask kept per block (or,
    under torch.compile with heads that differ, written out)."""

    shape: tuple
    bounds: Optional[Tensor] = None  # (1 or B, Lq, 2) int64: row i sees keys [lo, hi)
    mask: Optional[Tensor] = None  # (1 or B, 1 or H, Lq, Lk) boolean, True = take part
    causal: Optional[int] = None  # key j seen by query i when j <= i + causal
    blocks: Optional[MaskBlocks] = None  # (1 or B, 1 or H, Lq / R, Lk / K) blocks of (R, K) tiles

    def __post_init__(self) -> None:
        if sum(part is not None for part in (self.bounds, self.mask, self.blocks)) > 1:
            raise ValueError("an EvaluatedMask holds one of bounds, a mask and blocks")

    def dense(self) -> Tensor:
        """The mask written out, (1 or B, 1 or H, Lq, Lk) boolean: for tests and inspection."""
        if self.mask is not None:
            return self.mask
        _, _, len_q, len_k = self.shape
        if self.blocks is not None:
            return self.blocks.dense(len_q, len_k)
        device = self.bounds.device if self.bounds is not None else "cpu"
        keys = torch.arange(len_k, device=device)
        if self.bounds is not None:
            return ((keys >= self.bounds[..., :1]) & (keys < self.bounds[..., 1:]))[:, None]
        kept = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
        if self.causal is not None:
            kept = keys[None, :] <= torch.arange(len_q, device=device)[:, None] + self.causal
        return kept[None, None]


def _as_diagonal(bounds: Tensor, len_k: int) -> Optional[int]:
    """c where bounds (1, Lq, 2) are exactly the causal diagonal's [0, min(Lk, i + c + 1)),
    Lk where they are every key for every row, else None."""
    lo, hi = bounds[0, :, 0], bounds[0, :, 1]
    if bool(lo.any()):
        return None
    rows = torch.arange(len(hi), device=hi.device)
    candidates = {len_k}
    if int(hi[0]) < len_k:
        candidates.add(int(hi[0]) - 1)
    if int(hi[-1]) < len_k:
        candidates.add(int(hi[-1]) - len(hi))
    for c in sorted(candidates):
        if torch.equal(hi, (rows + c + 1).clamp(0, len_k)):
            return c
    return None


def _bhqkv(mask_mod: Callable) -> Callable:
    """mask_mod on index vectors b (B,), h (H,), q (R,), kv (Lk,) -> (B, H, R, Lk), by
    vmap over each argument: FlexAttention's convention for its mask functions."""
    fn = mask_mod
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=dims, out_dims=0)
    return fn


def _indexable():
    """FlexAttention's context in which `tensor[q_idx]` with a 0-d index works under vmap."""
    return regime.indexable_under_vmap()


def _narrow_broadcast(kept: Tensor) -> Tensor:
    """Axes 0 and 1 of stride 0 (a result the batch or head index did not change) at size 1."""
    for axis in (0, 1):
        if kept.shape[axis] > 1 and kept.stride(axis) == 0:
            kept = kept.narrow(axis, 0, 1)
    return kept


def _checked(kept: Any, start: int, stop: int, batch: int, heads: int, len_k: int, device: torch.device) -> Tensor:
    kept = torch.as_tensor(kept, device=device)
    if kept.dtype != torch.bool:
        raise TypeError(f"a mask function must return booleans (True = take part); got {kept.dtype}")
    kept = kept[(None,) * max(0, 4 - kept.dim())]
    rows = stop - start
    ok = kept.dim() == 4 and kept.shape[0] in (1, batch) and kept.shape[1] in (1, heads) and \
        kept.shape[2] in (1, rows) and kept.shape[3] in (1, len_k)
    if not ok:
        raise ValueError(f"a mask function's result for rows {start}:{stop} has shape {tuple(kept.shape)}; "
                         f"expected one broadcastable to ({batch}, {heads}, {rows}, {len_k})")
    return _narrow_broadcast(kept.expand(kept.shape[0], kept.shape[1], rows, len_k))


def _row_extents(rows_of: RowsOf, batch: int, heads: int, len_q: int, len_k: int,
                 device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's kept keys as (lo, hi), each (1 or batch, 1 or heads, len_q) int32 ([0, 0)
    for a row that sees none), and whether every row's keys are the interval [lo, hi)
    (a 0-d boolean tensor, read only by the caller: nothing here depends on the values)."""
    keys = torch.arange(len_k, dtype=torch.int32, device=device)
    los, his, holes = [], [], []
    start, width = 0, batch * heads
    while start < len_q:
        stop = min(len_q, start + max(1, EVALUATION().entries // max(1, width * len_k)))
        kept = _checked(rows_of(start, stop), start, stop, batch, heads, len_k, device)
        width = kept.shape[0] * kept.shape[1]  # a result shared by the entries or heads: more rows at once
        start = stop
        count = kept.sum(-1, dtype=torch.int32)
        lo = torch.where(kept, keys, len_k).amin(-1)
        hi = torch.where(kept, keys + 1, 0).amax(-1)
        none = count == 0
        holes.append(((count != hi - lo) & ~none).any())
        los.append(lo.masked_fill(none, 0))
        his.append(hi.masked_fill(none, 0))
    lo, hi = torch.cat([_rows(t, los) for t in los], -1), torch.cat([_rows(t, his) for t in his], -1)
    return lo, hi, ~torch.stack(holes).any()


def _per_block(rows_of: RowsOf, shape: tuple, batch: int, heads: int, device: torch.device | str,
               block: tuple[int, int]) -> EvaluatedMask:
    """The mask kept per block of `block` (R, K) (`mask_blocks`), a chunk of rows at a time."""
    len_q, len_k = shape[2:]
    step = max(1, EVALUATION().entries // max(1, shape[0] * shape[1] * len_k))

    def checked(start: int, stop: int) -> Tensor:
        return _checked(rows_of(start, stop), start, stop, batch, heads, len_k, device)

    return EvaluatedMask(shape, blocks=mask_blocks.from_rows(checked, shape[:2], len_q, len_k, step, block, device))


def _written_out(rows_of: RowsOf, shape: tuple, batch: int, heads: int, device: torch.device | str) -> EvaluatedMask:
    """The mask entry by entry, (1 or batch, 1 or heads, Lq, Lk) boolean, a chunk of rows at a time."""
    len_q, len_k = shape[2:]
    mask = torch.empty(shape, dtype=torch.bool, device=device)
    step = max(1, EVALUATION().entries // max(1, shape[0] * shape[1] * len_k))
    for start in range(0, len_q, step):
        stop = min(len_q, start + step)
        mask[:, :, start:stop] = _checked(rows_of(start, stop), start, stop, batch, heads, len_k, device)
    return EvaluatedMask(shape, mask=mask)


def evaluate_rows(rows_of: RowsOf, batch: int, heads: int, len_q: int, len_k: int,
                  device: torch.device | str = "cpu", fixed_form: bool = False,
                  block: Optional[tuple[int, int]] = None) -> EvaluatedMask:
    """The mask whose rows start:stop `rows_of(start, stop)` gives (boolean, broadcastable
    to (batch, heads, stop - start, len_k)), evaluated a chunk of rows at a time.
    fixed_form: the form follows the shapes alone, as under torch.compile (for a mask
    made outside a compiled function and passed in, so that every call meets one graph).
    block: (R, K) of a mask kept per block (default `mask_blocks.BLOCK`)."""
    if len_q == 0 or len_k == 0:  # no entry to evaluate: nothing to mask
        return EvaluatedMask((1, 1, len_q, len_k))
    lo, hi, intervals = _row_extents(rows_of, batch, heads, len_q, len_k, device)
    shape = (lo.shape[0], lo.shape[1], len_q, len_k)
    if fixed_form or torch.compiler.is_compiling() or torch.device(device).type == "meta":  # no values to choose by
        return _fixed_form(rows_of, lo, hi, intervals, shape, batch, heads, device)
    same_heads = lo.shape[1] == 1 or bool(((lo == lo[:, :1]) & (hi == hi[:, :1])).all())
    if not (bool(intervals) and same_heads):
        return _per_block(rows_of, shape, batch, heads, device, block or mask_blocks.BLOCK)
    bounds = torch.stack([lo[:, 0], hi[:, 0]], -1).to(torch.int64)
    if bounds.shape[0] > 1 and bool((bounds == bounds[:1]).all()):  # every batch entry alike
        bounds = bounds[:1]
    diagonal = _as_diagonal(bounds, len_k) if bounds.shape[0] == 1 else None
    if diagonal == len_k:  # every key for every row: no mask
        return EvaluatedMask((1, 1, len_q, len_k))
    if diagonal is not None:  # the causal diagonal alone: the kernels' own causal path
        return EvaluatedMask((1, 1, len_q, len_k), causal=diagonal)
    return EvaluatedMask((bounds.shape[0], 1, len_q, len_k), bounds=bounds)


def _fixed_form(rows_of: RowsOf, lo: Tensor, hi: Tensor, intervals: Tensor, shape: tuple, batch: int, heads: int,
            device: torch.device | str) -> EvaluatedMask:
    """The form of the mask from its shapes alone, as torch.compile needs (a choice made on
    the mask's values is a graph break): key bounds where the heads share the mask, checked when
    the graph runs to be intervals, else the mask written out. Inductor fuses the
    evaluation into the row reductions, so the bounds cost no Lq x Lk buffer either."""
    if shape[1] > 1:
        return _written_out(rows_of, shape, batch, heads, device)
    torch._assert_async(intervals, "attngrad under torch.compile: a row of this mask function sees keys with a gap "
                        "between them, which compiled calls cannot take as key bounds; evaluate it outside the "
                        "compiled region (attngrad.torch.create_block_mask) and pass block_mask=")
    bounds = torch.stack([lo[:, 0], hi[:, 0]], -1).to(torch.int64)
    return EvaluatedMask((shape[0], 1) + shape[2:], bounds=bounds)


def _rows(t: Tensor, chunks: list) -> Tensor:
    """A chunk's (b, h, R) row values broadcast to the widest (b, h) among the chunks."""
    b = max(c.shape[0] for c in chunks)
    h = max(c.shape[1] for c in chunks)
    return t.expand(b, h, t.shape[2])


def create_block_mask(mask_mod: Callable, B: Optional[int], H: Optional[int], Q_LEN: int, KV_LEN: int,
                      device: torch.device | str = "cpu",
                      BLOCK_SIZE: Optional[int | tuple[int, int]] = None) -> EvaluatedMask:
    """FlexAttention's `create_block_mask` for attngrad: `mask_mod` evaluated once for
    batch entries 0..B - 1 and heads 0..H - 1 (None: shared, evaluated at index 0), to
    pass as `attention(block_mask=...)` on every call of that shape. BLOCK_SIZE: the rows
    and keys of a block where the mask is kept per block (default 128 x 128)."""
    if isinstance(BLOCK_SIZE, int):
        BLOCK_SIZE = (BLOCK_SIZE, BLOCK_SIZE)
    if BLOCK_SIZE is not None and not (len(BLOCK_SIZE) == 2 and all(isinstance(n, int) and n >= 1 for n in BLOCK_SIZE)):
        raise ValueError(f"BLOCK_SIZE must be a positive int or a pair of them; got {BLOCK_SIZE!r}")
    sizes = dict(B=B, H=H, Q_LEN=Q_LEN, KV_LEN=KV_LEN)
    for name, n in sizes.items():
        if not (n is None and name in ("B", "H")) and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"{name} must be an int >= 0{' or None' if name in ('B', 'H') else ''}; got {n!r}")
    batch, heads = B or 1, H or 1
    fn = _bhqkv(mask_mod)
    b_index = torch.arange(batch, device=device)
    h_index = torch.arange(heads, device=device)
    k_index = torch.arange(KV_LEN, device=device)

    def rows_of(start: int, stop: int) -> Tensor:
        with _indexable():
            return fn(b_index, h_index, torch.arange(start, stop, device=device), k_index)

    return evaluate_rows(rows_of, batch, heads, Q_LEN, KV_LEN, device, block=BLOCK_SIZE)


def _dense_blocks(num_blocks: Optional[Tensor], indices: Optional[Tensor], n_k: int) -> Optional[Tensor]:
    """(B, H, query blocks, key blocks) boolean from a BlockMask's (count, indices) pair."""
    if num_blocks is None:
        return None
    listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]
    dense = torch.zeros(*indices.shape[:-1], n_k + 1, dtype=torch.bool, device=indices.device)
    dense.scatter_(-1, torch.where(listed, indices.long(), n_k), True)
    return dense[..., :n_k]


def _flex_block_mask(block_mask: Any, batch: int, heads: int, len_q: int, len_k: int,
                     device: torch.device) -> EvaluatedMask:
    """FlexAttention's BlockMask: an entry takes part when its block is full, or partial and
    mask_mod keeps it (FlexAttention's rule); mask_mod sees the call's batch and head indices."""
    if tuple(block_mask.seq_lengths) != (len_q, len_k):
        raise ValueError(f"block_mask was made for (Q_LEN, KV_LEN) = {tuple(block_mask.seq_lengths)}, but the call "
                         f"has ({len_q}, {len_k})")
    mask_batch, mask_heads = block_mask.kv_num_blocks.shape[:2]
    if mask_batch not in (1, batch) or mask_heads not in (1, heads):
        raise ValueError(f"block_mask of shape {tuple(block_mask.shape)} does not fit a call of batch {batch} and "
                         f"{heads} heads")
    block_q, block_k = block_mask.BLOCK_SIZE
    n_k = -(-len_k // block_k)
    partial = _dense_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, n_k).to(device)
    full = _dense_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n_k)
    key_blocks = torch.arange(len_k, device=device) // block_k
    fn = _bhqkv(block_mask.mask_mod)
    b_index, h_index = torch.arange(batch, device=device), torch.arange(heads, device=device)
    k_index = torch.arange(len_k, device=device)

    def rows_of(start: int, stop: int) -> Tensor:
        query_blocks = torch.arange(start, stop, device=device) // block_q
        in_partial = partial[:, :, query_blocks][..., key_blocks]
        with _indexable():
            kept = in_partial & fn(b_index, h_index, torch.arange(start, stop, device=device), k_index)
        if full is not None:
            kept = kept | full.to(device)[:, :, query_blocks][..., key_blocks]
        return kept

    return evaluate_rows(rows_of, batch, heads, len_q, len_k, device, block=(block_q, block_k))


# FlexAttention BlockMasks evaluated before, per mask and call shape: a block mask is made
# once and reused for many calls, as FlexAttention's users do.
_EVALUATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _is_flex_block_mask(block_mask: Any) -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # a PyTorch without FlexAttention
        return False
    return isinstance(block_mask, BlockMask)


def evaluated_mask(mask_mod: Optional[Callable], block_mask: Any, batch: int, heads: int, len_q: int, len_k: int,
                   device: torch.device) -> EvaluatedMask:
    """`attention`'s mask_mod or block_mask (an EvaluatedMask or FlexAttention's BlockMask)
    for a call of (batch, heads, len_q, len_k)."""
    if mask_mod is not None and block_mask is not None:
        raise ValueError("pass mask_mod or block_mask, not both (a block mask holds its mask_mod)")
    if mask_mod is not None:
        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be a function (b, h, q_idx, kv_idx) -> bool; got {type(mask_mod).__name__}")
        # kept for the next call while what mask_mod reads stays the same; not a mask written
        # out whole (under compile), which may be large
        return remembered(mask_mod, (batch, heads, len_q, len_k, str(device)),
                          lambda: create_block_mask(mask_mod, batch, heads, len_q, len_k, device),
                          worth_keeping=lambda evaluated: evaluated.mask is None)
    if isinstance(block_mask, EvaluatedMask):
        b, h, q, k = block_mask.shape
        if (q, k) != (len_q, len_k) or b not in (1, batch) or h not in (1, heads):
            raise ValueError(f"block_mask was made for (B, H, Q_LEN, KV_LEN) = {block_mask.shape}, which does not "
                             f"fit a call of ({batch}, {heads}, {len_q}, {len_k})")
        return block_mask
    if not _is_flex_block_mask(block_mask):
        raise TypeError(f"block_mask must come from attngrad.torch.create_block_mask or FlexAttention's "
                        f"create_block_mask; got {type(block_mask).__name__}")
    key = (batch, heads, len_q, len_k, str(device))
    if torch.compiler.is_compiling():
        return _flex_block_mask(block_mask, batch, heads, len_q, len_k, device)
    seen = _EVALUATED.setdefault(block_mask, {})
    if key not in seen:
        seen[key] = _flex_block_mask(block_mask, batch, heads, len_q, len_k, device)
    return seen[key]

