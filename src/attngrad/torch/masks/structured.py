"""Structured masks as per-row key bounds: padding lengths, sliding windows, packed documents.

Each of these leaves every query row one interval of keys, [lo, hi), so the ops take them
as a (1 or B, Lq, 2) int64 tensor of bounds instead of an Lq x Lk mask: O(L) memory, and the
kernels skip every tile that lies outside all of its rows' intervals (a window of w costs
O(L w), not O(L^2)).

    key_padding  (..., Lk) boolean, True = padding (PyTorch's modules), or (...,) lengths:
                 row i of batch entry b sees keys [first kept, last kept + 1) of its entry.
                 A boolean pattern with holes inside a row is no interval: it becomes a
                 (B, 1, 1, Lk) boolean mask instead (`Structure.keep`), still no Lq x Lk.
    window       (left, right): row i sees keys i + c - left .. i + c + right, c the causal
                 alignment (0 top-left, Lk - Lq bottom-right; top-left without is_causal);
                 None on a side leaves it open.
    document_ids (..., L) integers, each document's tokens contiguous, or cu_seqlens
                 (D + 1,) cumulative lengths from 0 to L (flash-attn's varlen convention,
                 shared by every batch entry): row i sees the keys of its own document.
With the causal diagonal beside any of these, its bound joins them, so that the bounds say
how wide each row's band really is. Bounds intersect: lo is the largest, hi the smallest.

The checks on values (lengths in range, documents contiguous, cu_seqlens rising) and the
choice between bounds and a mask for boolean padding read the tensors' values; inside a
torch.compile graph, where that would break the graph, the checks are left out (bounds
are clamped to 0..Lk whatever they are) and boolean padding always becomes the mask.
Under torch.func transforms they read them inside ops of rows (`attngrad::padding_bounds`,
`document_bounds`, `cu_seqlens_bounds`), whose batching rule folds vmap's axis into the
batch: a vmap over a batch of masks checks every slice and makes their bounds at once, and
boolean padding becomes the mask for all slices if any slice's padding has holes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Optional, TypedDict

import torch
from torch import Tensor
from typing_extensions import Unpack

from .. import regime
from ..layout import broadcast_shapes, rows_rule
from . import version_cache


class Structure(NamedTuple):
    """What the structured masks of one call become for the op."""

    bounds: Optional[Tensor]  # (1 or B, Lq, 2) int64
    keep: Optional[Tensor]  # (1 or B, 1, 1, Lk) boolean, for padding that is no interval


def _fold_batch(t: Tensor, batch: tuple, tail: tuple, name: str) -> Tensor:
    """`t`, broadcastable to (*batch, *tail), as (1 or prod(batch), *tail)."""
    full = (*batch, *tail)
    try:
        ok = t.dim() <= len(full) and t.shape[t.dim() - len(tail):] == torch.Size(tail) and \
            broadcast_shapes(t.shape, full) == torch.Size(full)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {tuple(t.shape)} does not fit the batch: expected a shape "
                         f"broadcastable to {full}")
    if all(size == 1 for size in t.shape[:t.dim() - len(tail)]):
        return t.reshape(1, *tail)
    return t.expand(full).reshape(math.prod(batch), *tail)


def _transformed() -> bool:
    """Whether a torch.func transform is active (outside torch.compile): a tensor's values
    are then read inside an op (`_define_rows_op`), whose batching rule under vmap reads
    every slice's at once."""
    return regime.transforms_active() and not torch.compiler.is_compiling()


def _eager(t: Tensor) -> bool:
    """Whether `t`'s values may be read: not while torch.compile traces a graph, nor on the
    meta device (shapes alone: the checks of values are the real call's)."""
    return not torch.compiler.is_compiling() and t.device.type != "meta"


