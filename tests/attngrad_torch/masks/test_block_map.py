"""block_map.empty_tiles, the tiles the compiled passes skip, and block_map.tile_map, which
also marks the tiles they compute without the mask and bias, against a dense reference
built by brute force: every entry's rule applied, then each tile read whole. The bias is
read per tile (a tile excluded where it is -inf throughout), so every tile the map excludes
is one no entry of takes part: skipping it is exact; a tile is unmasked only where the
mask keeps every entry and the bias is 0 on all of them: leaving them out is exact too."""

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attngrad.torch.masks import block_map  # noqa: E402
from attngrad.torch.masks.block_map import (  # noqa: E402
    ScoreFilter,
    empty_tiles,
    kept_keys,
    key_range,
    key_ranges,
    row_intervals,
    tile_map,
    unmasked_tiles,
)


def _reference(len_q, len_k, causal, bounds, mask, bias, block_rows, block_keys, exact=False):
    """(B', H', query blocks, key blocks): True where no entry of the tile takes part by the
    intervals and the mask, or where the bias is -inf on the whole tile; `exact`: where no
    entry takes part by all of them together (what a skip must never exceed)."""
    batch = max([1] + [t.shape[0] for t in (bounds, mask, bias) if t is not None])
    heads = max([1] + [t.shape[1] for t in (mask, bias) if t is not None])
    takes = torch.ones(batch, heads, len_q, len_k, dtype=torch.bool)
    rows, keys = torch.arange(len_q)[:, None], torch.arange(len_k)[None, :]
    if causal is not None:
        takes &= keys <= rows + causal
    if bounds is not None:
        takes &= ((keys >= bounds[..., :1]) & (keys < bounds[..., 1:]))[:, None]
    if mask is not None:
        takes &= mask
    finite = torch.ones_like(takes) if bias is None else (bias != float("-inf")).expand_as(takes)
    if exact:
        takes = takes & finite
    n_q, n_k = -(-len_q // block_rows), -(-len_k // block_keys)
    out = torch.empty(batch, heads, n_q, n_k, dtype=torch.bool)
    for i in range(n_q):
        for j in range(n_k):
            rows, keys = slice(i * block_rows, (i + 1) * block_rows), slice(j * block_keys, (j + 1) * block_keys)
            out[:, :, i, j] = ~takes[:, :, rows, keys].flatten(2).any(2) | ~finite[:, :, rows, keys].flatten(2).any(2)
    return out


def _check(len_q, len_k, causal, bounds, mask, bias, block_rows, block_keys):
    scores = ScoreFilter(len_q, len_k, causal, bounds, mask, bias)
    got = empty_tiles(scores, block_rows, block_keys)
    want = _reference(len_q, len_k, causal, bounds, mask, bias, block_rows, block_keys)
    assert got.dtype == torch.bool and got.is_contiguous()
    # the batch and head axes kept at 1 where nothing varies along them
    batch = max([1] + [t.shape[0] for t in (bounds, mask, bias) if t is not None])
    heads = max([1] + [t.shape[1] for t in (mask, bias) if t is not None])
    assert tuple(got.shape) == (batch, heads, *want.shape[2:])
    assert torch.equal(got, want)
    exact = _reference(len_q, len_k, causal, bounds, mask, bias, block_rows, block_keys, exact=True)
    assert not bool((got & ~exact).any()), "a tile with an entry that takes part was excluded"
    want_unmasked = _unmasked_tiles_reference(len_q, len_k, causal, bounds, mask, block_rows, block_keys)
    assert torch.equal(unmasked_tiles(scores, block_rows, block_keys).expand_as(want_unmasked), want_unmasked)
    ranges = key_ranges(len_q, len_k, causal, None, block_rows, kept_keys(mask, bias, len_q, block_rows))
    kinds = tile_map(scores, block_rows, block_keys, ranges=ranges)
    assert kinds.dtype == torch.uint8 and kinds.is_contiguous() and kinds.shape == got.shape
    unmasked = _unmasked_reference(len_q, len_k, mask, bias, block_rows, block_keys, ranges).expand_as(got)
    want_kinds = torch.where(want, block_map.SKIPPED, torch.where(unmasked, block_map.UNMASKED, block_map.COMPUTED)).to(torch.uint8)
    # a tile wholly outside its query block's range of keys is never walked, so its kind is
    # never read: the reference calls it unmasked (no entry to mask), the map may say computed
    walked = _walked(ranges, kinds.shape, block_keys)
    assert torch.equal(torch.where(walked, kinds, 0), torch.where(walked, want_kinds, 0))
    return got


def _unmasked_tiles_reference(len_q, len_k, causal, bounds, mask, block_rows, block_keys):
    """(B', H', query blocks, key blocks): True where the tile lies wholly inside (Lq, Lk) and
    every entry of it takes part by the intervals and the mask."""
    batch = max([1] + [t.shape[0] for t in (bounds, mask) if t is not None])
    heads = 1 if mask is None else mask.shape[1]
    lo, hi = row_intervals(len_q, len_k, causal, bounds)
    keys = torch.arange(len_k)
    takes = ((keys >= lo[..., None]) & (keys < hi[..., None]))[:, None]  # (1 or B, 1, Lq, Lk)
    if mask is not None:
        takes = takes & mask
    takes = takes.expand(batch, heads, len_q, len_k)
    n_q, n_k = -(-len_q // block_rows), -(-len_k // block_keys)
    out = torch.zeros(batch, heads, n_q, n_k, dtype=torch.bool)
    for i in range(len_q // block_rows):
        for j in range(len_k // block_keys):
            tile = takes[:, :, i * block_rows:(i + 1) * block_rows, j * block_keys:(j + 1) * block_keys]
            out[:, :, i, j] = tile.flatten(2).all(2)
    return out


def _walked(ranges, shape, block_keys):
    """(B', H', query blocks, key blocks): whether a tile holds a key of its query block's
    range [first, first + count) (`ranges` (B or 1, query blocks, 2))."""
    starts = torch.arange(shape[-1]) * block_keys
    first, end = ranges[..., :1], ranges.sum(-1, keepdim=True)  # (B or 1, query blocks, 1)
    walked = (starts + block_keys > first) & (starts < end)
    return walked[:, None].expand(max(shape[0], walked.shape[0]), shape[1], *walked.shape[1:])


def _unmasked_reference(len_q, len_k, mask, bias, block_rows, block_keys, ranges):
    """(B', H', query blocks, key blocks): True where a mask or bias is given and, on every
    entry of the tile up to its query block's end of keys (`ranges`), the mask keeps it and
    the bias is 0."""
    if mask is None and bias is None:
        return torch.zeros(1, 1, 1, 1, dtype=torch.bool)
    keeps = torch.ones(1, 1, len_q, len_k, dtype=torch.bool)
    if mask is not None:
        keeps = keeps & mask
    if bias is not None:
        keeps = keeps & (bias == 0)
    keeps = keeps.expand(max(keeps.shape[0], ranges.shape[0]), *keeps.shape[1:])
    n_q, n_k = -(-len_q // block_rows), -(-len_k // block_keys)
    out = torch.empty(*keeps.shape[:2], n_q, n_k, dtype=torch.bool)
    for b in range(keeps.shape[0]):
        for i in range(n_q):
            end = int(ranges[b % ranges.shape[0], i].sum())
            for j in range(n_k):
                rows = slice(i * block_rows, (i + 1) * block_rows)
                keys = slice(j * block_keys, min((j + 1) * block_keys, max(end, j * block_keys)))
                out[b, :, i, j] = keeps[b, :, rows, keys].flatten(1).all(1)
    return out


@settings(max_examples=300, deadline=None)
@given(data=st.data(), batch=st.integers(1, 3), heads=st.integers(1, 3), len_q=st.integers(1, 23),
       len_k=st.integers(1, 40), block_rows=st.integers(1, 7),
       block_keys=st.sampled_from([1, 2, 3, 5, 7, 8, 16]))
def test_empty_tiles_match_a_dense_reference(data, batch, heads, len_q, len_k, block_rows, block_keys):
    """Any causal offset (from rows that see no key to rows that see all), key bounds
    shared or per batch entry (some empty, some inverted: lo > hi), a mask and a bias with
    -inf entries, each with any of its axes broadcast (size 1)."""
    causal = data.draw(st.one_of(st.none(), st.just(0), st.just(len_k - len_q), st.integers(-30, 30)))
    seed = data.draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    bounds = None
    if data.draw(st.booleans()):
        rows = data.draw(st.sampled_from([1, batch]))
        bounds = torch.randint(0, len_k + 1, (rows, len_q, 2), generator=g)

    def sizes():
        return [data.draw(st.sampled_from([1, n])) for n in (batch, heads, len_q, len_k)]

    mask = bias = None
    if data.draw(st.booleans()):
        mask = torch.rand(*sizes(), generator=g) < data.draw(st.sampled_from([0.05, 0.5, 0.95, 1.0]))
    if data.draw(st.booleans()):
        dtype = data.draw(st.sampled_from([torch.float32, torch.float64]))
        if data.draw(st.booleans()):
            bias = torch.randn(*sizes(), generator=g, dtype=dtype)
        else:  # a float mask: zeros (some -0.0), here and there another value
            bias = torch.zeros(*sizes(), dtype=dtype)
            bias[torch.rand(bias.shape, generator=g) < 0.3] = -0.0
            bias[torch.rand(bias.shape, generator=g) < data.draw(st.sampled_from([0.0, 0.02]))] = 1e-30
        bias[torch.rand(bias.shape, generator=g) < data.draw(st.sampled_from([0.0, 0.1, 0.9]))] = float("-inf")
    _check(len_q, len_k, causal, bounds, mask, bias, block_rows, block_keys)


def test_padding_mask_excludes_whole_key_blocks():
    """A (B, 1, 1, Lk) padding mask: per batch entry, the key blocks wholly padded are
    empty for every query block; the head axis stays 1."""
    keep = torch.ones(2, 1, 1, 23, dtype=torch.bool)
    keep[0, ..., 15:] = False
    keep[1, ..., 6:] = False
    got = _check(17, 23, None, None, keep, None, 3, 5)
    assert got.shape == (2, 1, 6, 5)
    assert got[0].sum() == 6 * 2 and got[1].sum() == 6 * 3


def test_rows_that_see_no_key():
    """A causal offset below -Lq: no row sees a key, every tile is empty; rows whose bounds
    are empty (lo = hi) or inverted empty their tiles too."""
    assert bool(_check(9, 7, -10, None, None, None, 4, 3).all())
    bounds = torch.tensor([[[3, 3]] * 4 + [[0, 7]] * 5])
    got = _check(9, 7, None, bounds, None, None, 4, 3)
    assert bool(got[0, 0, 0].all()) and not bool(got[0, 0, 2].any())
    inverted = torch.tensor([[[5, 2]] * 9])
    assert bool(_check(9, 7, None, inverted, None, None, 4, 3).all())


def test_bias_of_minus_infinity_empties_its_tiles():
    """A per-head bias of -inf on a block of entries empties that tile of that head alone."""
    bias = torch.zeros(1, 2, 8, 8, dtype=torch.float64)
    bias[0, 1, :4, 4:] = float("-inf")
    got = _check(8, 8, None, None, None, bias, 4, 4)
    assert got.shape == (1, 2, 2, 2)
    assert got.sum() == 1 and bool(got[0, 1, 0, 1])


def test_causal_diagonal_and_offsets():
    """Top-left, bottom-right and shifted diagonals, with a mask that varies per row."""
    mask = torch.rand(2, 1, 13, 19, generator=torch.Generator().manual_seed(0)) < 0.3
    for causal in (0, 19 - 13, -5, 30):
        _check(13, 19, causal, None, None, None, 4, 5)
        _check(13, 19, causal, None, mask, None, 4, 5)


@settings(max_examples=200, deadline=None)
@given(st.data(), st.integers(1, 3), st.integers(1, 30), st.integers(1, 30), st.integers(1, 9))
def test_key_ranges_agree_with_key_range_and_hold_every_interval(data, batch, len_q, len_k, block_rows):
    """key_ranges, what the compiled tiles read, is key_range (the torch-ops kernels') for
    each query block of each batch entry: the causal prefix of the block's last row,
    narrowed to between its rows' smallest lower and largest upper bound (key0 = the end
    where they see none); every row's interval (row_intervals) lies within its block's."""
    causal = data.draw(st.one_of(st.none(), st.integers(-len_q - 2, len_k + 2)))
    bounds = None
    if data.draw(st.booleans()):
        ends = torch.tensor(data.draw(st.lists(st.integers(0, len_k), min_size=2 * batch * len_q,
                                               max_size=2 * batch * len_q))).view(batch, len_q, 2)
        bounds = torch.stack([ends.amin(-1), ends.amax(-1)], -1)
    ranges = key_ranges(len_q, len_k, causal, bounds, block_rows)
    n_q = -(-len_q // block_rows)
    assert ranges.dtype == torch.int64 and ranges.is_contiguous()
    assert ranges.shape == ((1 if bounds is None else batch), n_q, 2)
    lo, hi = row_intervals(len_q, len_k, causal, bounds)
    for b in range(ranges.shape[0]):
        lows = None if bounds is None else bounds[b, :, 0].tolist()
        highs = None if bounds is None else bounds[b, :, 1].tolist()
        for qb in range(n_q):
            start, stop = qb * block_rows, min(len_q, (qb + 1) * block_rows)
            first, end = key_range(start, stop, len_k, causal, lows, highs)
            key0, keys = ranges[b, qb].tolist()
            assert (key0, key0 + keys) == (first, end)
            assert 0 <= key0 <= key0 + keys <= len_k
            seen = hi[b, start:stop] > lo[b, start:stop]
            assert bool((lo[b, start:stop][seen] >= key0).all() & (hi[b, start:stop][seen] <= key0 + keys).all())


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 3), st.integers(1, 3), st.integers(1, 9), st.integers(2, 40),
       st.sampled_from(["mask", "bias", "both"]))
def test_kept_keys_span_exactly_the_keys_each_query_block_keeps(data, batch, heads, len_q, len_k, kind):
    """kept_keys of a mask or -inf bias, per key (B, H, 1, Lk: padding) or per row: for each
    query block, [first, stop) holds every key some row and head keeps, and its ends are
    kept (nothing narrower would do); (0, 0) where none is kept; None only where every block
    keeps its first and last key. Key ranges narrowed by it still hold every kept key of
    every row (the causal prefix aside)."""
    rows = data.draw(st.sampled_from([1, len_q]))
    block_rows = data.draw(st.integers(1, 4))
    keep = torch.tensor(data.draw(st.lists(st.booleans(), min_size=batch * heads * rows * len_k,
                                           max_size=batch * heads * rows * len_k))).view(batch, heads, rows, len_k)
    bias = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    mask = keep if kind in ("mask", "both") else None
    kept = kept_keys(mask, bias if kind in ("bias", "both") else None, len_q, block_rows)
    n_q = -(-len_q // block_rows)
    every_row = keep.expand(batch, heads, len_q, len_k).any(1)  # (B, Lq, Lk)
    spans = []
    for b in range(batch):
        for qb in range(n_q):
            columns = every_row[b, qb * block_rows:(qb + 1) * block_rows].any(0).nonzero().flatten().tolist()
            spans.append((columns[0], columns[-1] + 1) if columns else (0, 0))
    if kept is None:
        assert all(span == (0, len_k) for span in spans)
        return
    assert kept.dtype == torch.int64 and kept.shape[0] == batch and kept.shape[1] in (1, n_q)
    got = kept.expand(batch, n_q, 2).reshape(-1, 2).tolist()
    assert [tuple(span) for span in got] == spans
    causal = data.draw(st.one_of(st.none(), st.integers(-3, len_k)))
    ranges = key_ranges(len_q, len_k, causal, None, block_rows, kept)
    for b in range(batch):
        for qb in range(n_q):
            key0, keys = ranges[b, qb].tolist()
            for row in range(qb * block_rows, min(len_q, (qb + 1) * block_rows)):
                end = len_k if causal is None else max(0, min(len_k, row + causal + 1))
                seen = every_row[b, row, :end].nonzero().flatten().tolist()
                assert all(key0 <= j < key0 + keys for j in seen)


def test_kept_keys_read_two_columns_where_nothing_narrows():
    """A learned bias, a mask that keeps each block's first and last key, or one broadcast
    along the keys (a sink's bias) narrows nothing: None."""
    assert kept_keys(torch.ones(1, 1, 4, 6, dtype=torch.bool), None, 4, 2) is None
    assert kept_keys(None, torch.randn(2, 3, 5, 7), 5, 2) is None
    holes = torch.ones(1, 1, 4, 6, dtype=torch.bool)
    holes[..., 0, 1:5] = False
    assert kept_keys(holes, None, 4, 2) is None
    assert kept_keys(None, torch.zeros(1, 3, 1, 1), 4, 2) is None
    assert kept_keys(None, None, 4, 2) is None
