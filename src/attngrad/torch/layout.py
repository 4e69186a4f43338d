"""How the public functions' inputs of any rank, (..., H, L, E), map onto the ops'
(B, H, L, E), and the checks that name the user's arguments when they do not fit."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from .precision import FLOATS


def broadcast_shapes(*shapes: tuple) -> torch.Size:
    """torch.broadcast_shapes for a few short shapes, in plain Python (PyTorch's goes through
    its reference implementation: tens of microseconds of a small call); RuntimeError where
    they do not broadcast."""
    rank = 0
    for shape in shapes:  # loops Dynamo traces (it refuses max over a generator with a default)
        rank = max(rank, len(shape))
    result = [1] * rank
    for shape in shapes:
        for axis, size in enumerate(shape, start=rank - len(shape)):
            if size == 1 or size == result[axis]:
                continue
            if result[axis] != 1:
                raise RuntimeError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
            result[axis] = size
    return torch.Size(result)


def _describe(q_shape: tuple, k_shape: tuple, v_shape: tuple) -> str:
    return f"query {tuple(q_shape)}, key {tuple(k_shape)}, value {tuple(v_shape)}"


def describe_shapes(query: Tensor, key: Tensor, value: Tensor) -> str:
    return _describe(query.shape, key.shape, value.shape)


def check_tensors(query: Tensor, key: Tensor, value: Tensor, dropout_p: float) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dtype not in FLOATS:
            raise TypeError(f"{name} must be a floating tensor; got {t.dtype} ({describe_shapes(query, key, value)})")
        if t.dim() < 2:
            raise ValueError(f"query, key and value must have at least 2 dimensions (..., L, E); got "
                             f"{describe_shapes(query, key, value)}")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"query, key and value must share a dtype; got {query.dtype}, {key.dtype}, {value.dtype}")
    if not query.device == key.device == value.device:
        raise ValueError(f"query, key and value must be on one device; got {query.device}, {key.device}, {value.device}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key and value must have the same length Lk (dimension -2); got "
                         f"{describe_shapes(query, key, value)}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must share their last dimension E; got {describe_shapes(query, key, value)}")
    if not is_number(dropout_p):
        raise TypeError(f"dropout_p must be a number; got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1]; got {dropout_p}")


def is_number(x: object) -> bool:
    """Whether `x` is a real number an option takes: a Python or NumPy one, or torch.compile's
    symbolic one; not a bool, a string or a tensor."""
    return isinstance(x, (numbers.Real, torch.SymInt, torch.SymFloat)) and not isinstance(x, bool)


def check_optional_tensors(**given: object) -> None:
    """A TypeError naming each argument given that is not a tensor (a list, a NumPy array)."""
    for name, t in given.items():
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (or None); got {type(t).__name__}")


def _fold_plan(q_shape: tuple, k_shape: tuple, v_shape: tuple, enable_gqa: bool) -> tuple[bool, torch.Size, int, int]:
    """(flat, batch, heads, kv_heads) of `Layout` for inputs of these shapes, or a ValueError
    naming them."""
    shapes = (q_shape, k_shape, v_shape)
    flat = max(len(shape) for shape in shapes) == 2  # (L, E) inputs: no heads axis
    h_q, h_k, h_v = (shape[-3] if len(shape) >= 3 else 1 for shape in shapes)
    try:
        batch = broadcast_shapes(*(shape[:-3] for shape in shapes))
    except RuntimeError:
        raise ValueError(f"the batch dimensions of query, key and value do not broadcast; got "
                         f"{_describe(*shapes)}") from None
    if enable_gqa and h_q != h_k:
        if h_k != h_v:
            raise ValueError(f"with enable_gqa, key and value must have the same number of heads; got "
                             f"{_describe(*shapes)}")
        if h_k == 0 or h_q % h_k:
            raise ValueError(f"the number of query heads must be a multiple of key/value heads; got "
                             f"{_describe(*shapes)}")
        return flat, batch, h_q, h_k
    try:
        heads = broadcast_shapes((h_q,), (h_k,), (h_v,))[0]
    except RuntimeError:
        hint = "; pass enable_gqa=True" if h_k == h_v and h_k and h_q % h_k == 0 else ""
        raise ValueError(f"query has {h_q} heads but key/value {h_k}, {h_v}{hint} ({_describe(*shapes)})") from None
    # key and value heads broadcast over the query's: GQA with one group, no copy
    return flat, batch, heads, 1 if h_k == h_v == 1 and h_q > 1 else heads


# Eager calls repeat a handful of shapes (a model's layers, a decode loop's steps): each is
# worked out once. torch.compile traces the plain function (its shapes may be symbolic).
_cached_fold_plan = functools.lru_cache(maxsize=256)(_fold_plan)


class Layout:
    """How (..., H, L, E) inputs of any rank map onto the op's (B, H, L, E): the leading
    dimensions broadcast among query, key and value and fold into one batch axis; the
    heads axis (-3) broadcasts too, or groups query heads over key/value heads (GQA)."""

    def __init__(self, query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool) -> None:
        self._shapes = (tuple(query.shape), tuple(key.shape), tuple(value.shape))
        plan = _fold_plan if torch.compiler.is_compiling() else _cached_fold_plan
        self.flat, self.batch, self.heads, kv_heads = plan(*self._shapes, bool(enable_gqa))
        self.kv_heads = kv_heads
        self.len_q, self.len_k = query.shape[-2], key.shape[-2]
        self.q = fold(query, self.batch, self.heads)
        self.k = fold(key, self.batch, kv_heads)
        self.v = fold(value, self.batch, kv_heads)

    @property
    def shapes(self) -> str:
        """The inputs' shapes, for messages."""
        return _describe(*self._shapes)

    @property
    def target(self) -> tuple:
        """The full score shape a mask must broadcast to: (..., H, Lq, Lk)."""
        return self.target_with(self.len_k)

    def target_with(self, len_k: int) -> tuple:
        """`target` for Lk keys (a ring's local queries see the whole sequence's keys)."""
        return (*self.batch, self.heads, self.len_q, len_k) if not self.flat else (self.len_q, len_k)

    def fold_mask(self, mask: Tensor, name: str, len_k: Optional[int] = None) -> Tensor:
        """A mask or bias broadcastable to `target` (with `len_k` keys, if given), as one
        broadcastable to (B, H, Lq, Lk)."""
        target = self.target_with(self.len_k if len_k is None else len_k)
        try:
            ok = mask.dim() <= len(target) and broadcast_shapes(mask.shape, target) == torch.Size(target)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"{name} of shape {tuple(mask.shape)} does not broadcast to the scores' shape {target} "
                             f"({self.shapes})")
        return fold_mask(mask, self.batch)

    def unfold(self, out: Tensor) -> Tensor:
        """(B, H, Lq, Ev) back to the inputs' layout (..., H, Lq, Ev)."""
        return unfold(out, self.batch, self.flat)


