"""Tiled exact attention on plain tensors: forward and backward in O(L) extra memory.

The "torch-ops" backend (`backends.torch_ops`): they run every case on any device. On the
CPU the "tiles" backend (`native`) takes the calls first, fusing the passes below in cache.
Which keys a row sees comes from `block_map`.

Shape legend
    B batch, H query heads, Hkv key/value heads (G = H / Hkv), Lq / Lk query / key lengths,
    d query/key width, dv value width, R rows of one query block.

The manner of FlashAttention-2 (Dao, 2023), with whole key rows per block:
    forward, per block of R query rows:
        S   = scale * Q_blk K~^T + bias_blk, masked -> -inf      # (B, H, R, Lk')
        m   = rowmax(S),  E = exp(S - m),  l = rowsum(E)          # m, 1/l (B, H, R) kept
        O_blk = ((E * Z) V~) / l                                  # Z = keep / (1 - p); P = E / l
    backward, per block, recomputing E from m (nothing Lq x Lk is kept between blocks):
        dO'  = dO_blk / l                                         # folds 1/l into a small block
        dP / l = (dO' V~^T) * Z
        D    = rowsum(E * dP / l)                                 # = rowsum(P * dP) = rowsum(dO * O)
        dS   = E * (dP - D) / l                                   # = P * (dP - D)
        dV~ += (E * Z)^T dO',  dQ_blk = scale * dS K~,  dK~ += scale * dS^T Q_blk
        dbias_blk = dS, summed over the axes the bias broadcasts along
The logsumexp m + log(l) is the usual single statistic; keeping m and 1/l apart instead
recomputes P to within two roundings in float32, where exp(S - lse) would carry lse's
absolute rounding error (|lse| ~ 5-10) into every probability.
The row offset -m rides inside the backward's S GEMM as an extra column of the operands
(`with_column`): that saves a pass over each score tile (and in our runs gave the same bits
as the separate subtraction). D is summed from the block's own dP, which holds all of its
rows' keys (but in a ring step's part of the keys: there rowsum(dO * O)), so that dP's
rounding cancels in dP - D as in PyTorch's softmax backward: from
rowsum(dO * O), which carries O's rounding, dq was up to 4x less accurate than PyTorch's in
float32 on rows of few keys (issue 58). The forward's E V~ sums over `Tiling.value_slice` keys at a
time, for float32 accuracy.
The causal mask is a diagonal: key j is visible to query i when j <= i + c, where c (the
call's `causal`, None for no causal mask) is 0 for PyTorch's top-left alignment and
Lk - Lq for the bottom-right one. Lk' is Lk, or for a causal block only the keys any of its
rows may see (j <= last row + c), which halves the work; dK~ and dV~ then grow by key
prefixes (`KeyGradient`). Key bounds (1 or B, Lq, 2), which the structured masks become
(`structured`), leave row i the keys [lo, hi); a block then computes only the keys between
its rows' smallest lower and largest upper bound (`blocks`), so a sliding window costs its
band. A soft cap c makes S = c tanh(A / c) + bias for A = scale Q K~^T, and the backward
takes dA = (1 - tanh^2) dS back to Q and K~ (the bias still gets dS); the shift -m then
comes after the cap, out of the GEMM.
A row that may see no key gets m = 0 and 1/l = 0, so its output is 0 and everything it
sends back is 0: no NaN. A row that may see exactly one key gets P = 1 there and dS = 0
exactly: recomputing S in the backward can round it apart from the forward's m, and
P = 1 - 1e-7 would leave dQ and dK at 1e-7 where they are 0.

Dropout keep-masks are never stored: each block regenerates its entries from the seed and
their coordinates (`dropout`), so the backward sees the forward's mask.
Everything is computed in float32 (float64 for float64 inputs) whatever the input dtype.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from ...masks.block_map import excluded, key_range
from ...op.call import AttentionCall, PassInputs, ScoreMasks
from ...op.dropout import keep_scale_into
from ...precision import compute_dtype
from .tiling import TILING

if TYPE_CHECKING:  # typing's from Python 3.11; the annotations are never evaluated
    from typing_extensions import Unpack


def blocks(batch: int, heads: int, len_q: int, len_k: int, causal: int | None, min_rows: int | None = None,
           bounds: Tensor | None = None) -> list[tuple[int, int, int, int]]:
    """The query blocks (start, stop, first, keys): rows start:stop see keys first:keys.

    Each block's score tile holds about `Tiling.tile_elements` numbers, but at least
    `min_rows` (default `Tiling.min_rows`) rows. A causal block sees only the keys up to its last row, so early
    blocks, which see few keys, take more rows. With key `bounds` (1 or B, Lq, 2), a block
    sees only the keys between its rows' smallest lower and largest upper bound: a sliding
    window's block computes its band, not the whole prefix. first = keys: no key at all.
    """
    lows = highs = None
    if bounds is not None and bounds.device.type != "meta":  # per row, over the batch (meta: no values, shapes alone)
        lows, highs = bounds[..., 0].amin(dim=0).tolist(), bounds[..., 1].amax(dim=0).tolist()
    tiling = TILING()
    min_rows = tiling.min_rows if min_rows is None else min_rows
    out = []
    start = 0
    while start < len_q:
        rows = tiling.tile_elements // max(1, batch * heads * len_k)
        if causal is not None:  # solve rows * (seen + rows) ~ budget / (B H) for this block's rows
            budget = tiling.tile_elements / max(1, batch * heads)
            seen = min(len_k, max(0, start + causal))
            rows = int((math.sqrt(seen * seen + 4 * budget) - seen) / 2)
        rows = max(1, min(len_q - start, max(min_rows, min(tiling.max_rows, rows))))
        stop = start + rows
        first, keys = key_range(start, stop, len_k, causal, lows, highs)
        out.append((start, stop, first, keys))
        start = stop
    return out


def row_slice(t: Tensor | None, start: int, stop: int, keys: int, first: int = 0) -> Tensor | None:
    """The rows start:stop and keys first:keys of a (..., Lq or 1, Lk or 1) broadcastable tensor."""
    if t is None:
        return None
    if t.shape[-2] != 1:
        t = t[..., start:stop, :]
    if t.shape[-1] != 1:
        t = t[..., first:keys]
    return t


class Operands(NamedTuple):
    work: torch.dtype  # the compute dtype
    groups: int  # G = H / Hkv
    q_scaled: Tensor  # scale * Q, (B, H, Lq, d)
    k_rep: Tensor  # K~, (B, H, Lk, d)
    v_rep: Tensor  # V~, (B, H, Lk, dv)
    masks: ScoreMasks  # the call's, its bias in the compute dtype (as `scores_into` adds it)


def operands(call: AttentionCall) -> Operands:
    """Every pass's inputs in the compute dtype: keys and values repeated over each GQA
    group (O(L) memory), and the scale folded into Q once."""
    q, k, v, bias = call.q, call.k, call.v, call.bias
    work = compute_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1] if k.shape[1] else 1  # H = Hkv = 0: no heads at all
    k_rep = (k.repeat_interleave(groups, dim=1) if groups > 1 else k).to(work)
    v_rep = (v.repeat_interleave(groups, dim=1) if groups > 1 else v).to(work)
    masks = call.masks if bias is None else replace(call.masks, bias=bias.to(work))
    return Operands(work, groups, q.to(work) * call.scale, k_rep, v_rep, masks)


def excludes_keys(masks: ScoreMasks) -> bool:
    """Whether a mask, a bias, the causal diagonal, key bounds or a mask kept per block can
    leave a row fewer keys than the call's (`single_key_rows`)."""
    return any(t is not None for t in (masks.mask, masks.bias, masks.causal, masks.bounds, masks.blocks))


