"""The backends of attngrad.torch, each registered with `dispatch` when imported, in order
of preference: the compiled CPU tiles first, the portable torch-ops kernels last. A new
backend is one more module that calls `dispatch.register`."""

from . import tiles, torch_ops  # noqa: F401  (registering them is what importing does)
