"""PyTorch's whole input range: causal masks of both alignments (CausalBias objects too),
empty dimensions, broadcasting and extra batch dimensions, 1-D masks, dropout_p = 1,
GQA on 3-D inputs; each against PyTorch's math backend in float64, on both
implementations."""

import pytest

torch = pytest.importorskip("torch")
from torch.nn.attention.bias import causal_lower_right, causal_upper_left  # noqa: E402

from attngrad.torch import attention, create_block_mask, scaled_dot_product_attention  # noqa: E402

from ..conftest import EXACT, rel_err  # noqa: E402
from .conftest import math_sdpa  # noqa: E402

_seeds = iter(range(10_000))


def rand(*shape, grad=True):
    g = torch.Generator().manual_seed(next(_seeds))
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)


def both(ours_fn, ref_fn, leaves):
    """Output and the gradient of every leaf, with one random dout, from both functions."""
    ours = ours_fn(*leaves)
    ref = ref_fn(*leaves)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    if ref.numel() == 0:
        dout = torch.zeros_like(ref)
    else:
        dout = rand(*ref.shape, grad=False)
    needs = [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad(ours, needs, dout, allow_unused=True, materialize_grads=True)
    ref_grads = torch.autograd.grad(ref, needs, dout, allow_unused=True, materialize_grads=True)
    return (ours, *grads), (ref, *ref_grads)


def assert_same(ours, ref):
    for a, b in zip(ours, ref):
        assert a.shape == b.shape, (a.shape, b.shape)
        assert not a.isnan().any()
        if b.numel():
            assert rel_err(a, b) < EXACT


def dense_causal(len_q, len_k, bottom_right):
    offset = len_k - len_q if bottom_right else 0
    return torch.ones(len_q, len_k, dtype=torch.bool).tril(diagonal=offset)


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs:UserWarning")  # PyTorch's own kernels
@pytest.mark.parametrize("len_q,len_k", [(23, 56), (56, 23), (16, 16), (1, 9), (9, 1)])
@pytest.mark.parametrize("lower_right", [False, True])
def test_causal_bias_objects(many_blocks, backend, len_q, len_k, lower_right):
    """PyTorch's CausalBias masks (a tensor subclass whose storage is not the mask) of either
    alignment, with Lq < Lk and Lq > Lk, where some rows see no key: PyTorch's math backend
    on the equivalent dense mask, to 1e-12."""
    make = causal_lower_right if lower_right else causal_upper_left
    leaves = [rand(2, 3, len_q, 8), rand(2, 3, len_k, 8), rand(2, 3, len_k, 5)]
    ours, ref = both(lambda q, k, v: scaled_dot_product_attention(q, k, v, attn_mask=make(len_q, len_k)),
                     lambda q, k, v: math_sdpa(q, k, v, attn_mask=dense_causal(len_q, len_k, lower_right)), leaves)
    assert type(ours[0]) is torch.Tensor  # not a CausalBias: its class must not leak into the output
    assert_same(ours, ref)


def test_causal_bias_of_other_sizes_is_refused():
    q, k = rand(1, 2, 5, 4, grad=False), rand(1, 2, 7, 4, grad=False)
    with pytest.raises(ValueError, match=r"CausalBias for \(Lq, Lk\) = \(5, 8\)"):
        scaled_dot_product_attention(q, k, k, attn_mask=causal_lower_right(5, 8))
    with pytest.raises(ValueError, match="not both"):
        scaled_dot_product_attention(q, k, k, attn_mask=causal_lower_right(5, 7), is_causal=True)


@pytest.mark.parametrize("len_q,len_k", [(7, 19), (19, 7), (12, 12)])
@pytest.mark.parametrize("full_bias", [False, True])
def test_bottom_right_with_mask_bias_and_gqa(many_blocks, backend, len_q, len_k, full_bias):
    """attention(is_causal="bottom_right") with a boolean mask, a learned bias (one per head
    and key, or one per score) and GQA: the dense mask's result, and the bias's gradient,
    0 on the rows that see no key (Lq > Lk)."""
    keep = torch.rand(2, 1, len_q, len_k, generator=torch.Generator().manual_seed(3)) > 0.2
    bias = rand(2, 6, len_q, len_k) if full_bias else rand(6, 1, len_k)
    leaves = [rand(2, 6, len_q, 8), rand(2, 2, len_k, 8), rand(2, 2, len_k, 5), bias]

    def ours(q, k, v, bias):
        return attention(q, k, v, attn_mask=keep, attn_bias=bias, is_causal="bottom_right", enable_gqa=True)

    def ref(q, k, v, bias):
        allowed = keep & dense_causal(len_q, len_k, True)
        return math_sdpa(q, k, v, attn_mask=bias.masked_fill(~allowed, float("-inf")), enable_gqa=True)

    assert_same(*both(ours, ref, leaves))


def test_bad_causal_alignment():
    q = rand(1, 2, 5, 4, grad=False)
    with pytest.raises(ValueError, match="bottom_right"):
        attention(q, q, q, is_causal="lower")


EMPTY = {
    "Lq=0": ((2, 3, 0, 4), (2, 3, 5, 4), (2, 3, 5, 4)),
    "Lk=0": ((2, 3, 4, 4), (2, 3, 0, 4), (2, 3, 0, 4)),
    "H=0": ((2, 0, 4, 4), (2, 0, 5, 4), (2, 0, 5, 4)),
    "B=0": ((0, 3, 4, 4), (0, 3, 5, 4), (0, 3, 5, 4)),
    "E=0": ((2, 3, 4, 0), (2, 3, 5, 0), (2, 3, 5, 4)),
    "Ev=0": ((2, 3, 4, 4), (2, 3, 5, 4), (2, 3, 5, 0)),
}


@pytest.mark.parametrize("name", list(EMPTY))
@pytest.mark.parametrize("is_causal", [False, True])
def test_empty_dimensions(name, is_causal):
    """As PyTorch: empty outputs, zero gradients; with E = 0 every score is 0 (the mean of
    the values), with Lk = 0 the output is 0. The tiles refuse an empty dimension, so the
    registry hands these calls to the torch-ops kernels (`test_backends` checks the refusal)."""
    leaves = [rand(*shape) for shape in EMPTY[name]]
    assert_same(*both(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=is_causal),
                      lambda q, k, v: math_sdpa(q, k, v, is_causal=is_causal), leaves))


