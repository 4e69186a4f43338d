"""Scaled dot-product attention against PyTorch's math backend and finite differences."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attngrad.check import finite_difference_gradients
from attngrad.reference import causal_mask, dropout_keep_mask, sdpa_backward, sdpa_forward

from ..conftest import EXACT, assert_all_close, rel_err

torch = pytest.importorskip("torch")
F = torch.nn.functional
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402


def torch_sdpa(q, k, v, dout, *, mask=None, bias=None, is_causal=False, scale=None, enable_gqa=False, keep=None, p=0.0):
    """PyTorch's own math kernel, float64, backward with the same dout. Returns (out, grads)."""
    t = {n: torch.tensor(a, requires_grad=True) for n, a in (("q", q), ("k", k), ("v", v)) }
    tb = None if bias is None else torch.tensor(bias, requires_grad=True)
    attn_mask = tb
    if mask is not None:
        m = torch.as_tensor(mask)
        attn_mask = m if tb is None else tb.masked_fill(~m, float("-inf"))
    if is_causal and attn_mask is not None:  # torch refuses both together: spell causal out
        tri = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        attn_mask = attn_mask & tri if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~tri, float("-inf"))
        is_causal = False
    if keep is not None:
        out, _ = torch.ops.aten._scaled_dot_product_attention_math(
            t["q"], t["k"], t["v"], attn_mask, p, is_causal, torch.as_tensor(keep), scale=scale, enable_gqa=enable_gqa
        )
    else:
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(
                t["q"], t["k"], t["v"], attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
            )
    out.backward(torch.tensor(dout))
    grads = {"dq": t["q"].grad, "dk": t["k"].grad, "dv": t["v"].grad, "dbias": None if tb is None else tb.grad}
    return out.detach().numpy(), grads


def assert_matches_torch(rng, q, k, v, floor_fraction=0.0, **options):
    ours_options = {key: value for key, value in options.items() if key not in ("keep", "p")}
    if "keep" in options:
        ours_options.update(dropout_p=options["p"], keep_mask=options["keep"])
    out, cache = sdpa_forward(q, k, v, **ours_options)
    dout = rng.standard_normal(out.shape)
    grads = sdpa_backward(dout, cache)
    ref_out, ref = torch_sdpa(q, k, v, dout, **options)
    assert rel_err(out, ref_out) < EXACT
    if options.get("bias") is not None:
        assert grads.dbias.shape == options["bias"].shape
    else:
        assert grads.dbias is None and ref["dbias"] is None
    names = [n for n in ("dq", "dk", "dv", "dbias") if ref[n] is not None]
    assert_all_close({n: getattr(grads, n) for n in names}, {n: ref[n] for n in names}, floor_fraction=floor_fraction)
    return grads


def qkv(rng, batch=2, heads=3, kv_heads=None, len_q=5, len_k=7, dk=4, dv=6):
    kv_heads = heads if kv_heads is None else kv_heads
    return (
        rng.standard_normal((batch, heads, len_q, dk)),
        rng.standard_normal((batch, kv_heads, len_k, dk)),
        rng.standard_normal((batch, kv_heads, len_k, dv)),
    )


def test_plain(rng):
    assert_matches_torch(rng, *qkv(rng))


def test_custom_scale(rng):
    assert_matches_torch(rng, *qkv(rng), scale=0.37)


@pytest.mark.parametrize("len_q,len_k", [(5, 7), (7, 5), (6, 6), (1, 4)])
def test_causal_alignment_matches_torch_also_when_lengths_differ(rng, len_q, len_k):
    assert_matches_torch(rng, *qkv(rng, len_q=len_q, len_k=len_k), is_causal=True)


def test_causal_mask_is_top_left_aligned():
    assert causal_mask(2, 4).tolist() == [[True, False, False, False], [True, True, False, False]]


@pytest.mark.parametrize("mask_shape", [(2, 3, 5, 7), (2, 1, 5, 7), (5, 7), (1, 7)])
def test_boolean_mask_broadcasts(rng, mask_shape):
    mask = rng.random(mask_shape) > 0.35
    mask[..., 0] = True
    assert_matches_torch(rng, *qkv(rng), mask=mask)


