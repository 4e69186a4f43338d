"""How the compiled tiles cut a call: the query blocks and key blocks each pass takes, their heights
for bands and whole rows, and which calls copy the key side transposed."""

import pytest

torch = pytest.importorskip("torch")

from attngrad.torch.backends.cpu_tiles import native, tiling  # noqa: E402
from attngrad.torch.backends.torch_ops import first_order, higher_order  # noqa: E402

from ....conftest import EXACT, assert_all_close, rel_err  # noqa: E402
from .cases import after_forward, needs_tiles, query_blocks_taken, random_inputs, tiles_call  # noqa: E402


@needs_tiles
@pytest.mark.parametrize("len_q,causal,dtype,short", [
    (128, 0, torch.float32, True), (300, -5, torch.float64, True), (1, 4095, torch.float32, True),
    (128, None, torch.float32, False), (1024, 0, torch.float32, False), (128, 0, torch.bfloat16, False)])
def test_forward_and_backward_take_the_same_query_blocks(monkeypatch, len_q, causal, dtype, short):
    """The backward recomputes the forward's scores bit for bit only where its tiles are the
    forward's: both passes take their query blocks from `tiling.query_block_rows`, smaller than
    block_rows for a short causal call (its blocks skip more of the masked triangle) unless
    its products are bfloat16's."""
    q, k, v, dout = random_inputs(2, 2, 2, len_q, 4096 if len_q == 1 else len_q, 8, 8, dtype, 0)
    rows = query_blocks_taken(monkeypatch, q, k, v, dout, causal)
    assert rows["forward"] == rows["backward"] == tiling.query_block_rows(len_q, k.shape[2], causal, dtype == torch.bfloat16)
    assert (rows["forward"] < native.TILING().block_rows) is short


@needs_tiles
@pytest.mark.parametrize("band", ["window", "documents"])
def test_bounds_take_the_query_blocks_whose_tiles_cover_least(monkeypatch, band):
    """Under key bounds both passes take `_band_rows`'s query blocks: fewer rows for a
    causal sliding window (a block of R rows spans R + 255 keys for 256 a row), block_rows
    for documents whose rows share their bounds (a block spans its document alone)."""
    len_q = 1024
    rows_at = torch.arange(len_q)
    if band == "window":
        lo, hi = (rows_at - 255).clamp(min=0), rows_at + 1
    else:
        lo = rows_at // 256 * 256
        hi = lo + 256
    bounds = torch.stack([lo, hi], -1)[None]
    q, k, v, dout = random_inputs(1, 2, 2, len_q, len_q, 8, 8, torch.float32, 0)
    causal = 0 if band == "window" else None  # a causal diagonal would cut each document's blocks too
    rows = query_blocks_taken(monkeypatch, q, k, v, dout, causal, bounds=bounds)
    assert rows["forward"] == rows["backward"]
    assert (rows["forward"] < native.TILING().block_rows) is (band == "window")


@needs_tiles
@pytest.mark.parametrize("len_q, len_k, causal, rows", [(200, 200, True, 32), (300, 340, True, 64),
                                                        (300, 340, False, 256)])
def test_double_backward_at_its_own_block_heights(len_q, len_k, causal, rows):
    """The whole-row passes take blocks of 2 block_rows rows, a causal call's block_rows, and a
    short causal call's double backward fewer (`Tiling.whole_rows`, `double_causal_rows`). At the
    library's own settings, several blocks and a short last one (bottom-right where causal),
    float64: `higher_order`'s results to 1e-12."""
    causal = len_k - len_q if causal else None
    assert tiling.whole_row_split(torch.empty(1, 1, len_q, 1), torch.empty(1, 1, len_k, 1), {}, False, 1, causal,
                                   double_backward=True)[0] == rows
    q, k, v, dout = random_inputs(2, 4, 2, len_q, len_k, 24, 16, torch.float64, 5)
    g = torch.Generator().manual_seed(6)
    gq, gk, gv = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (q, k, v))
    scale = 24**-0.5
    call = tiles_call(q, k, v, causal, scale)
    out, row_max, inv_sum = first_order.attention_forward(call)
    inputs = after_forward(dout, (out, row_max, inv_sum), dout_grad=True, bias_grad=False, gq=gq, gk=gk, gv=gv)
    ours = native.attention_double_backward(call, inputs)
    theirs = higher_order.attention_double_backward(call, **inputs, gbias=None)
    names = ("g_dout", "g_q", "g_k", "g_v")
    assert_all_close(dict(zip(names, ours[:4])), dict(zip(names, theirs[:4])))


def test_whole_row_blocks_are_taller_where_nothing_bands_the_keys():
    """2 block_rows rows per block for a full call, up to double_tile numbers a tile; block_rows
    for a causal call, key bounds (a window) or a block mask, whose taller blocks would span
    keys their rows do not see."""
    q = torch.empty(1, 1, 4096, 1)

    def rows(len_k, causal=None, **masks):
        return tiling.whole_row_split(q, torch.empty(1, 1, len_k, 1), masks, False, 1, causal)[0]

    sizes = tiling.TILING()
    assert rows(4096) == 2 * sizes.block_rows == 256 and rows(8192) == sizes.double_tile // 8192 == 128
    assert rows(4096, 0) == rows(4096, key_bounds=torch.zeros(1)) == rows(4096, mask_blocks=object()) == 128


@needs_tiles
def test_key_chunks_give_the_same_gradients():
    """One head on several threads splits its keys into chunks, each with its own dQ sum."""
    q, k, v, dout = random_inputs(1, 1, 1, 300, 1100, 16, 16, torch.float64, 3)
    call = tiles_call(q, k, v, 0, 0.25)
    inputs = after_forward(dout, native.attention_forward(call))
    one = native.attention_backward(call, inputs, chunks=1)[:3]
    for chunks in (2, 3, 8):
        for a, b in zip(native.attention_backward(call, inputs, chunks=chunks)[:3], one):
            assert rel_err(a, b) < EXACT


@needs_tiles
@pytest.mark.parametrize("case,transposed", [
    ("window", True), ("documents", False), ("bfloat16", False), ("decode", False), ("no bounds", False)])
def test_which_calls_take_transposed_keys(monkeypatch, case, transposed):
    """Transposed copies pay where a band's query blocks are narrow (a causal window of 256:
    32 rows): not for documents of 512 (64 or 128 rows, whose NT products are as fast), nor
    bfloat16 products, nor a decode step (one row, its own product), nor without bounds."""
    taken = {}
    run = native._run

    def recording(name, call, layout, *args, **kwargs):
        taken[name] = layout.transposed_keys
        return run(name, call, layout, *args, **kwargs)

    monkeypatch.setattr(native, "_run", recording)
    len_q = 1 if case == "decode" else 1024
    rows = torch.arange(1024)[-len_q:]
    window = torch.stack([(rows - 255).clamp(min=0), rows + 1], -1)[None]
    documents = torch.stack([rows // 512 * 512, rows // 512 * 512 + 512], -1)[None]
    bounds = {"documents": documents, "no bounds": None}.get(case, window)
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    q, k, v, dout = random_inputs(1, 2, 2, len_q, 1024, 16, 16, dtype, 0)
    causal = 1024 - len_q
    call = tiles_call(q, k, v, causal, 0.25, bounds=bounds)
    out = native.attention_forward(call)
    assert taken["forward"] is transposed
    if case != "decode":
        native.attention_backward(call, after_forward(dout, out))
        assert taken["backward"] is transposed
