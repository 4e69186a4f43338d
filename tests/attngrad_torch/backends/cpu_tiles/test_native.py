"""The compiled tiles (attngrad.torch.backends.cpu_tiles.native) against the torch-ops kernels and PyTorch."""

import contextlib
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch")
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attngrad.torch import scaled_dot_product_attention  # noqa: E402
from attngrad.torch.backends.cpu_tiles import native  # noqa: E402
from attngrad.torch.backends.torch_ops import first_order as kernels  # noqa: E402
from attngrad.torch.backends.torch_ops import higher_order as kernels_higher  # noqa: E402
from attngrad.torch.masks import block_map  # noqa: E402
from attngrad.torch.masks import version_cache as kept  # noqa: E402
from attngrad.torch.op import dispatch  # noqa: E402

from ....conftest import EXACT, assert_all_close, rel_err  # noqa: E402
from ...conftest import make_call  # noqa: E402
from ...test_functional import math_sdpa  # noqa: E402

compiler = shutil.which(os.environ.get("CXX", "c++"))
needs_tiles = pytest.mark.skipif(native.library() is None, reason=f"no compiled tiles: {native.build_info.reason}")


@pytest.mark.skipif(compiler is None, reason="no C++ compiler")
def test_tiles_are_built_where_there_is_a_compiler():
    """A silent fallback would leave the compiled path untested and slow: with a compiler
    and PyTorch's BLAS at hand, the library must load."""
    assert native.library() is not None, native.build_info.reason


# The causal diagonal: none, top-left, bottom-right, or any offset from "no row sees a key"
# to "every row sees every key" (a ring step of context parallelism meets all of these).
CAUSAL = st.one_of(st.none(), st.just("top-left"), st.just("bottom-right"), st.integers(-80, 80))


def _diagonal(causal, len_q, len_k):
    """The op's causal offset for a drawn CAUSAL value."""
    return {"top-left": 0, "bottom-right": len_k - len_q}.get(causal, causal)


def _at_most_one_key(causal, len_q, len_k, mask=None, bias=None):
    """Whether no row sees two keys: then P is 1 or 0 everywhere whatever the scores, dQ and
    dK are 0, and both sides hold rounding noise there."""
    allowed = torch.ones(len_q, len_k, dtype=torch.bool)
    if causal is not None:
        allowed = allowed.tril(causal)
    if mask is not None:
        allowed = allowed & mask
    if bias is not None:
        allowed = allowed & (bias > float("-inf"))
    return int(allowed.sum(dim=-1).max()) <= 1


# Which of a boolean mask and a float bias a call has, and the axes each broadcasts along
MASKING = st.tuples(st.sampled_from(["none", "mask", "bias", "both"]),
                    st.sampled_from([(1, 1, 0, 0), (0, 1, 0, 0), (1, 0, 1, 0), (0, 0, 0, 0), (1, 1, 1, 0)]))


def _masks(masking, batch, heads, len_q, len_k, dtype, seed):
    """(mask or None, bias or None) for a drawn MASKING: a mask that drops about a third of
    the keys (some rows all of them), a bias with some -inf entries; 1 along the axes marked."""
    kind, broadcast = masking
    shape = tuple(1 if one else n for one, n in zip(broadcast, (batch, heads, len_q, len_k)))
    g = torch.Generator().manual_seed(seed + 2)
    mask = bias = None
    if kind in ("mask", "both"):
        mask = torch.rand(shape, generator=g) > 0.35
    if kind in ("bias", "both"):
        bias = torch.randn(shape, generator=g, dtype=dtype).masked_fill(torch.rand(shape, generator=g) < 0.1, float("-inf"))
    return mask, bias


# The calls of the whole-row passes' property tests (JVP, the backward's JVP, double
# backward): shapes with GQA and Lq != Lk, causal diagonals, masks, and block heights of
# 3 rows (many blocks, row tails) or 128 (one block).
WHOLE_ROW_CALLS = dict(
    batch=st.integers(1, 2), kv_heads=st.integers(1, 2), groups=st.integers(1, 3), len_q=st.integers(1, 50),
    len_k=st.integers(1, 50), dim=st.sampled_from([1, 5, 16]), dim_v=st.sampled_from([3, 16]), causal=CAUSAL,
    masking=MASKING, rows=st.sampled_from([3, 128]), softcap=st.sampled_from([0.0, 0.0, 0.7]),
    transposed_keys=st.booleans(),
)


@contextlib.contextmanager
def _whole_row_settings(rows: int, transposed_keys: bool):
    """The whole-row passes' block height, and whether they take the key side transposed
    (csrc/whole_rows.h, KeySide) or in place, for the calls inside."""
    keys = native.TILING().transposed_keys if transposed_keys else 0
    with native.TILING.override(block_rows=rows, transposed_keys=keys):
        yield


def _inputs(batch, heads, kv_heads, len_q, len_k, dim, dim_v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, len_q, dim, generator=g, dtype=dtype)
    k = torch.randn(batch, kv_heads, len_k, dim, generator=g, dtype=dtype)
    v = torch.randn(batch, kv_heads, len_k, dim_v, generator=g, dtype=dtype)
    dout = torch.randn(batch, heads, len_q, dim_v, generator=g, dtype=dtype)
    return q, k, v, dout


def _query_blocks_taken(monkeypatch, q, k, v, dout, causal, **masks) -> dict:
    """The rows per query block the compiled forward and backward took, by pass name."""
    rows = {}

    def recording(name, *args, **kwargs):
        rows[name] = kwargs["block_rows"]
        return run(name, *args, **kwargs)

    run = native._run
    monkeypatch.setattr(native, "_run", recording)
    out, row_max, inv_sum = native.attention_forward(q, k, v, causal, 0.3, **masks)
    native.attention_backward(dout, q, k, v, out, row_max, inv_sum, causal, 0.3, **masks)
    return rows


@needs_tiles
@pytest.mark.parametrize("len_q,causal,dtype,short", [
    (128, 0, torch.float32, True), (300, -5, torch.float64, True), (1, 4095, torch.float32, True),
    (128, None, torch.float32, False), (1024, 0, torch.float32, False), (128, 0, torch.bfloat16, False)])
def test_forward_and_backward_take_the_same_query_blocks(monkeypatch, len_q, causal, dtype, short):
    """The backward recomputes the forward's scores bit for bit only where its tiles are the
    forward's: both passes take their query blocks from `_block_rows`, smaller than
    BLOCK_ROWS for a short causal call (its blocks skip more of the masked triangle) unless
    its products are bfloat16's."""
    q, k, v, dout = _inputs(2, 2, 2, len_q, 4096 if len_q == 1 else len_q, 8, 8, dtype, 0)
    rows = _query_blocks_taken(monkeypatch, q, k, v, dout, causal)
    assert rows["forward"] == rows["backward"] == native._block_rows(len_q, k.shape[2], causal, dtype == torch.bfloat16)
    assert (rows["forward"] < native.TILING().block_rows) is short


@needs_tiles
@pytest.mark.parametrize("band", ["window", "documents"])
def test_bounds_take_the_query_blocks_whose_tiles_cover_least(monkeypatch, band):
    """Under key bounds both passes take `_band_rows`'s query blocks: fewer rows for a
    causal sliding window (a block of R rows spans R + 255 keys for 256 a row), BLOCK_ROWS
    for documents whose rows share their bounds (a block spans its document alone)."""
    len_q = 1024
    rows_at = torch.arange(len_q)
    if band == "window":
        lo, hi = (rows_at - 255).clamp(min=0), rows_at + 1
    else:
        lo = rows_at // 256 * 256
        hi = lo + 256
    bounds = torch.stack([lo, hi], -1)[None]
    q, k, v, dout = _inputs(1, 2, 2, len_q, len_q, 8, 8, torch.float32, 0)
    causal = 0 if band == "window" else None  # a causal diagonal would cut each document's blocks too
    rows = _query_blocks_taken(monkeypatch, q, k, v, dout, causal, bounds=bounds)
    assert rows["forward"] == rows["backward"]
    assert (rows["forward"] < native.TILING().block_rows) is (band == "window")


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
    q, k, v, dout = _inputs(batch, kv_heads * groups, kv_heads, len_q, len_k, dim, dim_v, torch.float64, seed)
    scale, causal = dim**-0.5, _diagonal(causal, len_q, len_k)
    mask, bias = _masks(masking, batch, kv_heads * groups, len_q, len_k, torch.float64, seed)
    bias_grad = bias_grad and bias is not None
    with native.TILING.override(**dict(zip(("block_rows", "block_keys", "value_slice"), blocks))):
        ours = native.attention_forward(q, k, v, causal, scale, mask=mask, bias=bias, seed=seed, dropout_p=dropout_p,
                                        softcap=softcap)
        grads = native.attention_backward(dout, q, k, v, *ours, causal, scale, chunks=chunks, mask=mask, bias=bias,
                                          seed=seed, dropout_p=dropout_p, bias_grad=bias_grad, softcap=softcap)
    theirs = kernels.attention_forward(q, k, v, mask, bias, seed, causal, scale, softcap, dropout_p)
    their_grads = kernels.attention_backward(dout, q, k, v, mask, bias, seed, *theirs, causal, scale, softcap,
                                             dropout_p, bias_grad)
    assert (grads[3] is None) is (not bias_grad)
    grads, their_grads = grads[: 3 + bias_grad], their_grads[: 3 + bias_grad]
    names = ("out", "row_max", "inv_sum", "dq", "dk", "dv", "dbias")
    for a, b in zip((*ours, *grads), (*theirs, *their_grads)):
        assert a.shape == b.shape and a.dtype == b.dtype
    # conftest's `zeros` where no row sees two keys; floor_fraction as in the other property tests
    zeros = {"dq", "dk"} if _at_most_one_key(causal, len_q, len_k, mask, bias) else set()
    assert_all_close(dict(zip(names, (*ours, *grads))), dict(zip(names, (*theirs, *their_grads))), zeros=zeros,
                     floor_fraction=1e-3)