@pytest.mark.parametrize("bias_shape", [(2, 3, 5, 7), (1, 3, 5, 7), (5, 7), (3, 1, 7), (7,), (2, 1, 1, 7)])
def test_bias_gradient_is_reduced_to_the_bias_shape(rng, bias_shape):
    assert_matches_torch(rng, *qkv(rng), bias=rng.standard_normal(bias_shape))


def test_bias_constant_over_keys_has_zero_gradient(rng):
    """A bias that is the same for every key of a row shifts the row's scores by a constant,
    which softmax ignores: its gradient is 0 (the key bias b^K of MHA is such a bias)."""
    q, k, v = qkv(rng)
    out, cache = sdpa_forward(q, k, v, bias=rng.standard_normal((2, 3, 5, 1)))
    grads = sdpa_backward(rng.standard_normal(out.shape), cache)
    assert np.abs(grads.dbias).max() < 1e-14 * np.abs(grads.dq).max()


def test_bias_with_minus_inf_entries_excludes_those_keys(rng):
    q, k, v = qkv(rng)
    bias = rng.standard_normal((5, 7))
    bias[:, 3] = -np.inf
    out, cache = sdpa_forward(q, k, v, bias=bias)
    assert (cache.probs[..., 3] == 0).all()
    grads = sdpa_backward(rng.standard_normal(out.shape), cache)
    assert (grads.dbias[:, 3] == 0).all() and np.isfinite(grads.dbias).all()


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 3), (4, 1)])
def test_grouped_query_attention(rng, heads, kv_heads):
    assert_matches_torch(rng, *qkv(rng, heads=heads, kv_heads=kv_heads), enable_gqa=True)


def test_dropout_with_explicit_keep_mask(rng):
    p = 0.3
    keep = rng.random((2, 3, 5, 7)) >= p
    assert_matches_torch(rng, *qkv(rng), keep=keep, p=p)


def test_everything_at_once(rng):
    q, k, v = qkv(rng, heads=4, kv_heads=2)
    mask = rng.random((2, 1, 5, 7)) > 0.3
    mask[..., 0] = True
    keep = rng.random((2, 4, 5, 7)) >= 0.2
    assert_matches_torch(
        rng, q, k, v, mask=mask, bias=rng.standard_normal((4, 5, 7)), enable_gqa=True, keep=keep, p=0.2
    )


def test_dropout_seed_is_reproducible_and_exact(rng):
    q, k, v = qkv(rng)
    out1, cache1 = sdpa_forward(q, k, v, dropout_p=0.5, dropout_seed=11)
    out2, _ = sdpa_forward(q, k, v, dropout_p=0.5, dropout_seed=11)
    out3, _ = sdpa_forward(q, k, v, dropout_p=0.5, dropout_seed=12)
    assert np.array_equal(out1, out2) and not np.array_equal(out1, out3)
    keep = dropout_keep_mask((2, 3, 5, 7), 0.5, 11)
    assert 0.3 < keep.mean() < 0.7
    # the seed's mask is the explicit-mask computation, gradients included
    out4, cache4 = sdpa_forward(q, k, v, dropout_p=0.5, keep_mask=keep)
    assert np.array_equal(out1, out4)
    dout = rng.standard_normal(out1.shape)
    for a, b in zip(sdpa_backward(dout, cache1)[:3], sdpa_backward(dout, cache4)[:3]):
        assert np.array_equal(a, b)


def test_fully_masked_rows_give_zero_output_and_gradient_never_nan(rng):
    q, k, v = qkv(rng)
    mask = np.ones((2, 3, 5, 7), dtype=bool)
    mask[0, 1, 2] = False  # one row
    mask[1] = False  # a whole batch element
    grads = assert_matches_torch(rng, q, k, v, mask=mask)
    out, cache = sdpa_forward(q, k, v, mask=mask)
    assert (out[0, 1, 2] == 0).all() and (out[1] == 0).all()
    assert (grads.dq[0, 1, 2] == 0).all() and (grads.dq[1] == 0).all()
    assert (grads.dk[1] == 0).all() and (grads.dv[1] == 0).all()
    for g in grads[:3]:
        assert np.isfinite(g).all()


