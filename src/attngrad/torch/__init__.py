"""attngrad.torch: exact attention for PyTorch in O(L) memory.

`scaled_dot_product_attention` is a drop-in for PyTorch's function that also returns the
gradient of a float attention mask; `MultiheadAttention` is a drop-in for
`torch.nn.MultiheadAttention` built on it; `attention` is the same op with a boolean mask,
a float bias and the causal mask in any combination. All run wherever the tensors are;
`backends()` lists the backends that run the passes (the compiled tiles, the torch-ops
kernels, ...), `use_implementation` chooses among them, and `ran` counts what ran.
`replace_sdpa()` sends every call of PyTorch's own function inside a block to attngrad,
in any model that makes one. `buffer_cache` keeps the gradient of a bias of the scores'
size between calls (`buffer_cache.set_limit`, `buffer_cache.empty_cache`). What is made from a
mask is kept while the mask's version counter stays (`kept`); `forget_masks()` drops it
after a write that bypasses the counter (`.data`, NumPy's shared memory).
"""

from . import backends as _backends  # noqa: F401  (registers the backends)
from .dispatch import backends, ran, use_implementation
from .functional import attention, scaled_dot_product_attention
from .kept import forget_masks
from .mask_functions import create_block_mask
from .mha import MultiheadAttention
from .sdpa_mode import SDPACalls, replace_sdpa

__all__ = ["MultiheadAttention", "SDPACalls", "attention", "backends", "create_block_mask", "forget_masks", "ran",
           "replace_sdpa", "scaled_dot_product_attention", "use_implementation"]