@needs_tiles
@pytest.mark.parametrize("len_q, len_k, causal, rows", [(200, 200, True, 32), (300, 340, True, 64),
                                                        (300, 340, False, 256)])
def test_double_backward_at_its_own_block_heights(len_q, len_k, causal, rows):
    """The whole-row passes take blocks of 2 BLOCK_ROWS rows, a causal call's BLOCK_ROWS, and a
    short causal call's double backward fewer (`Tiling.whole_rows`, `double_causal_rows`). At the
    library's own settings, several blocks and a short last one (bottom-right where causal),
    float64: `kernels_higher`'s results to 1e-12."""
    causal = len_k - len_q if causal else None
    assert native._whole_row_split(torch.empty(1, 1, len_q, 1), torch.empty(1, 1, len_k, 1), {}, False, 1, causal,
                                   double_backward=True)[0] == rows
    q, k, v, dout = _inputs(2, 4, 2, len_q, len_k, 24, 16, torch.float64, 5)
    g = torch.Generator().manual_seed(6)
    gq, gk, gv = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (q, k, v))
    scale = 24**-0.5
    out, row_max, inv_sum = kernels.attention_forward(q, k, v, None, None, 0, causal, scale, 0.0, 0.0)
    ours = native.attention_double_backward(dout, q, k, v, out, row_max, inv_sum, causal, scale, True, gq, gk, gv)
    theirs = kernels_higher.attention_double_backward(dout, q, k, v, None, None, 0, out, row_max, inv_sum, causal,
                                                      scale, 0.0, 0.0, False, True, gq, gk, gv, None)
    names = ("g_dout", "g_q", "g_k", "g_v")
    assert_all_close(dict(zip(names, ours[:4])), dict(zip(names, theirs[:4])))


