"""A backend defined in the tests, in one module: the torch-ops kernels, wrapped so that every
pass is counted and its call kept. Registering it is all it takes for the ops, the autograd
Functions and the ring to run on it (importable by the distributed tests' processes)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from attngrad.torch import use_backend
from attngrad.torch.backends import torch_ops
from attngrad.torch.op import dispatch
from attngrad.torch.op.call import AttentionCall


class CountingBackend:
    name = "counting"

    def __init__(self) -> None:
        self.calls: list[tuple[str, AttentionCall, bool]] = []  # (pass, call, given the whole rows' sums)
        passes = {name: self._wrap(name, fn) for name, fn in torch_ops.BACKEND.passes.items()}
        self.backend = dispatch.Backend(name=self.name, passes=passes, row_sums=True, description="a test's own")

    def _wrap(self, pass_name: str, fn: Callable) -> Callable:
        def run(call: AttentionCall, **inputs):
            self.calls.append((pass_name, call, inputs.get("row_sums") is not None))
            return fn(call, **inputs)
        return run

    def count(self, pass_name: str, *, ring_step: bool | None = None) -> int:
        """Calls of `pass_name`; with `ring_step`, only those on a part of each row's keys (or not)."""
        return sum(1 for name, call, _ in self.calls
                   if name == pass_name and (ring_step is None or call.partial_rows == ring_step))


@contextmanager
def registered_counting_backend() -> Iterator[CountingBackend]:
    """A `CountingBackend`, registered first and the only one allowed inside the block."""
    counting = CountingBackend()
    dispatch.register(counting.backend, before=dispatch.registered()[0])
    try:
        with use_backend(counting.name):
            yield counting
    finally:
        dispatch.unregister(counting.name)
