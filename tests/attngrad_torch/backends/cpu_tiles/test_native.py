"""The compiled tiles (attngrad.torch.backends.cpu_tiles.native) against the torch-ops kernels and PyTorch."""

import pytest

torch = pytest.importorskip("torch")
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attngrad.torch import scaled_dot_product_attention  # noqa: E402
from attngrad.torch.backends.cpu_tiles import native, tiling  # noqa: E402
from attngrad.torch.backends.torch_ops import first_order, higher_order  # noqa: E402
from attngrad.torch.op import dispatch  # noqa: E402
from attngrad.torch.op.dropout import Placement  # noqa: E402

from ....conftest import EXACT, assert_all_close, rel_err  # noqa: E402
from ...conftest import make_call  # noqa: E402
from ...test_functional import math_sdpa  # noqa: E402
from .cases import (  # noqa: E402
    BANDS,
    CAUSAL,
    MASKING,
    WHOLE_ROW_CALLS,
    after_forward,
    at_most_one_key,
    band_bounds,
    causal_offset,
    drawn_masks,
    given_row_sums,
    needs_tiles,
    random_inputs,
    tiles_call,
    torch_ops_first_order,
    whole_row_settings,
)

TANGENTS = ("tdout", "tq", "tk", "tv", "tbias")  # the backward JVP's tangents by name, as the tests draw them


def drawn_like(seed, tensors, present):
    """Random float64 tensors shaped like `tensors`, None where `present` says 0 or the tensor is None."""
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(t.shape, generator=g, dtype=torch.float64) if keep and t is not None else None
            for t, keep in zip(tensors, present)]


def torch_ops_stats(call, dout):
    """dout and the torch-ops kernels' forward results (out, row_max, inv_sum), by name."""
    out, row_max, inv_sum = first_order.attention_forward(call)
    return dict(dout=dout, out=out, row_max=row_max, inv_sum=inv_sum)


@needs_tiles
@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 2), kv_heads=st.integers(1, 2), groups=st.integers(1, 3),
    len_q=st.integers(1, 70), len_k=st.integers(1, 70), dim=st.sampled_from([1, 5, 16]), dim_v=st.sampled_from([3, 16]),
    causal=CAUSAL, masking=MASKING, dropout_p=st.sampled_from([0.0, 0.0, 0.3, 1.0]),
    # (rows, keys, value slice): one block, many with row tails, 16-wide vectors with tails
    blocks=st.sampled_from([(128, 512, 128), (3, 5, 2), (7, 20, 4), (16, 33, 16)]),
    chunks=st.integers(1, 4), bias_grad=st.booleans(), seed=st.integers(0, 2**16),
    softcap=st.sampled_from([0.0, 0.0, 0.7]),
)
def test_tiles_match_the_torch_ops_kernels(batch, kv_heads, groups, len_q, len_k, dim, dim_v, causal, masking,
                                           dropout_p, blocks, chunks, bias_grad, seed, softcap):
    """float64, every block layout and key split, every causal diagonal, a boolean mask and a
    bias of any broadcast shape and its gradient, dropout (the same coordinate-keyed mask),
    a softcap: the same statistics, output and gradients as `kernels` to 1e-12."""
    q, k, v, dout = random_inputs(batch, kv_heads * groups, kv_heads, len_q, len_k, dim, dim_v, torch.float64, seed)
    scale, causal = dim**-0.5, causal_offset(causal, len_q, len_k)
    mask, bias = drawn_masks(masking, batch, kv_heads * groups, len_q, len_k, torch.float64, seed)
    bias_grad = bias_grad and bias is not None
    call = tiles_call(q, k, v, causal, scale, seed, mask=mask, bias=bias, dropout_p=dropout_p, softcap=softcap)
    with native.TILING.override(**dict(zip(("block_rows", "block_keys", "value_slice"), blocks))):
        ours = native.attention_forward(call)
        grads = native.attention_backward(call, after_forward(dout, ours, bias_grad=bias_grad), chunks=chunks)
    theirs, their_grads = torch_ops_first_order(call, dout, bias_grad)
    assert (grads[3] is None) is (not bias_grad)
    grads, their_grads = grads[: 3 + bias_grad], their_grads[: 3 + bias_grad]
    names = ("out", "row_max", "inv_sum", "dq", "dk", "dv", "dbias")
    for a, b in zip((*ours, *grads), (*theirs, *their_grads)):
        assert a.shape == b.shape and a.dtype == b.dtype
    # conftest's `zeros` where no row sees two keys; floor_fraction as in the other property tests
    zeros = {"dq", "dk"} if at_most_one_key(causal, len_q, len_k, mask, bias) else set()
    assert_all_close(dict(zip(names, (*ours, *grads))), dict(zip(names, (*theirs, *their_grads))), zeros=zeros,
                     floor_fraction=1e-3)


