"""attngrad.torch: exact attention for PyTorch in O(L) memory.

`scaled_dot_product_attention` is a drop-in for PyTorch's function that also returns the
gradient of a float attention mask; `MultiheadAttention` is a drop-in for
`torch.nn.MultiheadAttention` built on it; `attention` is the same op with a boolean mask,
a float bias and the causal mask in any combination. All run wherever the tensors are;
`use_implementation` chooses between the compiled tiles and the torch-ops kernels.
"""

from .functional import attention, scaled_dot_product_attention
from .implementation import use_implementation
from .mha import MultiheadAttention

__all__ = ["MultiheadAttention", "attention", "scaled_dot_product_attention", "use_implementation"]
