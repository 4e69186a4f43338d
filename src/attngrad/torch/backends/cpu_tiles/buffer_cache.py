"""Large gradient buffers kept between calls, as PyTorch's CUDA caching allocator keeps freed
blocks for the next request.

A bias of the scores' own size has a gradient of that size: 512 MiB for 8 heads at L=4096
in float32. The CPU allocator returns such a block to the system when it is freed, and the
next one arrives as fresh pages, each faulted in and zeroed by the kernel on first write:
on the machines here that cost the bias case a fifth of its time, more than writing the
gradient itself. The cache keeps each buffer it handed out and hands it out again, for
the same sizes and dtype, once nothing else holds its memory: not the gradient autograd
stored in `.grad`, not a view of it, not its storage. At most `limit()` bytes are kept
(least recently used go first); `empty_cache()` lets them all go.

The passes that take a buffer from here write every entry of it (or zero it first), so
what a buffer held before never shows through.
"""

from __future__ import annotations

import collections
import math
import sys
import threading

import torch
from torch import Tensor

from ... import regime
from .tiling import TILING

__all__ = ["cached_bytes", "empty", "empty_cache", "limit", "set_limit"]

DEFAULT_LIMIT = 1 << 30

_lock = threading.RLock()  # cached_bytes() runs both inside and outside it
_kept: collections.OrderedDict[tuple, Tensor] = collections.OrderedDict()
_limit = DEFAULT_LIMIT
_storage_use_count = regime.storage_use_count  # private; without it nothing is kept


def _wrapper_refs(base: Tensor) -> int:
    """sys.getrefcount of the Python object of `base`'s storage where only this function's
    names hold it besides PyTorch (which keeps a reference of its own while a tensor holds
    the storage, torch 2.13)."""
    storage = base.untyped_storage()
    return sys.getrefcount(storage)


def _free(base: Tensor) -> bool:
    """Whether the cache's tensor is the only holder of its memory: its storage has one
    tensor (this one), and no Python object of the storage is held elsewhere (a storage
    object someone kept is the one `untyped_storage()` returns, with more references)."""
    storage = base.untyped_storage()
    return _storage_use_count(storage._cdata) == 2 and sys.getrefcount(storage) <= _UNSHARED


_UNSHARED = _wrapper_refs(torch.empty(1)) if _storage_use_count is not None else 0


def empty(sizes: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """An uninitialised CPU tensor of `sizes` and `dtype`: a kept buffer where one of these
    sizes is free, else a new one, kept for the next call when it is large enough and the
    limit allows. The caller must write every entry."""
    sizes = tuple(int(n) for n in sizes)
    nbytes = math.prod(sizes) * dtype.itemsize
    if _storage_use_count is None or nbytes < TILING().smallest_kept_buffer or nbytes > _limit:
        return torch.empty(sizes, dtype=dtype)
    key = (sizes, dtype)
    with _lock:
        base = _kept.get(key)
        if base is None or not _free(base):
            # a buffer still held elsewhere is the holder's now: the new one takes its place
            base = _kept[key] = torch.empty(sizes, dtype=dtype)
        _kept.move_to_end(key)
        _trim(_limit)  # the least recently used go first: this one, the most recent, fits
        # a tensor of its own on the same storage: autograd may store it as `.grad`
        # without copying (it copies a gradient that other tensors reference)
        return torch.empty(0, dtype=dtype).set_(base.untyped_storage(), 0, sizes, base.stride())


def _trim(most: int) -> None:
    while _kept and cached_bytes() > most:
        _kept.popitem(last=False)


def cached_bytes() -> int:
    """The bytes the cache holds, free or handed out."""
    with _lock:
        return sum(t.untyped_storage().nbytes() for t in _kept.values())


def limit() -> int:
    """The most bytes the cache keeps (1 GiB unless set)."""
    return _limit


def set_limit(nbytes: int) -> None:
    """Keep at most `nbytes` bytes of buffers between calls; 0 keeps none."""
    global _limit
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"set_limit: nbytes must be an int >= 0; got {nbytes!r}")
    with _lock:
        _limit = nbytes
        _trim(nbytes)


def empty_cache() -> None:
    """Let every kept buffer go (those still held elsewhere stay with their holders)."""
    with _lock:
        _kept.clear()
