"""attngrad.torch: exact attention for PyTorch in O(L) memory.

`scaled_dot_product_attention` is a drop-in for PyTorch's function that also returns the
gradient of a float attention mask; `MultiheadAttention` is a drop-in for
`torch.nn.MultiheadAttention` built on it; `attention` is the same op with a boolean mask,
a float bias and the causal mask in any combination. All run wherever the tensors are.
"""

from .functional import attention, scaled_dot_product_attention
from .mha import MultiheadAttention

__all__ = ["MultiheadAttention", "attention", "scaled_dot_product_attention"]
