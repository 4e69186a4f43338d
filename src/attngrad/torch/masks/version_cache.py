"""Values made from tensors, kept while those tensors live unchanged.

A model's layers share their masks, and a backward its forward's: the key bounds of a
structured mask (`structured.structure`) and the block maps the tiles read
(`native._tile_map`) are made once and then looked up, not made again each call (a
structured mask's bounds and maps cost about 0.6 ms of Python a call; a (1, 1, 4096, 4096)
float mask's tile map 11 ms).

A value is keyed by what it is, its sizes and options, and the identity of each tensor it
is made from: the memory the tensor views, its layout and its version counter (bumped by
in-place writes). A weak reference to the tensor that owns that memory drops the entry when
that tensor is freed: it then neither holds a dead mask's bounds nor answers for another
tensor given the same memory.

As with autograd's check of the tensors it saves, a write that bypasses the version counter
(through `.data`, or to memory shared with NumPy by `torch.from_numpy`) is not seen: after
one, `attngrad.torch.forget_masks()` drops what was made from the old values.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from .. import regime

KEPT = 64  # entries: a call's bounds, block maps and key ranges, for a few masks at a time
_VALUES: collections.OrderedDict = collections.OrderedDict()


def identity(t: Optional[Tensor]) -> tuple:
    """What a kept value is keyed by for `t` (None for None)."""
    if t is None:
        return (None,)
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, t._version)


def value(what: str, sizes: tuple, sources: tuple, make: Callable[[], Any]) -> Any:
    """make()'s value, kept under `what` and `sizes` (hashable) while the tensors `sources`
    it is made from live unchanged, and dropped when one of them is freed; made anew from
    inference tensors (made under torch.inference_mode), whose in-place writes no version
    counter records."""
    if any(t is not None and t.is_inference() for t in sources):
        return make()
    key = (what, *sizes, *(identity(t) for t in sources))
    entry = _VALUES.get(key)
    if entry is not None and all(ref() is not None for ref in entry[0]):
        _VALUES.move_to_end(key)
        return entry[1]
    made = make()

    def forget(_ref: weakref.ref, values: collections.OrderedDict = _VALUES) -> None:
        values.pop(key, None)  # the dict itself, which outlives the module's globals at exit

    owners = (t._base if t._base is not None else t for t in sources if t is not None)
    _VALUES[key] = (tuple(weakref.ref(owner, forget) for owner in owners), made)
    while len(_VALUES) > KEPT:
        _VALUES.popitem(last=False)
    return made


def keepable(*sources: Optional[Tensor]) -> bool:
    """Whether a value made now from `sources` may be kept for later calls: eager, outside
    torch.func transforms, dispatch modes (a fake tensor made under one must not reach a
    later real call) and inference mode (its tensors cannot be saved for a later backward),
    and every source a plain tensor (or None)."""
    return (not torch.compiler.is_compiling() and not regime.transforms_active()
            and not regime.dispatch_modes() and not torch.is_inference_mode_enabled()
            and all(t is None or type(t) is Tensor for t in sources))


def clear() -> None:
    """Forget every kept value."""
    _VALUES.clear()


def forget_masks() -> None:
    """Forget everything made from masks and mask functions for later calls (the kept values
    here and the evaluations of `mask_memo`): for masks written past their version counter."""
    from . import memo as mask_memo

    clear()
    mask_memo.clear()