def _padding(key_padding: Tensor, batch: tuple, len_k: int) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """((b, 1, 2) bounds, None) for lengths or for padding that leaves an interval per row;
    (None, (b, 1, 1, Lk) keep-mask) for any other boolean pattern."""
    if key_padding.dtype == torch.bool:
        rows = _fold_batch(key_padding, batch, (len_k,), "key_padding")  # (b, Lk)
    elif key_padding.is_floating_point() or key_padding.is_complex():
        raise TypeError(f"key_padding must be boolean (True = padding) or integer lengths; got {key_padding.dtype}")
    else:
        rows = _fold_batch(key_padding, batch, (), "key_padding lengths")  # (b,)
    if _transformed():
        bounds, keep = torch.ops.attngrad.padding_bounds(rows, len_k)
        return _given(bounds), _given(keep)
    return _padding_bounds(rows, len_k)


def _padding_bounds(rows: Tensor, len_k: int) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """`_padding` of key_padding folded to (b, Lk) booleans or (b,) lengths: each entry's
    own, but one choice of bounds or keep-mask for all of them."""
    if rows.dtype == torch.bool:
        kept = ~rows  # (b, Lk)
        if not _eager(kept):
            return None, kept[:, None, None, :]
        count = kept.sum(dim=-1)
        position = torch.arange(len_k, device=kept.device)
        first = torch.where(kept, position, len_k).amin(dim=-1)
        last = torch.where(kept, position + 1, 0).amax(dim=-1)
        if bool(((last - first == count) | (count == 0)).all()):  # every row's kept keys are one run
            lo = torch.where(count > 0, first, 0)
            return torch.stack([lo, torch.where(count > 0, last, 0)], dim=-1)[:, None, :], None
        return None, kept[:, None, None, :]
    lengths = rows  # (b,)
    if _eager(lengths) and bool(((lengths < 0) | (lengths > len_k)).any()):
        raise ValueError(f"key_padding lengths must lie in [0, Lk = {len_k}]; got {lengths.tolist()}")
    lengths = lengths.to(torch.int64)
    return torch.stack([torch.zeros_like(lengths), lengths], dim=-1)[:, None, :], None


def _checked_window(window: object) -> tuple:
    """`window` as a (left, right) tuple, each side a number of keys >= 0 or None."""
    if not (isinstance(window, (tuple, list)) and len(window) == 2) or any(
        side is not None and (isinstance(side, bool) or not isinstance(side, int) or side < 0) for side in window
    ):
        raise ValueError(f"window must be (left, right), each a number of keys >= 0 or None; got {window!r}")
    return tuple(window)


def _window(window: tuple, len_q: int, len_k: int, offset: int, device: torch.device) -> Tensor:
    """(1, Lq, 2) bounds of a band around the diagonal j = i + offset."""
    left, right = _checked_window(window)
    # row i's bounds are i + first and i + stop, the offsets exact in Python's integers and
    # clamped to [-Lq, Lk], which moves no row's bound across 0 or Lk (an offset near int64's
    # limits would wrap in the tensor's arithmetic)
    first = -len_q if left is None else max(-len_q, min(len_k, offset - left))
    stop = len_k if right is None else max(-len_q, min(len_k, offset + right + 1))
    row = torch.arange(len_q, device=device, dtype=torch.int64)
    return torch.stack([(row + first).clamp(min=0), (row + stop).clamp(max=len_k)], dim=-1)[None]


def _documents(document_ids: Tensor, batch: tuple, length: int) -> Tensor:
    """(b, L, 2) bounds: the run of equal ids around each position."""
    if document_ids.is_floating_point() or document_ids.dtype == torch.bool:
        raise TypeError(f"document_ids must be integers; got {document_ids.dtype}")
    ids = _fold_batch(document_ids, batch, (length,), "document_ids")  # (b, L)
    return torch.ops.attngrad.document_bounds(ids) if _transformed() else _document_bounds(ids)