@needs_tiles
@settings(max_examples=60, deadline=None)
@given(
    **WHOLE_ROW_CALLS, chunks=st.integers(1, 4),
    present=st.sampled_from([(1, 1, 1, 1), (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (0, 0, 0, 0)]),
    dout_grad=st.booleans(), dropout_p=st.sampled_from([0.0, 0.3]), bias_grad=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_double_backward_tiles_match_the_torch_ops_kernels(batch, kv_heads, groups, len_q, len_k, dim, dim_v, causal,
                                                           masking, rows, softcap, transposed_keys, chunks, present,
                                                           dout_grad, dropout_p, bias_grad, seed):
    """float64, any subset of the cotangents (gQ, gK, gV, and gbias with the bias's
    gradient), with and without g_dO, dropout, every block height and split of the query
    blocks: `higher_order`'s results to 1e-12."""
    q, k, v, dout = random_inputs(batch, kv_heads * groups, kv_heads, len_q, len_k, dim, dim_v, torch.float64, seed)
    scale, causal = dim**-0.5, causal_offset(causal, len_q, len_k)
    mask, bias = drawn_masks(masking, batch, kv_heads * groups, len_q, len_k, torch.float64, seed)
    bias_grad = bias_grad and bias is not None
    gq, gk, gv, gbias = drawn_like(seed, (q, k, v, bias if bias_grad else None), present)
    call = tiles_call(q, k, v, causal, scale, seed, mask=mask, bias=bias, dropout_p=dropout_p, softcap=softcap)
    inputs = dict(torch_ops_stats(call, dout), dout_grad=dout_grad, bias_grad=bias_grad, gq=gq, gk=gk, gv=gv,
                  gbias=gbias)
    with whole_row_settings(rows, transposed_keys):
        ours = native.attention_double_backward(call, inputs, chunks=chunks)
    theirs = higher_order.attention_double_backward(call, **inputs)
    assert (ours[0] is None) is (not dout_grad) and (ours[4] is None) is (not bias_grad)
    names = ("g_dout", "g_q", "g_k", "g_v", "g_bias")
    kept = [i for i in range(5) if theirs[i] is not None]
    if at_most_one_key(causal, len_q, len_k, mask, bias):
        # P is 1 or 0 whatever the scores: the backward's dQ, dK, dV, dbias do not depend on
        # q, k, v or the bias, and g_q, g_k, g_v, g_bias are 0 (both sides hold rounding noise)
        for i in [1, 2, 3] + ([4] if bias_grad else []):
            assert float(ours[i].abs().max()) < EXACT and float(theirs[i].abs().max()) < EXACT, names[i]
        kept = [0] if dout_grad else []
    assert_all_close({names[i]: ours[i] for i in kept}, {names[i]: theirs[i] for i in kept}, floor_fraction=1e-3)


@needs_tiles
@settings(max_examples=40, deadline=None)
@given(
    **WHOLE_ROW_CALLS, dropout_p=st.sampled_from([0.0, 0.0, 0.3, 1.0]),
    present=st.sampled_from([(1, 1, 1, 1), (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (0, 0, 0, 0)]),
    seed=st.integers(0, 2**16),
)
def test_jvp_tiles_match_the_torch_ops_kernels(batch, kv_heads, groups, len_q, len_k, dim, dim_v, causal, masking,
                                               rows, softcap, transposed_keys, dropout_p, present, seed):
    """float64, any subset of the tangents (tQ, tK, tV, tbias), masks and a bias of any
    broadcast shape, dropout, every block height: `higher_order`'s output tangent to 1e-12."""
    q, k, v, _ = random_inputs(batch, kv_heads * groups, kv_heads, len_q, len_k, dim, dim_v, torch.float64, seed)
    scale, causal = dim**-0.5, causal_offset(causal, len_q, len_k)
    mask, bias = drawn_masks(masking, batch, kv_heads * groups, len_q, len_k, torch.float64, seed)
    tq, tk, tv, tbias = drawn_like(seed, (q, k, v, bias), present)
    call = tiles_call(q, k, v, causal, scale, seed, mask=mask, bias=bias, dropout_p=dropout_p, softcap=softcap)
    out, row_max, inv_sum = first_order.attention_forward(call)
    inputs = dict(row_max=row_max, inv_sum=inv_sum, tq=tq, tk=tk, tv=tv, tbias=tbias)
    with whole_row_settings(rows, transposed_keys):
        ours = native.attention_jvp(call, inputs)
    theirs = higher_order.attention_jvp(call, **inputs)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert_all_close({"out_t": ours}, {"out_t": theirs}, floor_fraction=1e-3)


@needs_tiles
@settings(max_examples=60, deadline=None)
@given(
    **WHOLE_ROW_CALLS, chunks=st.integers(1, 4),
    dropout_p=st.sampled_from([0.0, 0.3]), bias_grad=st.booleans(),
    present=st.sampled_from([(1, 1, 1, 1, 1), (1, 0, 0, 0, 0), (0, 1, 0, 0, 0), (0, 0, 1, 0, 0), (0, 0, 0, 1, 0),
                             (0, 0, 0, 0, 1), (0, 0, 0, 0, 0)]),
    seed=st.integers(0, 2**16),
)
def test_backward_jvp_tiles_match_the_torch_ops_kernels(batch, kv_heads, groups, len_q, len_k, dim, dim_v, causal,
                                                        masking, rows, softcap, transposed_keys, chunks, dropout_p,
                                                        bias_grad, present, seed):
    """float64, any subset of the tangents (tdO, tQ, tK, tV, tbias), masks and a bias of any
    broadcast shape with and without its gradient, dropout, every block height and split of
    the query blocks: `higher_order`'s tangents of dq, dk, dv, dbias to 1e-12. The pass with
    the backward (`with_backward`) gives the same tangents bit for bit, and `kernels`'
    gradients to 1e-12."""
    q, k, v, dout = random_inputs(batch, kv_heads * groups, kv_heads, len_q, len_k, dim, dim_v, torch.float64, seed)
    scale, causal = dim**-0.5, causal_offset(causal, len_q, len_k)
    mask, bias = drawn_masks(masking, batch, kv_heads * groups, len_q, len_k, torch.float64, seed)
    bias_grad = bias_grad and bias is not None
    tangents = drawn_like(seed, (dout, q, k, v, bias), present)
    call = tiles_call(q, k, v, causal, scale, seed, mask=mask, bias=bias, dropout_p=dropout_p, softcap=softcap)
    stats = torch_ops_stats(call, dout)
    inputs = dict(stats, bias_grad=bias_grad, **dict(zip(TANGENTS, tangents)))
    with whole_row_settings(rows, transposed_keys):
        ours, both = (native.attention_backward_jvp(call, inputs, with_backward=with_backward, chunks=chunks)
                      for with_backward in (False, True))
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(both[4:], ours))
    grads = first_order.attention_backward(call, **stats, bias_grad=bias_grad)
    grad_names = ("dq", "dk", "dv", "dbias")[: 3 + bias_grad]
    assert (both[3] is None) is (not bias_grad)
    assert_all_close(dict(zip(grad_names, both[:4])), dict(zip(grad_names, grads)), floor_fraction=1e-3)
    theirs = higher_order.attention_backward_jvp(call, **stats, bias_grad=bias_grad,
                                                   **dict(zip(TANGENTS, tangents)))
    assert (ours[3] is None) is (not bias_grad)
    names = ("dq_t", "dk_t", "dv_t", "dbias_t")[: 3 + bias_grad]
    for a, b in zip(ours, theirs):
        assert a is None or (a.shape == b.shape and a.dtype == b.dtype)
    if at_most_one_key(causal, len_q, len_k, mask, bias):
        # P is 1 or 0 whatever the scores: dq, dk (and dbias) do not move, and both sides
        # hold rounding noise there
        for i in (0, 1, 3)[: 2 + bias_grad]:
            assert float(ours[i].abs().max()) < EXACT and float(theirs[i].abs().max()) < EXACT, names[i]
        names = ("dv_t",)
        ours, theirs = ours[2:3], theirs[2:3]
    assert_all_close(dict(zip(names, ours)), dict(zip(names, theirs)), floor_fraction=1e-3)


@needs_tiles
@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 2), kv_heads=st.integers(1, 2), groups=st.integers(1, 3), len_q=st.integers(1, 60),
    len_k=st.integers(1, 60), dim=st.sampled_from([1, 5, 16]), dim_v=st.sampled_from([3, 16]), causal=CAUSAL,
    masking=MASKING, blocks=st.sampled_from([(128, 512), (3, 5), (7, 20), (16, 33)]), chunks=st.integers(1, 4),
    softcap=st.sampled_from([0.0, 0.0, 0.7]), dropout_p=st.sampled_from([0.0, 0.0, 0.3]),
    present=st.sampled_from([(1, 1, 1, 1, 1), (1, 0, 0, 0, 0), (0, 1, 0, 0, 0), (0, 0, 1, 0, 0), (0, 0, 0, 1, 0),
                             (0, 0, 0, 0, 1), (0, 1, 1, 1, 0)]),
    seed=st.integers(0, 2**16),
)
# two keys, one wide: dq' = scale dS'_1 (K_1 - K_2), O(1) terms cancelling to 3e-4 (a draw that failed)
@example(batch=2, kv_heads=2, groups=1, len_q=14, len_k=2, dim=1, dim_v=3, causal="bottom-right",
         masking=("mask", (0, 0, 0, 0)), blocks=(128, 512), chunks=1, softcap=0.0, dropout_p=0.0,
         present=(0, 1, 0, 0, 0), seed=14)
