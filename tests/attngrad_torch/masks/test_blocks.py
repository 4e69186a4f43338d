"""A mask kept per block (`mask_blocks`): what masks with holes inside rows, or heads that
differ, become. The form holds the mask exactly (any shape, any block size, hypothesis),
keeps only distinct partial tiles, and classifies the kernels' tiles exactly; every pass of
every backend reads it as PyTorch's math kernel reads the dense mask (float64, 1e-12: out,
every gradient, the JVP, the double backward), with the other masks beside it; the ops
refuse bad blocks by name; and a dilated mask at L = 4096 holds no Lq x Lk tensor.
"""

import itertools

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from attngrad.torch import attention, create_block_mask  # noqa: E402
from attngrad.torch.masks import blocks as mask_blocks  # noqa: E402
from attngrad.torch.masks.blocks import EMPTY, FULL, MaskBlocks  # noqa: E402

from ...conftest import assert_all_close  # noqa: E402
from ..conftest import make_call  # noqa: E402

B, H, LQ, LK, D = 2, 3, 45, 52, 8
BLOCK = (5, 7)  # neither divides the lengths: blocks past the edge
DOUBLE = torch.float64


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DOUBLE)


def with_a_key(kept):
    """Every row keeps a key (the math kernel gives NaN for a row that keeps none)."""
    rows, keys = torch.arange(kept.shape[-2])[:, None], torch.arange(kept.shape[-1])[None, :]
    return kept | (keys == rows % kept.shape[-1])


ENTRIES = with_a_key(torch.rand(B, H, LQ, LK, generator=torch.Generator().manual_seed(1)) > 0.6)
WHOLE = torch.rand(B, 1, 10, 8, generator=torch.Generator().manual_seed(2)) > 0.5


def dilated(b, h, q, kv):  # shared by every head; a few distinct patterns, repeated
    return (kv % 2 == q % 2) | (kv == q % LK)


