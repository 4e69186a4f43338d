"""Masks as functions: `attention(mask_mod=...)` and `attention(block_mask=...)` (attngrad's
own or FlexAttention's BlockMask) equal FlexAttention's eager forward and, for gradients,
PyTorch's math path on the dense mask FlexAttention's `create_mask` writes (float64,
1e-12), on causal, sliding-window, prefix-LM, document, random-block and dilated masks, in every
backend; interval masks become key bounds (nothing Lq x Lk), the rest a mask kept per block; the
evaluation's chunking does not change the result; bad arguments get clear errors.
"""

import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask as flex_block_mask  # noqa: E402
from torch.nn.attention.flex_attention import create_mask, flex_attention  # noqa: E402

from attngrad.torch import attention, create_block_mask  # noqa: E402
from attngrad.torch.masks import functions  # noqa: E402

from ...conftest import assert_all_close  # noqa: E402

B, H, LQ, LK, D = 2, 3, 45, 52, 8
gen = torch.Generator().manual_seed(11)
DOCS = torch.stack([torch.arange(LK) // 17, (torch.arange(LK) >= 30).long()])  # per batch entry
RANDOM_BLOCKS = torch.rand(B, H, 6, 6, generator=gen) > 0.5


def causal(b, h, q, kv):
    return q >= kv


def sliding_window(b, h, q, kv):
    return (q >= kv) & (q - kv < 6)


def prefix_lm(b, h, q, kv):
    return (kv < 9) | (q >= kv)


def document(b, h, q, kv):
    return DOCS[b, q] == DOCS[b, kv]


def random_blocks(b, h, q, kv):  # per batch entry and head, holes inside rows: no interval
    return RANDOM_BLOCKS[b, h, q // 8, kv // 9] | (q == kv)


def dilated(b, h, q, kv):  # every head alike, holes inside rows
    return (q >= kv) & ((q - kv) % 3 == 0)


MASKS = [causal, sliding_window, prefix_lm, document, random_blocks, dilated]
INTERVALS = {causal, sliding_window, prefix_lm, document}


def inputs(transposed=False):
    q = torch.randn(B, H, LQ, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H, LK, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H, LK, D, generator=gen, dtype=torch.float64)
    if transposed:
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return [t.requires_grad_() for t in (q, k, v)]


def results(fn, q, k, v):
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=torch.Generator().manual_seed(3),
                                                            dtype=out.dtype))
    return dict(out=out, dq=grads[0], dk=grads[1], dv=grads[2])


@pytest.mark.parametrize("given", ["mask_mod", "attngrad block_mask", "flex block_mask"])
@pytest.mark.parametrize("mask_mod", MASKS, ids=lambda f: f.__name__)
def test_function_masks_equal_flex_attention(mask_mod, given, backend):
    q, k, v = inputs(transposed=mask_mod is document)
    if given == "mask_mod":
        kwargs = dict(mask_mod=mask_mod)
    elif given == "attngrad block_mask":
        kwargs = dict(block_mask=create_block_mask(mask_mod, B, H, LQ, LK))
    else:
        kwargs = dict(block_mask=flex_block_mask(mask_mod, B, H, LQ, LK, device="cpu", BLOCK_SIZE=16))
    ours = results(lambda *t: attention(*t, **kwargs), q, k, v)
    dense = create_mask(mask_mod, B, H, LQ, LK, device="cpu")
    with sdpa_kernel(SDPBackend.MATH):
        theirs = results(lambda *t: F.scaled_dot_product_attention(*t, attn_mask=dense), q, k, v)
    assert_all_close(ours, theirs)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")  # its eager reference
        flex = flex_attention(q.detach(), k.detach(), v.detach(), block_mask=flex_block_mask(mask_mod, B, H, LQ, LK, device="cpu"))
    assert_all_close(dict(out=ours["out"]), dict(out=flex))


@pytest.mark.parametrize("entries", [1, 200, 1 << 22])
@pytest.mark.parametrize("mask_mod", MASKS, ids=lambda f: f.__name__)
def test_interval_masks_become_bounds_whatever_the_chunks(mask_mod, entries, tuned):
    """The causal mask as the causal diagonal, the other rows' intervals as key bounds
    (1 or B, Lq, 2), the rest kept per block, each equal to FlexAttention's dense mask,
    whether one row or all are evaluated at once."""
    tuned(functions.EVALUATION, entries=entries)
    evaluated = create_block_mask(mask_mod, B, H, LQ, LK)
    dense = create_mask(mask_mod, B, H, LQ, LK, device="cpu")
    assert torch.equal(evaluated.dense().expand(dense.shape), dense)
    if mask_mod is causal:
        assert (evaluated.causal, evaluated.bounds, evaluated.mask) == (0, None, None)
    elif mask_mod in INTERVALS:
        assert evaluated.mask is None and evaluated.bounds.shape[1:] == (LQ, 2)
    else:
        assert evaluated.bounds is None and evaluated.mask is None and evaluated.blocks is not None


def test_empty_calls_evaluate_nothing():
    q = torch.randn(1, 2, 0, D, dtype=torch.float64)
    k = torch.randn(1, 2, 5, D, dtype=torch.float64)
    assert attention(q, k, k, mask_mod=causal).shape == (1, 2, 0, D)
    assert create_block_mask(causal, None, None, 4, 0).dense().shape == (1, 1, 4, 0)


def test_the_whole_matrix_and_diagonals_need_no_mask():
    every = create_block_mask(lambda b, h, q, kv: q >= -1, None, None, LQ, LK)
    assert (every.causal, every.bounds, every.mask) == (None, None, None)
    right = create_block_mask(lambda b, h, q, kv: kv <= q + LK - LQ, None, None, LQ, LK)
    assert right.causal == LK - LQ and right.bounds is None
    q, k, v = inputs()
    assert_all_close(dict(out=attention(q, k, v, block_mask=right)),
                     dict(out=attention(q, k, v, is_causal="bottom_right")))


def test_flex_block_structure_counts():
    """FlexAttention's rule: an entry of a block the BlockMask leaves out takes no part
    whatever mask_mod says; the evaluation is kept with the BlockMask for the next call."""
    q, k, v = inputs()
    block_mask = flex_block_mask(causal, None, None, LQ, LK, device="cpu", BLOCK_SIZE=16)
    block_mask.mask_mod = lambda b, h, q_idx, kv_idx: q_idx >= 0  # every entry, but only in listed blocks
    out = attention(q, k, v, block_mask=block_mask)
    assert block_mask in functions._EVALUATED
    listed = torch.arange(LK)[None, :] // 16 <= torch.arange(LQ)[:, None] // 16
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=listed)
    assert_all_close(dict(out=out), dict(out=expected))


