"""The backends of attngrad.torch, each registered with `dispatch` when imported, in order
of preference: the compiled CPU tiles first, the Triton kernels (CUDA) next, the portable
torch-ops kernels last. A new backend is one more package that calls `dispatch.register`.
(`triton` registers itself just before torch-ops, so it is imported after it.)

`attngrad.torch.list_backends()` says which run here. This package took the name of the
function that said so before (`attngrad.torch.backends()`); calling it still works, with a
FutureWarning."""

import sys
import types
import warnings

from . import cpu_tiles, torch_ops, triton  # noqa: F401  (registering them is what importing does)


class _Package(types.ModuleType):
    def __call__(self) -> list:
        warnings.warn("attngrad.torch.backends() is deprecated; call attngrad.torch.list_backends(), which returns "
                      "the same list", FutureWarning, stacklevel=2)
        from ..op.dispatch import list_backends

        return list_backends()


sys.modules[__name__].__class__ = _Package
