"""Dropout keep-masks from a counter-based generator: the draw for score (b, h, i, j) is a
hash of the seed and those four coordinates alone, so a mask is the same whatever the
tiling, the thread count, the batch folding or the implementation (this module, or the
compiled tiles' copy of it in `csrc/tile_call.h`, which must give the same bits).

The hash is SplitMix64's output function (Steele, Lea and Flood, 2014) applied to a
counter, which is what makes SplitMix a counter-based generator:

    key_bh = mix(seed + gamma (b 2^32 + h + 1))                 one per (b, h)
    z      = mix(key_bh + gamma (i 2^32 + j + 1))                one per score
    keep   = (z >> 32) >= ceil(p 2^32)                           P(keep) = 1 - p to 2^-32
    Z      = keep / (1 - p)                                      (0 everywhere when p = 1)

(h, i, j) are the score's head, row and key in the whole: a call on a part of it (a ring
step or a head group of `attngrad.torch.distributed`) says where its heads, rows and keys
start (`Placement`), so its masks are those of the whole.

All arithmetic is modulo 2^64. PyTorch has no unsigned 64-bit shifts, so it runs on int64,
whose products wrap, with logical shifts spelled as an arithmetic shift and a mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

GAMMA = 0x9E3779B97F4A7C15
MIX_1 = 0xBF58476D1CE4E5B9
MIX_2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


def as_int64(seed: int) -> int:
    """A seed's 64 bits as the int64 with the same bits, which an int64 argument of an op or
    a kernel takes."""
    bits = seed & _MASK64
    return bits - (1 << 64) if bits >> 63 else bits


class Placement(NamedTuple):
    """Where a call sits in a larger one (a ring step, a head group of
    `attngrad.torch.distributed`): the dropout seed; the whole's row, key and head of the
    call's first score, which key its dropout draws (all 0 for a whole call); and whether
    the call's keys are only a part of each row's (then no pass may take a sum over the
    call's keys for a whole row's)."""

    seed: int
    row_offset: int = 0
    key_offset: int = 0
    head_offset: int = 0
    partial_rows: int = 0

    @classmethod
    def of(cls, seed: Union[int, Placement, Tensor]) -> Placement:
        """From an int (the seed), a placement, or the ops' seed tensor: 0-d (the seed), or
        (5,) int64, the fields in order."""
        if isinstance(seed, Placement):
            return seed
        if isinstance(seed, Tensor):
            placement = cls(*(int(x) for x in seed.reshape(-1).tolist()))
            if min(placement[1:]) < 0 or placement.partial_rows > 1:
                raise ValueError(f"attngrad attention op: the seed's offsets must be >= 0 and its last entry 0 or 1; "
                                 f"got {placement}")
            return placement
        return cls(int(seed))

    def tensor(self) -> Tensor:
        """The ops' seed tensor: 0-d for a whole call, else (5,)."""
        if not any(self[1:]):
            return torch.tensor(self.seed, dtype=torch.int64)
        return torch.tensor(list(self), dtype=torch.int64)


def _signed(c: int) -> int:
    """A 64-bit pattern as the int64 with the same bits."""
    c &= _MASK64
    return c - (1 << 64) if c >> 63 else c


def _shr(z: Tensor, bits: int) -> Tensor:
    """Logical right shift of an int64 tensor's bit pattern."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: Tensor) -> Tensor:
    z = z ^ _shr(z, 30)
    z = z * _signed(MIX_1)
    z = z ^ _shr(z, 27)
    z = z * _signed(MIX_2)
    return z ^ _shr(z, 31)


def mix_int(z: int) -> int:
    """The same hash on a Python int (the tests' independent reference)."""
    z &= _MASK64
    z ^= z >> 30
    z = (z * MIX_1) & _MASK64
    z ^= z >> 27
    z = (z * MIX_2) & _MASK64
    return z ^ (z >> 31)


def threshold(dropout_p: float) -> int:
    """The 32-bit draw below which a score is dropped: ceil(p 2^32), 2^32 for p = 1."""
    return min(1 << 32, math.ceil(dropout_p * (1 << 32)))


def keep_value(dropout_p: float) -> float:
    """Z on a kept score: 1 / (1 - p); 0 when p = 1 (nothing is kept)."""
    return 0.0 if dropout_p >= 1.0 else 1.0 / (1.0 - dropout_p)


def keep_int(seed: int, b: int, h: int, i: int, j: int, dropout_p: float) -> bool:
    """Whether score (b, h, i, j) is kept, on Python ints."""
    key = mix_int(seed + GAMMA * ((b << 32) + h + 1))
    return mix_int(key + GAMMA * ((i << 32) + j + 1)) >> 32 >= threshold(dropout_p)


# A compiled fill of the same bits, where a backend offers one (`use_compiled_fill`):
# fill(out, seed, row_start, threshold, keep_value, key_start) -> out, or None where it
# does not take that tile.
_compiled_fill: Optional[Callable[..., Optional[Tensor]]] = None


def use_compiled_fill(fill: Callable[..., Optional[Tensor]]) -> None:
    """Have `keep_scale_into` try `fill` first (the compiled tiles register theirs)."""
    global _compiled_fill
    _compiled_fill = fill


def keep_scale_into(out: Tensor, seed: Union[int, Placement], row_start: int, dropout_p: float,
                    key_start: int = 0) -> Tensor:
    """Fill `out` (B, H, R, keys) with Z for rows row_start.. and keys key_start.. of every
    (b, h), both counted from the key's offsets: by the compiled fill where it takes the tile,
    else by `keep_scale_torch`. Both give the same bits."""
    seed, row_offset, key_offset, head_offset, _ = Placement.of(seed)
    row_start, key_start = row_start + row_offset, key_start + key_offset
    if head_offset:
        return keep_scale_torch(out, seed, row_start, dropout_p, key_start, head_offset)
    if _compiled_fill is not None:
        filled = _compiled_fill(out, seed, row_start, threshold(dropout_p), keep_value(dropout_p), key_start)
        if filled is not None:
            return filled
    return keep_scale_torch(out, seed, row_start, dropout_p, key_start)


def keep_scale_torch(out: Tensor, seed: int, row_start: int, dropout_p: float, key_start: int = 0,
                     head_offset: int = 0) -> Tensor:
    """`keep_scale_into` in PyTorch operators, for any device (int64 tiles: slower)."""
    batch, heads, rows, keys = out.shape
    device = out.device
    b = torch.arange(batch, dtype=torch.int64, device=device)[:, None, None, None]
    h = torch.arange(head_offset, head_offset + heads, dtype=torch.int64, device=device)[None, :, None, None]
    key_bh = _mix(((b << 32) + h + 1) * _signed(GAMMA) + _signed(seed))  # (B, H, 1, 1)
    i = torch.arange(row_start, row_start + rows, dtype=torch.int64, device=device)[:, None]
    j = torch.arange(key_start, key_start + keys, dtype=torch.int64, device=device)
    z = _mix(key_bh + ((i << 32) * _signed(GAMMA) + (j + 1) * _signed(GAMMA)))  # (B, H, R, keys)
    # 1 * Z rounds to Z in out's dtype, as the compiled tiles' static_cast does
    return out.copy_(_shr(z, 32) >= threshold(dropout_p)).mul_(keep_value(dropout_p))