def test_backward_jvp_given_sums_matches_the_torch_ops_kernels(batch, kv_heads, groups, len_q, len_k, dim, dim_v,
                                                               causal, masking, blocks, chunks, softcap, dropout_p,
                                                               present, seed):
    """The backward's JVP on the backward's tiles, given each row's centre and D' (the
    torch-ops kernels' sums): float64, any subset of the tangents, masks and a bias of any
    broadcast shape, dropout, a soft cap, GQA, every tile size and split of the keys:
    `higher_order`'s tangents of dq, dk, dv to 1e-12; with the backward, `kernels`'
    gradients to 1e-12 and the same tangents bit for bit."""
    q, k, v, dout = random_inputs(batch, kv_heads * groups, kv_heads, len_q, len_k, dim, dim_v, torch.float64, seed)
    scale, causal = dim**-0.5, causal_offset(causal, len_q, len_k)
    mask, bias = drawn_masks(masking, batch, kv_heads * groups, len_q, len_k, torch.float64, seed)
    tangents = drawn_like(seed, (dout, q, k, v, bias), present)
    call = tiles_call(q, k, v, causal, scale, seed, mask=mask, bias=bias, dropout_p=dropout_p, softcap=softcap)
    stats = torch_ops_stats(call, dout)
    centre, delta_t = given_row_sums(call, stats, tangents)
    inputs = dict(stats, row_sums=dict(centre=centre, delta_t=delta_t), **dict(zip(TANGENTS, tangents)))
    with native.TILING.override(block_rows=blocks[0], block_keys=blocks[1]):
        ours, both = (native.attention_backward_jvp_given_sums(call, inputs, with_backward=with_backward, chunks=chunks)
                      for with_backward in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(both[3:], ours))
    grads = first_order.attention_backward(call, **stats, bias_grad=False)
    assert_all_close(dict(zip(("dq", "dk", "dv"), both[:3])), dict(zip(("dq", "dk", "dv"), grads[:3])),
                     floor_fraction=1e-3)
    theirs = higher_order.attention_backward_jvp(call, **stats, bias_grad=False,
                                                   **dict(zip(TANGENTS, tangents)))[:3]
    names = ("dq_t", "dk_t", "dv_t")
    if at_most_one_key(causal, len_q, len_k, mask, bias):
        # P is 1 or 0 whatever the scores: dq and dk do not move (rounding noise on both sides)
        for i in (0, 1):
            assert float(ours[i].abs().max()) < EXACT and float(theirs[i].abs().max()) < EXACT, names[i]
        names, ours, theirs = ("dv_t",), ours[2:3], theirs[2:3]
    # a floor of 1e-2 of the largest tangent, not 1e-3: a tangent can be the difference of the
    # products over a row's few keys (the example above: errors of 5e-16, 1.8e-12 of its size)
    assert_all_close(dict(zip(names, ours)), dict(zip(names, theirs)), floor_fraction=1e-2)


