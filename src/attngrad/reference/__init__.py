"""attngrad.reference: closed-form attention gradients in NumPy, no autograd anywhere.

Every layer is a pair `*_forward(...) -> (out, cache)` and `*_backward(dout, cache) -> grads`;
the backward returns the gradient of sum(out * dout) with respect to each input.
"""

from .flavors import (
    CrossAttentionGrads,
    SelfAttentionGrads,
    decoder_self_attention_backward,
    decoder_self_attention_forward,
    encoder_decoder_attention_backward,
    encoder_decoder_attention_forward,
    encoder_self_attention_backward,
    encoder_self_attention_forward,
    self_attention_backward,
    self_attention_forward,
)
from .jacobian import jacobian_from_vjp, mha_jacobian, sdpa_jacobian
from .linear import linear_backward, linear_forward, merge_heads, split_heads
from .mha import MHACache, MHAGrads, mha_backward, mha_forward
from .params import MHAParams
from .sdpa import SDPACache, SDPAGrads, causal_mask, dropout_keep_mask, sdpa_backward, sdpa_forward
from .second_order import mha_hvp, mha_jvp, sdpa_hvp, sdpa_jvp
from .softmax import softmax_backward, softmax_forward

__all__ = [
    "CrossAttentionGrads",
    "MHACache",
    "MHAGrads",
    "MHAParams",
    "SDPACache",
    "SDPAGrads",
    "SelfAttentionGrads",
    "causal_mask",
    "decoder_self_attention_backward",
    "decoder_self_attention_forward",
    "dropout_keep_mask",
    "encoder_decoder_attention_backward",
    "encoder_decoder_attention_forward",
    "encoder_self_attention_backward",
    "encoder_self_attention_forward",
    "jacobian_from_vjp",
    "linear_backward",
    "linear_forward",
    "merge_heads",
    "mha_backward",
    "mha_forward",
    "mha_hvp",
    "mha_jvp",
    "mha_jacobian",
    "sdpa_backward",
    "sdpa_forward",
    "sdpa_hvp",
    "sdpa_jvp",
    "sdpa_jacobian",
    "self_attention_backward",
    "self_attention_forward",
    "softmax_backward",
    "softmax_forward",
    "split_heads",
]
