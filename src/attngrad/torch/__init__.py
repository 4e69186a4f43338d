"""attngrad.torch: exact attention for PyTorch in O(L) memory.

`scaled_dot_product_attention` is a drop-in for PyTorch's function that also returns the
gradient of a float attention mask; `MultiheadAttention` is a drop-in for
`torch.nn.MultiheadAttention` built on it; `attention` is the same op with a boolean mask,
a float bias and the causal mask in any combination. All run wherever the tensors are;
`list_backends()` lists the backends that run the passes (the compiled tiles, the torch-ops
kernels, ...), `use_backend` chooses among them, and `ran` counts what ran.
`replace_sdpa()` sends every call of PyTorch's own function inside a block to attngrad,
in any model that makes one. The compiled CPU tiles keep the gradient of a bias of the
scores' size between calls (`from attngrad.torch.backends.cpu_tiles import buffer_cache`:
`set_limit`, `empty_cache`).
What is made from a mask is kept while the mask's version counter stays
(`masks.version_cache`); `forget_masks()` drops it after a write that bypasses the counter
(`.data`, NumPy's shared memory).

Layout: the entry points above (`functional`, `mha`, `sdpa_mode`, `nested`, `distributed`)
build one `op.call.AttentionCall` (`arguments`, `layout`); `op` runs its passes as PyTorch
operators and sends each to a backend (`op.dispatch`); each backend is one package under
`backends`; `masks` holds masks in every form. docs/design.md draws it.
"""

import torch

from . import backends  # registers the backends
from .arguments import AttentionOptions
from .functional import attention, scaled_dot_product_attention
from .masks.functions import create_block_mask
from .masks.version_cache import forget_masks
from .mha import MultiheadAttention
from .op.dispatch import list_backends, ran, use_backend, use_implementation
from .sdpa_mode import SDPACalls, replace_sdpa

if torch.distributed.is_available():
    from . import distributed  # noqa: F401 - registers the passes' DTensor handlers

__all__ = ["AttentionOptions", "MultiheadAttention", "SDPACalls", "attention", "backends", "create_block_mask", "forget_masks",
           "list_backends", "ran", "replace_sdpa", "scaled_dot_product_attention", "use_backend", "use_implementation"]