@needs_tiles
@pytest.mark.parametrize("causal,dropout_p", [(None, 0.0), (0, 0.0), (0, 0.3), (-3, 0.3)])
def test_backward_jvp_given_sums_on_a_part_of_the_keys(causal, dropout_p):
    """A ring step's backward JVP: the keys split in two calls whose placement says they are
    a part of each row's (dropout drawn at the whole's coordinates), each given the whole
    rows' statistics and sums. dQ' is the parts' sum, dK' and dV' the parts side by side:
    the whole call's, to 1e-12."""
    q, k, v, dout = random_inputs(2, 4, 2, 23, 31, 8, 6, torch.float64, 4)
    g = torch.Generator().manual_seed(5)
    tangents = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (dout, q, k, v)] + [None]
    scale, seed, split = 0.3, 11, 13
    call = tiles_call(q, k, v, causal, scale, seed, dropout_p=dropout_p)
    stats = torch_ops_stats(call, dout)
    centre, delta_t = given_row_sums(call, stats, tangents)
    inputs = dict(stats, row_sums=dict(centre=centre, delta_t=delta_t), **dict(zip(TANGENTS[:4], tangents)))
    whole = native.attention_backward_jvp_given_sums(call, inputs)
    parts = []
    for lo, hi in ((0, split), (split, 31)):
        part_causal = None if causal is None else causal - lo
        part = tiles_call(q, k[:, :, lo:hi], v[:, :, lo:hi], part_causal, scale, Placement(seed, 0, lo, 0, 1),
                          dropout_p=dropout_p)
        tk, tv = tangents[2][:, :, lo:hi], tangents[3][:, :, lo:hi]
        parts.append(native.attention_backward_jvp_given_sums(part, dict(inputs, tk=tk, tv=tv)))
    joined = (parts[0][0] + parts[1][0], torch.cat([parts[0][1], parts[1][1]], 2),
              torch.cat([parts[0][2], parts[1][2]], 2))
    theirs = higher_order.attention_backward_jvp(call, **stats, bias_grad=False,
                                                   **dict(zip(TANGENTS, tangents)))[:3]
    names = ("dq_t", "dk_t", "dv_t")
    assert_all_close(dict(zip(names, whole)), dict(zip(names, theirs)))
    assert_all_close(dict(zip(names, joined)), dict(zip(names, theirs)))