def with_column(t: Tensor, column: Tensor | float) -> Tensor:
    """[t | column]: (..., L, d) and a (..., L, 1) column (or a number) -> (..., L, d + 1).

    Appending row offsets c to one GEMM operand and ones to the other makes the GEMM add c_i
    to every entry of row i: A K^T - c costs one GEMM instead of a GEMM and a pass over the
    score tile, and a 65-wide product measured as fast as a 64-wide one."""
    if not isinstance(column, Tensor):
        column = t.new_full((), column)
    return torch.cat([t, column.expand(*t.shape[:-1], 1)], dim=-1)


class KeyGradient:
    """A key-side gradient, dK~ or dV~ (B, H, Lk, w), summed block by block: each block adds
    A^T X, for A (B, H, R, keys) and X (B, H, R, w), into its first `keys` rows.

    A block that sees every key adds in place with one batched GEMM. A causal block's keys
    are a prefix, whose (B, H, keys, w) row slice is no batch of contiguous matrices: the
    GEMM that writes it in place runs per head and changes its bits with the thread count
    (torch 2.13, MKL), so the block's product is formed in a contiguous buffer and added."""

    def __init__(self, like: Tensor, width: int) -> None:
        batch, heads, len_k = like.shape[0], like.shape[1], like.shape[-2]
        self.sum = torch.zeros((batch, heads, len_k, width), dtype=like.dtype, device=like.device)

    def add(self, a: Tensor, x: Tensor, first: int = 0) -> None:
        """sum[first:first + keys] += a^T x, as one batched GEMM over the (B, H) axes."""
        bh, rows, keys, width = a.shape[0] * a.shape[1], a.shape[-2], a.shape[-1], x.shape[-1]
        a3, x3 = a.reshape(bh, rows, keys), x.reshape(bh, rows, width)
        if first == 0 and keys == self.sum.shape[-2]:
            self.sum.view(bh, keys, width).baddbmm_(a3.transpose(1, 2), x3)
        else:
            self.sum[..., first:first + keys, :] += torch.bmm(a3.transpose(1, 2), x3).view(*a.shape[:2], keys, width)

    def total(self, groups: int) -> Tensor:
        """The gradient (B, H / groups, Lk, w), contiguous, summed over each GQA group
        (the adjoint of repeating K and V over it). Call it once: the sum is let go, so that
        its buffer is freed as soon as the result is made."""
        out, self.sum = self.sum, None
        if groups > 1:
            out = out.unflatten(1, (-1, groups)).sum(dim=2)
        return out.contiguous()


