"""diffusers' models under replace_sdpa(): tiny DiT, SD3 and Flux transformers and a UNet with
cross-attention, from random weights, in training mode, float64, to first and second order
against PyTorch's math path; every attention call taken by attngrad."""

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from attngrad.torch.op import dispatch  # noqa: E402

from ..conftest import assert_all_close  # noqa: E402
from ..replaced_sdpa import replaced_and_math  # noqa: E402

f64 = dict(dtype=torch.float64)


def _dit():
    model = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                            num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10,
                                            norm_num_groups=1)
    inputs = dict(hidden_states=torch.randn(2, 4, 8, 8), timestep=torch.tensor([1, 5]), class_labels=torch.tensor([0, 3]))
    return model, inputs, 2


def _sd3():
    model = diffusers.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                            num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                            pooled_projection_dim=12, out_channels=4, pos_embed_max_size=16)
    inputs = dict(hidden_states=torch.randn(2, 4, 8, 8), encoder_hidden_states=torch.randn(2, 5, 16),
                  pooled_projections=torch.randn(2, 12), timestep=torch.tensor([1.0, 5.0]))
    return model, inputs, 2


def _flux():
    """One double-stream and one single-stream block; the second prompt's last 3 of 5 text
    tokens are padding, masked out of the joint attention of both blocks."""
    model = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                             attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                             pooled_projection_dim=12, axes_dims_rope=(2, 2, 4))
    keep = torch.ones(2, 5 + 16, dtype=torch.bool)  # (B, text + image tokens), True = attend
    keep[1, 2:5] = False
    inputs = dict(hidden_states=torch.randn(2, 16, 8), encoder_hidden_states=torch.randn(2, 5, 16),
                  pooled_projections=torch.randn(2, 12), timestep=torch.tensor([0.1, 0.5]), img_ids=torch.randn(16, 3),
                  txt_ids=torch.randn(5, 3), joint_attention_kwargs={"attention_mask": keep})
    return model, inputs, 2


def _unet():
    model = diffusers.UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16),
                                           layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                           up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
                                           attention_head_dim=4, norm_num_groups=4)
    inputs = dict(sample=torch.randn(2, 4, 8, 8), timestep=torch.tensor([1, 5]), encoder_hidden_states=torch.randn(2, 5, 16))
    return model, inputs, 8  # self- and cross-attention in 4 transformer blocks


@pytest.mark.parametrize("make", [_dit, _sd3, _flux, _unet], ids=["DiT", "SD3", "Flux", "UNet"])
def test_model_matches_the_math_path_to_second_order(make):
    torch.manual_seed(0)
    model, inputs, attention_calls = make()
    model = model.to(torch.float64).train()
    inputs = {k: v.to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in inputs.items()}
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    rest = {k: v for k, v in inputs.items() if k not in tensors}

    def forward(**tensors):
        return model(**tensors, **rest).sample

    before = dispatch.ran.copy()
    ours, theirs, calls = replaced_and_math(forward, tensors, model)
    ran = dispatch.ran - before
    # a bias on every key adds the same q.b to a query's every score: the softmax does not
    # see it, so its gradients are 0 and both sides hold rounding noise (joint attention's
    # biases each shift a part of the keys, and are not)
    zeros = {name for name in theirs if name.endswith("attn1.to_k.bias")}
    assert_all_close(ours, theirs, zeros=zeros)
    assert calls.attngrad == 2 * attention_calls and calls.pytorch == {}  # the gradients' forward and the JVP's
    # attngrad's own count agrees: every pass of every call ran on attngrad's backends
    # (the JVP's forward runs with its tangent, one pass: the parameters need grad, so autograd
    # sees the call, and its forward waits for its jvp)
    assert {p: n for (p, _), n in ran.items()} == {"forward": attention_calls, "forward_jvp": attention_calls,
                                                   "backward": 2 * attention_calls, "double_backward": attention_calls}
