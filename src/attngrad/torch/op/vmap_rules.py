"""Batching rules for the attention ops, so that torch.func.vmap (and jacrev, jacfwd, hessian,
which vmap) runs each op once instead of once per batched slice.

Attention is already batched over B, so a vmapped axis of size N folds into it: every
(B, ...) operand becomes (N B, ...), key bounds (1 or B, Lq, 2) become (N B, Lq, 2), a
bias-like operand (a mask, a bias, or its tangent or cotangent, broadcastable to
(B, H, Lq, Lk)) is expanded to (N B, h, lq, lk), the op runs once, and the outputs unfold to (N, B, ...). A bias gradient comes back per vmapped slice, summed to
the bias's own shape. With dropout the fold would change the blocks' shapes and so the masks
drawn for them, so then, as with a batched seed (or batched tiles of a mask kept per block),
the op runs once per slice.

The ops that make the structured masks' bounds (`structured`) take and return rows, one per
batch entry: their rule (`rows_rule`) folds the vmapped axis into the rows the same way, so
a vmap over a batch of key_padding, document_ids or cu_seqlens reads their values once,
unbatched, where reading a batched tensor's values fails.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..layout import fold_batch, vmapped_first
from .call import FIELDS, PASSES

# Operands broadcastable to (B, H, Lq, Lk): the masks, and what is shaped like the bias; a
# mask's blocks (1 or B, 1 or H, ., .) fold the same way, and its tiles are shared by all.
BIAS_LIKE = frozenset({"mask", "bias", "mask_blocks"} | {f.name for f in FIELDS.values() if f.like == "bias"})
# Operands (1 or B, ...): the key bounds, the sink logits and their tangents and cotangents.
ROWS_LIKE = frozenset({"bounds", "sinks"} | {f.name for f in FIELDS.values() if f.like == "sinks"})


def _fold_bias(t: Tensor, dim: int | None, n: int, batch: int) -> Tensor:
    """A tensor broadcastable to (B, H, Lq, Lk), with an optional vmapped axis -> (N B, h, lq, lk)."""
    t = vmapped_first(t, dim, n)
    t = t.reshape(n, *([1] * (5 - t.dim())), *t.shape[1:])  # (N, b0, h, lq, lk)
    return t.expand(n, batch, *t.shape[2:]).reshape(n * batch, *t.shape[2:])


def _fold_per_batch(t: Tensor, dim: int | None, n: int, batch: int) -> Tensor:
    """Key bounds (1 or B, Lq, 2) or sink logits (1 or B, H), with an optional vmapped axis
    -> (N B, ...)."""
    t = vmapped_first(t, dim, n)
    return t.expand(n, batch, *t.shape[2:]).reshape(n * batch, *t.shape[2:])


def _unfold_bias(grad: Tensor, n: int, batch: int, shape: torch.Size) -> Tensor:
    """(N B, h, lq, lk) -> (N, *shape): each slice's gradient in the bias's own shape."""
    grad = grad.reshape(n, batch, *grad.shape[1:])
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    if padded[0] == 1:
        grad = grad.sum(dim=1, keepdim=True)
    return grad.reshape(n, *shape)


def make_rule(op: Callable, pass_name: str, names: Sequence[str]) -> Callable:
    """The batching rule of `op`, the op of pass `pass_name`, whose arguments are called
    `names` in order; an output shaped like the bias or the sinks (`call.PASSES`) unfolds to
    that one's own shape per slice."""
    bias_outputs = {i for i, output in enumerate(PASSES[pass_name].outputs) if output.like == "bias"}
    sinks_outputs = {i for i, output in enumerate(PASSES[pass_name].outputs) if output.like == "sinks"}
    q_index, seed_index, dropout_index = names.index("q"), names.index("seed"), names.index("dropout_p")
    tiles_index = names.index("mask_tiles")

    def per_slice(info: Any, in_dims: tuple, args: tuple) -> tuple[Any, Any]:
        results = []
        for i in range(info.batch_size):
            sliced = [a.select(d, i) if isinstance(a, Tensor) and d is not None else a for a, d in zip(args, in_dims)]
            results.append(op(*sliced))
        if isinstance(results[0], Tensor):
            return torch.stack(results), 0
        return tuple(torch.stack(parts) for parts in zip(*results)), (0,) * len(results[0])

    def rule(info: Any, in_dims: tuple, *args: Any) -> tuple[Any, Any]:
        # (the dispatcher leaves out trailing arguments at their defaults, as absent tiles are)
        tiles_batched = len(in_dims) > tiles_index and in_dims[tiles_index] is not None
        if args[dropout_index] > 0.0 or in_dims[seed_index] is not None or tiles_batched:
            return per_slice(info, in_dims, args)
        n = info.batch_size
        q, q_dim = args[q_index], in_dims[q_index]
        batch = q.shape[0] if q_dim is None else q.movedim(q_dim, 0).shape[1]
        bias_shape, sinks_shape = None, None
        folded = []
        for name, arg, dim in zip(names, args, in_dims):
            if not isinstance(arg, Tensor) or name in ("seed", "mask_tiles"):
                folded.append(arg)
            elif name in ROWS_LIKE:
                if name == "sinks":
                    sinks_shape = arg.shape if dim is None else arg.movedim(dim, 0).shape[1:]
                folded.append(_fold_per_batch(arg, dim, n, batch))
            elif name in BIAS_LIKE:
                if name == "bias":
                    bias_shape = arg.shape if dim is None else arg.movedim(dim, 0).shape[1:]
                folded.append(_fold_bias(arg, dim, n, batch))
            else:
                folded.append(fold_batch(arg, dim, n))
        outputs = op(*folded)
        if isinstance(outputs, Tensor):
            return outputs.reshape(n, batch, *outputs.shape[1:]), 0
        unfolded: list[Tensor] = []
        dims: list[int | None] = []
        for i, out in enumerate(outputs):
            if out.dim() == 1 and out.numel() == 0:  # a placeholder: that gradient was not asked for
                unfolded.append(out)
                dims.append(None)
            elif i in bias_outputs:
                unfolded.append(_unfold_bias(out, n, batch, bias_shape))
                dims.append(0)
            elif i in sinks_outputs:  # (N B, H) -> (N, 1 or B, H)
                out = out.reshape(n, batch, *out.shape[1:])
                unfolded.append(out.sum(dim=1, keepdim=True) if sinks_shape[0] == 1 else out)
                dims.append(0)
            else:
                unfolded.append(out.reshape(n, batch, *out.shape[1:]))
                dims.append(0)
        return tuple(unfolded), tuple(dims)

    return rule