def test_whole_row_blocks_are_taller_where_nothing_bands_the_keys():
    """2 BLOCK_ROWS rows per block for a full call, up to DOUBLE_TILE numbers a tile; BLOCK_ROWS
    for a causal call, key bounds (a window) or a block mask, whose taller blocks would span
    keys their rows do not see."""
    q = torch.empty(1, 1, 4096, 1)

    def rows(len_k, causal=None, **masks):
        return native._whole_row_split(q, torch.empty(1, 1, len_k, 1), masks, False, 1, causal)[0]

    tiling = native.TILING()
    assert rows(4096) == 2 * tiling.block_rows == 256 and rows(8192) == tiling.double_tile // 8192 == 128
    assert rows(4096, 0) == rows(4096, key_bounds=torch.zeros(1)) == rows(4096, mask_blocks=object()) == 128


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
    blocks: `kernels_higher`'s results to 1e-12."""
    q, k, v, dout = _inputs(batch, kv_heads * groups, kv_heads, len_q, len_k, dim, dim_v, torch.float64, seed)
    scale, causal = dim**-0.5, _diagonal(causal, len_q, len_k)
    mask, bias = _masks(masking, batch, kv_heads * groups, len_q, len_k, torch.float64, seed)
    bias_grad = bias_grad and bias is not None
    g = torch.Generator().manual_seed(seed + 1)
    gq, gk, gv, gbias = (torch.randn(t.shape, generator=g, dtype=torch.float64) if keep and t is not None else None
                         for t, keep in zip((q, k, v, bias if bias_grad else None), present))
    out, row_max, inv_sum = kernels.attention_forward(q, k, v, mask, bias, seed, causal, scale, softcap, dropout_p)
    with _whole_row_settings(rows, transposed_keys):
        ours = native.attention_double_backward(dout, q, k, v, out, row_max, inv_sum, causal, scale, dout_grad,
                                                gq, gk, gv, chunks=chunks, mask=mask, bias=bias, gbias=gbias,
                                                seed=seed, dropout_p=dropout_p, bias_grad=bias_grad, softcap=softcap)
    theirs = kernels_higher.attention_double_backward(dout, q, k, v, mask, bias, seed, out, row_max, inv_sum, causal,
                                                      scale, softcap, dropout_p, bias_grad, dout_grad, gq, gk, gv,
                                                      gbias)
    assert (ours[0] is None) is (not dout_grad) and (ours[4] is None) is (not bias_grad)
    names = ("g_dout", "g_q", "g_k", "g_v", "g_bias")
    kept = [i for i in range(5) if theirs[i] is not None]
    if _at_most_one_key(causal, len_q, len_k, mask, bias):
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
    broadcast shape, dropout, every block height: `kernels_higher`'s output tangent to 1e-12."""
    q, k, v, _ = _inputs(batch, kv_heads * groups, kv_heads, len_q, len_k, dim, dim_v, torch.float64, seed)
    scale, causal = dim**-0.5, _diagonal(causal, len_q, len_k)
    mask, bias = _masks(masking, batch, kv_heads * groups, len_q, len_k, torch.float64, seed)
    g = torch.Generator().manual_seed(seed + 1)
    tq, tk, tv, tbias = (torch.randn(t.shape, generator=g, dtype=torch.float64) if keep and t is not None else None
                         for t, keep in zip((q, k, v, bias), present))
    out, row_max, inv_sum = kernels.attention_forward(q, k, v, mask, bias, seed, causal, scale, softcap, dropout_p)
    with _whole_row_settings(rows, transposed_keys):
        ours = native.attention_jvp(q, k, v, row_max, inv_sum, causal, scale, tq, tk, tv, mask=mask, bias=bias,
                                    tbias=tbias, seed=seed, dropout_p=dropout_p, softcap=softcap)
    theirs = kernels_higher.attention_jvp(q, k, v, mask, bias, seed, row_max, inv_sum, causal, scale, softcap,
                                          dropout_p, tq, tk, tv, tbias)
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
    the query blocks: `kernels_higher`'s tangents of dq, dk, dv, dbias to 1e-12. The pass with
    the backward (`with_backward`) gives the same tangents bit for bit, and `kernels`'
    gradients to 1e-12."""
    q, k, v, dout = _inputs(batch, kv_heads * groups, kv_heads, len_q, len_k, dim, dim_v, torch.float64, seed)
    scale, causal = dim**-0.5, _diagonal(causal, len_q, len_k)
    mask, bias = _masks(masking, batch, kv_heads * groups, len_q, len_k, torch.float64, seed)
    bias_grad = bias_grad and bias is not None
    g = torch.Generator().manual_seed(seed + 1)
    tangents = [torch.randn(t.shape, generator=g, dtype=torch.float64) if keep and t is not None else None
                for t, keep in zip((dout, q, k, v, bias), present)]
    out, row_max, inv_sum = kernels.attention_forward(q, k, v, mask, bias, seed, causal, scale, softcap, dropout_p)
    with _whole_row_settings(rows, transposed_keys):
        ours, both = (native.attention_backward_jvp(dout, q, k, v, out, row_max, inv_sum, causal, scale, *tangents[:4],
                                                    mask=mask, bias=bias, tbias=tangents[4], seed=seed,
                                                    dropout_p=dropout_p, bias_grad=bias_grad, chunks=chunks,
                                                    softcap=softcap, with_backward=with_backward)
                      for with_backward in (False, True))
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(both[4:], ours))
    grads = kernels.attention_backward(dout, q, k, v, mask, bias, seed, out, row_max, inv_sum, causal, scale, softcap,
                                       dropout_p, bias_grad)
    grad_names = ("dq", "dk", "dv", "dbias")[: 3 + bias_grad]
    assert (both[3] is None) is (not bias_grad)
    assert_all_close(dict(zip(grad_names, both[:4])), dict(zip(grad_names, grads)), floor_fraction=1e-3)
    theirs = kernels_higher.attention_backward_jvp(dout, q, k, v, mask, bias, seed, out, row_max, inv_sum, causal,
                                                   scale, softcap, dropout_p, bias_grad, *tangents)
    assert (ours[3] is None) is (not bias_grad)
    names = ("dq_t", "dk_t", "dv_t", "dbias_t")[: 3 + bias_grad]
    for a, b in zip(ours, theirs):
        assert a is None or (a.shape == b.shape and a.dtype == b.dtype)
    if _at_most_one_key(causal, len_q, len_k, mask, bias):
        # P is 1 or 0 whatever the scores: dq, dk (and dbias) do not move, and both sides
        # hold rounding noise there
        for i in (0, 1, 3)[: 2 + bias_grad]:
            assert float(ours[i].abs().max()) < EXACT and float(theirs[i].abs().max()) < EXACT, names[i]
        names = ("dv_t",)
        ours, theirs = ours[2:3], theirs[2:3]
    assert_all_close(dict(zip(names, ours)), dict(zip(names, theirs)), floor_fraction=1e-3)


def _row_sums(dout, q, k, v, out, row_max, inv_sum, mask, bias, seed, causal, scale, softcap, dropout_p, tangents):
    """The torch-ops kernels' whole-row sums (B, H, Lq, 1) for tangents (tdO, tQ, tK, tV,
    tbias): the centre rowsum(P * S') and D' = rowsum(tdO * O + dO * O')."""
    tdout, tq, tk, tv, tbias = tangents
    centre = torch.zeros(*q.shape[:3], 1, dtype=q.dtype)
    args = (q, k, v, mask, bias, seed, row_max, inv_sum, causal, scale, softcap, dropout_p, tq, tk, tv, tbias)
    kernels_higher.attention_jvp(*args, centre=torch.zeros_like(centre), centre_sums=centre)  # adds rowsum(P * S')
    delta_t = (dout * kernels_higher.attention_jvp(*args)).sum(-1, keepdim=True)
    if tdout is not None:
        delta_t += (tdout * out).sum(-1, keepdim=True)
    return centre, delta_t


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
    `kernels_higher`'s tangents of dq, dk, dv to 1e-12; with the backward, `kernels`'
    gradients to 1e-12 and the same tangents bit for bit."""
    q, k, v, dout = _inputs(batch, kv_heads * groups, kv_heads, len_q, len_k, dim, dim_v, torch.float64, seed)
    scale, causal = dim**-0.5, _diagonal(causal, len_q, len_k)
    mask, bias = _masks(masking, batch, kv_heads * groups, len_q, len_k, torch.float64, seed)
    g = torch.Generator().manual_seed(seed + 1)
    tangents = [torch.randn(t.shape, generator=g, dtype=torch.float64) if keep and t is not None else None
                for t, keep in zip((dout, q, k, v, bias), present)]
    out, row_max, inv_sum = kernels.attention_forward(q, k, v, mask, bias, seed, causal, scale, softcap, dropout_p)
    centre, delta_t = _row_sums(dout, q, k, v, out, row_max, inv_sum, mask, bias, seed, causal, scale, softcap,
                                dropout_p, tangents)
    with native.TILING.override(block_rows=blocks[0], block_keys=blocks[1]):
        ours, both = (native.attention_backward_jvp_given_sums(
            dout, q, k, v, out, row_max, inv_sum, causal, scale, *tangents[:4], centre, delta_t, mask=mask, bias=bias,
            tbias=tangents[4], seed=seed, dropout_p=dropout_p, chunks=chunks, softcap=softcap,
            with_backward=with_backward) for with_backward in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(both[3:], ours))
    grads = kernels.attention_backward(dout, q, k, v, mask, bias, seed, out, row_max, inv_sum, causal, scale, softcap,
                                       dropout_p, False)
    assert_all_close(dict(zip(("dq", "dk", "dv"), both[:3])), dict(zip(("dq", "dk", "dv"), grads[:3])),
                     floor_fraction=1e-3)
    theirs = kernels_higher.attention_backward_jvp(dout, q, k, v, mask, bias, seed, out, row_max, inv_sum, causal,
                                                   scale, softcap, dropout_p, False, *tangents)[:3]
    names = ("dq_t", "dk_t", "dv_t")
    if _at_most_one_key(causal, len_q, len_k, mask, bias):
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
    q, k, v, dout = _inputs(2, 4, 2, 23, 31, 8, 6, torch.float64, 4)
    g = torch.Generator().manual_seed(5)
    tangents = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (dout, q, k, v)] + [None]
    scale, seed, split = 0.3, 11, 13
    out, row_max, inv_sum = kernels.attention_forward(q, k, v, None, None, seed, causal, scale, 0.0, dropout_p)
    centre, delta_t = _row_sums(dout, q, k, v, out, row_max, inv_sum, None, None, seed, causal, scale, 0.0,
                                dropout_p, tangents)
    whole = native.attention_backward_jvp_given_sums(dout, q, k, v, out, row_max, inv_sum, causal, scale,
                                                     *tangents[:4], centre, delta_t, seed=seed, dropout_p=dropout_p)
    parts = []
    for lo, hi in ((0, split), (split, 31)):
        part_causal = None if causal is None else causal - lo
        tk, tv = tangents[2][:, :, lo:hi], tangents[3][:, :, lo:hi]
        parts.append(native.attention_backward_jvp_given_sums(
            dout, q, k[:, :, lo:hi], v[:, :, lo:hi], out, row_max, inv_sum, part_causal, scale, tangents[0],
            tangents[1], tk, tv, centre, delta_t, seed=native.Placement(seed, 0, lo, 0, 1), dropout_p=dropout_p))
    joined = (parts[0][0] + parts[1][0], torch.cat([parts[0][1], parts[1][1]], 2),
              torch.cat([parts[0][2], parts[1][2]], 2))
    theirs = kernels_higher.attention_backward_jvp(dout, q, k, v, None, None, seed, out, row_max, inv_sum, causal,
                                                   scale, 0.0, dropout_p, False, *tangents)[:3]
    names = ("dq_t", "dk_t", "dv_t")
    assert_all_close(dict(zip(names, whole)), dict(zip(names, theirs)))
    assert_all_close(dict(zip(names, joined)), dict(zip(names, theirs)))


@needs_tiles
def test_forward_jvp_writes_each_rows_centre():
    """Given a buffer, the forward's JVP writes each row's centre rowsum(P * S') there: the
    torch-ops kernels' to 1e-12 (0 for a row that sees no key)."""
    q, k, v, dout = _inputs(2, 4, 2, 37, 29, 8, 6, torch.float64, 6)
    mask = torch.rand(2, 1, 37, 29, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[0, :, 5] = False  # a row that sees no key
    g = torch.Generator().manual_seed(7)
    tq, tk, tv = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (q, k, v))
    centre = torch.full((2, 4, 37), float("nan"), dtype=torch.float64)
    out, row_max, inv_sum, _ = native.attention_forward_jvp(q, k, v, 0, 0.3, tq, tk, tv, mask=mask, centre=centre)
    theirs, _ = _row_sums(dout, q, k, v, out, row_max, inv_sum, mask, None, 0, 0, 0.3, 0.0, 0.0,
                          (None, tq, tk, tv, None))
    assert float(centre[0, :, 5].abs().max()) == 0.0
    assert_all_close({"centre": centre}, {"centre": theirs[..., 0]})


@needs_tiles
@pytest.mark.parametrize("chunks", [None, 3])
def test_fused_passes_write_their_primal_results_into_the_given_tensors(chunks):
    """Given `results`, the forward's JVP writes out and its statistics there, and the
    backward's JVP given sums the gradient (over stale contents: dq, dk, dv are sums), the
    same numbers as into new tensors; a tensor of another shape or dtype is refused by name."""
    q, k, v, dout = _inputs(2, 4, 2, 37, 29, 8, 6, torch.float64, 8)
    g = torch.Generator().manual_seed(9)
    tq, tk, tv = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (q, k, v))
    fresh = native.attention_forward_jvp(q, k, v, 0, 0.3, tq, tk, tv)
    held = [torch.full_like(t, float("nan")) for t in fresh[:3]]
    given = native.attention_forward_jvp(q, k, v, 0, 0.3, tq, tk, tv, results=held)
    assert all(a is b for a, b in zip(given[:3], held))
    assert all(torch.equal(a, b) for a, b in zip(given, fresh))
    out, row_max, inv_sum, out_t = fresh
    centre, delta_t = (torch.randn(2, 4, 37, 1, generator=g, dtype=torch.float64) for _ in range(2))
    args = (dout, q, k, v, out, row_max, inv_sum, 0, 0.3, None, tq, tk, tv, centre, delta_t)
    fresh = native.attention_backward_jvp_given_sums(*args, with_backward=True, chunks=chunks)
    held = [torch.full_like(t, 7.0) for t in (q, k, v)]
    given = native.attention_backward_jvp_given_sums(*args, with_backward=True, chunks=chunks, results=held)
    assert all(a is b for a, b in zip(given[:3], held))
    assert all(torch.equal(a, b) for a, b in zip(given, fresh))
    with pytest.raises(ValueError, match=r"results\[1\] is \(2, 2, 29, 8\) torch.float32"):
        native.attention_backward_jvp_given_sums(*args, with_backward=True, results=[held[0], held[1].float(), held[2]])


@needs_tiles
@pytest.mark.parametrize("is_causal", [False, True])
def test_float32_tiles_agree_with_float64(is_causal):
    """float32 through the vectorised exp and the explicit SIMD loops, in all three passes:
    within float32 rounding of the float64 tiles (a wrong polynomial or lane would be off by
    far more)."""
    q, k, v, dout = _inputs(2, 4, 2, 200, 300, 64, 64, torch.float64, 5)
    causal = 0 if is_causal else None
    cotangents = [torch.randn_like(t) for t in (q, k, v)]
    results = []
    for dtype in (torch.float64, torch.float32):
        args, do = [t.to(dtype) for t in (q, k, v)], dout.to(dtype)
        out, row_max, inv_sum = native.attention_forward(*args, causal, 0.125)
        grads = native.attention_backward(do, *args, out, row_max, inv_sum, causal, 0.125)[:3]
        second = native.attention_double_backward(do, *args, out, row_max, inv_sum, causal, 0.125, True,
                                                  *(c.to(dtype) for c in cotangents))[:4]
        results.append((out, inv_sum, *grads, *second))
    names = ("out", "inv_sum", "dq", "dk", "dv", "g_dout", "g_q", "g_k", "g_v")
    for name, exact, single in zip(names, *results):
        error = float((single.double() - exact).norm() / exact.norm())
        assert error < 1e-6, (name, error)


@needs_tiles
def test_tiles_run_behind_the_public_function_and_are_deterministic(monkeypatch):
    """No mask, bias or dropout: the public function takes the tiles (same bits as calling
    them), gives the same bits twice, and matches PyTorch's math backend in float64."""
    q, k, v, dout = _inputs(2, 6, 3, 150, 90, 16, 8, torch.float64, 9)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for is_causal in (False, True):
        runs = []
        for _ in range(2):
            out = scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
            runs.append((out, *torch.autograd.grad(out, [q, k, v], dout)))
        assert all(torch.equal(a, b) for a, b in zip(*runs))
        direct = native.attention_forward(q.detach(), k.detach(), v.detach(), 0 if is_causal else None, 0.25)[0]
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
    q, k, v, dout = _inputs(2, 4, 2, len_q, 700, dim, dim_v, torch.float64, 17)
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
def test_key_chunks_give_the_same_gradients():
    """One head on several threads splits its keys into chunks, each with its own dQ sum."""
    q, k, v, dout = _inputs(1, 1, 1, 300, 1100, 16, 16, torch.float64, 3)
    stats = native.attention_forward(q, k, v, 0, 0.25)
    one = native.attention_backward(dout, q, k, v, *stats, 0, 0.25, chunks=1)[:3]
    for chunks in (2, 3, 8):
        for a, b in zip(native.attention_backward(dout, q, k, v, *stats, 0, 0.25, chunks=chunks)[:3], one):
            assert rel_err(a, b) < EXACT


@needs_tiles
def test_a_broadcast_bias_gradient_takes_no_copy_per_batch_entry_or_head():
    """The batch entries and heads that share a broadcast bias are one work item, so its
    gradient needs a part per key chunk only where the bias broadcasts along the keys (then
    it is small), never a bias-sized copy per batch entry or head."""
    q, k, v, _ = _inputs(3, 4, 2, 37, 300, 8, 8, torch.float32, 0)

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
    assert native._independent(k, (1, 4, 37, 300)) == 2 and native._independent(k, None) == 6


@needs_tiles
@pytest.mark.parametrize("shape", [(2, 4, 37, 300), (4, 37, 300), (2, 1, 1, 300), (1, 4, 1, 300), (37, 300), (1, 4, 37, 1)])
@pytest.mark.parametrize("expanded", [False, True])
def test_bias_gradient_parts_add_up(shape, expanded):
    """The bias gradient of each broadcast shape, as given or expanded (stride 0) to the
    scores' shape (then its gradient is per entry): work items that add into the same
    entries (other batch entries, key/value heads, key chunks) own separate parts, added in
    order. Against the torch-ops kernels, for 1 and 3 key chunks, GQA, causal. A bias
    constant along the keys has gradient sum_j dS_ij = 0: there both sides hold rounding."""
    q, k, v, dout = _inputs(2, 4, 2, 37, 300, 8, 8, torch.float64, 5)
    bias = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    if expanded:
        bias = bias.expand(2, 4, 37, 300)
    stats = kernels.attention_forward(q, k, v, None, bias, 0, 0, 0.3, 0.0, 0.0)
    theirs = kernels.attention_backward(dout, q, k, v, None, bias, 0, *stats, 0, 0.3, 0.0, 0.0, True)
    with native.TILING.override(block_keys=64):
        for chunks in (1, 3):
            ours = native.attention_backward(dout, q, k, v, *stats, 0, 0.3, chunks=chunks, bias=bias, bias_grad=True)
            assert ours[3].shape == bias.shape
            names = ("dq", "dk", "dv", "dbias")
            if bias.shape[-1] == 1:
                assert float(ours[3].abs().max()) < EXACT and float(theirs[3].abs().max()) < EXACT
                names = names[:3]
            assert_all_close(dict(zip(names, ours)), dict(zip(names, theirs)))


def test_a_failed_build_falls_back_with_a_warning(monkeypatch, tmp_path):
    from attngrad.torch.backends.cpu_tiles import build as native_build

    monkeypatch.setenv("ATTNGRAD_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    monkeypatch.setattr(native_build, "_loaded", None)  # as a fresh process, which loaded no build yet
    native.library.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert native.library() is None
        assert len(caught) == 1, [str(w.message) for w in caught]  # one warning, and it says why
        assert "compiled attention tiles are unavailable" in str(caught[0].message)
        assert "failed" in native.build_info.reason and "false" in native.build_info.reason  # names the compiler
        assert not native.available()
        q, k, v, _ = _inputs(1, 2, 2, 5, 6, 4, 4, torch.float64, 0)
        assert dispatch.choose("forward", make_call(q, k, v)).name == "torch-ops"
        out = scaled_dot_product_attention(q, k, v)  # the torch-ops kernels run instead
        assert rel_err(out, math_sdpa(q, k, v)) < EXACT
        monkeypatch.setenv("ATTNGRAD_NATIVE", "0")
        native.library.cache_clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # turned off on purpose: no warning
            assert native.library() is None
        assert native.build_info.reason == "turned off by ATTNGRAD_NATIVE=0"
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
        native.library()


@needs_tiles
def test_a_second_build_in_one_process_is_refused_not_loaded(monkeypatch):
    """PyTorch takes one TORCH_LIBRARY per namespace and process: where the build's key
    changes under a process that has loaded the tiles (sources edited, another target CPU),
    the tiles fall back with a warning that says why, and nothing is built or loaded (a
    second library's registration would end the process)."""
    from attngrad.torch.backends.cpu_tiles import build as native_build

    loaded = native.library()
    monkeypatch.setenv("ATTNGRAD_MARCH", "x86-64-v2")  # another key, not built in this cache
    monkeypatch.setattr(native_build, "_build", lambda *args: pytest.fail("a second build was made"))
    native.library.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert native.library() is None
        assert len(caught) == 1 and "another build of the tiles is loaded" in native.build_info.reason
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert native.library() == loaded and native.available()


@needs_tiles
def test_a_failed_openmp_build_is_tried_again_without_it(monkeypatch):
    """Where the build with the OpenMP flag fails (Apple's clang refuses it), library()
    builds again without it and warns that the tiles run on one thread (the build itself:
    the next test, in scripts/portable_tiles.sh)."""
    from attngrad.torch.backends.cpu_tiles import build as native_build

    loaded = native.library()
    tried = []

    def load_or_build(openmp: bool):
        tried.append(openmp)
        if openmp:
            raise RuntimeError("c++: error: unrecognized command-line option '-fopenmp'")
        return loaded

    monkeypatch.setattr(native_build, "_load_or_build", load_or_build)
    native.library.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert native.library() == loaded and native.build_info.reason is None
        assert tried == [True, False] and len(caught) == 1 and "without OpenMP" in str(caught[0].message)
        assert "-fopenmp" in native_build.flags() and "-fopenmp" not in native_build.flags(openmp=False)
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert native.library() == loaded


@needs_tiles
@pytest.mark.skipif(os.environ.get("ATTNGRAD_BUILD_TESTS") != "1",
                    reason="builds the tiles again (10 s): scripts/portable_tiles.sh runs it, before csrc/ changes land")
def test_a_compiler_without_openmp_still_builds_the_tiles(tmp_path):
    """Where the compiler refuses the OpenMP flag (Apple's clang), the tiles are built
    without it and run, on one thread, with a warning that says so (a fresh process: one
    build of the tiles per process)."""
    script = textwrap.dedent("""
        import warnings, torch
        from attngrad.torch.backends.cpu_tiles import build as native_build, native
        native_build.OPENMP_FLAGS = ("-fopenmp", "-fattngrad-no-such-flag")
        native_build.FLAGS = ("-O0", *native_build.FLAGS[1:])  # the fallback is the point here, not speed
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert native.library() is not None, native.build_info.reason
        assert any("without OpenMP" in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert "-fattngrad-no-such-flag" not in native_build.flags(openmp=False)
        from attngrad.torch import attention, ran, use_implementation
        q = torch.randn(1, 2, 9, 4, dtype=torch.float64)
        with use_implementation("tiles"):
            out = attention(q, q, q, is_causal=True)
        ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert float((out - ref).abs().max()) < 1e-12 and ran[("forward", "tiles")] == 1
        print("ok")
    """)
    env = {**os.environ, "ATTNGRAD_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_a_build_says_so_on_stderr_and_a_cached_load_is_quiet(monkeypatch, tmp_path, capsys):
    """A first use waits 10-60 s for the build: it says so once on stderr, with the cache
    folder, then how long it took. A process that finds the build loads it in silence.
    (No compiler runs here: _build and the load are stand-ins.)"""
    from attngrad.torch.backends.cpu_tiles import build as native_build

    monkeypatch.setenv("ATTNGRAD_CACHE", str(tmp_path))
    monkeypatch.setattr(native_build, "_loaded", None)  # as a fresh process, which loaded no build yet
    for field in ("compiled", "seconds"):
        monkeypatch.setattr(native_build.build_info, field, getattr(native_build.build_info, field))
    built = []

    def build(folder, openmp):
        folder.mkdir(parents=True)
        built.append(folder)

    monkeypatch.setattr(native_build, "_build", build)
    target = native_build._load_or_build(openmp=True)
    lines = capsys.readouterr().err.splitlines()
    assert built == [target.parent]
    assert lines[0] == (f"attngrad: compiling the CPU tiles (once, cached in {target.parent}; usually 10-60 s)...")
    assert len(lines) == 2 and lines[1].startswith("attngrad: compiling the CPU tiles done in ")  # no count: no TTY
    monkeypatch.setattr(native_build, "_loaded", None)  # the next process finds the build
    monkeypatch.setattr(torch.ops, "load_library", lambda path: None)
    assert native_build._load_or_build(openmp=True) == target and built == [target.parent]
    assert capsys.readouterr().err == ""


def test_a_build_counts_its_seconds_on_a_terminal_alone():
    """On a terminal a second line counts the seconds, rewritten in place, and ends as the
    line saying how it went; a failed build says it failed."""
    import io
    import time

    from attngrad.torch.backends.cpu_tiles import build as native_build

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    with native_build.announced("/cache/tiles", terminal, tick=0.01):
        time.sleep(0.1)
    first, second = terminal.getvalue().split("\n", 1)
    assert first == "attngrad: compiling the CPU tiles (once, cached in /cache/tiles; usually 10-60 s)..."
    assert second.startswith("\rattngrad: compiling, 0 s") and second.endswith("\rattngrad: compiling the CPU tiles "
                                                                               "done in 0 s\n")
    log = io.StringIO()
    with pytest.raises(RuntimeError), native_build.announced("/cache/tiles", log, tick=0.01):
        time.sleep(0.05)
        raise RuntimeError("the compiler failed")
    assert log.getvalue().splitlines()[1:] == ["attngrad: compiling the CPU tiles failed after 0 s"]  # no count


@needs_tiles
def test_the_tiles_are_cached_and_keyed(monkeypatch, tmp_path):
    """The library sits in the cache folder, in a folder of its own key (sources, flags,
    compiler, CPU): a sanitizer build, another target CPU or another compiler gets another
    folder, and a process that finds the build loads it without compiling."""
    from attngrad.torch.backends.cpu_tiles import build as native_build

    path = native.build_info.path
    assert path.parent.parent == native_build._cache_dir() and path.exists()
    assert (path.parent / "build_seconds").exists() and native.fresh_build_seconds() > 0
    assert native.library() is path and native.available()
    monkeypatch.setenv("ATTNGRAD_SANITIZE", "0")
    key = native_build._machine_key()
    monkeypatch.setenv("ATTNGRAD_SANITIZE", "1")
    assert native_build._machine_key() != key and "-fsanitize=address,undefined" in native_build.flags()
    monkeypatch.setenv("ATTNGRAD_SANITIZE", "0")
    march = os.environ.get("ATTNGRAD_MARCH")  # scripts/portable_tiles.sh runs this test on x86-64-v3
    monkeypatch.setenv("ATTNGRAD_MARCH", "x86-64-v2")
    assert "-march=x86-64-v2" in native_build.flags() and "-march=native" not in native_build.flags()
    assert native_build._machine_key() != key
    if march is None:
        monkeypatch.delenv("ATTNGRAD_MARCH")
    else:
        monkeypatch.setenv("ATTNGRAD_MARCH", march)
    assert native_build._machine_key() == key
    monkeypatch.setenv("CXX", "g++-other")
    assert native_build._machine_key() != key


@needs_tiles
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_aten_gemm_gives_the_blas_results(dtype):
    """Where PyTorch has no Fortran BLAS to link (macOS, another BLAS), the tiles' GEMMs are
    ATen's at::cpu::addmm_out: every pass gives the BLAS path's results, float64 to 1e-12
    (the same sums, perhaps in another order)."""
    ops = torch.ops.attngrad_tiles
    q, k, v, dout = _inputs(2, 4, 2, 37, 45, 16, 8, dtype, 11)
    bias = torch.randn(4, 37, 45, dtype=dtype, generator=torch.Generator().manual_seed(1))
    cot = [torch.randn_like(t) for t in (q, k, v)]

    def passes():
        stats = native.attention_forward(q, k, v, 0, 0.25, bias=bias, seed=3, dropout_p=0.2)
        grads = native.attention_backward(dout, q, k, v, *stats, 0, 0.25, bias=bias, seed=3, dropout_p=0.2,
                                          bias_grad=True)
        second = native.attention_double_backward(dout, q, k, v, *stats, 0, 0.25, True, *cot, bias=bias, seed=3,
                                                  dropout_p=0.2)
        jvp = native.attention_jvp(q, k, v, *stats[1:], 0, 0.25, *cot)
        bjvp = native.attention_backward_jvp(dout, q, k, v, *stats, 0, 0.25, dout, *cot)
        return [t for t in (*stats, *grads, *second, jvp, *bjvp) if t is not None]

    with pytest.raises(RuntimeError, match="choose is 2, expected -1, 0 or 1"):
        ops.gemm_path(2)
    if ops.gemm_path(-1) == 1:
        pytest.skip("no BLAS in this process: the tiles run on ATen's GEMM throughout")
    blas = passes()
    try:
        assert ops.gemm_path(1) == 1
        aten = passes()
    finally:
        ops.gemm_path(0)
    for a, b in zip(aten, blas):
        assert rel_err(a, b) < (EXACT if dtype == torch.float64 else 1e-5)


@needs_tiles
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_half_precision_runs_on_the_tiles(dtype, is_causal):
    """float16 and bfloat16 inputs: every pass on the tiles, returned in the inputs' dtype
    (float16 computed in float32; bfloat16's GEMMs multiply bfloat16 operands, P and dS
    rounded to bfloat16 as PyTorch's kernels round them, with float32 sums); the torch-ops
    kernels (float32 throughout) give the same numbers up to about a rounding of the
    half-precision results."""
    from attngrad.torch import attention, ran, use_implementation

    g = torch.Generator().manual_seed(4)
    q, k, v, dout, tq, tk, tv = (torch.randn(2, 4, 37, 16, generator=g).to(dtype) for _ in range(7))
    bias = torch.randn(4, 37, 37, generator=g).to(dtype)
    keep = torch.rand(2, 1, 37, 37, generator=g) > 0.2

    def everything():
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out = attention(*leaves[:3], attn_mask=keep, attn_bias=leaves[3], is_causal=is_causal)
        grads = torch.autograd.grad(out, leaves, dout, create_graph=True)
        second = torch.autograd.grad(sum((gr.float() ** 2).sum() for gr in grads[:3]), leaves[:3])
        fixed = bias.clone()
        out_t = torch.func.jvp(lambda q, k, v: attention(q, k, v, attn_mask=keep, attn_bias=fixed, is_causal=is_causal),
                               (q, k, v), (tq, tk, tv))[1]
        return [t.detach() for t in (out, *grads, *second, out_t)]

    ran.clear()
    ours = everything()
    assert {("forward", "tiles"), ("backward", "tiles"), ("forward_jvp", "tiles")} <= set(ran)
    with use_implementation("torch-ops"):
        theirs = everything()
    eps = torch.finfo(dtype).eps
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.dtype == b.dtype == dtype, i
        # each side rounds its float32 result to the half dtype (eps / 2 at most); measured 0.54-0.64 eps
        assert rel_err(a.float(), b.float()) < eps, i


def _brgemm_route_on() -> int:
    """Turns bfloat16's brgemm route on and returns the route before; skips where there is none."""
    ops = torch.ops.attngrad_tiles
    before = ops.brgemm_path(-1)
    try:
        ops.brgemm_path(1)
    except RuntimeError as error:
        pytest.skip(str(error))
    return before


@needs_tiles
@pytest.mark.parametrize("is_causal", [False, True])
def test_bfloat16_products_on_either_route(is_causal):
    """bfloat16 products whose B is a pass input (K, V and their tangents) run on oneDNN's
    brgemm from VNNI copies where PyTorch packs bfloat16 (the matrix units), the others on
    MKL's bfloat16 GEMM: every pass (forward, backward with a learned bias, double backward,
    JVP), on lengths the route takes (>= 256; Lq odd, so one block's rows are odd; GQA; a
    mask), agrees with MKL's alone to far below bfloat16's rounding (their float32 sums round
    apart, which moves a few bfloat16 results by an ulp: 0 to 6.3e-4 measured, eps 7.8e-3), and
    is the same bit for bit on 1 and 2 threads."""
    from attngrad.torch import attention

    ops = torch.ops.attngrad_tiles
    before = _brgemm_route_on()
    g = torch.Generator().manual_seed(7)
    q, dout, tq = (torch.randn(1, 4, 261, 32, generator=g).bfloat16() for _ in range(3))
    k, v, tk, tv = (torch.randn(1, 2, 320, 32, generator=g).bfloat16() for _ in range(4))
    bias = torch.randn(4, 261, 320, generator=g).bfloat16()
    keep = torch.rand(1, 1, 261, 320, generator=g) > 0.2

    def everything():
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out = attention(*leaves[:3], attn_mask=keep, attn_bias=leaves[3], is_causal=is_causal, enable_gqa=True)
        grads = torch.autograd.grad(out, leaves, dout, create_graph=True)
        second = torch.autograd.grad(sum((gr.float() ** 2).sum() for gr in grads[:3]), leaves[:3])
        out_t = torch.func.jvp(lambda q, k, v: attention(q, k, v, attn_mask=keep, is_causal=is_causal, enable_gqa=True),
                               (q, k, v), (tq, tk, tv))[1]
        return [t.detach().float() for t in (out, *grads, *second, out_t)]

    threads = torch.get_num_threads()
    try:
        results = {}
        for route, count in ((1, 1), (1, 2), (0, 2)):
            ops.brgemm_path(route)
            torch.set_num_threads(count)
            results[route, count] = everything()
    finally:
        torch.set_num_threads(threads)
        ops.brgemm_path(before)
    eps = torch.finfo(torch.bfloat16).eps
    for i, (one, two, mkl) in enumerate(zip(results[1, 1], results[1, 2], results[0, 2])):
        assert torch.equal(one, two), i
        assert rel_err(two, mkl) < eps / 8, i


@needs_tiles
def test_bfloat16_products_follow_torch_backends_mkldnn():
    """PyTorch's brgemm refuses while torch.backends.mkldnn is off: a bfloat16 call that the
    brgemm route took before runs on MKL's GEMM alone then (the backward raised, the forward
    threw and caught an error in every product), and the route comes back with it on."""
    ops = torch.ops.attngrad_tiles
    before = _brgemm_route_on()
    g = torch.Generator().manual_seed(8)
    q, k, v, dout = (torch.randn(1, 2, 256, 32, generator=g).bfloat16() for _ in range(4))

    def step():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = scaled_dot_product_attention(*leaves, is_causal=True)
        return [t.float() for t in (out.detach(), *torch.autograd.grad(out, leaves, dout))]

    try:
        on = step()
        enabled = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = False  # its flags() context also sets oneDNN's TF32, with a warning
        try:
            assert ops.brgemm_path(-1) == 0
            off = step()
        finally:
            torch.backends.mkldnn.enabled = enabled
        assert ops.brgemm_path(-1) == 1
        ops.brgemm_path(0)
        mkl = step()
    finally:
        ops.brgemm_path(before)
    for a, b, c in zip(on, off, mkl):
        assert torch.equal(b, c)
        assert rel_err(a, c) < torch.finfo(torch.bfloat16).eps / 8


def test_what_the_tiles_take():
    """The tiles backend takes CPU calls in any float dtype (half computed in float32), with
    masks and a bias, and refuses an empty axis and other devices, saying why."""
    from attngrad.torch.backends import cpu_tiles as tiles

    q, k, v, _ = _inputs(1, 2, 2, 5, 6, 4, 4, torch.float64, 0)

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
    from attngrad.torch import ran, use_implementation

    q, k, v, dout = _inputs(1, 2, 2, 5, 6, 4, 4, torch.float64, 0)
    q.requires_grad_()
    ran.clear()
    with use_implementation("torch-ops"):
        out = scaled_dot_product_attention(q, k, v)
        out.backward(dout)
    assert dict(ran) == {("forward", "torch-ops"): 1, ("backward", "torch-ops"): 1}
    if native.library() is None:
        return
    ran.clear()
    with use_implementation("tiles"):
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
        with use_implementation("flash"):
            pass


@needs_tiles
def test_a_kept_block_map_follows_its_tensors(monkeypatch, tuned):
    """The block maps kept between calls are a float bias's while it lives unchanged: after
    an in-place write of -inf over a key block, the next call skips that block."""
    tuned(native.TILING, block_rows=4, block_keys=8)
    q, k, v, _ = _inputs(1, 2, 2, 8, 16, 4, 4, torch.float64, 5)
    bias = torch.zeros(1, 1, 8, 16, dtype=torch.float64)
    _, before = _counted(lambda: native.attention_forward(q, k, v, None, 0.5, bias=bias))
    _, again = _counted(lambda: native.attention_forward(q, k, v, None, 0.5, bias=bias))
    bias[..., 8:] = float("-inf")  # the second key block, in place
    out, after = _counted(lambda: native.attention_forward(q, k, v, None, 0.5, bias=bias))
    assert before == again and after < before, (before, again, after)
    assert rel_err(out[0], kernels.attention_forward(q, k, v, None, bias, 0, None, 0.5, 0.0, 0.0)[0]) < EXACT


def _tiles_not_empty(q, k, causal, mask=None, bias=None, bounds=None, block_keys=None):
    """Score tiles of the forward (and of the backward: the same tiling) that the block map
    leaves to compute: all B H Lq/R Lk/C of them less its EMPTY ones, and how many those are."""
    from attngrad.torch.masks.block_map import empty_tiles

    masks = native._score_masks(mask, bias, q.dtype, bounds=bounds)
    block_keys = block_keys or native._block_keys(bounds)
    rows = native._block_rows(q.shape[2], k.shape[2], causal, q.dtype == torch.bfloat16, masks.get("key_bounds"))
    empty = empty_tiles(q.shape[2], k.shape[2], causal, masks.get("key_bounds"), masks.get("mask"),
                        masks.get("bias"), rows, block_keys)
    empty = empty.expand(q.shape[0], q.shape[1], *empty.shape[2:])
    return int((~empty).sum()), int(empty.sum())


def _counted(run):
    """run()'s result and the score tiles the compiled passes computed during it."""
    torch.ops.attngrad_tiles.tiles_computed(True)
    result = run()
    return result, torch.ops.attngrad_tiles.tiles_computed(True)


@needs_tiles
@pytest.mark.parametrize("causal", [None, 0, -4])
def test_tiles_skip_what_a_padding_mask_excludes(causal):
    """Padding of a different length per sequence, on 3 x 5 tiles: whole tiles are excluded
    and skipped (the forward and the backward each compute all tiles less the block map's
    EMPTY ones, counted), others partly; rows of the second sequence see no key past its
    padding. Forward, backward and double backward equal the torch-ops kernels' to 1e-12."""
    q, k, v, dout = _inputs(2, 4, 2, 17, 23, 8, 6, torch.float64, 3)
    keep = torch.ones(2, 1, 1, 23, dtype=torch.bool)
    keep[0, ..., 15:] = False
    keep[1, ..., 6:] = False
    bias = torch.zeros(2, 1, 17, 23, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    cotangents = [torch.randn_like(t) for t in (q, k, v)]
    # the mask as given, as a float bias, and expanded (stride 0) to every head and row
    for mask, float_mask in ((keep, None), (None, bias), (keep.expand(2, 4, 17, 23), None)):
        with native.TILING.override(block_rows=3, block_keys=5):
            tiles, empty = _tiles_not_empty(q, k, causal, mask, float_mask)
            ours, forward_tiles = _counted(lambda: native.attention_forward(q, k, v, causal, 0.3, mask=mask,
                                                                            bias=float_mask))
            grads, backward_tiles = _counted(lambda: native.attention_backward(
                dout, q, k, v, *ours, causal, 0.3, mask=mask, bias=float_mask)[:3])
            second = native.attention_double_backward(dout, q, k, v, *ours, causal, 0.3, True, *cotangents,
                                                      mask=mask, bias=float_mask)[:4]
        # 2 x 4 heads of 6 x 5 tiles: the first sequence's last two key blocks and the
        # second's last three are padding alone (more under the causal diagonals)
        assert empty >= 4 * 6 * (2 + 3)
        assert forward_tiles == backward_tiles == tiles == 2 * 4 * 6 * 5 - empty
        theirs = kernels.attention_forward(q, k, v, mask, float_mask, 0, causal, 0.3, 0.0, 0.0)
        their_grads = kernels.attention_backward(dout, q, k, v, mask, float_mask, 0, *theirs, causal, 0.3, 0.0, 0.0,
                                                 False)
        their_second = kernels_higher.attention_double_backward(dout, q, k, v, mask, float_mask, 0, *theirs, causal,
                                                                0.3, 0.0, 0.0, False, True, *cotangents, None)
        names = ("out", "row_max", "inv_sum", "dq", "dk", "dv", "g_dout", "g_q", "g_k", "g_v")
        assert_all_close(dict(zip(names, (*ours, *grads, *second))),
                         dict(zip(names, (*theirs, *their_grads[:3], *their_second[:4]))))


@needs_tiles
@pytest.mark.parametrize("causal", [None, 3])
def test_unmasked_tiles_give_the_bits_of_masked_ones(monkeypatch, causal, tuned):
    """A float mask of 0 and -inf per row (a padding mask per sequence, and holes), a
    boolean mask that keeps most tiles whole, and a soft cap, on 4 x 8 tiles: the passes
    leave the mask and bias out on the tiles the tile map marks UNMASKED (some are), and the
    forward's and backward's float32 results are bit for bit those of a map that marks
    every such tile COMPUTED (adding 0 and keeping every entry change no score)."""
    q, k, v, dout = _inputs(2, 3, 3, 21, 37, 8, 6, torch.float32, 11)
    bias = torch.zeros(2, 1, 21, 37)
    bias[0, ..., 29:] = float("-inf")
    bias[1, :, 5, 9] = float("-inf")
    mask = torch.ones(2, 3, 21, 37, dtype=torch.bool)
    mask[1, 2, 17, 30] = False
    tuned(native.TILING, block_rows=4, block_keys=8)
    made = []

    def run():
        kept.clear()
        out = native.attention_forward(q, k, v, causal, 0.3, softcap=2.0, mask=mask, bias=bias)
        grads = native.attention_backward(dout, q, k, v, *out, causal, 0.3, softcap=2.0, mask=mask, bias=bias)[:3]
        return out + tuple(grads)

    def demoted(*args, **kwargs):  # the same map, UNMASKED tiles computed with the mask and bias
        kinds = block_map.tile_map(*args, **kwargs)
        made.append(int((kinds == block_map.UNMASKED).sum()))
        return kinds.masked_fill(kinds == block_map.UNMASKED, block_map.COMPUTED)

    ours = run()
    monkeypatch.setattr(native, "tile_map", demoted)
    computed = run()
    assert made and min(made) > 10, made
    for name, a, b in zip(("out", "row_max", "inv_sum", "dq", "dk", "dv"), ours, computed):
        assert torch.equal(a, b), name
    theirs = kernels.attention_forward(q.double(), k.double(), v.double(), mask, bias.double(), 0, causal, 0.3,
                                       2.0, 0.0)
    assert rel_err(ours[0].double(), theirs[0]) < 1e-5  # float32 against float64: the map is the right one


@needs_tiles
@pytest.mark.parametrize("with_mask", [False, True])
def test_tiles_skip_what_a_causal_window_excludes(with_mask):
    """A causal sliding window of 9 keys (key bounds), with or without a boolean mask that
    drops every third key of the first batch entry, on 4 x 5 tiles: the tiles below the
    window and above the diagonal are skipped, each pass computing exactly the block map's
    tiles that are not EMPTY; the results equal the torch-ops kernels' to 1e-12."""
    q, k, v, dout = _inputs(2, 2, 1, 37, 37, 8, 6, torch.float64, 5)
    rows = torch.arange(37)
    bounds = torch.stack([(rows - 8).clamp(min=0), rows + 1], -1)[None]  # (1, Lq, 2)
    mask = None
    if with_mask:
        mask = torch.ones(2, 1, 37, 37, dtype=torch.bool)
        mask[0, ..., ::3] = False
    with native.TILING.override(block_rows=4, narrow_block_keys=5, band_row_cost=(1.0,)):  # 4 rows a block, no fewer
        tiles, empty = _tiles_not_empty(q, k, 0, mask, bounds=bounds)
        ours, forward_tiles = _counted(lambda: native.attention_forward(q, k, v, 0, 0.3, mask=mask, bounds=bounds))
        grads, backward_tiles = _counted(lambda: native.attention_backward(dout, q, k, v, *ours, 0, 0.3, mask=mask,
                                                                           bounds=bounds)[:3])
    all_tiles = 2 * 2 * 10 * 8
    # per head, of 10 x 8 tiles, the window and the diagonal leave 2 or 3 per query block
    assert empty >= 2 * 2 * (10 * 8 - 3 * 10)
    assert forward_tiles == backward_tiles == tiles == all_tiles - empty
    theirs = kernels.attention_forward(q, k, v, mask, None, 0, 0, 0.3, 0.0, 0.0, bounds=bounds)
    their_grads = kernels.attention_backward(dout, q, k, v, mask, None, 0, *theirs, 0, 0.3, 0.0, 0.0, False,
                                             bounds=bounds)[:3]
    names = ("out", "row_max", "inv_sum", "dq", "dk", "dv")
    assert_all_close(dict(zip(names, (*ours, *grads))), dict(zip(names, (*theirs, *their_grads))))


@needs_tiles
def test_a_query_block_that_sees_no_key_computes_no_tile(monkeypatch, tuned):
    """Key bounds that leave a whole query block no key, its empty range starting inside a
    key block (where the tiles of the other blocks start too): neither pass computes a tile
    for it (the counts equal the block map's), its rows give 0, and every result equals the
    torch-ops kernels'."""
    tuned(native.TILING, block_rows=4, narrow_block_keys=8, band_row_cost=(1.0,))  # 4 rows a block
    q, k, v, dout = _inputs(2, 2, 2, 23, 23, 8, 6, torch.float64, 6)
    rows = torch.arange(23)
    lo, hi = (rows - 3).clamp(min=0), rows + 1
    lo[4:8] = hi[4:8] = 13  # rows 4..7, the second query block, see no key
    bounds = torch.stack([lo, hi], -1)[None]
    tiles, _ = _tiles_not_empty(q, k, None, bounds=bounds)
    ours, forward_tiles = _counted(lambda: native.attention_forward(q, k, v, None, 0.3, bounds=bounds))
    grads, backward_tiles = _counted(lambda: native.attention_backward(dout, q, k, v, *ours, None, 0.3,
                                                                       bounds=bounds)[:3])
    assert forward_tiles == backward_tiles == tiles
    assert not ours[0][:, :, 4:8].any() and not grads[0][:, :, 4:8].any()
    theirs = kernels.attention_forward(q, k, v, None, None, 0, None, 0.3, 0.0, 0.0, bounds=bounds)
    their_grads = kernels.attention_backward(dout, q, k, v, None, None, 0, *theirs, None, 0.3, 0.0, 0.0, False,
                                             bounds=bounds)[:3]
    names = ("out", "row_max", "inv_sum", "dq", "dk", "dv")
    assert_all_close(dict(zip(names, (*ours, *grads))), dict(zip(names, (*theirs, *their_grads))))


# Key bounds of a narrow band (each a (B or 1, Lq, 2) tensor of [lo, hi) per row): a causal
# window of `width` keys, packed documents of `width` keys, or random bounds (empty rows
# too, but not only)
BANDS = st.sampled_from(["window", "documents", "random"])


def _band_bounds(band, batch, len_q, len_k, width, seed):
    rows = torch.arange(len_q)
    if band == "window":
        lo, hi = (rows - width + 1).clamp(0, len_k), (rows + 1).clamp(max=len_k)
    elif band == "documents":
        lo = (rows // width * width).clamp(max=len_k)
        hi = (lo + width).clamp(max=len_k)
    else:
        g = torch.Generator().manual_seed(seed + 3)
        lo = torch.randint(0, len_k + 1, (batch, len_q), generator=g)
        hi = (lo + torch.randint(0, width + 1, (batch, len_q), generator=g)).clamp(max=len_k)
        lo[:, 0], hi[:, 0] = 0, min(width, len_k)  # some row sees a key: else every block height costs nothing
        return torch.stack([lo, hi], -1)
    return torch.stack([lo, hi], -1)[None]


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
    """A narrow band's forward and backward on query blocks of a quarter of BLOCK_ROWS take
    S and dP from transposed copies of K and V (csrc/tiles.h, BandKeys): a copy per run of
    query blocks in the forward, per key block in the backward (blocks of 7 and 16 keys
    split the runs' ranges), with masks, a bias and its gradient, dropout, a softcap, GQA and
    any causal diagonal: float64 results equal the torch-ops kernels' to 1e-12."""
    heads = kv_heads * groups
    q, k, v, dout = _inputs(batch, heads, kv_heads, len_q, len_k, dim, dim_v, torch.float64, seed)
    scale, causal = dim**-0.5, _diagonal(causal, len_q, len_k)
    mask, bias = _masks(masking, batch, heads, len_q, len_k, torch.float64, seed)
    bias_grad = bias_grad and bias is not None
    bounds = _band_bounds(band, batch, len_q, len_k, width, seed)
    options = dict(mask=mask, bias=bias, seed=seed, dropout_p=dropout_p, softcap=softcap, bounds=bounds)
    taken = {}
    run = native._run

    def recording(name, *args, **kwargs):
        taken[name] = kwargs["transposed_keys"], kwargs["block_rows"]
        return run(name, *args, **kwargs)

    # always a quarter of 16 rows: 4 rows a block
    tiling = dict(block_rows=16, band_row_cost=(1e9, 1e9, 1.0), narrow_block_keys=block_keys, band_transpose_rows=1)
    with pytest.MonkeyPatch.context() as patch, native.TILING.override(**tiling):
        patch.setattr(native, "_run", recording)
        ours = native.attention_forward(q, k, v, causal, scale, **options)
        grads = native.attention_backward(dout, q, k, v, *ours, causal, scale, chunks=chunks, bias_grad=bias_grad,
                                          **options)
    # a quarter of BLOCK_ROWS wherever the blocks cover any score (else the cost ties at 0)
    assert taken["forward"] == taken["backward"] == (taken["forward"][1] <= 4, taken["forward"][1])
    theirs = kernels.attention_forward(q, k, v, mask, bias, seed, causal, scale, softcap, dropout_p, bounds=bounds)
    their_grads = kernels.attention_backward(dout, q, k, v, mask, bias, seed, *theirs, causal, scale, softcap,
                                             dropout_p, bias_grad, bounds=bounds)
    grads, their_grads = grads[: 3 + bias_grad], their_grads[: 3 + bias_grad]
    names = ("out", "row_max", "inv_sum", "dq", "dk", "dv", "dbias")
    keys = torch.arange(len_k)
    in_bounds = (keys >= bounds[..., :1]) & (keys < bounds[..., 1:])  # (B or 1, Lq, Lk)
    allowed = in_bounds[:, None] if mask is None else in_bounds[:, None] & mask
    zeros = {"dq", "dk"} if _at_most_one_key(causal, len_q, len_k, allowed, bias) else set()
    assert_all_close(dict(zip(names, (*ours, *grads))), dict(zip(names, (*theirs, *their_grads))), zeros=zeros,
                     floor_fraction=1e-3)


@needs_tiles
@pytest.mark.parametrize("case,transposed", [
    ("window", True), ("documents", False), ("bfloat16", False), ("decode", False), ("no bounds", False)])
def test_which_calls_take_transposed_keys(monkeypatch, case, transposed):
    """Transposed copies pay where a band's query blocks are narrow (a causal window of 256:
    32 rows): not for documents of 512 (64 or 128 rows, whose NT products are as fast), nor
    bfloat16 products, nor a decode step (one row, its own product), nor without bounds."""
    taken = {}
    run = native._run

    def recording(name, *args, **kwargs):
        taken[name] = kwargs["transposed_keys"]
        return run(name, *args, **kwargs)

    monkeypatch.setattr(native, "_run", recording)
    len_q = 1 if case == "decode" else 1024
    rows = torch.arange(1024)[-len_q:]
    window = torch.stack([(rows - 255).clamp(min=0), rows + 1], -1)[None]
    documents = torch.stack([rows // 512 * 512, rows // 512 * 512 + 512], -1)[None]
    bounds = {"documents": documents, "no bounds": None}.get(case, window)
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    q, k, v, dout = _inputs(1, 2, 2, len_q, 1024, 16, 16, dtype, 0)
    causal = 1024 - len_q
    out = native.attention_forward(q, k, v, causal, 0.25, bounds=bounds)
    assert taken["forward"] is transposed
    if case != "decode":
        native.attention_backward(dout, q, k, v, *out, causal, 0.25, bounds=bounds)
        assert taken["backward"] is transposed


@needs_tiles
@pytest.mark.parametrize("fault", ["shape", "dtype", "layout", "kind"])
def test_tiles_check_the_tile_map(fault):
    """The ops check the tile map they are handed like every other tensor: its shape
    against the call's blocks, uint8, contiguous, and each entry one of the three kinds;
    the message names it."""
    q, k, v, _ = _inputs(1, 2, 2, 9, 11, 4, 4, torch.float32, 1)
    good = torch.tensor([0, 1, 2], dtype=torch.uint8).repeat(4)[:12].view(1, 2, 3, 2)  # 9 rows of 4, 11 keys of 8
    bad = {"shape": torch.zeros(1, 2, 3, 3, dtype=torch.uint8), "dtype": good.to(torch.bool),
           "layout": torch.zeros(1, 2, 2, 3, dtype=torch.uint8).transpose(2, 3),
           "kind": good.clone().index_fill_(3, torch.tensor([1]), 3)}[fault]
    out, row_max, inv_sum = q.new_empty(1, 2, 9, 4), q.new_empty(1, 2, 9), q.new_empty(1, 2, 9)
    options = native._options(None, 0.5, block_rows=4, block_keys=8)
    torch.ops.attngrad_tiles.forward(q, k, v, None, None, None, out=out, row_max=row_max, inv_sum=inv_sum,
                                     tile_map=good, **options)
    with pytest.raises(RuntimeError, match="attngrad_tiles.forward: tile_map"):
        torch.ops.attngrad_tiles.forward(q, k, v, None, None, None, out=out, row_max=row_max, inv_sum=inv_sum,
                                         tile_map=bad, **options)


@needs_tiles
@pytest.mark.parametrize("fault", ["past the keys", "negative", "shape", "dtype", "layout"])
@pytest.mark.parametrize("op", ["forward", "jvp"])
def test_tiles_check_the_key_ranges(fault, op):
    """The ops check the key ranges they are handed (block_map.key_ranges) like every other
    tensor, values too: (1 or batch, query blocks, 2) int64, contiguous, each block's
    [key0, key0 + keys) within the keys; the message names the argument."""
    q, k, v, _ = _inputs(1, 2, 2, 9, 11, 4, 4, torch.float32, 1)
    good = block_map.key_ranges(9, 11, 0, None, 4)  # 9 rows of 4: 3 query blocks
    bad = {"past the keys": torch.tensor([[[0, 4], [3, 9], [0, 11]]]),
           "negative": torch.tensor([[[0, 4], [-1, 5], [0, 11]]]),
           "shape": torch.zeros(1, 2, 2, dtype=torch.int64), "dtype": good.to(torch.int32),
           "layout": torch.zeros(1, 2, 3, dtype=torch.int64).transpose(1, 2)}[fault]
    row_max, inv_sum = q.new_zeros(1, 2, 9), q.new_ones(1, 2, 9)
    args = dict(q=q, k=k, v=v, mask=None, bias=None, key_bounds=None, **native._options(0, 0.5, block_rows=4,
                                                                                        block_keys=8))
    if op == "forward":
        args.update(out=q.new_empty(1, 2, 9, 4), row_max=row_max, inv_sum=inv_sum)
    else:
        args.update(row_max=row_max, inv_sum=inv_sum, tq=None, tk=None, tv=None, tbias=None, tout=q.new_empty(1, 2, 9, 4))
    getattr(torch.ops.attngrad_tiles, op)(**args, key_ranges=good)
    with pytest.raises(RuntimeError, match=f"attngrad_tiles.{op}: key_ranges"):
        getattr(torch.ops.attngrad_tiles, op)(**args, key_ranges=bad)


@needs_tiles
@pytest.mark.parametrize("is_causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("per_row", [False, True])
def test_padding_narrows_the_tiles_and_every_derivative_holds(many_blocks, is_causal, per_row):
    """A key padding mask with left and right padding (per batch entry), or one whose kept
    keys also differ between query blocks (`per_row`, as a float mask of 0 and -inf writes
    a padded batch), narrows every pass's key ranges (block_map.kept_keys): the tiles stop
    where the kept keys do, the backward's at the forward's width. With a full-size bias
    whose gradient the backward writes entry by entry (the narrowed-off columns as 0):
    output, dq, dk, dv, dbias, a JVP and a double backward equal PyTorch's math backend to
    1e-12 in float64."""
    from attngrad.torch import attention, use_implementation

    g = torch.Generator().manual_seed(21)
    q = torch.randn(2, 3, 17, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 3, 43, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    bias = torch.randn(2, 3, 17, 43, generator=g, dtype=torch.float64, requires_grad=True)
    keep = torch.zeros(2, 1, 1, 43, dtype=torch.bool)
    keep[0, ..., 5:31] = True
    keep[1, ..., 22:41] = True
    if per_row:  # rows 2, 5, 8 of the first sequence see keys 9-19 alone, rows 14 and 16 of the second none
        keep = keep.expand(2, 1, 17, 43).clone()
        keep[0, :, 2:9:3] = False
        keep[0, :, 2:9:3, 9:20] = True
        keep[1, :, 14:17:2] = False
    dout = torch.randn(2, 3, 17, 8, generator=g, dtype=torch.float64)
    offset = 43 - 17 if is_causal == "bottom_right" else 0
    allowed = keep & torch.ones(17, 43, dtype=torch.bool).tril(offset) if is_causal else keep
    seen = allowed.any(-1, keepdim=True)  # rows that see no key: 0 in attngrad, NaN in PyTorch

    def ours(q, k, v, bias):
        with use_implementation("tiles"):
            return attention(q, k, v, attn_mask=keep, attn_bias=bias, is_causal=is_causal)

    def theirs(q, k, v, bias):
        out = math_sdpa(q, k, v, attn_mask=bias.masked_fill(~allowed, float("-inf")))
        return torch.where(seen, out, 0.0)

    results = {}
    for name, fn in (("ours", ours), ("theirs", theirs)):
        out = fn(q, k, v, bias)
        grads = torch.autograd.grad(out, (q, k, v, bias), dout, create_graph=True)
        second = torch.autograd.grad(sum((gr * gr).sum() for gr in grads[:3]), (q, k, v))
        tangent = torch.func.jvp(fn, (q.detach(), k.detach(), v.detach(), bias.detach()),
                                 tuple(torch.ones_like(t) * 0.1 for t in (q, k, v, bias)))[1]
        results[name] = dict(zip(("out", "dq", "dk", "dv", "dbias", "g_q", "g_k", "g_v", "jvp"),
                                 (out, *grads, *second, tangent)))
    for name in results["ours"]:
        theirs_value = torch.nan_to_num(results["theirs"][name].detach())
        assert rel_err(results["ours"][name].detach(), theirs_value) <= EXACT, name


@needs_tiles
@pytest.mark.parametrize("is_causal", [None, 0])
def test_bfloat16_products_on_either_gemm_path(is_causal):
    """bfloat16 inputs multiply in bfloat16: the float32 results of MKL's bfloat16 GEMM and of
    the fallback (the same rounded operands through the float32 GEMM) differ from a
    float32-product computation by about bfloat16's rounding of P and dS (more than float32's,
    less than bfloat16's eps), and from each other by far less (their scores differ in the
    last float32 bit, which moves a few entries of P to the next bfloat16: 1.6e-4 measured)."""
    g = torch.Generator().manual_seed(6)
    q, k, v, dout = (torch.randn(2, 3, 150, 32, generator=g).bfloat16() for _ in range(4))

    def passes(*inputs):
        out, row_max, inv_sum = native.attention_forward(*inputs[:3], is_causal, 0.2)
        return (out, *native.attention_backward(inputs[3], *inputs[:3], out, row_max, inv_sum, is_causal, 0.2)[:3])

    before = torch.ops.attngrad_tiles.gemm_path(-1)
    try:
        results = {}
        for path in (0, 1):  # 0: the BLAS (MKL's bfloat16 GEMM where it has one), 1: ATen's float32 GEMM
            try:
                torch.ops.attngrad_tiles.gemm_path(path)
            except RuntimeError:  # no BLAS in this process
                continue
            results[path] = passes(q, k, v, dout)
    finally:
        torch.ops.attngrad_tiles.gemm_path(before)
    float_products = passes(*(t.float() for t in (q, k, v, dout)))
    for i, ours in enumerate(results[1]):
        assert ours.dtype == torch.float32
        if 0 in results:
            assert rel_err(results[0][i], ours) < torch.finfo(torch.bfloat16).eps / 8, i
        assert 1e-5 < rel_err(ours, float_products[i]) < torch.finfo(torch.bfloat16).eps, i