@needs_tiles
def test_forward_jvp_writes_each_rows_centre():
    """Given a buffer, the forward's JVP writes each row's centre rowsum(P * S') there: the
    torch-ops kernels' to 1e-12 (0 for a row that sees no key)."""
    q, k, v, dout = random_inputs(2, 4, 2, 37, 29, 8, 6, torch.float64, 6)
    mask = torch.rand(2, 1, 37, 29, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[0, :, 5] = False  # a row that sees no key
    g = torch.Generator().manual_seed(7)
    tq, tk, tv = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (q, k, v))
    centre = torch.full((2, 4, 37), float("nan"), dtype=torch.float64)
    call = tiles_call(q, k, v, 0, 0.3, mask=mask)
    tangents = dict(tq=tq, tk=tk, tv=tv, row_sums=dict(centre_sums=centre))
    out, row_max, inv_sum, _ = native.attention_forward_jvp(call, tangents)
    stats = dict(dout=dout, out=out, row_max=row_max, inv_sum=inv_sum)
    theirs, _ = given_row_sums(call, stats, (None, tq, tk, tv, None))
    assert float(centre[0, :, 5].abs().max()) == 0.0
    assert_all_close({"centre": centre}, {"centre": theirs[..., 0]})


@needs_tiles
@pytest.mark.parametrize("chunks", [None, 3])
def test_fused_passes_write_their_primal_results_into_the_given_tensors(chunks):
    """Given `results`, the forward's JVP writes out and its statistics there, and the
    backward's JVP given sums the gradient (over stale contents: dq, dk, dv are sums), the
    same numbers as into new tensors; a tensor of another shape or dtype is refused by name."""
    q, k, v, dout = random_inputs(2, 4, 2, 37, 29, 8, 6, torch.float64, 8)
    g = torch.Generator().manual_seed(9)
    tq, tk, tv = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (q, k, v))
    call, tangents = tiles_call(q, k, v, 0, 0.3), dict(tq=tq, tk=tk, tv=tv)
    fresh = native.attention_forward_jvp(call, tangents)
    held = [torch.full_like(t, float("nan")) for t in fresh[:3]]
    given = native.attention_forward_jvp(call, dict(tangents, row_sums=dict(results=held)))
    assert all(a is b for a, b in zip(given[:3], held))
    assert all(torch.equal(a, b) for a, b in zip(given, fresh))
    centre, delta_t = (torch.randn(2, 4, 37, 1, generator=g, dtype=torch.float64) for _ in range(2))
    inputs = after_forward(dout, fresh[:3], tdout=None, **tangents)

    def given_sums(**results):
        row_sums = dict(centre=centre, delta_t=delta_t, **results)
        return native.attention_backward_jvp_given_sums(call, dict(inputs, row_sums=row_sums), with_backward=True,
                                                        chunks=chunks)

    fresh = given_sums()
    held = [torch.full_like(t, 7.0) for t in (q, k, v)]
    given = given_sums(results=held)
    assert all(a is b for a, b in zip(given[:3], held))
    assert all(torch.equal(a, b) for a, b in zip(given, fresh))
    with pytest.raises(ValueError, match=r"results\[1\] is \(2, 2, 29, 8\) torch.float32"):
        given_sums(results=[held[0], held[1].float(), held[2]])