class ScoreTiles:
    """Score-sized scratch buffers, allocated once per call and reused by every block:
    a fresh 16 MiB tensor per operation would cost more in page faults than the math."""

    def __init__(self, count: int, plan: list[tuple[int, int, int, int]], batch: int, heads: int, dtype: torch.dtype,
                 device) -> None:
        numel = batch * heads * max(((stop - start) * (keys - first) for start, stop, first, keys in plan), default=0)
        self.flat = [torch.empty(numel, dtype=dtype, device=device) for _ in range(count)]

    def get(self, index: int, shape: tuple[int, int, int, int]) -> Tensor:
        """Buffer `index` as a contiguous tensor of `shape`."""
        return self.flat[index][: math.prod(shape)].view(shape)


def scores_into(out: Tensor, q_blk: Tensor, k: Tensor, masks: ScoreMasks, start: int, stop: int, first: int = 0,
                tanh_out: Tensor | None = None) -> Tensor:
    """S = Q_blk K^T + bias into `out` (B, H, R, keys - first) for rows start:stop and keys
    first:keys, excluded entries at -inf: by the mask, the causal diagonal, the key bounds
    (1 or B, Lq, 2) [lo, hi) of each row, and a mask kept per block, read for this tile
    alone (`masks`, its bias in `out`'s dtype). q_blk carries the scale already. With a soft
    cap c, S = c tanh(A / c) + bias for A = Q_blk K^T, and tanh(A / c) is left in `tanh_out`
    where given (the derivatives need it)."""
    keys = first + out.shape[-1]
    torch.matmul(q_blk, k[..., first:keys, :].transpose(-1, -2), out=out)
    softcap = masks.softcap
    if softcap:
        capped = torch.div(out, softcap, out=tanh_out if tanh_out is not None else out).tanh_()
        torch.mul(capped, softcap, out=out)
    b = row_slice(masks.bias, start, stop, keys, first)
    if b is not None:
        out.add_(b)
    allowed = row_slice(masks.mask, start, stop, keys, first)
    if allowed is not None:
        out.masked_fill_(~allowed, float("-inf"))
    if masks.blocks is not None:
        out.masked_fill_(~masks.blocks.entries(start, stop, first, keys), float("-inf"))
    outside = excluded(start, stop, first, keys, masks.causal, masks.bounds, out.device)  # (1 or b, R, keys - first)
    if outside is not None:
        out.masked_fill_(outside[:, None], float("-inf"))
    return out


