"""The backends of attngrad.torch, each registered with `dispatch` when imported, in order
of preference: the compiled CPU tiles first, the Triton kernels (CUDA) next, the portable
torch-ops kernels last. A new backend is one more package that calls `dispatch.register`.
(`triton` registers itself just before torch-ops, so it is imported after it.)

`attngrad.torch.list_backends()` says which run here. (This package took the name of the
function that said so before, `attngrad.torch.backends()`, which is no longer callable:
CHANGELOG.md.)"""

from . import cpu_tiles, torch_ops, triton  # noqa: F401  (registering them is what importing does)