BROADCAST = {
    "query batch 1, keys batch 2": ((1, 3, 5, 4), (2, 3, 6, 4), (2, 3, 6, 3)),
    "key batch 1": ((2, 3, 5, 4), (1, 3, 6, 4), (2, 3, 6, 3)),
    "key heads 1 (broadcast)": ((2, 3, 5, 4), (2, 1, 6, 4), (2, 1, 6, 3)),
    "query heads 1 (broadcast)": ((2, 1, 5, 4), (2, 3, 6, 4), (2, 3, 6, 3)),
    "two batch dimensions": ((2, 2, 3, 5, 4), (2, 2, 3, 6, 4), (2, 2, 3, 6, 3)),
    "two batch dimensions, broadcast": ((1, 2, 3, 5, 4), (2, 1, 3, 6, 4), (2, 1, 3, 6, 3)),
    "3-D": ((3, 5, 4), (3, 6, 4), (3, 6, 3)),
    "2-D": ((5, 4), (6, 4), (6, 3)),
    "4-D query, 3-D keys": ((2, 3, 5, 4), (3, 6, 4), (3, 6, 3)),
}


@pytest.mark.parametrize("name", list(BROADCAST))
def test_broadcast_and_leading_dimensions(many_blocks, backend, name):
    """Leading dimensions broadcast and fold into one batch, the heads broadcast too: the
    math backend's output and gradients (summed over what broadcast), with a causal mask."""
    leaves = [rand(*shape) for shape in BROADCAST[name]]
    assert_same(*both(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True),
                      lambda q, k, v: math_sdpa(q, k, v, is_causal=True), leaves))


@pytest.mark.parametrize("mask_shape", [(6,), (5, 6), (2, 1, 3, 5, 6), (1, 1, 1, 6)])
def test_masks_of_any_rank(many_blocks, mask_shape):
    """A boolean mask of 1 to 5 dimensions, and a float mask of the same shape with its
    gradient, over inputs with two batch dimensions."""
    g = torch.Generator().manual_seed(4)
    keep = torch.rand(mask_shape, generator=g) > 0.3
    leaves = [rand(2, 2, 3, 5, 4), rand(2, 2, 3, 6, 4), rand(2, 2, 3, 6, 3), rand(*mask_shape)]
    assert_same(*both(lambda q, k, v, b: scaled_dot_product_attention(q, k, v, attn_mask=keep),
                      lambda q, k, v, b: math_sdpa(q, k, v, attn_mask=keep), leaves))
    assert_same(*both(lambda q, k, v, b: scaled_dot_product_attention(q, k, v, attn_mask=b),
                      lambda q, k, v, b: math_sdpa(q, k, v, attn_mask=b), leaves))


@pytest.mark.parametrize("shapes", [((6, 5, 4), (2, 7, 4), (2, 7, 3)), ((2, 2, 6, 5, 4), (2, 2, 2, 7, 4), (2, 2, 2, 7, 3))])
def test_gqa_on_3d_and_5d_inputs(backend, shapes):
    leaves = [rand(*shape) for shape in shapes]
    assert_same(*both(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                      lambda q, k, v: math_sdpa(q, k, v, is_causal=True, enable_gqa=True), leaves))


