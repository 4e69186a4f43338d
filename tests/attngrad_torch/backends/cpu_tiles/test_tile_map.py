"""The tiles' map of skipped, partial and full tiles: kept while its tensors live, what padding,
windows and masks leave out, the bits of unmasked tiles, and the checks of a map or key range
that is wrong."""

import pytest

torch = pytest.importorskip("torch")

from attngrad.torch.backends.cpu_tiles import native  # noqa: E402
from attngrad.torch.backends.torch_ops import first_order, higher_order  # noqa: E402
from attngrad.torch.masks import block_map  # noqa: E402
from attngrad.torch.masks import version_cache as kept  # noqa: E402

from ....conftest import EXACT, assert_all_close, rel_err  # noqa: E402
from ...conftest import make_call  # noqa: E402
from ...test_functional import math_sdpa  # noqa: E402
from .cases import (  # noqa: E402
    after_forward,
    needs_tiles,
    random_inputs,
    tiles_call,
    tiles_counted,
    tiles_not_empty,
    torch_ops_first_order,
)


@needs_tiles
def test_a_kept_block_map_follows_its_tensors(monkeypatch, tuned):
    """The block maps kept between calls are a float bias's while it lives unchanged: after
    an in-place write of -inf over a key block, the next call skips that block."""
    tuned(native.TILING, block_rows=4, block_keys=8)
    q, k, v, _ = random_inputs(1, 2, 2, 8, 16, 4, 4, torch.float64, 5)
    bias = torch.zeros(1, 1, 8, 16, dtype=torch.float64)
    call = tiles_call(q, k, v, None, 0.5, bias=bias)
    _, before = tiles_counted(lambda: native.attention_forward(call))
    _, again = tiles_counted(lambda: native.attention_forward(call))
    bias[..., 8:] = float("-inf")  # the second key block, in place
    out, after = tiles_counted(lambda: native.attention_forward(call))
    assert before == again and after < before, (before, again, after)
    assert rel_err(out[0], first_order.attention_forward(make_call(q, k, v, bias=bias, scale=0.5))[0]) < EXACT