@pytest.mark.parametrize("is_causal", [False, True])
def test_function_masks_join_the_other_masks(is_causal):
    """mask_mod's bounds intersect key_padding's and a window's (and the causal diagonal's);
    its causal diagonal meets is_causal's (the lower holds); its mask joins attn_mask."""
    q, k, v = inputs()
    lengths = torch.tensor([40, 52])
    rows, keys = torch.arange(LQ)[:, None], torch.arange(LK)[None, :]
    structure = (keys < lengths[:, None, None, None]) & (keys <= rows + 4) & (keys >= rows - 4)
    if is_causal:
        structure = structure & (keys <= rows)
    keep = torch.rand(LQ, LK, generator=gen) > 0.2
    cases = [  # (arguments, the dense mask they stand for)
        (dict(mask_mod=document, key_padding=lengths, window=(4, 4), is_causal=is_causal),
         create_mask(document, B, H, LQ, LK, device="cpu") & structure),
        (dict(mask_mod=causal, is_causal="bottom_right" if is_causal else False), keys <= rows),
        (dict(mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx - 3, is_causal=is_causal), keys <= rows - 3),
        (dict(mask_mod=dilated, attn_mask=keep), create_mask(dilated, B, H, LQ, LK, device="cpu") & keep),
    ]
    for arguments, dense in cases:
        with sdpa_kernel(SDPBackend.MATH):
            expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        assert_all_close(dict(out=attention(q, k, v, **arguments)), dict(out=expected.nan_to_num(0.0)))


def test_bad_function_masks_are_named():
    q, k, v = inputs()
    with pytest.raises(ValueError, match="not both"):
        attention(q, k, v, mask_mod=causal, block_mask=create_block_mask(causal, None, None, LQ, LK))
    with pytest.raises(ValueError, match=r"\(B, H, L, E\)"):
        attention(q[0], k[0], v[0], mask_mod=causal)
    with pytest.raises(TypeError, match="booleans"):
        attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: q_idx - kv_idx)
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        attention(q, k, v, mask_mod="causal")
    with pytest.raises(ValueError, match="does not fit"):
        attention(q, k, v, block_mask=create_block_mask(causal, None, None, LQ, LK + 1))
    with pytest.raises(ValueError, match=r"\(Q_LEN, KV_LEN\)"):
        attention(q, k, v, block_mask=flex_block_mask(causal, None, None, LQ + 1, LK, device="cpu"))
    with pytest.raises(TypeError, match="create_block_mask"):
        attention(q, k, v, block_mask=torch.ones(LQ, LK, dtype=torch.bool))
    for sizes in ((None, None, -1, LK), (None, None, LQ, -2), (-1, None, LQ, LK), (None, 1.5, LQ, LK)):
        with pytest.raises(ValueError, match=r"(B|H|Q_LEN|KV_LEN) must be an int >= 0"):
            create_block_mask(causal, *sizes)


@pytest.mark.parametrize("mask_mod", [sliding_window, document, random_blocks, dilated], ids=lambda f: f.__name__)
def test_function_masks_under_fullgraph_compile(mask_mod):
    """Compiled, a mask's form follows its shapes: one shared by the heads becomes key bounds
    (checked to be intervals when the graph runs), one whose heads differ the written-out
    mask. No graph break (fullgraph), the same numbers as the eager call; a mask with gaps
    inside its rows, shared by the heads, is refused when the graph runs."""
    torch._dynamo.reset()
    q, k, v = inputs()
    compiled = torch.compile(lambda *t: attention(*t, mask_mod=mask_mod), fullgraph=True, backend="aot_eager")
    if mask_mod is dilated:
        with pytest.raises(RuntimeError, match="gap"):
            compiled(q, k, v)
        return
    assert_all_close(results(compiled, q, k, v), results(lambda *t: attention(*t, mask_mod=mask_mod), q, k, v))
    fixed = functions.evaluate_rows(
        lambda start, stop: create_mask(mask_mod, B, H, LQ, LK, device="cpu")[:, :, start:stop], B, H, LQ, LK,
        fixed_form=True)
    assert (fixed.mask is None) == (mask_mod is not random_blocks)
    assert torch.equal(fixed.dense().expand(B, H, LQ, LK), create_mask(mask_mod, B, H, LQ, LK, device="cpu"))
