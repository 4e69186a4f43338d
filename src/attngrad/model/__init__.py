"""attngrad.model: a whole Transformer in NumPy, trained by hand-derived gradients alone.

`transformer` is the model of "Attention Is All You Need" (encoder-decoder, or a decoder-only
language model) as forward/backward pairs built on `attngrad.reference`; `layers` and `loss`
hold the other pieces; `optim` is Adam with the paper's warm-up; `tasks` the toy tasks and a
character-level text; `training` the loop, checkpoints and decoding.
"""

from .transformer import BOS, EOS, PAD, TransformerConfig, backward, forward, init_params, parameter_shapes

__all__ = ["BOS", "EOS", "PAD", "TransformerConfig", "backward", "forward", "init_params", "parameter_shapes"]
