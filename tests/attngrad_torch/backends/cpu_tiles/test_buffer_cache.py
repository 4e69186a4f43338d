"""The gradient buffers kept between calls (attngrad.torch.backends.cpu_tiles.buffer_cache): handed out again
only once nothing holds them, within the limit, and never showing what they held."""

import pytest

torch = pytest.importorskip("torch")

from attngrad.torch import attention, scaled_dot_product_attention  # noqa: E402
from attngrad.torch.backends.cpu_tiles import buffer_cache, native  # noqa: E402

from ....conftest import assert_all_close  # noqa: E402
from ...conftest import math_sdpa  # noqa: E402

needs_tiles = pytest.mark.skipif(native.library() is None, reason=f"no compiled tiles: {native.build_info.reason}")
SIZES = (2, 3, 5, 7)


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch, tuned):
    """An empty cache that keeps even small buffers, and the default limit after the test."""
    tuned(buffer_cache.TILING, smallest_kept_buffer=0)
    buffer_cache.empty_cache()
    yield
    buffer_cache.set_limit(buffer_cache.DEFAULT_LIMIT)
    buffer_cache.empty_cache()


def test_a_buffer_is_handed_out_again_once_nothing_holds_it():
    first = buffer_cache.empty(SIZES, torch.float32)
    address = first.data_ptr()
    held = buffer_cache.empty(SIZES, torch.float32)  # the first is still held: a new one
    assert held.data_ptr() != address
    address = held.data_ptr()
    del first  # the cache keeps `held`'s buffer in its place: the first's memory is the allocator's
    del held
    assert buffer_cache.empty(SIZES, torch.float64).data_ptr() != address  # another dtype: a buffer of its own
    again = buffer_cache.empty(SIZES, torch.float32)
    assert again.data_ptr() == address
    assert again.shape == SIZES and again.is_contiguous() and again._base is None
    address = again.data_ptr()
    # what still holds the memory, each alone: a view, a reshape, the storage object
    for keep in (lambda t: t[1:], lambda t: t.reshape(-1), lambda t: t.untyped_storage()):
        kept = keep(again)
        del again
        assert buffer_cache.empty(SIZES, torch.float32).data_ptr() != address
        del kept
        again = buffer_cache.empty(SIZES, torch.float32)  # the new one, now free in its turn
        address = again.data_ptr()


def test_the_limit_and_empty_cache():
    nbytes = 2 * 3 * 5 * 7 * 4
    buffer_cache.set_limit(nbytes)
    a = buffer_cache.empty(SIZES, torch.float32)
    assert buffer_cache.cached_bytes() == nbytes
    b = buffer_cache.empty((7, 5, 3, 2), torch.float32)  # the limit holds one: the older goes
    assert buffer_cache.cached_bytes() == nbytes
    del a, b
    assert buffer_cache.empty((2, 3, 5, 8), torch.float32) is not None and buffer_cache.cached_bytes() == nbytes
    buffer_cache.empty_cache()
    assert buffer_cache.cached_bytes() == 0
    buffer_cache.set_limit(0)  # keeps none
    assert buffer_cache.empty(SIZES, torch.float32).shape == SIZES and buffer_cache.cached_bytes() == 0
    assert buffer_cache.limit() == 0
    with pytest.raises(ValueError, match="nbytes must be an int >= 0; got -1"):
        buffer_cache.set_limit(-1)


def _poisoned(sizes: tuple, dtype: torch.dtype) -> None:
    """The cache's buffer of `sizes` filled with NaN and released, so the next call gets it."""
    buffer_cache.empty(sizes, dtype).fill_(float("nan"))


@needs_tiles
@pytest.mark.parametrize("causal", [False, True, "window"])
def test_a_kept_buffer_never_shows_through(monkeypatch, causal, tuned):
    """A bias of the scores' own size has its gradient written entry by entry into a kept
    buffer (zeros in the tiles and keys the passes skip: where the bias is -inf, a padded
    sequence's keys, a causal triangle, the keys before a sliding window, whose tiles start
    inside a key block), and the double backward adds into a kept one it zeroes first. Each
    buffer filled with NaN beforehand, the gradients still equal autograd's through
    PyTorch's math path, float64, to 1e-12."""
    tuned(native.TILING, block_rows=4, narrow_block_keys=8, block_keys=8)
    torch.manual_seed(0)
    batch, heads, len_q, len_k = 2, 3, 13, 29
    q = torch.randn(batch, heads, len_q, 16, dtype=torch.float64)
    k, v = (torch.randn(batch, heads, len_k, 16, dtype=torch.float64) for _ in range(2))
    bias = torch.randn(batch, heads, len_q, len_k, dtype=torch.float64)
    bias[1, :, :, 9:] = float("-inf")  # the second sequence's keys from 9 on are padding
    offset = torch.arange(len_k)[None, :] - torch.arange(len_q)[:, None]  # j - i
    if causal:
        bias.masked_fill_(offset > 0, float("-inf"))
    ours = scaled_dot_product_attention
    if causal == "window":  # five keys a row: our passes take the window as key bounds
        bias.masked_fill_(offset < -4, float("-inf"))

        def ours(q, k, v, attn_mask):
            return attention(q, k, v, attn_bias=attn_mask, is_causal=True, window=(4, None))

    dout = torch.randn(batch, heads, len_q, 16, dtype=torch.float64)
    results = {}
    for name, run in (("ours", ours), ("theirs", math_sdpa)):
        leaves = [t.detach().requires_grad_() for t in (q, k, v, bias)]
        _poisoned((1, *bias.shape), torch.float64)  # the backward's parts: one
        out = run(*leaves[:3], attn_mask=leaves[3])
        grads = torch.autograd.grad(out, leaves, dout, create_graph=True)
        _poisoned((1, *bias.shape), torch.float64)
        second = torch.autograd.grad(sum((g * c).sum() for g, c in zip(grads[:3], (q, k, v))), leaves)
        for prefix, values in (("d", grads), ("dd", second)):
            results.setdefault(name, {}).update({f"{prefix}{n}": t for n, t in zip("qkvb", values)})
    assert not any(t.isnan().any() for t in results["ours"].values())
    assert_all_close(results["ours"], results["theirs"])


@needs_tiles
def test_grad_takes_the_kept_buffer_without_a_copy():
    """autograd stores the gradient as `.grad` as it is (it copies a gradient other tensors
    reference); after `.grad = None` the next backward writes into the same memory, and
    accumulating into a held `.grad` leaves it where it is."""
    q, k, v = (torch.randn(1, 2, 9, 8, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, 9, 9, requires_grad=True)
    scaled_dot_product_attention(q, k, v, attn_mask=bias).sum().backward()
    address, first = bias.grad.data_ptr(), bias.grad.clone()
    assert address in {t.data_ptr() for t in buffer_cache._kept.values()}
    bias.grad = None
    scaled_dot_product_attention(q, k, v, attn_mask=bias).sum().backward()
    assert bias.grad.data_ptr() == address and torch.equal(bias.grad, first)
    scaled_dot_product_attention(q, k, v, attn_mask=bias).sum().backward()
    assert bias.grad.data_ptr() == address and torch.equal(bias.grad, 2 * first)