def test_causal_with_more_queries_than_keys_has_no_empty_row(rng):
    # top-left alignment: query i sees keys 0..i, so row 0 always sees key 0
    out, cache = sdpa_forward(*qkv(rng, len_q=7, len_k=3), is_causal=True)
    np.testing.assert_allclose(cache.probs.sum(-1), 1.0, atol=1e-15)


def test_against_finite_differences(rng):
    q, k, v = qkv(rng, heads=4, kv_heads=2, len_q=3, len_k=4)
    bias = rng.standard_normal((1, 4, 3, 4))
    keep = rng.random((2, 4, 3, 4)) >= 0.25
    options = dict(is_causal=True, enable_gqa=True, dropout_p=0.25, keep_mask=keep)

    def forward(x):
        return sdpa_forward(x["q"], x["k"], x["v"], bias=x["bias"], **options)[0]

    out, cache = sdpa_forward(q, k, v, bias=bias, **options)
    dout = rng.standard_normal(out.shape)
    grads = sdpa_backward(dout, cache)
    numeric = finite_difference_gradients(forward, {"q": q, "k": k, "v": v, "bias": bias}, dout)
    for ours, name in zip(grads, ("q", "k", "v", "bias")):
        assert rel_err(ours, numeric[name]) < 1e-7, name


def test_float32_is_computed_in_float32_and_close_to_float64(rng):
    q, k, v = qkv(rng)
    out64, cache64 = sdpa_forward(q, k, v, is_causal=True)
    out32, cache32 = sdpa_forward(*(a.astype(np.float32) for a in (q, k, v)), is_causal=True)
    assert out32.dtype == np.float32
    dout = rng.standard_normal(out64.shape)
    g32 = sdpa_backward(dout.astype(np.float32), cache32)
    g64 = sdpa_backward(dout, cache64)
    assert all(g.dtype == np.float32 for g in g32[:3])
    assert rel_err(out32, out64) < 1e-6
    for a, b in zip(g32[:3], g64[:3]):
        assert rel_err(a, b) < 1e-5


@st.composite
def attention_problems(draw):
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.integers(1, 3))
    sizes = dict(
        batch=draw(st.integers(1, 3)), heads=heads, kv_heads=kv_heads,
        len_q=draw(st.integers(1, 6)), len_k=draw(st.integers(1, 6)),
        dk=draw(st.integers(1, 5)), dv=draw(st.integers(1, 5)),
    )
    seed = draw(st.integers(0, 2**32 - 1))
    use_mask = draw(st.booleans())
    use_bias = draw(st.booleans())
    is_causal = draw(st.booleans())
    mask_shape = draw(st.sampled_from(["full", "per_batch", "2d"]))
    return sizes, seed, use_mask, use_bias, is_causal, mask_shape


@settings(max_examples=60, deadline=None)
@given(attention_problems())
def test_property_random_shapes_and_masks_match_torch(problem):
    sizes, seed, use_mask, use_bias, is_causal, mask_shape = problem
    rng = np.random.default_rng(seed)
    q, k, v = qkv(rng, **sizes)
    b, h, lq, lk = sizes["batch"], sizes["heads"], sizes["len_q"], sizes["len_k"]
    shape = {"full": (b, h, lq, lk), "per_batch": (b, 1, lq, lk), "2d": (lq, lk)}[mask_shape]
    options = dict(enable_gqa=sizes["heads"] != sizes["kv_heads"])
    if use_mask:
        options["mask"] = rng.random(shape) > 0.4  # fully masked rows allowed: they must give 0
    if use_bias:
        options["bias"] = rng.standard_normal(shape)
    options["is_causal"] = is_causal
    assert_matches_torch(rng, q, k, v, floor_fraction=1e-3, **options)