def single_key_rows(e: Tensor, masked: bool, inv: Tensor) -> Tensor | None:
    """The rows (B, H, R, 1) of a tile E = exp(S - m) in which one key alone has weight
    (the others masked, or so far below that exp gives 0), or None if there is none; such a
    row's E is set to exactly 1 there. The forward had exp(S - m) = exp(0) = 1 and P = 1
    exactly, which a recomputed S can round apart from. `masked`: whether a mask, bias or
    the causal diagonal can exclude keys (otherwise only a single-key call has such rows);
    `inv` (B, H, R, 1) the rows' 1/l: such a row had l = 1 exactly, so only rows with
    1/l = 1 are counted (a pass over the whole tile would cost a quarter of the backward)."""
    if e.device.type == "meta":  # shapes alone: no row to set
        return None
    if not masked:
        if e.shape[-1] != 1:
            return None
        e.fill_(1.0)
        return e.new_ones(e.shape, dtype=torch.bool)
    candidates = (inv == 1).squeeze(-1)  # (B, H, R)
    if not bool(candidates.any()):
        return None
    rows = e[candidates]  # (n, keys): a copy of the candidate rows
    one = (rows > 0).sum(dim=-1) == 1
    if not bool(one.any()):
        return None
    single = torch.zeros_like(candidates)
    single[candidates] = one
    e[single] = (e[single] > 0).to(e.dtype)
    return single[..., None]


def _probs_times_values(e: Tensor, v: Tensor) -> Tensor:
    """E V~ for E (B, H, R, keys) and V~ (B, H, keys, dv), as a sum over `Tiling.value_slice`-key slices."""
    keys, step = e.shape[-1], TILING().value_slice
    out = torch.matmul(e[..., :step], v[..., :step, :])
    bh = e.shape[0] * e.shape[1]
    acc = out.view(bh, *out.shape[2:])
    for first in range(step, keys, step):
        last = min(first + step, keys)  # sizes spelled out: with B or H 0 a -1 is ambiguous
        acc.baddbmm_(e[..., first:last].reshape(bh, e.shape[2], last - first),
                     v[..., first:last, :].reshape(bh, last - first, v.shape[-1]))
    return out