def _document_bounds(ids: Tensor) -> Tensor:
    """`_documents` of document_ids folded to (b, L)."""
    length = ids.shape[-1]
    position = torch.arange(length, device=ids.device).expand_as(ids)
    new_run = torch.ones_like(ids, dtype=torch.bool)
    new_run[:, 1:] = ids[:, 1:] != ids[:, :-1]
    distinct = torch.ones_like(new_run)
    ordered = ids.sort(dim=-1).values
    distinct[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    if _eager(ids) and not bool((new_run.sum(dim=-1) == distinct.sum(dim=-1)).all()):
        raise ValueError("document_ids: each document's tokens must be contiguous (packed sequences)")
    lo = torch.where(new_run, position, 0).cummax(dim=-1).values
    ends_run = torch.ones_like(new_run)
    ends_run[:, :-1] = new_run[:, 1:]
    hi = torch.where(ends_run, position + 1, length).flip(-1).cummin(dim=-1).values.flip(-1)
    return torch.stack([lo, hi], dim=-1)


def _cu_seqlens(cu_seqlens: Tensor, length: int) -> Tensor:
    """(1, L, 2) bounds from cumulative document lengths."""
    if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be a 1-D integer tensor; got {cu_seqlens.dtype} of shape "
                        f"{tuple(cu_seqlens.shape)}")
    rows = cu_seqlens[None]  # (1, D + 1)
    return torch.ops.attngrad.cu_seqlens_bounds(rows, length) if _transformed() else _cu_seqlens_bounds(rows, length)


def _cu_seqlens_bounds(rows: Tensor, length: int) -> Tensor:
    """(b, L, 2) bounds from (b, D + 1) rows of cumulative lengths, one row per batch entry."""
    cu = rows.to(torch.int64)
    if cu.shape[-1] < 2 or (_eager(cu) and bool((cu[:, 0] != 0).any() | (cu[:, -1] != length).any()
                                                 | (cu[:, 1:] < cu[:, :-1]).any())):
        shown = rows[0] if rows.shape[0] == 1 else rows
        raise ValueError(f"cu_seqlens must rise from 0 to the sequence length {length}; got {shown.tolist()}")
    position = torch.arange(length, device=cu.device).expand(cu.shape[0], length).contiguous()
    # (clamped, so that unchecked values under torch.compile index no memory outside the row)
    document = (torch.searchsorted(cu, position, right=True) - 1).clamp(0, cu.shape[-1] - 2)  # (b, L)
    return torch.stack([cu.gather(-1, document), cu.gather(-1, document + 1)], dim=-1)


class StructuredMasks(TypedDict, total=False):
    """The structured masks a call may take, as `attention` does (each absent or None: none)."""

    key_padding: Optional[Tensor]
    window: Optional[tuple]
    document_ids: Optional[Tensor]
    cu_seqlens: Optional[Tensor]


def structure(batch: tuple, len_q: int, len_k: int, causal: Optional[int], device: torch.device,
              **masks: Unpack[StructuredMasks]) -> Structure:
    """The key bounds (and, for padding with holes, a keep-mask) of the structured masks
    given, for a call with batch dimensions `batch` and causal diagonal `causal`. Kept while
    the tensors given live unchanged (`version_cache.value`): a model's layers share one structure,
    and the tiles then find the block maps they keep for its bounds."""
    unknown = set(masks) - set(StructuredMasks.__annotations__)
    if unknown:
        raise TypeError(f"structure() got unexpected structured masks {sorted(unknown)}")
    masks = {name: masks.get(name) for name in StructuredMasks.__annotations__}
    if masks["window"] is not None:
        masks["window"] = _checked_window(masks["window"])
    window = masks["window"]
    sources = (masks["key_padding"], masks["document_ids"], masks["cu_seqlens"])

    def make() -> Structure:
        return _structure(batch, len_q, len_k, causal, device, masks)

    if not version_cache.keepable(*sources):
        return make()
    return version_cache.value("structure", (tuple(batch), len_q, len_k, causal, device, window), sources, make)