@needs_tiles
@pytest.mark.parametrize("causal", [None, 0, -4])
def test_tiles_skip_what_a_padding_mask_excludes(causal):
    """Padding of a different length per sequence, on 3 x 5 tiles: whole tiles are excluded
    and skipped (the forward and the backward each compute all tiles less the block map's
    EMPTY ones, counted), others partly; rows of the second sequence see no key past its
    padding. Forward, backward and double backward equal the torch-ops kernels' to 1e-12."""
    q, k, v, dout = random_inputs(2, 4, 2, 17, 23, 8, 6, torch.float64, 3)
    keep = torch.ones(2, 1, 1, 23, dtype=torch.bool)
    keep[0, ..., 15:] = False
    keep[1, ..., 6:] = False
    bias = torch.zeros(2, 1, 17, 23, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    cotangents = [torch.randn_like(t) for t in (q, k, v)]
    # the mask as given, as a float bias, and expanded (stride 0) to every head and row
    for mask, float_mask in ((keep, None), (None, bias), (keep.expand(2, 4, 17, 23), None)):
        with native.TILING.override(block_rows=3, block_keys=5):
            tiles, empty = tiles_not_empty(q, k, causal, mask, float_mask)
            call = tiles_call(q, k, v, causal, 0.3, mask=mask, bias=float_mask)
            ours, forward_tiles = tiles_counted(lambda: native.attention_forward(call))
            inputs = after_forward(dout, ours)
            grads, backward_tiles = tiles_counted(lambda: native.attention_backward(call, inputs)[:3])
            cot = dict(zip(("gq", "gk", "gv"), cotangents))
            second = native.attention_double_backward(call, dict(inputs, dout_grad=True, **cot))[:4]
        # 2 x 4 heads of 6 x 5 tiles: the first sequence's last two key blocks and the
        # second's last three are padding alone (more under the causal diagonals)
        assert empty >= 4 * 6 * (2 + 3)
        assert forward_tiles == backward_tiles == tiles == 2 * 4 * 6 * 5 - empty
        call = make_call(q, k, v, mask, float_mask, causal=causal, scale=0.3)
        theirs, their_grads = torch_ops_first_order(call, dout)
        (out, row_max, inv_sum), (gq, gk, gv) = theirs, cotangents
        their_second = higher_order.attention_double_backward(call, dout=dout, out=out, row_max=row_max,
                                                                inv_sum=inv_sum, bias_grad=False, dout_grad=True,
                                                                gq=gq, gk=gk, gv=gv, gbias=None)
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
    q, k, v, dout = random_inputs(2, 3, 3, 21, 37, 8, 6, torch.float32, 11)
    bias = torch.zeros(2, 1, 21, 37)
    bias[0, ..., 29:] = float("-inf")
    bias[1, :, 5, 9] = float("-inf")
    mask = torch.ones(2, 3, 21, 37, dtype=torch.bool)
    mask[1, 2, 17, 30] = False
    tuned(native.TILING, block_rows=4, block_keys=8)
    made = []

    def run():
        kept.clear()
        call = tiles_call(q, k, v, causal, 0.3, softcap=2.0, mask=mask, bias=bias)
        out = native.attention_forward(call)
        grads = native.attention_backward(call, after_forward(dout, out))[:3]
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
    theirs = first_order.attention_forward(make_call(q.double(), k.double(), v.double(), mask, bias.double(),
                                                 causal=causal, scale=0.3, softcap=2.0))
    assert rel_err(ours[0].double(), theirs[0]) < 1e-5  # float32 against float64: the map is the right one


@needs_tiles
@pytest.mark.parametrize("with_mask", [False, True])
def test_tiles_skip_what_a_causal_window_excludes(with_mask):
    """A causal sliding window of 9 keys (key bounds), with or without a boolean mask that
    drops every third key of the first batch entry, on 4 x 5 tiles: the tiles below the
    window and above the diagonal are skipped, each pass computing exactly the block map's
    tiles that are not EMPTY; the results equal the torch-ops kernels' to 1e-12."""
    q, k, v, dout = random_inputs(2, 2, 1, 37, 37, 8, 6, torch.float64, 5)
    rows = torch.arange(37)
    bounds = torch.stack([(rows - 8).clamp(min=0), rows + 1], -1)[None]  # (1, Lq, 2)
    mask = None
    if with_mask:
        mask = torch.ones(2, 1, 37, 37, dtype=torch.bool)
        mask[0, ..., ::3] = False
    with native.TILING.override(block_rows=4, narrow_block_keys=5, band_row_cost=(1.0,)):  # 4 rows a block, no fewer
        tiles, empty = tiles_not_empty(q, k, 0, mask, bounds=bounds)
        call = tiles_call(q, k, v, 0, 0.3, mask=mask, bounds=bounds)
        ours, forward_tiles = tiles_counted(lambda: native.attention_forward(call))
        grads, backward_tiles = tiles_counted(lambda: native.attention_backward(call, after_forward(dout, ours))[:3])
    all_tiles = 2 * 2 * 10 * 8
    # per head, of 10 x 8 tiles, the window and the diagonal leave 2 or 3 per query block
    assert empty >= 2 * 2 * (10 * 8 - 3 * 10)
    assert forward_tiles == backward_tiles == tiles == all_tiles - empty
    theirs, their_grads = torch_ops_first_order(make_call(q, k, v, mask, bounds=bounds, causal=0, scale=0.3), dout)
    their_grads = their_grads[:3]
    names = ("out", "row_max", "inv_sum", "dq", "dk", "dv")
    assert_all_close(dict(zip(names, (*ours, *grads))), dict(zip(names, (*theirs, *their_grads))))


@needs_tiles
def test_a_query_block_that_sees_no_key_computes_no_tile(monkeypatch, tuned):
    """Key bounds that leave a whole query block no key, its empty range starting inside a
    key block (where the tiles of the other blocks start too): neither pass computes a tile
    for it (the counts equal the block map's), its rows give 0, and every result equals the
    torch-ops kernels'."""
    tuned(native.TILING, block_rows=4, narrow_block_keys=8, band_row_cost=(1.0,))  # 4 rows a block
    q, k, v, dout = random_inputs(2, 2, 2, 23, 23, 8, 6, torch.float64, 6)
    rows = torch.arange(23)
    lo, hi = (rows - 3).clamp(min=0), rows + 1
    lo[4:8] = hi[4:8] = 13  # rows 4..7, the second query block, see no key
    bounds = torch.stack([lo, hi], -1)[None]
    tiles, _ = tiles_not_empty(q, k, None, bounds=bounds)
    call = tiles_call(q, k, v, None, 0.3, bounds=bounds)
    ours, forward_tiles = tiles_counted(lambda: native.attention_forward(call))
    grads, backward_tiles = tiles_counted(lambda: native.attention_backward(call, after_forward(dout, ours))[:3])
    assert forward_tiles == backward_tiles == tiles
    assert not ours[0][:, :, 4:8].any() and not grads[0][:, :, 4:8].any()
    theirs, their_grads = torch_ops_first_order(make_call(q, k, v, bounds=bounds, scale=0.3), dout)
    their_grads = their_grads[:3]
    names = ("out", "row_max", "inv_sum", "dq", "dk", "dv")
    assert_all_close(dict(zip(names, (*ours, *grads))), dict(zip(names, (*theirs, *their_grads))))


@needs_tiles
@pytest.mark.parametrize("fault", ["shape", "dtype", "layout", "kind"])
def test_tiles_check_the_tile_map(fault):
    """The ops check the tile map they are handed like every other tensor: its shape
    against the call's blocks, uint8, contiguous, and each entry one of the three kinds;
    the message names it."""
    q, k, v, _ = random_inputs(1, 2, 2, 9, 11, 4, 4, torch.float32, 1)
    good = torch.tensor([0, 1, 2], dtype=torch.uint8).repeat(4)[:12].view(1, 2, 3, 2)  # 9 rows of 4, 11 keys of 8
    bad = {"shape": torch.zeros(1, 2, 3, 3, dtype=torch.uint8), "dtype": good.to(torch.bool),
           "layout": torch.zeros(1, 2, 2, 3, dtype=torch.uint8).transpose(2, 3),
           "kind": good.clone().index_fill_(3, torch.tensor([1]), 3)}[fault]
    out, row_max, inv_sum = q.new_empty(1, 2, 9, 4), q.new_empty(1, 2, 9), q.new_empty(1, 2, 9)
    options = native._options(tiles_call(q, k, v, None, 0.5), native._Layout(block_rows=4, block_keys=8))
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
    q, k, v, _ = random_inputs(1, 2, 2, 9, 11, 4, 4, torch.float32, 1)
    good = block_map.key_ranges(9, 11, 0, None, 4)  # 9 rows of 4: 3 query blocks
    bad = {"past the keys": torch.tensor([[[0, 4], [3, 9], [0, 11]]]),
           "negative": torch.tensor([[[0, 4], [-1, 5], [0, 11]]]),
           "shape": torch.zeros(1, 2, 2, dtype=torch.int64), "dtype": good.to(torch.int32),
           "layout": torch.zeros(1, 2, 3, dtype=torch.int64).transpose(1, 2)}[fault]
    row_max, inv_sum = q.new_zeros(1, 2, 9), q.new_ones(1, 2, 9)
    options = native._options(tiles_call(q, k, v, 0, 0.5), native._Layout(block_rows=4, block_keys=8))
    args = dict(q=q, k=k, v=v, mask=None, bias=None, key_bounds=None, **options)
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
    from attngrad.torch import attention, use_backend

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
        with use_backend("tiles"):
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