def attention_forward(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
    """(out (B, H, Lq, dv) in q's dtype; row max m and inverse row sum 1/l, (B, H, Lq) each,
    in the compute dtype)."""
    q, v = call.q, call.v
    batch, heads, len_q, _ = q.shape
    len_k = call.k.shape[-2]
    work, _, q_scaled, k_rep, v_rep, masks = operands(call)
    placement, dropout_p = call.placement, call.dropout_p  # the placement once: it reads the seed tensor
    out = torch.empty(batch, heads, len_q, v.shape[-1], dtype=q.dtype, device=q.device)
    row_max = torch.zeros(batch, heads, len_q, dtype=work, device=q.device)
    inv_sum = torch.zeros(batch, heads, len_q, dtype=work, device=q.device)
    plan = blocks(batch, heads, len_q, len_k, call.causal, bounds=call.bounds)
    tiles = ScoreTiles(2 if dropout_p > 0.0 else 1, plan, batch, heads, work, q.device)
    for start, stop, first, keys in plan:
        if keys == first:  # no key at all for these rows
            out[:, :, start:stop] = 0
            continue
        shape = (batch, heads, stop - start, keys - first)
        s = scores_into(tiles.get(0, shape), q_scaled[:, :, start:stop], k_rep, masks, start, stop, first)
        m = s.amax(dim=-1, keepdim=True)  # (B, H, R, 1)
        # empty rows (m = -inf): any finite shift; m NaN or +inf (a NaN or Inf arrived) stays,
        # so that l, 1/l and the row's output come out NaN
        m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        e = s.sub_(m).exp_()  # E = exp(S - m)
        total = e.sum(dim=-1, keepdim=True)  # l, (B, H, R, 1); 0 for an empty row alone
        empty = total == 0
        inv = torch.where(empty, torch.zeros_like(total), 1.0 / total)
        row_max[:, :, start:stop] = m.squeeze(-1)
        inv_sum[:, :, start:stop] = inv.squeeze(-1)
        if dropout_p > 0.0:
            e = e.mul_(keep_scale_into(tiles.get(1, shape), placement, start, dropout_p, first))
        o = _probs_times_values(e, v_rep[..., first:keys, :])  # (B, H, R, dv), normalised here: cheaper than P
        # an empty row's O is 0, even where 0 x NaN (a NaN value among the keys) left NaN
        out[:, :, start:stop] = o.mul_(inv).masked_fill_(empty, 0.0).to(q.dtype)
    return out, row_max, inv_sum


def _reduce_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """Sum a (B, H, R, keys) block of dS over the axes a bias of `shape` broadcasts along."""
    if grad.numel() == math.prod(shape):  # only size-1 axes to drop: a view, no copy
        return grad.view(shape)
    extra = grad.dim() - len(shape)
    if extra:
        grad = grad.sum(dim=tuple(range(extra)))
    dims = tuple(i for i in range(len(shape) - 2) if shape[i] == 1 and grad.shape[i] != 1)
    if dims:
        grad = grad.sum(dim=dims, keepdim=True)
    if shape[-2] == 1 and grad.shape[-2] != 1:
        grad = grad.sum(dim=-2, keepdim=True)
    if shape[-1] == 1 and grad.shape[-1] != 1:
        grad = grad.sum(dim=-1, keepdim=True)
    return grad


def add_block_to_bias(grad: Tensor, block: Tensor, start: int, stop: int, keys: int, first: int = 0) -> None:
    """grad += a (B, H, R, keys - first) block of a bias-shaped gradient (rows start:stop,
    keys first:keys), summed over the axes along which the bias broadcasts."""
    target = grad[..., start:stop, :] if grad.shape[-2] != 1 else grad
    target = target[..., first:keys] if grad.shape[-1] != 1 else target
    target += _reduce_to(block, target.shape)


def attention_backward(call: AttentionCall,
                       **inputs: Unpack[PassInputs]) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(dq, dk, dv, dbias or None), each in its input's dtype and shape. `out` is read only
    where the keys are a part of each row's (a ring step's placement, the call's seed): else
    D comes from each block's own dP."""
    q, k, v, bias, scale, softcap = call.q, call.k, call.v, call.bias, call.scale, call.softcap
    dout, row_max, inv_sum, bias_grad = inputs["dout"], inputs["row_max"], inputs["inv_sum"], inputs["bias_grad"]
    batch, heads, len_q, width = q.shape
    len_k, width_v = k.shape[-2], v.shape[-1]
    work, groups, q_scaled, k_rep, v_rep, masks = operands(call)
    placement, dropout_p = call.placement, call.dropout_p  # the placement once: it reads the seed tensor
    dout_w = dout.to(work)
    # D = rowsum(dO * O) where the call's keys are a part of each row's (a ring step); else
    # each block's own rowsum(P dP), below
    delta = None  # (B, H, Lq, 1)
    if placement.partial_rows:
        delta = (dout_w * inputs["out"].to(work)).sum(dim=-1, keepdim=True)
    # The row offset -m rides in the GEMM as an extra column (`with_column`):
    # [scale Q | -m] [K~ | 1]^T = S - m (before bias and masks)
    q_shifted, k_ones = with_column(q_scaled, -row_max[..., None]), with_column(k_rep, 1.0)
    q_scaled, k_rep = q_shifted[..., :-1], k_ones[..., :-1]  # views: no second copy kept
    dq = torch.empty(batch, heads, len_q, width, dtype=work, device=q.device)
    dk_sum, dv_sum = KeyGradient(k_rep, width), KeyGradient(k_rep, width_v)
    # A bias with a row per query and a column per key gets each block's dS exactly once:
    # it is copied into an uninitialised buffer (zeroing 0.5 GiB first would cost more
    # than the copy). A bias broadcast along rows or keys sums several blocks: += into zeros.
    written_once = bias_grad and bias.shape[-2] == len_q and bias.shape[-1] == len_k
    dbias = None
    if bias_grad:
        dbias = (torch.empty if written_once else torch.zeros)(bias.shape, dtype=work, device=q.device)
    plan = blocks(batch, heads, len_q, len_k, call.causal, bounds=call.bounds)
    tiles = ScoreTiles(3 + (dropout_p > 0.0) + bool(softcap), plan, batch, heads, work, q.device)
    masked = excludes_keys(masks)
    for start, stop, first, keys in plan:
        r, width = stop - start, keys - first
        if keys == first:  # rows that see no key send nothing back
            dq[:, :, start:stop] = 0
            if written_once:  # its uninitialised rows are written by no other block
                dbias[..., start:stop, :] = 0
            continue
        q_blk = q_scaled[:, :, start:stop]
        inv = inv_sum[:, :, start:stop, None]  # 1/l, (B, H, R, 1)
        do_blk = dout_w[:, :, start:stop] * inv  # dO' = dO / l
        # forward: E = exp(S - m), recomputed; 0 on excluded entries and on empty rows
        shape = (batch, heads, r, width)
        if softcap:  # the cap comes before the shift: S - m = c tanh(A / c) + bias - m
            capped = tiles.get(len(tiles.flat) - 1, shape)  # tanh(A / c)
            e = scores_into(tiles.get(0, shape), q_scaled[:, :, start:stop], k_rep, masks, start, stop, first,
                            capped).sub_(row_max[:, :, start:stop, None]).exp_()
        else:
            e = scores_into(tiles.get(0, shape), q_shifted[:, :, start:stop], k_ones, masks, start, stop, first).exp_()
        single = single_key_rows(e, masked, inv)
        # forward: O = (E * Z) V~ / l  ->  dP / l = (dO' V~^T) * Z,  dV~ += (E * Z)^T dO'
        # forward: P = softmax(S)  ->  dS = P * (dP - D) = E * (dP - D) / l
        dp = torch.matmul(do_blk, v_rep[..., first:keys, :].transpose(-1, -2), out=tiles.get(1, shape))  # dP / l
        if dropout_p > 0.0:
            z = keep_scale_into(tiles.get(3, shape), placement, start, dropout_p, first)
            dp.mul_(z)
            dv_sum.add(z.mul_(e), do_blk, first)
        else:
            dv_sum.add(e, do_blk, first)
        # D = rowsum(P dP) = rowsum(E dP / l) from this very dP: its rounding then cancels in
        # dP - D (rowsum(dO * O) would carry O's own instead). Subtracted before the product with E:
        # E dP / l - E D / l left dq and dmask up to 1.25x less accurate
        if delta is None:
            row_delta = torch.mul(e, dp, out=tiles.get(2, shape)).sum(dim=-1, keepdim=True)
        else:
            row_delta = delta[:, :, start:stop]
        dp.sub_(row_delta * inv)  # (dP - D) / l
        # forward: S = scale * Q K~^T + bias  ->  dbias = dS summed over the bias's broadcast axes
        target = dbias[..., start:stop, first:keys] if written_once else None
        in_place = target is not None and target.numel() == e.numel() and target.is_contiguous()
        # a full-size bias: dS lands in its gradient
        ds = torch.mul(e, dp, out=target.view(e.shape)) if in_place else e.mul_(dp)
        if single is not None:  # dP - D is rounding there: D = dP exactly
            ds.masked_fill_(single, 0.0)
        if target is not None and not in_place:
            target.copy_(_reduce_to(ds, target.shape))
        elif dbias is not None and target is None:  # several blocks add into each entry
            add_block_to_bias(dbias, ds, start, stop, keys, first)
        if target is not None:  # keys the block never sees: past the causal diagonal or its bounds
            dbias[..., start:stop, :first] = 0
            dbias[..., start:stop, keys:] = 0
        if softcap:  # forward: S = c tanh(A / c) + bias  ->  dA = dS (1 - tanh^2)
            ds = capped.square_().neg_().add_(1.0).mul_(ds)
        dq[:, :, start:stop] = torch.matmul(ds, k_rep[..., first:keys, :]).mul_(scale)
        dk_sum.add(ds, q_blk, first)
    # forward: K~, V~ = repeat(K, G), repeat(V, G)
    return (
        dq.to(q.dtype),
        dk_sum.total(groups).to(k.dtype),
        dv_sum.total(groups).to(v.dtype),
        None if dbias is None else dbias.to(bias.dtype),
    )