@needs_tiles
@pytest.mark.parametrize("is_causal", [False, True])
def test_float32_tiles_agree_with_float64(is_causal):
    """float32 through the vectorised exp and the explicit SIMD loops, in all three passes:
    within float32 rounding of the float64 tiles (a wrong polynomial or lane would be off by
    far more)."""
    q, k, v, dout = random_inputs(2, 4, 2, 200, 300, 64, 64, torch.float64, 5)
    causal = 0 if is_causal else None
    cotangents = [torch.randn_like(t) for t in (q, k, v)]
    results = []
    for dtype in (torch.float64, torch.float32):
        call = tiles_call(*(t.to(dtype) for t in (q, k, v)), causal, 0.125)
        out, row_max, inv_sum = native.attention_forward(call)
        inputs = after_forward(dout.to(dtype), (out, row_max, inv_sum))
        grads = native.attention_backward(call, inputs)[:3]
        cot = dict(zip(("gq", "gk", "gv"), (c.to(dtype) for c in cotangents)))
        second = native.attention_double_backward(call, dict(inputs, dout_grad=True, **cot))[:4]
        results.append((out, inv_sum, *grads, *second))
    names = ("out", "inv_sum", "dq", "dk", "dv", "g_dout", "g_q", "g_k", "g_v")
    for name, exact, single in zip(names, *results):
        error = float((single.double() - exact).norm() / exact.norm())
        assert error < 1e-6, (name, error)


@needs_tiles
def test_tiles_run_behind_the_public_function_and_are_deterministic(monkeypatch):
    """No mask, bias or dropout: the public function takes the tiles (same bits as calling
    them), gives the same bits twice, and matches PyTorch's math backend in float64."""
    q, k, v, dout = random_inputs(2, 6, 3, 150, 90, 16, 8, torch.float64, 9)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for is_causal in (False, True):
        runs = []
        for _ in range(2):
            out = scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
            runs.append((out, *torch.autograd.grad(out, [q, k, v], dout)))
        assert all(torch.equal(a, b) for a, b in zip(*runs))
        direct = native.attention_forward(tiles_call(q.detach(), k.detach(), v.detach(), 0 if is_causal else None,
                                                     0.25))[0]
        assert torch.equal(runs[0][0], direct)
        ref = math_sdpa(q, k, v, is_causal=is_causal, enable_gqa=True)
        for ours, theirs in zip(runs[0], (ref, *torch.autograd.grad(ref, [q, k, v], dout))):
            assert rel_err(ours, theirs) < EXACT


@needs_tiles
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("len_q,dim,dim_v", [(1, 64, 64), (1, 100, 72), (129, 7, 100)])
def test_one_row_tiles_take_the_row_products(dtype, len_q, dim, dim_v):
    """A tile of one query row (a decode step; the last row of 129 in 128-row blocks) has its
    products from csrc/row_products.h in every pass, not the BLAS: a bias with its gradient,
    several key blocks (700 keys, beta = 1 sums), head widths with and without a tail past
    the vectors. float64 holds against PyTorch's math path; float32 against float64 within
    its own rounding."""
    q, k, v, dout = random_inputs(2, 4, 2, len_q, 700, dim, dim_v, torch.float64, 17)
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(4, len_q, 700, generator=g, dtype=torch.float64)
    cot = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (q, k, v)]
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    ref = math_sdpa(*leaves[:3], attn_mask=leaves[3], enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, leaves, dout, create_graph=True)
    ref_second = torch.autograd.grad(ref_grads[:3], leaves[:3], cot)
    results = []
    for precision in (torch.float64, dtype):
        leaves = [t.to(precision).requires_grad_() for t in (q, k, v, bias)]
        out = scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3], enable_gqa=True)
        grads = torch.autograd.grad(out, leaves, dout.to(precision), create_graph=True)
        second = torch.autograd.grad(grads[:3], leaves[:3], [c.to(precision) for c in cot])
        results.append([t.double() for t in (out, *grads, *second)])
    for exact, theirs in zip(results[0], (ref, *ref_grads, *ref_second)):
        assert rel_err(exact, theirs) < EXACT
    if dtype == torch.float32:
        for single, exact in zip(*results):
            assert rel_err(single, exact) < 1e-5


