"""Tiled exact attention on plain tensors: forward and backward in O(L) extra memory.

Shape legend
    B batch, H query heads, Hkv key/value heads (G = H / Hkv), Lq / Lk query / key lengths,
    d query/key width, dv value width, R rows of one query block.

The manner of FlashAttention-2 (Dao, 2023), with whole key rows per block:
    forward, per block of R query rows:
        S   = scale * Q_blk K~^T + bias_blk, masked -> -inf      # (B, H, R, Lk')
        lse = m + log(sum exp(S - m)),  m = rowmax(S)             # (B, H, R), kept
        P   = exp(S - lse);  O_blk = (P * Z) V~                   # Z = keep / (1 - p)
    backward, per block, recomputing P from lse (nothing Lq x Lk is kept between blocks):
        D    = rowsum(dO * O)                                     # = rowsum(dP * P), dropout or not
        dP   = (dO_blk V~^T) * Z
        dS   = P * (dP - D)
        dV~ += (P * Z)^T dO_blk,  dQ_blk = scale * dS K~,  dK~ += scale * dS^T Q_blk
        dbias_blk = dS, summed over the axes the bias broadcasts along
Lk' is Lk, or for a causal block only the keys any of its rows may see (j <= last row),
which halves the work. A row that may see no key gets lse = +inf, so P = exp(S - lse) = 0
there in both passes: output 0, gradients 0, no NaN.

Dropout keep-masks are never stored: block i draws its (B, H, R, Lk') uniforms from a
generator seeded with (seed, i), so the backward regenerates the very same mask.
Everything is computed in float32 (float64 for float64 inputs) whatever the input dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Elements of one (B, H, R, Lk') score tile: 2^22 float32 = 16 MiB. A handful of tiles are
# alive at once in the backward, which bounds the extra memory whatever the length.
TILE_ELEMENTS = 1 << 22
MIN_ROWS = 16


def block_rows(batch: int, heads: int, len_q: int, len_k: int) -> int:
    """Rows R per query block, so that one score tile holds about TILE_ELEMENTS numbers."""
    rows = TILE_ELEMENTS // max(1, batch * heads * len_k)
    return max(1, min(len_q, max(MIN_ROWS, rows)))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(t: Tensor | None, start: int, stop: int, keys: int) -> Tensor | None:
    """The rows start:stop and keys :keys of a (..., Lq or 1, Lk or 1) broadcastable tensor."""
    if t is None:
        return None
    if t.shape[-2] != 1:
        t = t[..., start:stop, :]
    if t.shape[-1] != 1:
        t = t[..., :keys]
    return t


def _key_range(start: int, stop: int, len_k: int, is_causal: bool) -> int:
    """Keys a block of rows start:stop may see: all, or for causal up to its last row."""
    return min(len_k, stop) if is_causal else len_k


class _Tiles:
    """Score-sized scratch buffers, allocated once per call and reused by every block:
    a fresh 16 MiB tensor per operation would cost more in page faults than the math."""

    def __init__(self, count: int, batch: int, heads: int, rows: int, len_k: int, dtype: torch.dtype, device) -> None:
        self.flat = [torch.empty(batch * heads * rows * len_k, dtype=dtype, device=device) for _ in range(count)]
        self.lead = (batch, heads)

    def get(self, index: int, rows: int, keys: int) -> Tensor:
        """Buffer `index` as a contiguous (B, H, rows, keys) tensor."""
        n = self.lead[0] * self.lead[1] * rows * keys
        return self.flat[index][:n].view(*self.lead, rows, keys)


def _keep_scale_into(out: Tensor, seed: int, block: int, dropout_p: float) -> Tensor:
    """Fill `out` with Z = keep / (1 - p) for one block, regenerated identically from (seed, block)."""
    generator = torch.Generator(device=out.device)
    generator.manual_seed((seed * 1_000_003 + block) % (2**63 - 1))
    out.uniform_(generator=generator)  # U[0, 1)
    return out.ge_(dropout_p).mul_(1.0 / (1.0 - dropout_p))  # keep where U >= p


def _scores(
    out: Tensor, q_blk: Tensor, k: Tensor, mask: Tensor | None, bias: Tensor | None, start: int, stop: int,
    is_causal: bool,
) -> Tensor:
    """S = Q_blk K^T + bias into `out` (B, H, R, keys), excluded entries at -inf.
    q_blk carries the scale already."""
    keys = out.shape[-1]
    torch.matmul(q_blk, k[..., :keys, :].transpose(-1, -2), out=out)
    b = _rows(bias, start, stop, keys)
    if b is not None:
        out.add_(b)
    allowed = _rows(mask, start, stop, keys)
    if allowed is not None:
        out.masked_fill_(~allowed, float("-inf"))
    if is_causal and keys > start:  # only keys start.. can lie in a row's future
        rows = torch.arange(start, stop, device=out.device)[:, None]
        future = torch.arange(start, keys, device=out.device)[None, :] > rows  # (R, keys - start)
        out[..., start:].masked_fill_(future, float("-inf"))
    return out


def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, seed: int,
    is_causal: bool, scale: float, dropout_p: float,
) -> tuple[Tensor, Tensor]:
    """(out (B, H, Lq, dv) in q's dtype, lse (B, H, Lq) in the compute dtype)."""
    batch, heads, len_q, _ = q.shape
    len_k = k.shape[-2]
    work = compute_dtype(q.dtype)
    groups = heads // k.shape[1]
    k_rep = (k.repeat_interleave(groups, dim=1) if groups > 1 else k).to(work)  # (B, H, Lk, d)
    v_rep = (v.repeat_interleave(groups, dim=1) if groups > 1 else v).to(work)  # (B, H, Lk, dv)
    q_scaled = q.to(work) * scale  # the scale folded into Q once
    bias = None if bias is None else bias.to(work)
    out = torch.empty(batch, heads, len_q, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, len_q, dtype=work, device=q.device)
    rows = block_rows(batch, heads, len_q, len_k)
    tiles = _Tiles(2 if dropout_p > 0.0 else 1, batch, heads, min(rows, len_q), len_k, work, q.device)
    for block, start in enumerate(range(0, len_q, rows)):
        stop = min(start + rows, len_q)
        keys = _key_range(start, stop, len_k, is_causal)
        if keys == 0:  # no key at all for these rows
            out[:, :, start:stop] = 0
            lse[:, :, start:stop] = math.inf
            continue
        s = _scores(tiles.get(0, stop - start, keys), q_scaled[:, :, start:stop], k_rep, mask, bias, start, stop, is_causal)
        m = s.amax(dim=-1, keepdim=True)  # (B, H, R, 1)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # empty rows: any finite shift
        p = s.sub_(m).exp_()  # exp(S - m), unnormalised
        denom = p.sum(dim=-1, keepdim=True)  # (B, H, R, 1), 0 for an empty row
        empty = denom == 0
        lse[:, :, start:stop] = torch.where(empty, math.inf, m + torch.log(denom)).squeeze(-1)
        if dropout_p > 0.0:
            p = p.mul_(_keep_scale_into(tiles.get(1, stop - start, keys), seed, block, dropout_p))
        o = torch.matmul(p, v_rep[..., :keys, :])  # (B, H, R, dv), normalised below: cheaper than P
        out[:, :, start:stop] = o.div_(torch.where(empty, torch.ones_like(denom), denom)).to(q.dtype)
    return out, lse


def _reduce_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """Sum a (B, H, R, keys) block of dS over the axes a bias of `shape` broadcasts along."""
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


def attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, seed: int,
    out: Tensor, lse: Tensor, is_causal: bool, scale: float, dropout_p: float, bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(dq, dk, dv, dbias or None), each in its input's dtype and shape."""
    batch, heads, len_q, width = q.shape
    kv_heads, len_k, width_v = k.shape[1], k.shape[-2], v.shape[-1]
    work = compute_dtype(q.dtype)
    groups = heads // kv_heads
    k_rep = (k.repeat_interleave(groups, dim=1) if groups > 1 else k).to(work)
    v_rep = (v.repeat_interleave(groups, dim=1) if groups > 1 else v).to(work)
    q_scaled = q.to(work) * scale
    bias_work = None if bias is None else bias.to(work)
    dout_w = dout.to(work)
    delta = (dout_w * out.to(work)).sum(dim=-1, keepdim=True)  # D = rowsum(dO * O), (B, H, Lq, 1)
    dq = torch.empty(batch, heads, len_q, width, dtype=work, device=q.device)
    dk_rep = torch.zeros(batch, heads, len_k, width, dtype=work, device=q.device)
    dv_rep = torch.zeros(batch, heads, len_k, width_v, dtype=work, device=q.device)
    dbias = torch.zeros(bias.shape, dtype=work, device=q.device) if bias_grad else None
    rows = block_rows(batch, heads, len_q, len_k)
    tiles = _Tiles(3 if dropout_p > 0.0 else 2, batch, heads, min(rows, len_q), len_k, work, q.device)
    bh = batch * heads
    for block, start in enumerate(range(0, len_q, rows)):
        stop = min(start + rows, len_q)
        r, keys = stop - start, _key_range(start, stop, len_k, is_causal)
        if keys == 0:
            dq[:, :, start:stop] = 0
            continue
        q_blk = q_scaled[:, :, start:stop]
        do_blk = dout_w[:, :, start:stop]
        # forward: P = exp(S - lse), recomputed; 0 on excluded entries and on empty rows
        p = _scores(tiles.get(0, r, keys), q_blk, k_rep, mask, bias_work, start, stop, is_causal)
        p = p.sub_(lse[:, :, start:stop, None]).exp_()
        # forward: O = (P * Z) V~  ->  dP = (dO V~^T) * Z,  dV~ += (P * Z)^T dO
        dp = torch.matmul(do_blk, v_rep[..., :keys, :].transpose(-1, -2), out=tiles.get(1, r, keys))
        dv_acc = dv_rep[..., :keys, :].view(bh, keys, width_v)
        if dropout_p > 0.0:
            z = _keep_scale_into(tiles.get(2, r, keys), seed, block, dropout_p)
            dp.mul_(z)
            dv_acc.baddbmm_(z.mul_(p).view(bh, r, keys).transpose(1, 2), do_blk.reshape(bh, r, width_v))
        else:
            dv_acc.baddbmm_(p.view(bh, r, keys).transpose(1, 2), do_blk.reshape(bh, r, width_v))
        # forward: P = softmax(S)  ->  dS = P * (dP - D)
        ds = p.mul_(dp.sub_(delta[:, :, start:stop]))
        # forward: S = scale * Q K~^T + bias
        if dbias is not None:
            target = dbias
            if bias.shape[-2] != 1:
                target = target[..., start:stop, :]
            if bias.shape[-1] != 1:
                target = target[..., :keys]
            target += _reduce_to(ds, target.shape)
        dq[:, :, start:stop] = torch.matmul(ds, k_rep[..., :keys, :]).mul_(scale)
        dk_rep[..., :keys, :].view(bh, keys, width).baddbmm_(ds.view(bh, r, keys).transpose(1, 2), q_blk.reshape(bh, r, width))
    # forward: K~, V~ = repeat(K, G), repeat(V, G)
    if groups > 1:
        dk_rep = dk_rep.view(batch, kv_heads, groups, len_k, -1).sum(dim=2)
        dv_rep = dv_rep.view(batch, kv_heads, groups, len_k, -1).sum(dim=2)
    return (
        dq.to(q.dtype),
        dk_rep.to(k.dtype),
        dv_rep.to(v.dtype),
        None if dbias is None else dbias.to(bias.dtype),
    )
