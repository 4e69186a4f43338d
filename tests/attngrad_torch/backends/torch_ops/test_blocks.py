"""The torch-ops kernels' blocking (`first_order.blocks`): how a call's query rows split into
blocks whose score tiles bound the kernels' memory, which keys each block sees, and that
neither the blocking nor its tuning changes a result beyond rounding (dropout's draws
included). Every other behaviour of the torch-ops kernels is tested beside the other
backends', through the shared `backend` fixture."""

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attngrad.torch import attention, use_backend  # noqa: E402
from attngrad.torch.backends.torch_ops import first_order  # noqa: E402
from attngrad.torch.masks.structured import structure  # noqa: E402

from ....conftest import EXACT, rel_err  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 3), heads=st.integers(1, 4), len_q=st.integers(1, 300), len_k=st.integers(1, 300),
       causal=st.sampled_from([None, 0, "bottom_right", -5, 7]), tile=st.sampled_from([1 << 9, 1 << 12, 1 << 22]),
       min_rows=st.sampled_from([1, 3, 16]))
def test_blocks_cover_every_row_once_and_bound_their_tiles(batch, heads, len_q, len_k, causal, tile, min_rows):
    """The blocks partition the query rows in order; each sees keys [0, keys) of the causal
    prefix of its last row (all keys without the causal mask); and a block of more than
    min_rows rows holds at most tile_elements scores over the batch and heads, so the
    kernels' extra memory is bounded whatever the length."""
    diagonal = len_k - len_q if causal == "bottom_right" else causal
    with first_order.TILING.override(tile_elements=tile, min_rows=min_rows):
        plan = first_order.blocks(batch, heads, len_q, len_k, diagonal)
    assert plan[0][0] == 0 and plan[-1][1] == len_q
    for (_, stop, _, _), (start, _, _, _) in zip(plan, plan[1:]):
        assert stop == start
    for start, stop, first, keys in plan:
        assert 0 <= start < stop <= len_q
        seen = len_k if diagonal is None else min(len_k, max(0, stop - 1 + diagonal + 1))
        assert keys == seen and first in (0, keys)  # first == keys: the block sees no key at all
        if stop - start > min_rows:
            assert batch * heads * (stop - start) * max(1, keys) <= max(tile, batch * heads * len_k) * 1.01


def test_torch_ops_blocks_hold_only_their_band(many_blocks):
    """The torch-ops kernels' query blocks under a causal window of w keys see their R rows'
    R + w - 1 keys at most, wherever they lie: the band, not the prefix."""
    length, keys = 64, 5
    bounds, _ = structure((1,), length, length, 0, torch.device("cpu"), window=(keys - 1, None))
    plan = first_order.blocks(1, 1, length, length, 0, bounds=bounds)
    assert len(plan) > 3 and plan[-1][1] == length
    for start, stop, first, last in plan:
        assert first == max(0, start - keys + 1) and last == stop


def test_dropout_mask_does_not_depend_on_the_tiling(tuned):
    """The torch-ops kernels draw per block: with one tile of 2^22 scores or many of 2^9
    the keep-mask is the same, so the output and gradients agree to rounding (a different
    mask would change them by O(1))."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 60, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 3, 60, 16, generator=g, dtype=torch.float64)

    def run():
        torch.manual_seed(11)
        with use_backend("torch-ops"):
            out = attention(q, k, v, is_causal=True, dropout_p=0.4)
            return (out, *torch.autograd.grad(out, (q, k, v), dout))

    big, big_plan = run(), first_order.blocks(2, 3, 60, 60, 0)
    tuned(first_order.TILING, tile_elements=1 << 9, min_rows=3)
    small, small_plan = run(), first_order.blocks(2, 3, 60, 60, 0)
    assert len(big_plan) == 1 and len(small_plan) > 10
    for a, b in zip(big, small):
        assert rel_err(a, b) < EXACT


@pytest.mark.parametrize("causal", [False, True])
def test_the_kernels_take_shapes_alone_on_the_meta_device(causal):
    """On the meta device (no values: shape inference, a model built before its weights)
    the kernels run every first-order pass and give the shapes and dtypes they give on the
    CPU."""
    q, k, v = (torch.empty(2, 4, n, 8, device="meta", dtype=torch.float64, requires_grad=True) for n in (5, 7, 7))
    with use_backend("torch-ops"):
        out = attention(q, k, v, is_causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert out.shape == (2, 4, 5, 8) and out.device.type == "meta" and out.dtype == torch.float64
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