@needs_tiles
def test_a_broadcast_bias_gradient_takes_no_copy_per_batch_entry_or_head():
    """The batch entries and heads that share a broadcast bias are one work item, so its
    gradient needs a part per key chunk only where the bias broadcasts along the keys (then
    it is small), never a bias-sized copy per batch entry or head."""
    q, k, v, _ = random_inputs(3, 4, 2, 37, 300, 8, 8, torch.float32, 0)

    def parts(bias_sizes, backward_jvp=False):
        theirs = torch.ops.attngrad_tiles.bias_grad_parts(list(bias_sizes), 5, backward_jvp)  # what the ops check
        ours = native._bias_grad_parts(bias_sizes, 5, backward_jvp)  # what native.py allocates
        assert ours == theirs
        return ours

    assert parts((1, 4, 37, 300)) == parts((1, 1, 37, 300)) == parts((3, 4, 37, 300)) == 1
    assert parts((1, 1, 37, 1)) == 5  # per key, summed over key chunks: 5 parts of 37 numbers
    assert parts((1, 1, 1, 300), backward_jvp=True) == 5
    with pytest.raises(RuntimeError, match="bias_sizes must have 4 entries"):
        torch.ops.attngrad_tiles.bias_grad_parts([37, 300], 5, False)  # the backward's JVP chunks the query rows
    assert tiling.independent_items(k, (1, 4, 37, 300)) == 2 and tiling.independent_items(k, None) == 6


@needs_tiles
@pytest.mark.parametrize("shape", [(2, 4, 37, 300), (4, 37, 300), (2, 1, 1, 300), (1, 4, 1, 300), (37, 300), (1, 4, 37, 1)])
@pytest.mark.parametrize("expanded", [False, True])
def test_bias_gradient_parts_add_up(shape, expanded):
    """The bias gradient of each broadcast shape, as given or expanded (stride 0) to the
    scores' shape (then its gradient is per entry): work items that add into the same
    entries (other batch entries, key/value heads, key chunks) own separate parts, added in
    order. Against the torch-ops kernels, for 1 and 3 key chunks, GQA, causal. A bias
    constant along the keys has gradient sum_j dS_ij = 0: there both sides hold rounding."""
    q, k, v, dout = random_inputs(2, 4, 2, 37, 300, 8, 8, torch.float64, 5)
    bias = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    if expanded:
        bias = bias.expand(2, 4, 37, 300)
    stats, theirs = torch_ops_first_order(make_call(q, k, v, bias=bias, causal=0, scale=0.3), dout, bias_grad=True)
    with native.TILING.override(block_keys=64):
        for chunks in (1, 3):
            ours = native.attention_backward(tiles_call(q, k, v, 0, 0.3, bias=bias),
                                             after_forward(dout, stats, bias_grad=True), chunks=chunks)
            assert ours[3].shape == bias.shape
            names = ("dq", "dk", "dv", "dbias")
            if bias.shape[-1] == 1:
                assert float(ours[3].abs().max()) < EXACT and float(theirs[3].abs().max()) < EXACT
                names = names[:3]
            assert_all_close(dict(zip(names, ours)), dict(zip(names, theirs)))


def test_what_the_tiles_take():
    """The tiles backend takes CPU calls in any float dtype (half computed in float32), with
    masks and a bias, and refuses an empty axis and other devices, saying why."""
    from attngrad.torch.backends import cpu_tiles as tiles

    q, k, v, _ = random_inputs(1, 2, 2, 5, 6, 4, 4, torch.float64, 0)

    def refusal(q, k, v, **masks):
        return tiles.BACKEND.refuses(make_call(q, k, v, **masks), "forward", {})

    assert refusal(q, k, v) is None
    assert refusal(q, k, v, mask=torch.ones(5, 6, dtype=torch.bool), bias=torch.zeros(5, 6, dtype=torch.float64)) is None
    assert refusal(q.half(), k.half(), v.half()) is None  # computed in float32
    assert refusal(q, k[..., :0, :], v[..., :0, :]) == "it takes no empty dimension"
    assert "runs on the CPU" in refusal(q.to("meta"), k.to("meta"), v.to("meta"))


def test_use_implementation_chooses_and_counts():
    """The choice is the user's: torch-ops alone, tiles alone (a call they cannot run raises,
    never silently runs elsewhere), and `ran` says what ran, backward passes included."""
    from attngrad.torch import ran, use_backend

    q, k, v, dout = random_inputs(1, 2, 2, 5, 6, 4, 4, torch.float64, 0)
    q.requires_grad_()
    ran.clear()
    with use_backend("torch-ops"):
        out = scaled_dot_product_attention(q, k, v)
        out.backward(dout)
    assert dict(ran) == {("forward", "torch-ops"): 1, ("backward", "torch-ops"): 1}
    if native.library() is None:
        return
    ran.clear()
    with use_backend("tiles"):
        scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)
        with pytest.raises(RuntimeError, match="no allowed backend runs this forward call.*tiles: it takes no empty dimension"):
            scaled_dot_product_attention(q, k[..., :0, :], v[..., :0, :])  # an empty axis
        torch.func.jvp(lambda q: scaled_dot_product_attention(q, k, v), (q.detach(),), (torch.ones_like(q),))
        # forward mode alone: the forward and its JVP in one pass
        assert dict(ran) == {("forward", "tiles"): 1, ("backward", "tiles"): 1, ("forward_jvp", "tiles"): 1}
        dq, = torch.autograd.grad(scaled_dot_product_attention(q, k, v, dropout_p=0.5).sum(), q, create_graph=True)
        dq.sum().backward()  # dropout's double backward, on the tiles too
        assert ran[("double_backward", "tiles")] == 1
    assert dispatch.allowed() == dispatch.registered()
    with pytest.raises(ValueError, match="one or more of"):
        with use_backend("flash"):
            pass


