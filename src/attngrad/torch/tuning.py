"""Tuning as data (a backend's block sizes and thresholds, how the masks are evaluated): a
frozen dataclass, the value in force read at each call, and overridden inside a `with`
block (tests, sweeps) rather than by patching module constants. The override is a context
variable: it holds in the thread (and asyncio task) that set it, which is where a CPU pass
and its backward run. Code Dynamo traces (the masks) reads it when the graph is traced, and
the graph keeps that value."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


@torch.compiler.assume_constant_result  # Dynamo cannot trace ContextVar.get: a constant of the graph
def _read(value: ContextVar) -> Any:
    return value.get()[0]


_overrides = itertools.count(1)  # each override's key: never reused, so a key names one value
# the key of the innermost override in force, of any Tuning: it names every Tuning's value at
# once (each override sets it and puts the outer one back), for `dispatch.state()`
_in_force: ContextVar[int] = ContextVar("attngrad_tuning_in_force", default=0)


def in_force() -> int:
    """A key naming the value in force of every Tuning together (0: all at their defaults)."""
    return _in_force.get()


class Tuning(Generic[T]):
    """`tuning()` is the value in force; `with tuning.override(field=value):` changes fields
    inside the block. `tuning.key()` names the value in force, for caches that depend on it
    (0 for the default; hashing the value itself costs a microsecond a call)."""

    def __init__(self, name: str, default: T) -> None:
        self._value: ContextVar[tuple[T, int]] = ContextVar(name, default=(default, 0))

    def __call__(self) -> T:
        return _read(self._value)

    def key(self) -> int:
        return self._value.get()[1]

    @contextlib.contextmanager
    def override(self, **changes: Any) -> Iterator[T]:
        key = next(_overrides)
        token = self._value.set((dataclasses.replace(self._value.get()[0], **changes), key))
        all_token = _in_force.set(key)
        try:
            yield self._value.get()[0]
        finally:
            _in_force.reset(all_token)
            self._value.reset(token)