def whole_blocks(b, h, q, kv):  # per batch entry: FlexAttention's block sparsity, blocks of BLOCK
    return WHOLE[b, 0, q // BLOCK[0], kv // BLOCK[1]] | (kv == q % LK)


def one_key_rows(b, h, q, kv):  # even rows see one key (P = 1 exactly), odd rows holes; heads differ
    return (kv == (7 * q + h) % LK) | (ENTRIES[b, h, q, kv] & (q % 2 == 1))


@st.composite
def masks(draw):
    b, h = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3]))
    len_q, len_k = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    block = (draw(st.integers(1, 9)), draw(st.integers(1, 9)))
    kind = draw(st.sampled_from(["entries", "blocks", "all", "none"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if kind == "entries":
        mask = torch.rand(b, h, len_q, len_k, generator=gen) > 0.5
    elif kind == "blocks":
        coarse = torch.rand(b, h, -(-len_q // block[0]), -(-len_k // block[1]), generator=gen) > 0.5
        mask = coarse.repeat_interleave(block[0], 2).repeat_interleave(block[1], 3)[..., :len_q, :len_k]
    else:
        mask = torch.full((b, h, len_q, len_k), kind == "all")
    return mask, block


@settings(max_examples=30, deadline=None)
@given(masks())
def test_blocks_hold_the_mask_exactly(drawn):
    """Any mask, any block size: written back out it is the mask; EMPTY and FULL blocks are
    those with no and every entry kept (past the edges nothing counts); partial tiles are
    distinct and there are no more of them than partial blocks."""
    mask, block = drawn
    blocks = mask_blocks.from_dense(mask, block)
    len_q, len_k = mask.shape[2:]
    assert torch.equal(blocks.dense(len_q, len_k), mask)
    r, k = block
    assert blocks.index.shape == (*mask.shape[:2], -(-len_q // r), -(-len_k // k)) and blocks.index.dtype == torch.int32
    assert not blocks.tiles[EMPTY].any() and blocks.tiles[FULL].all()
    for (bi, hi, i, j) in torch.cartesian_prod(*(torch.arange(n) for n in blocks.index.shape)).tolist():
        entries = mask[bi, hi, i * r:(i + 1) * r, j * k:(j + 1) * k]
        expected = EMPTY if not entries.any() else FULL if entries.all() else None
        if expected is None:
            assert blocks.index[bi, hi, i, j] >= 2
        else:
            assert blocks.index[bi, hi, i, j] == expected
    partial = blocks.tiles[2:].flatten(1)
    assert len(torch.unique(partial, dim=0)) == len(partial) <= int((blocks.index >= 2).sum())


@settings(max_examples=25, deadline=None)
@given(masks(), st.integers(1, 12), st.integers(1, 12))
def test_tiles_with_no_entry_or_every_entry_are_exact(drawn, block_rows, block_keys):
    """The kernels' tiles of any size skipped by the blocks: exactly those whose blocks are
    all EMPTY; and walked unmasked: exactly those whose blocks are all FULL."""
    mask, block = drawn
    blocks = mask_blocks.from_dense(mask, block)
    len_q, len_k = mask.shape[2:]
    none = mask_blocks.blocks_with_no_entry(blocks, len_q, len_k, block_rows, block_keys)
    every = mask_blocks.blocks_all_full(blocks, len_q, len_k, block_rows, block_keys)
    for i in range(none.shape[2]):
        for j in range(none.shape[3]):
            rows = slice(i * block_rows // block[0], ((i + 1) * block_rows - 1) // block[0] + 1)
            keys = slice(j * block_keys // block[1], ((j + 1) * block_keys - 1) // block[1] + 1)
            classes = blocks.index[:, :, rows, keys].flatten(2)
            assert torch.equal(none[:, :, i, j], (classes == EMPTY).all(2))
            assert torch.equal(every[:, :, i, j], (classes == FULL).all(2))


def numbered_plainly(mask, block, rows_per_chunk):
    """(index, tiles) of `mask` (b, h, Lq, Lk) kept per block, written plainly: the blocks
    visited in the order `from_rows` reads them (a chunk of block rows at a time; in it by
    entry, head, block row, block column) and each distinct partial tile numbered by its
    first appearance, after EMPTY and FULL. This is what `from_rows` gave when it gathered
    every partial tile and de-duplicated them all at once."""
    b, h, len_q, len_k = mask.shape
    r, k = block
    n_q, n_k = -(-len_q // r), -(-len_k // k)
    padded = torch.zeros(b, h, n_q * r, n_k * k, dtype=torch.bool)
    padded[..., :len_q, :len_k] = mask
    index = torch.empty(b, h, n_q, n_k, dtype=torch.int32)
    tiles = [torch.zeros(r, k, dtype=torch.bool), torch.ones(r, k, dtype=torch.bool)]
    numbers = {}
    step = max(1, rows_per_chunk // r)  # block rows per chunk
    for first in range(0, n_q, step):
        for bi, hi, i, j in itertools.product(range(b), range(h), range(first, min(n_q, first + step)), range(n_k)):
            inside = mask[bi, hi, i * r:(i + 1) * r, j * k:(j + 1) * k]
            tile = padded[bi, hi, i * r:(i + 1) * r, j * k:(j + 1) * k]
            if not inside.any():
                index[bi, hi, i, j] = EMPTY
            elif inside.all():
                index[bi, hi, i, j] = FULL
            else:
                key = tile.numpy().tobytes()
                if key not in numbers:
                    numbers[key] = len(tiles)
                    tiles.append(tile.clone())
                index[bi, hi, i, j] = numbers[key]
    return index, torch.stack(tiles)


def repeating_holes(b, h, len_q, len_k, block, seed):
    """A mask with holes inside its rows whose partial blocks repeat a few patterns (so that
    copies of one tile fall in different chunks), beside empty and full blocks."""
    gen = torch.Generator().manual_seed(seed)
    r, k = block
    n_q, n_k = -(-len_q // r), -(-len_k // k)
    pool = torch.cat([torch.zeros(1, r, k, dtype=torch.bool), torch.ones(1, r, k, dtype=torch.bool),
                      torch.rand(5, r, k, generator=gen) > 0.5])
    choice = torch.randint(0, len(pool), (b, h, n_q, n_k), generator=gen)
    mask = pool[choice].transpose(3, 4).reshape(b, h, n_q * r, n_k * k)[..., :len_q, :len_k]
    holes = torch.rand(b, h, len_q, len_k, generator=gen) > 0.997  # and a few tiles of their own
    return mask ^ holes


@pytest.mark.parametrize("at_once", [1, 3, 64])
@pytest.mark.parametrize("shape, block, rows_per_chunk, seed", [
    ((2, 3, 45, 52), (5, 7), 12, 1),  # edges past the lengths, a chunk of two block rows
    ((1, 2, 64, 40), (4, 4), 1, 2),  # one block row at a time
    ((2, 1, 33, 70), (8, 6), 100, 3),  # every row at once
])
def test_tiles_are_numbered_as_when_deduplicated_all_at_once(tuned, at_once, shape, block, rows_per_chunk, seed):
    """De-duplicating the partial tiles `at_once` at a time gives the index and tiles, bit
    for bit, of numbering every distinct tile by its first appearance over the whole mask."""
    tuned(mask_blocks.BLOCKING, tiles_at_once=at_once)
    mask = repeating_holes(*shape, block, seed)
    blocks = mask_blocks.from_rows(lambda start, stop: mask[:, :, start:stop], shape[:2], *shape[2:], rows_per_chunk,
                                   block)
    index, tiles = numbered_plainly(mask, block, rows_per_chunk)
    partial = int((index >= 2).sum())
    assert partial > at_once and partial > 2 * (len(tiles) - 2)  # several steps, and tiles repeat across them
    assert torch.equal(blocks.index, index) and torch.equal(blocks.tiles, tiles)


def test_partial_tiles_are_never_held_all_at_once():
    """No tensor made while keeping a mask per block is larger than the rows read at a time:
    the partial tiles (here 528, of 32 x 32, from a dilated causal mask) are copied out and
    de-duplicated `TILES_AT_ONCE` at a time, not gathered whole (which held 528 x 32 x 32)."""
    from ...largest_tensor import LargestTensor

    length, rows_per_chunk, block = 1024, 128, (32, 32)
    rows, keys = torch.arange(length)[:, None], torch.arange(length)[None, :]
    mask = ((rows >= keys) & ((rows - keys) % 3 == 0))[None, None]
    with LargestTensor() as seen:
        blocks = mask_blocks.from_rows(lambda start, stop: mask[:, :, start:stop], (1, 1), length, length,
                                       rows_per_chunk, block)
    assert int((blocks.index >= 2).sum()) == 32 * 33 // 2 and len(blocks.tiles) < 16
    assert seen.numel <= rows_per_chunk * length



CASES = {
    "one-key-rows": dict(mask_mod=one_key_rows, heads=(B, H), bias_shape=(B, H, LQ, LK)),
    "dilated-causal-bias": dict(mask_mod=dilated, heads=(1, 1), is_causal="bottom_right", bias_shape=(1, H, LQ, LK)),
    "whole-blocks-mask-padding": dict(mask_mod=whole_blocks, heads=(B, 1), bias_shape=(LQ, LK),
                                      attn_mask=torch.rand(LQ, LK, generator=torch.Generator().manual_seed(4)) > 0.2,
                                      key_padding=torch.tensor([LK, LK - 9])),
}


class Case:
    """One mask function with the other options, as a pair of functions of (q, k, v[, bias]):
    attngrad's through the blocks, and the math kernel's on the dense mask."""

    def __init__(self, mask_mod, heads, is_causal=False, bias_shape=None, attn_mask=None, key_padding=None,
                 shape=(B, H, LQ, LK)):
        batch, n_heads, len_q, len_k = self.shape = shape
        self.evaluated = create_block_mask(mask_mod, heads[0] if heads[0] > 1 else None,
                                           heads[1] if heads[1] > 1 else None, len_q, len_k, BLOCK_SIZE=BLOCK)
        assert self.evaluated.blocks is not None
        assert self.evaluated.blocks.index.shape[:2] == heads
        self.options = dict(is_causal=is_causal, attn_mask=attn_mask, key_padding=key_padding)
        allowed = self.evaluated.dense().expand(shape)
        rows, keys = torch.arange(len_q)[:, None], torch.arange(len_k)[None, :]
        if is_causal:
            allowed = allowed & (keys <= rows + len_k - len_q)
        if attn_mask is not None:
            allowed = allowed & attn_mask
        if key_padding is not None:
            allowed = allowed & (keys < key_padding[:, None, None, None])
        self.allowed = allowed
        self.q = randn(batch, n_heads, len_q, D, seed=5).transpose(1, 2).contiguous().transpose(1, 2)  # transposed
        self.k, self.v = randn(batch, n_heads, len_k, D, seed=6), randn(batch, n_heads, len_k, D, seed=7)
        self.bias = None if bias_shape is None else randn(*bias_shape, seed=8)

    @property
    def primals(self):
        return (self.q, self.k, self.v) + (() if self.bias is None else (self.bias,))

    def ours(self, q, k, v, bias=None):
        return attention(q, k, v, attn_bias=bias, block_mask=self.evaluated, **self.options)

    def theirs(self, q, k, v, bias=None):
        additive = (bias if bias is not None else q.new_zeros(())).masked_fill(~self.allowed, float("-inf"))
        with sdpa_kernel(SDPBackend.MATH):
            out, _ = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, additive, 0.0, False, None)
        return out.nan_to_num(0.0)  # a row the padding and the mask leave no key: 0, as attngrad gives


def _names(primals):
    return ["q", "k", "v", "bias"][:len(primals)]


@pytest.mark.parametrize("name", CASES)
def test_every_pass_reads_the_blocks(name, backend, many_blocks):
    """out, every gradient, a JVP and the double backward (grad of <grads, w> by q, k, v,
    bias and dout) through the blocks equal the math kernel on the dense mask."""
    _every_pass(Case(**CASES[name]))


TRITON_CASES = {  # small: the interpreter runs every program instance in Python
    "per-head-causal-bias": dict(mask_mod=one_key_rows, heads=(2, 2), is_causal="bottom_right",
                                 bias_shape=(2, 2, 13, 17), shape=(2, 2, 13, 17)),
    "shared-padding": dict(mask_mod=dilated, heads=(1, 1), key_padding=torch.tensor([17, 11]), shape=(2, 2, 13, 17)),
}


@pytest.mark.parametrize("name", TRITON_CASES)
def test_every_pass_reads_the_blocks_in_triton(name):
    """The same in the Triton kernels, run by Triton's interpreter (float64)."""
    pytest.importorskip("triton")
    from attngrad.torch import use_backend
    from attngrad.torch.backends import triton as triton_backend
    from attngrad.torch.op import dispatch

    if not triton_backend.interpreting():
        pytest.skip("the Triton kernels are compiled here (TRITON_INTERPRET=0): tests/attngrad_torch/backends/triton/test_passes.py")
    before = dict(dispatch.ran)
    with use_backend("triton"):
        _every_pass(Case(**TRITON_CASES[name]))
    assert {key[1] for key, count in dispatch.ran.items() if count > before.get(key, 0)} == {"triton"}


def _every_pass(case: "Case") -> None:
    primals = case.primals
    dout = randn(*case.shape[:3], D, seed=10)
    tangents = tuple(randn(*p.shape, seed=20 + i) for i, p in enumerate(primals))
    weights = tuple(randn(*p.shape, seed=30 + i) for i, p in enumerate(primals))
    results = {}
    for who, fn in (("ours", case.ours), ("theirs", case.theirs)):
        inputs = [p.clone().requires_grad_() for p in primals]
        g_out = dout.clone().requires_grad_()
        out = fn(*inputs)
        grads = torch.autograd.grad(out, inputs, g_out, create_graph=True)
        second = torch.autograd.grad(sum((g * w).sum() for g, w in zip(grads, weights)), [*inputs, g_out])
        _, out_t = torch.func.jvp(fn, primals, tangents)
        results[who] = dict(out=out, out_t=out_t, **{f"d{n}": g for n, g in zip(_names(primals), grads)},
                            **{f"g_{n}": g for n, g in zip([*_names(primals), "dout"], second)})
    assert_all_close(results["ours"], results["theirs"])


def test_vmap_folds_the_blocks_into_the_batch(backend):
    """torch.func.vmap over q (and jacrev, which vmaps the backward): the blocks' index
    folds into the batch like a mask, the tiles stay shared; equal to a loop of calls."""
    case = Case(**TRITON_CASES["per-head-causal-bias"])
    qs = torch.stack([case.q, 2 * case.q, -case.q])
    batched = torch.func.vmap(lambda q: case.ours(q, case.k, case.v, case.bias))(qs)
    assert torch.equal(batched, torch.stack([case.ours(q, case.k, case.v, case.bias) for q in qs]))
    small = Case(**TRITON_CASES["shared-padding"])
    jacobian = torch.func.jacrev(lambda v: small.ours(small.q, small.k, v))(small.v)
    expected = torch.autograd.functional.jacobian(lambda v: small.theirs(small.q, small.k, v), small.v)
    assert_all_close(dict(jacobian=jacobian), dict(jacobian=expected))


def test_blocks_made_outside_a_fullgraph_compile_pass_in():
    """Blocks made eagerly (their tile count is a value: no compiled graph can make them)
    enter a fullgraph-compiled function as two tensors; out and gradients equal eager."""
    torch._dynamo.reset()
    case = Case(**TRITON_CASES["per-head-causal-bias"])
    compiled = torch.compile(case.ours, fullgraph=True, backend="aot_eager")
    results = {}
    for who, fn in (("compiled", compiled), ("eager", case.ours)):
        inputs = [p.clone().requires_grad_() for p in case.primals]
        out = fn(*inputs)
        results[who] = dict(out=out, **dict(zip("qkvb", torch.autograd.grad(out.sum(), inputs))))
    assert_all_close(results["compiled"], results["eager"])


def test_ops_refuse_bad_blocks_by_name():
    """Each bad block index, tile or pairing is named before a kernel reads it, by the op
    and by the compiled tiles themselves."""
    from attngrad.torch.backends.cpu_tiles import native
    from attngrad.torch.op import ops

    q, k, v = randn(1, 2, 9, 4, seed=1), randn(1, 2, 11, 4, seed=2), randn(1, 2, 11, 4, seed=3)
    good = mask_blocks.from_dense(torch.rand(1, 2, 9, 11, generator=torch.Generator().manual_seed(0)) > 0.5, (4, 4))

    def run(blocks):
        return ops.run_op("forward", make_call(q, k, v, blocks=blocks))

    run(good)
    bad = {
        "holds tile": MaskBlocks(torch.full_like(good.index, len(good.tiles)), good.tiles),
        "keep no entry": MaskBlocks(good.index, good.tiles.flip(0)),
        "does not fit": MaskBlocks(good.index[..., :1], good.tiles),
        "int32": MaskBlocks(good.index.long(), good.tiles),
        "T >= 2": MaskBlocks(good.index.clamp(max=0), good.tiles[:1]),
    }
    for message, blocks in bad.items():
        with pytest.raises((ValueError, TypeError), match=message):
            run(blocks)
    with pytest.raises(ValueError, match="come together"):
        ops.attention_forward(q, k, v, None, None, None, torch.tensor(0), None, 0.5, 0.0, 0.0, mask_blocks=good.index)
    if native.library() is None:
        return
    tiles_op = torch.ops.attngrad_tiles.forward
    out, stats = q.new_empty(1, 2, 9, 4), q.new_empty(1, 2, 9)
    options = dict(causal=None, scale=0.5, softcap=0.0, dropout=False, seed=0, threshold=0, keep_value=1.0,
                   row_offset=0, key_offset=0, head_offset=0, partial_rows=False, sink=False, block_rows=3,
                   block_keys=5, value_slice=4, chunks=1)
    for message, blocks in (("holds tile", bad["holds tile"]), ("keep no entry", bad["keep no entry"]),
                            ("mask_blocks has shape", bad["does not fit"])):
        with pytest.raises(RuntimeError, match=message):
            tiles_op(q, k, v, None, None, None, out, stats, stats.clone(), **options, mask_blocks=blocks.index,
                     mask_tiles=blocks.tiles)
    with pytest.raises(RuntimeError, match="come together"):
        tiles_op(q, k, v, None, None, None, out, stats, stats.clone(), **options, mask_blocks=good.index)


def test_a_dilated_mask_at_4096_holds_nothing_lq_by_lk():
    """L = 4096: the evaluated mask is a few distinct tiles and the index, and no tensor of
    the forward and backward has Lq x Lk entries."""
    from ...largest_tensor import LargestTensor

    length = 4096
    evaluated = create_block_mask(lambda b, h, q, kv: (q >= kv) & ((q - kv) % 3 == 0), None, None, length, length)
    assert evaluated.blocks is not None and evaluated.blocks.nbytes() < length * length // 100
    # EMPTY, FULL, the diagonal's blocks, and below them the three phases of (q - kv) % 3
    assert len(evaluated.blocks.tiles) == 2 + 1 + 3

    q = torch.randn(1, 1, length, 16, requires_grad=True)
    with LargestTensor() as seen:
        attention(q, q, q, block_mask=evaluated).sum().backward()
    assert 0 < seen.numel < length * length