def test_dropout_one_gives_zeros():
    """dropout_p = 1 drops every score, as PyTorch: output and gradients 0, no NaN."""
    leaves = [rand(2, 3, 5, 4), rand(2, 3, 6, 4), rand(2, 3, 6, 3)]
    ours, ref = both(lambda q, k, v: scaled_dot_product_attention(q, k, v, dropout_p=1.0),
                     lambda q, k, v: math_sdpa(q, k, v, dropout_p=1.0), leaves)
    for a in ours:
        assert not a.isnan().any() and float(a.detach().abs().max()) == 0.0
    assert float(ref[0].detach().abs().max()) == 0.0


@pytest.mark.parametrize("shape,is_causal", [((9, 9), True), ((12, 5), "bottom_right"), ((6, 1), False), ((1, 8), True)])
def test_float32_single_key_rows_are_exact(backend, shape, is_causal):
    """float32, a row that sees one key: P = 1 there, so its dq row is exactly 0, and where
    every row sees one key so is dk; double backward likewise. (Recomputed scores once gave
    P = 1 - 1.8e-7 and dq, dk of 3e-7.)"""
    len_q, len_k = shape
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g).requires_grad_() for n in (len_q, len_k, len_k))
    out = attention(q, k, v, is_causal=is_causal)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=g), create_graph=True)
    offset = 0 if is_causal in (True, False) else len_k - len_q
    seen = torch.arange(len_q) + offset + 1 if is_causal else torch.full((len_q,), len_k)
    single = seen.clamp(0, len_k) == 1
    assert single.any()
    assert float(dq[:, :, single].detach().abs().max()) == 0.0
    # forward mode: P' = 0 there, so the output's tangent is the one key's tV alone
    tangents = tuple(torch.randn(t.shape, generator=g) for t in (q, k, v))
    out_t = torch.func.jvp(lambda *a: attention(*a, is_causal=is_causal), (q.detach(), k.detach(), v.detach()),
                           tangents)[1]
    first = int(seen[single][0]) - 1  # the key those rows see
    assert torch.equal(out_t[:, :, single], tangents[2][:, :, first, None].expand_as(out_t[:, :, single]))
    if bool(single.all()):
        assert float(dk.detach().abs().max()) == 0.0
        g_q, g_k = torch.autograd.grad((dv * dv).sum(), (q, k))
        assert float(g_q.abs().max()) == 0.0 and float(g_k.abs().max()) == 0.0


@pytest.mark.parametrize("given", ["attn_mask", "block_mask"])
@pytest.mark.parametrize("small_tiles", [False, True])
def test_float32_single_key_rows_under_a_mask(backend, small_tiles, given, request):
    """The same through a boolean mask that leaves one key to some rows, in the first key
    block or a later one; with small tiles each row's keys span several blocks, so no block
    holds all of a row's keys. The mask given whole or kept per block (`mask_blocks`)."""
    if small_tiles:
        request.getfixturevalue("many_blocks")
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 3, 10, 16, generator=g).requires_grad_()
    k, v = (torch.randn(2, 3, 45, 16, generator=g).requires_grad_() for _ in range(2))
    keep = torch.rand(10, 45, generator=g) > 0.5
    keep[::2] = False
    keep[0:6:2, 3] = True  # rows 0, 2, 4: key 3 alone
    keep[6::2, 41] = True  # rows 6, 8: key 41 alone
    masked = dict(attn_mask=keep)
    if given == "block_mask":
        masked = dict(block_mask=create_block_mask(lambda b, h, q_idx, kv_idx: keep[q_idx, kv_idx], None, None, 10, 45,
                                                   BLOCK_SIZE=(3, 8)))
        assert masked["block_mask"].blocks is not None
    out = attention(q, k, v, **masked)
    dq, dk = torch.autograd.grad(out, (q, k), torch.randn(out.shape, generator=g), create_graph=True)
    assert float(dq[:, :, ::2].detach().abs().max()) == 0.0
    assert float(dq[:, :, 1::2].detach().abs().max()) > 0.0
    # forward mode: P' = 0 on those rows, so the output's tangent is the one key's tV alone
    tangents = tuple(torch.randn(t.shape, generator=g) for t in (q, k, v))
    out_t = torch.func.jvp(lambda *a: attention(*a, **masked), (q.detach(), k.detach(), v.detach()), tangents)[1]
    assert torch.equal(out_t[:, :, 0:6:2], tangents[2][:, :, 3, None].expand_as(out_t[:, :, 0:6:2]))
    assert torch.equal(out_t[:, :, 6::2], tangents[2][:, :, 41, None].expand_as(out_t[:, :, 6::2]))
