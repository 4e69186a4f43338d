"""The attention ops' contract, checked where a call enters them.

`torch.ops.attngrad.*` are public: anyone can call them directly, past the friendly
checks of `functional`. The kernels behind them index by the sizes of q, k and v, and the
compiled tiles read raw memory, so every op checks its arguments against one another
first (in the real and in the fake implementation, so torch.compile reports the same
error) and names the argument and the shapes when they disagree.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ..layout import broadcast_shapes
from ..masks.blocks import MaskBlocks
from ..precision import FLOATS
from .call import FIELDS, AttentionCall


def _shape(t: Tensor) -> tuple:
    return tuple(t.shape)


def _qkv(call: AttentionCall) -> str:
    return f"q {_shape(call.q)}, k {_shape(call.k)}, v {_shape(call.v)}"


def _fail(message: str) -> None:
    raise ValueError(f"attngrad attention op: {message}")


def _check_like(name: str, t: Optional[Tensor], shape: tuple, device: torch.device, what: str) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"attngrad attention op: {name} must be a tensor; got {type(t).__name__}")
    if _shape(t) != shape:
        _fail(f"{name} must have shape {shape} ({what}); got {_shape(t)}")
    if t.dtype not in FLOATS:
        raise TypeError(f"attngrad attention op: {name} must be floating; got {t.dtype}")
    if t.device != device:
        _fail(f"{name} is on {t.device} but q on {device}")


def _check_broadcast(name: str, t: Optional[Tensor], target: tuple, device: torch.device) -> None:
    if t is None:
        return
    if t.device != device:
        _fail(f"{name} is on {t.device} but q on {device}")
    ok = 2 <= t.dim() <= 4
    if ok:
        try:
            ok = broadcast_shapes(t.shape, target) == torch.Size(target)
        except RuntimeError:
            ok = False
    if not ok:
        _fail(f"{name} of shape {_shape(t)} does not broadcast to (B, H, Lq, Lk) = {target} with 2 to 4 dimensions")


def _check_bounds(bounds: Optional[Tensor], batch: int, len_q: int, device: torch.device) -> None:
    if bounds is None:
        return
    if not isinstance(bounds, Tensor) or bounds.dtype != torch.int64:
        raise TypeError(f"attngrad attention op: bounds must be an int64 tensor; got {getattr(bounds, 'dtype', bounds)!r}")
    if bounds.dim() != 3 or bounds.shape[0] not in (1, batch) or bounds.shape[1:] != (len_q, 2):
        _fail(f"bounds must have shape (1 or B, Lq, 2) = (1 or {batch}, {len_q}, 2); got {_shape(bounds)}")
    if bounds.device != device:
        _fail(f"bounds is on {bounds.device} but q on {device}")


def _check_blocks(blocks: Optional[MaskBlocks], target: tuple, device: torch.device) -> None:
    """A mask kept per block: index int32 (1 or B, 1 or H, ceil(Lq / R), ceil(Lk / K)) for its
    tiles (T, R, K) bool, T >= 2 (its values: `check_block_values`)."""
    if blocks is None:
        return
    index, tiles = blocks.index, blocks.tiles
    for name, t in (("mask_blocks", index), ("mask_tiles", tiles)):
        if not isinstance(t, Tensor):
            raise TypeError(f"attngrad attention op: {name} must be a tensor; got {type(t).__name__}")
        if t.device != device:
            _fail(f"{name} is on {t.device} but q on {device}")
    if index.dtype != torch.int32 or tiles.dtype != torch.bool:
        raise TypeError(f"attngrad attention op: mask_blocks must be int32 and mask_tiles boolean; got {index.dtype} "
                        f"and {tiles.dtype}")
    if tiles.dim() != 3 or tiles.shape[0] < 2 or min(tiles.shape[1:]) < 1:
        _fail(f"mask_tiles must be (T, R, K) with T >= 2 (EMPTY and FULL first) and R, K >= 1; got {_shape(tiles)}")
    batch, heads, len_q, len_k = target
    r, k = tiles.shape[1:]
    blocks_q, blocks_k = -(-len_q // r), -(-len_k // k)
    if index.dim() != 4 or index.shape[0] not in (1, batch) or index.shape[1] not in (1, heads) or \
            index.shape[2:] != (blocks_q, blocks_k):
        _fail(f"mask_blocks of shape {_shape(index)} does not fit tiles of {r} x {k} on (B, H, Lq, Lk) = {target}: "
              f"expected (1 or {batch}, 1 or {heads}, {blocks_q}, {blocks_k})")


def check_block_values(call: AttentionCall) -> None:
    """The values of a mask kept per block, which the kernels index by: each block's tile in
    [0, T), tiles[0] keeping no entry and tiles[1] every one (the kernels skip reading those).
    Read where the op runs, not in its fake."""
    blocks = call.blocks
    if blocks is None or blocks.index.numel() == 0:
        return
    count = blocks.tiles.shape[0]
    low, high = int(blocks.index.min()), int(blocks.index.max())
    if low < 0 or high >= count:
        _fail(f"mask_blocks holds tile {low if low < 0 else high}, outside the {count} of mask_tiles")
    if bool(blocks.tiles[0].any()) or not bool(blocks.tiles[1].all()):
        _fail("mask_tiles[0] must keep no entry and mask_tiles[1] every entry (EMPTY and FULL)")


def _check_call(call: AttentionCall) -> None:
    """q (B, H, Lq, d), k (B, Hkv, Lk, d), v (B, Hkv, Lk, dv), H a multiple of Hkv; mask
    boolean and bias floating, each broadcastable to (B, H, Lq, Lk); bounds int64
    (1 or B, Lq, 2), each row's keys [lo, hi) (its values are checked where they are read:
    `structured` builds them in range, the tiles refuse any out of it)."""
    q, k, v = call.q, call.k, call.v
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"attngrad attention op: {name} must be a tensor; got {type(t).__name__}")
        if t.dim() != 4:
            _fail(f"q, k, v must be 4-D (B, H, L, E); got q {_shape(q)}, k {_shape(k)}, v {_shape(v)}")
        if t.dtype not in FLOATS:
            raise TypeError(f"attngrad attention op: {name} must be floating; got {t.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"attngrad attention op: q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        _fail(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    batch, heads, len_q, dim = q.shape
    kv_heads = k.shape[1]
    if k.shape[0] != batch or v.shape[0] != batch:
        _fail(f"q, k, v must share the batch size B; got {_qkv(call)}")
    if k.shape[:3] != v.shape[:3]:
        _fail(f"k and v must share (B, Hkv, Lk); got {_qkv(call)}")
    if k.shape[-1] != dim:
        _fail(f"q and k must share their width d; got {_qkv(call)}")
    if (kv_heads == 0 and heads != 0) or (kv_heads != 0 and heads % kv_heads):
        _fail(f"the query heads H must be a multiple of the key/value heads Hkv; got {_qkv(call)}")
    mask, bias = call.mask, call.bias
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"attngrad attention op: mask must be boolean; got {mask.dtype}")
    if bias is not None and bias.dtype not in FLOATS:
        raise TypeError(f"attngrad attention op: bias must be floating; got {bias.dtype}")
    target = (batch, heads, len_q, k.shape[2])
    _check_broadcast("mask", mask, target, q.device)
    _check_broadcast("bias", bias, target, q.device)
    _check_bounds(call.bounds, batch, len_q, q.device)
    _check_blocks(call.blocks, target, q.device)
    sinks = call.sinks
    if sinks is not None:
        if not isinstance(sinks, Tensor) or sinks.dtype not in FLOATS:
            raise TypeError(f"attngrad attention op: sinks must be a floating tensor; got {getattr(sinks, 'dtype', sinks)!r}")
        if sinks.dim() != 2 or sinks.shape[0] not in (1, batch) or sinks.shape[1] != heads:
            _fail(f"sinks must have shape (1 or B, H) = (1 or {batch}, {heads}), a logit per query head; got "
                  f"{_shape(sinks)} ({_qkv(call)})")
        if sinks.device != q.device:
            _fail(f"sinks is on {sinks.device} but q on {q.device}")
    seed = call.seed
    if not isinstance(seed, Tensor) or seed.shape not in ((), (5,)) or seed.dtype != torch.int64:
        _fail(f"seed must be a 0-d int64 tensor, or (5,): a `dropout.Placement`; got {seed!r}")
    causal = call.causal
    if causal is not None and (not isinstance(causal, int) or isinstance(causal, bool)):
        raise TypeError(f"attngrad attention op: causal must be None or an int diagonal offset; got {causal!r}")
    if not 0.0 <= call.dropout_p <= 1.0:
        _fail(f"dropout_p must be in [0, 1]; got {call.dropout_p}")
    if not 0.0 <= call.softcap < float("inf"):
        _fail(f"softcap must be 0 (none) or a positive finite number; got {call.softcap}")


def check_fields(call: AttentionCall, inputs: dict[str, Any]) -> None:
    """Raise a clear error unless a pass's arguments fit together: the call's own
    (`_check_call`), and each of the pass's inputs shaped as its `call.FIELDS` entry says
    (like q, k, v, the output (B, H, Lq, dv), the row statistics (B, H, Lq) or the bias)."""
    _check_call(call)
    q, v, bias, sinks = call.q, call.v, call.bias, call.sinks
    shapes = {"q": _shape(q), "k": _shape(call.k), "v": _shape(v), "out": (*_shape(q)[:3], v.shape[-1]),
              "rows": _shape(q)[:3], "bias": _shape(bias) if bias is not None else (),
              "sinks": _shape(sinks) if sinks is not None else ()}
    what = {"out": "(B, H, Lq, dv)", "rows": "(B, H, Lq)", "bias": "the shape of bias", "sinks": "the shape of sinks"}
    if inputs.get("bias_grad") and bias is None:
        _fail("bias_grad=True needs a bias")
    for name, t in inputs.items():
        like = FIELDS[name].like if name in FIELDS else None
        if like is None:
            continue
        if like == "bias" and t is not None and bias is None:
            _fail(f"{name} was given without a bias")
        if like == "sinks" and t is not None and sinks is None:
            _fail(f"{name} was given without sinks")
        _check_like(name, t, shapes[like], q.device, what.get(like, f"the shape of {like}"))
