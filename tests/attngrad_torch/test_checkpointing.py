"""replace_sdpa() under activation checkpointing: the recomputation in the backward runs on
attngrad too, so checkpointed training equals unchecked training (float64, 1e-12), with no
call on PyTorch's kernel. Before, the recomputation ran outside the mode: non-reentrant
checkpoint raised CheckpointError (25 tensors saved, none recomputed), reentrant checkpoint
ran its backward on PyTorch's kernel uncounted."""

import functools

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts  # noqa: E402

from attngrad.torch import replace_sdpa  # noqa: E402
from attngrad.torch.op import dispatch  # noqa: E402

from ..conftest import EXACT, rel_err  # noqa: E402


def _layer(seed):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=4, dim_feedforward=32, dropout=0.0, batch_first=True,
                                       dtype=torch.float64)
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    return layer, x


def _selective(fn, x):
    """Selective checkpointing: matrix products kept, everything else (attention too) recomputed."""
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    return checkpoint(fn, x, use_reentrant=False, context_fn=functools.partial(create_selective_checkpoint_contexts, policy))


WAYS = {
    "non-reentrant": lambda fn, x: checkpoint(fn, x, use_reentrant=False),
    "reentrant": lambda fn, x: checkpoint(fn, x, use_reentrant=True),
    "selective": _selective,
}


def _forward(layer, x, way, mask):
    leaf = x.detach().requires_grad_()
    fn = functools.partial(layer, src_mask=mask) if mask is not None else layer
    return leaf, fn(leaf) if way is None else WAYS[way](fn, leaf)


def _backward(layer, leaf, out):
    """loss.backward(), as a training step calls it (reentrant checkpoint refuses autograd.grad)."""
    layer.zero_grad(set_to_none=True)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (out * w).sum().backward()
    return [leaf.grad, *(p.grad for p in layer.parameters())]


def _gradients(layer, x, way, mask):
    return _backward(layer, *_forward(layer, x, way, mask))


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("backward_inside", [True, False])
def test_checkpointed_training_equals_unchecked_training(way, masked, backward_inside):
    layer, x = _layer(0)
    mask = nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.float64) if masked else None
    with replace_sdpa(strict=True) as plain_calls:
        expected = _gradients(layer, x, None, mask)
    before = dict(dispatch.ran)
    with replace_sdpa(strict=True) as calls:
        if backward_inside:
            got = _gradients(layer, x, way, mask)
        else:  # the backward after the block: the recomputation still runs on attngrad
            leaf, out = _forward(layer, x, way, mask)
    if not backward_inside:
        got = _backward(layer, leaf, out)
    assert plain_calls.attngrad == 1 and not plain_calls.pytorch
    assert calls.attngrad == 2 and not calls.pytorch  # the forward and its recomputation
    forwards = sum(n for (p, _), n in dispatch.ran.items() if p == "forward") - \
        sum(n for (p, _), n in before.items() if p == "forward")
    assert forwards == 2
    for g, e in zip(got, expected):
        assert rel_err(g, e) < EXACT
    with sdpa_kernel(SDPBackend.MATH):  # PyTorch's math path, checkpointed the same way
        math = _gradients(layer, x, way, mask)
    for g, e in zip(got, math):
        assert rel_err(g, e) < EXACT


def test_a_recomputation_runs_the_forwards_backend_with_its_bits():
    """Two layers in one checkpoint, each call recomputed on the tiles: the same bits as the
    unchecked step, not merely within rounding."""
    torch.manual_seed(0)
    block = nn.Sequential(*(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, dtype=torch.float64)
                            for _ in range(2)))
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    with replace_sdpa(strict=True):
        expected = _gradients(block, x, None, None)
        got = _gradients(block, x, "non-reentrant", None)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_diffusers_gradient_checkpointing():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                            num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10,
                                            norm_num_groups=1).double()
    inputs = dict(hidden_states=torch.randn(2, 4, 8, 8, dtype=torch.float64), timestep=torch.tensor([1, 5]),
                  class_labels=torch.tensor([0, 3]))

    def grads():
        torch.manual_seed(7)
        model.zero_grad(set_to_none=True)
        model(**inputs).sample.square().sum().backward()
        return [p.grad for p in model.parameters()]

    with replace_sdpa(strict=True) as plain:
        expected = grads()
    model.enable_gradient_checkpointing()
    with replace_sdpa(strict=True) as calls:
        got = grads()
    assert calls.attngrad == 2 * plain.attngrad and not calls.pytorch
    for g, e in zip(got, expected):
        assert rel_err(g, e) < EXACT


@pytest.mark.parametrize("reentrant", [False, True])
def test_transformers_gradient_checkpointing_under_replace_sdpa(reentrant):
    """A model on transformers' own "sdpa" attention, checkpointed by transformers."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, torch_dtype=torch.float64)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double().train()
    ids = torch.randint(0, 64, (2, 12))

    def grads():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad for p in model.parameters()]

    with replace_sdpa(strict=True) as plain:
        expected = grads()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    with replace_sdpa(strict=True) as calls:
        got = grads()
    assert plain.attngrad == 2 and calls.attngrad == 4 and not calls.pytorch
    for g, e in zip(got, expected):
        assert rel_err(g, e) < EXACT


@pytest.mark.parametrize("reentrant", [False, True])
def test_timm_vit_grad_checkpointing(reentrant):
    """timm's ViT checkpointed by its own set_grad_checkpointing(), in both of timm's modes.
    Skipped where timm does not import: it needs torchvision, and PyPI's torchvision 0.28.0 is
    a CUDA build that does not load beside torch 2.13.0+cpu (docs/api.md says how it was run)."""
    timm = pytest.importorskip("timm")
    from timm.layers import set_reentrant_ckpt, use_reentrant_ckpt

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, embed_dim=16,
                              depth=2, num_heads=2, num_classes=5).double().train()
    images = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    w = torch.randn(2, 5, dtype=torch.float64)

    def grads():
        model.zero_grad(set_to_none=True)
        (model(images) * w).sum().backward()
        return [p.grad for p in model.parameters()]

    with replace_sdpa(strict=True) as plain:
        expected = grads()
    before = use_reentrant_ckpt()
    set_reentrant_ckpt(reentrant)
    model.set_grad_checkpointing(True)
    try:
        with replace_sdpa(strict=True) as calls:
            got = grads()
    finally:
        set_reentrant_ckpt(before)
    assert plain.attngrad == 2 and calls.attngrad == 4 and not calls.pytorch
    for g, e in zip(got, expected):
        assert rel_err(g, e) < EXACT
