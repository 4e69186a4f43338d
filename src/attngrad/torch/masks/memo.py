"""Evaluations of `attention(mask_mod=fn)` kept for the calls after the first.

Evaluating a mask function is O(Lq Lk) work, where the attention of a window of w keys is
O(L w): a mask_mod passed on every call would cost more than the attention it masks.
FlexAttention's users evaluate once (`create_block_mask`); here a call reuses the
evaluation of an earlier one when the function reads exactly what it read then.

What a function reads: its code, its defaults, its closure cells' values and the globals
its code names, and through any function among those, what that one reads. Their
fingerprint decides: numbers, strings, dtypes and devices by value; modules, classes and
PyTorch's own functions by identity; tuples, lists and dicts by their contents; tensors by
identity, storage, shape and version counter (an in-place change bumps it: the check
autograd makes of the tensors it saves). A function that reads anything else (an object's
attributes, a callable instance) has no fingerprint and is evaluated on every call.
"""

from __future__ import annotations

import functools
import types
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Optional

import torch
from torch import Tensor

# Evaluations kept, the least recently used dropped first; each holds what its key names.
KEPT = 8
_BY_VALUE = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)
_DEPTH = 6  # functions reached through functions: deeper than this, no fingerprint


class _Unreadable(Exception):
    pass


def fingerprint(fn: Callable) -> Optional[tuple[Hashable, list]]:
    """What `fn` reads, as a hashable key, and the objects the key names by identity (held
    with it, so that no other object takes their id while it lives); None where some of
    it has no fingerprint."""
    held: list = []
    try:
        return _value(fn, held, 0), held
    except _Unreadable:
        return None


def _value(v: object, held: list, depth: int) -> Hashable:
    if isinstance(v, _BY_VALUE):
        return (type(v), v)
    if isinstance(v, Tensor):
        if v.is_inference():  # no version counter to tell an in-place change
            raise _Unreadable
        held.append(v)
        return ("tensor", id(v), v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape),
                tuple(v.stride()), v.dtype, v._version)
    if isinstance(v, (tuple, list, frozenset)):
        return (type(v), tuple(_value(x, held, depth) for x in v))
    if isinstance(v, dict):
        return (dict, tuple((_value(k, held, depth), _value(x, held, depth)) for k, x in v.items()))
    if isinstance(v, functools.partial):
        return ("partial", _value(v.func, held, depth), _value(v.args, held, depth),
                _value(v.keywords, held, depth))
    if isinstance(v, (types.ModuleType, type, types.BuiltinFunctionType, types.BuiltinMethodType)) or (
            isinstance(v, types.FunctionType) and not v.__closure__ and (v.__module__ or "").split(".")[0] == "torch"):
        held.append(v)  # PyTorch's own functions (not closures like its and_masks'): fixed code
        return ("identity", id(v))
    if isinstance(v, types.FunctionType):
        return _function(v, held, depth)
    raise _Unreadable


def _names(code: types.CodeType) -> set:
    """The global (and attribute) names `code` and the code nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _function(fn: types.FunctionType, held: list, depth: int) -> Hashable:
    if depth >= _DEPTH:
        raise _Unreadable
    try:
        contents = [cell.cell_contents for cell in fn.__closure__ or ()]
    except ValueError:  # a cell not yet bound
        raise _Unreadable from None
    cells = tuple(_value(c, held, depth + 1) for c in contents)
    named = tuple((name, _value(fn.__globals__[name], held, depth + 1))
                  for name in sorted(_names(fn.__code__)) if name in fn.__globals__)
    return ("function", fn.__code__, cells, named, _value(fn.__defaults__, held, depth + 1),
            _value(fn.__kwdefaults__, held, depth + 1))


_KEPT: OrderedDict = OrderedDict()


def remembered(mask_mod: Callable, shape: tuple, evaluate: Callable[[], object],
               worth_keeping: Callable[[object], bool] = lambda _: True) -> object:
    """`evaluate()`, or what it gave for an earlier call of `mask_mod` with the same
    fingerprint and `shape` (the call's batch, heads, lengths and device); a result
    that is not `worth_keeping` is not kept."""
    if torch.compiler.is_compiling():  # a compiled graph evaluates it inside the graph
        return evaluate()
    found = fingerprint(mask_mod)
    if found is None:
        return evaluate()
    key, held = (found[0], shape), found[1]
    if key in _KEPT:
        _KEPT.move_to_end(key)
        return _KEPT[key][0]
    evaluated = evaluate()
    if not worth_keeping(evaluated):
        return evaluated
    _KEPT[key] = (evaluated, held)
    while len(_KEPT) > KEPT:
        _KEPT.popitem(last=False)
    return evaluated


def clear() -> None:
    """Forget every kept evaluation."""
    _KEPT.clear()