def fold(t: Tensor, batch: torch.Size, heads: int) -> Tensor:
    """t (..., L, E) as (B, heads, L, E): broadcast to the batch axes and heads, the batch
    axes flattened (a Layout's folding, which depends on the shapes alone)."""
    if t.dim() == 4 and len(batch) == 1 and t.shape[0] == batch[0] and t.shape[1] == heads:
        return t  # (B, H, L, E) already: no view to make
    while t.dim() < 3:
        t = t.unsqueeze(0)
    t = t.expand(*batch, heads, *t.shape[-2:])
    return t.reshape(math.prod(batch), *t.shape[-3:]) if len(batch) != 1 else t


def fold_mask(mask: Tensor, batch: torch.Size) -> Tensor:
    """A mask or bias broadcastable to (..., H, Lq, Lk) with leading dimensions `batch` as
    one broadcastable to the op's (B, H, Lq, Lk) (`Layout.fold_mask`, which checks it)."""
    mask = mask[(None,) * max(0, 4 - mask.dim())]  # at least (b, h, lq, lk)
    if len(batch) <= 1:  # the batch axis is the op's as it is
        return mask
    if all(size == 1 for size in mask.shape[:-3]):
        return mask.reshape(1, *mask.shape[-3:])
    return mask.expand(*batch, *mask.shape[-3:]).reshape(math.prod(batch), *mask.shape[-3:])


def unfold(out: Tensor, batch: torch.Size, flat: bool) -> Tensor:
    """The op's (B, H, Lq, Ev) output in inputs' layout (..., H, Lq, Ev), or (Lq, Ev) for
    `flat` inputs."""
    if flat:
        return out.reshape(out.shape[-2:])
    if len(batch) == 1:
        return out  # (B, H, Lq, Ev) is the layout
    return out.reshape(*batch, *out.shape[1:])


def default_scale(query: Tensor, scale: Optional[float]) -> float:
    """`scale`, or PyTorch's default 1 / sqrt(E) (with E = 0 every score is 0 whatever the scale)."""
    if scale is not None:
        if not is_number(scale):
            raise TypeError(f"scale must be a number (or None); got {type(scale).__name__}")
        return float(scale)
    return 1.0 / math.sqrt(query.shape[-1]) if query.shape[-1] else 1.0


def vmapped_first(t: Tensor, dim: int | None, n: int) -> Tensor:
    """A tensor under torch.func.vmap with its vmapped axis first: moved there, or a new
    one of size n where it has none (dim None)."""
    return t.movedim(dim, 0) if dim is not None else t.expand(n, *t.shape)


def fold_batch(t: Tensor, dim: int | None, n: int) -> Tensor:
    """(B, ...) with an optional vmapped axis -> (N B, ...)."""
    t = vmapped_first(t, dim, n)
    return t.reshape(n * t.shape[1], *t.shape[2:])


def rows_rule(op: Callable) -> Callable:
    """The batching rule of an op of rows (`structured`): the first dimension of every
    tensor it takes and returns is one per batch entry, each row's result its own row's
    (apart from one choice the op makes for all of them). The vmapped axis folds into the
    rows, (N, b, ...) -> (N b, ...), the op runs once and its results unfold; an empty
    placeholder, a result not made, stays unbatched."""

    def rule(info: Any, in_dims: tuple, *args: Any) -> tuple[Any, Any]:
        n = info.batch_size
        outputs = op(*(fold_batch(a, d, n) if isinstance(a, Tensor) else a for a, d in zip(args, in_dims)))
        single = isinstance(outputs, Tensor)
        unfolded, dims = [], []
        for out in (outputs,) if single else outputs:
            placeholder = out.dim() == 1 and out.numel() == 0
            unfolded.append(out if placeholder else out.reshape(n, out.shape[0] // n, *out.shape[1:]))
            dims.append(None if placeholder else 0)
        return (unfolded[0], dims[0]) if single else (tuple(unfolded), tuple(dims))

    return rule