def _structure(batch: tuple, len_q: int, len_k: int, causal: Optional[int], device: torch.device,
               masks: StructuredMasks) -> Structure:
    key_padding, window, document_ids, cu_seqlens = (masks[n] for n in StructuredMasks.__annotations__)
    parts: list[Tensor] = []
    keep = None
    if key_padding is not None:
        bounds, keep = _padding(key_padding.to(device), batch, len_k)
        if bounds is not None:
            parts.append(bounds)
    if window is not None:
        parts.append(_window(window, len_q, len_k, causal or 0, device))
    if document_ids is not None or cu_seqlens is not None:
        if document_ids is not None and cu_seqlens is not None:
            raise ValueError("pass either document_ids or cu_seqlens, not both")
        if len_q != len_k:
            raise ValueError(f"packed documents need as many queries as keys; got Lq = {len_q}, Lk = {len_k}")
        if document_ids is not None:
            parts.append(_documents(document_ids.to(device), batch, len_q))
        else:
            parts.append(_cu_seqlens(cu_seqlens.to(device), len_q))
    if not parts:
        return Structure(None, keep)
    return Structure(join_bounds(parts, len_q, len_k, causal, device), keep)


def join_bounds(parts: list, len_q: int, len_k: int, causal: Optional[int], device: torch.device) -> Tensor:
    """Key bounds, each (1 or B, Lq or 1, 2), as one (1 or B, Lq, 2): each row's intervals
    intersected (lo the largest, hi the smallest), with the causal diagonal's own."""
    if causal is not None:  # the diagonal's own bound, so the bounds tell each row's real width
        parts = [*parts, _window((None, 0), len_q, len_k, causal, device)]
    lo = torch.stack(torch.broadcast_tensors(*(p[..., 0] for p in parts))).amax(dim=0)
    hi = torch.stack(torch.broadcast_tensors(*(p[..., 1] for p in parts))).amin(dim=0)
    lo, hi = lo.clamp(0, len_k), hi.clamp(0, len_k)
    return torch.stack([lo, torch.maximum(lo, hi)], dim=-1).expand(-1, len_q, 2).contiguous()


# The parts of `structure` that read values, as ops of rows (one per batch entry, the first
# dimension of every tensor in and out), so that torch.func.vmap folds its axis into the
# rows, runs each once and unfolds (`layout.rows_rule`), where reading a batched
# tensor's values would fail. A result the op does not make is an empty placeholder.


def _given(t: Tensor) -> Optional[Tensor]:
    """None for an op's placeholder, else `t`."""
    return None if t.dim() == 1 else t


def _padding_op(rows: Tensor, len_k: int) -> tuple[Tensor, Tensor]:
    bounds, keep = _padding_bounds(rows, len_k)
    return (rows.new_empty(0, dtype=torch.int64) if bounds is None else bounds,
            rows.new_empty(0, dtype=torch.bool) if keep is None else keep)


def _padding_fake(rows: Tensor, len_k: int) -> tuple[Tensor, Tensor]:
    """What shapes alone give (as under torch.compile): boolean padding as the keep-mask."""
    if rows.dtype == torch.bool:
        return rows.new_empty(0, dtype=torch.int64), rows.new_empty(rows.shape[0], 1, 1, len_k, dtype=torch.bool)
    return rows.new_empty(rows.shape[0], 1, 2, dtype=torch.int64), rows.new_empty(0, dtype=torch.bool)


def _define_rows_op(name: str, function: Callable, fake: Callable, schema: str) -> None:
    op = torch.library.custom_op(f"attngrad::{name}", function, mutates_args=(), schema=schema)
    op.register_fake(fake)  # meta tensors under a torch.func transform
    op.register_vmap(rows_rule(op))


_define_rows_op("padding_bounds", _padding_op, _padding_fake, "(Tensor rows, int len_k) -> (Tensor, Tensor)")
_define_rows_op("document_bounds", _document_bounds, lambda ids: ids.new_empty(*ids.shape, 2, dtype=torch.int64),
                "(Tensor ids) -> Tensor")
_define_rows_op("cu_seqlens_bounds", _cu_seqlens_bounds,
                lambda rows, length: rows.new_empty(rows.shape[0], length, 2, dtype=torch.int64),
                "(Tensor rows, int length) -> Tensor")