@needs_tiles
@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 2), kv_heads=st.integers(1, 2), groups=st.integers(1, 2), len_q=st.integers(1, 90),
    len_k=st.integers(1, 90), dim=st.sampled_from([5, 16]), dim_v=st.sampled_from([3, 16]), causal=CAUSAL,
    masking=MASKING, band=BANDS, width=st.integers(1, 20), block_keys=st.sampled_from([7, 16, 2048]),
    chunks=st.integers(1, 3), dropout_p=st.sampled_from([0.0, 0.3]), softcap=st.sampled_from([0.0, 0.7]),
    bias_grad=st.booleans(), seed=st.integers(0, 2**16),
)
def test_narrow_band_tiles_from_transposed_keys_match_the_torch_ops_kernels(
        batch, kv_heads, groups, len_q, len_k, dim, dim_v, causal, masking, band, width, block_keys, chunks,
        dropout_p, softcap, bias_grad, seed):
    """A narrow band's forward and backward on query blocks of a quarter of block_rows take
    S and dP from transposed copies of K and V (csrc/pass.h, BandKeys): a copy per run of
    query blocks in the forward, per key block in the backward (blocks of 7 and 16 keys
    split the runs' ranges), with masks, a bias and its gradient, dropout, a softcap, GQA and
    any causal diagonal: float64 results equal the torch-ops kernels' to 1e-12."""
    heads = kv_heads * groups
    q, k, v, dout = random_inputs(batch, heads, kv_heads, len_q, len_k, dim, dim_v, torch.float64, seed)
    scale, causal = dim**-0.5, causal_offset(causal, len_q, len_k)
    mask, bias = drawn_masks(masking, batch, heads, len_q, len_k, torch.float64, seed)
    bias_grad = bias_grad and bias is not None
    bounds = band_bounds(band, batch, len_q, len_k, width, seed)
    call = tiles_call(q, k, v, causal, scale, seed, mask=mask, bias=bias, dropout_p=dropout_p, softcap=softcap,
                      bounds=bounds)
    taken = {}
    run = native._run

    def recording(name, call, layout, *args, **kwargs):
        taken[name] = layout.transposed_keys, layout.block_rows
        return run(name, call, layout, *args, **kwargs)

    # always a quarter of 16 rows: 4 rows a block
    tiling = dict(block_rows=16, band_row_cost=(1e9, 1e9, 1.0), narrow_block_keys=block_keys, band_transpose_rows=1)
    with pytest.MonkeyPatch.context() as patch, native.TILING.override(**tiling):
        patch.setattr(native, "_run", recording)
        ours = native.attention_forward(call)
        grads = native.attention_backward(call, after_forward(dout, ours, bias_grad=bias_grad), chunks=chunks)
    # a quarter of block_rows wherever the blocks cover any score (else the cost ties at 0)
    assert taken["forward"] == taken["backward"] == (taken["forward"][1] <= 4, taken["forward"][1])
    call = make_call(q, k, v, mask, bias, bounds, seed=torch.tensor(seed), causal=causal, scale=scale,
                     softcap=softcap, dropout_p=dropout_p)
    theirs, their_grads = torch_ops_first_order(call, dout, bias_grad)
    grads, their_grads = grads[: 3 + bias_grad], their_grads[: 3 + bias_grad]
    names = ("out", "row_max", "inv_sum", "dq", "dk", "dv", "dbias")
    keys = torch.arange(len_k)
    in_bounds = (keys >= bounds[..., :1]) & (keys < bounds[..., 1:])  # (B or 1, Lq, Lk)
    allowed = in_bounds[:, None] if mask is None else in_bounds[:, None] & mask
    zeros = {"dq", "dk"} if at_most_one_key(causal, len_q, len_k, allowed, bias) else set()
    assert_all_close(dict(zip(names, (*ours, *grads))), dict(zip(names, (*theirs, *their_grads))), zeros=zeros,
                     floor_fraction=1e-3)
