"""The forward with its JVP in one pass (`forward_jvp`): where forward mode alone
differentiates a call (torch.func.jvp, a dual level), the output and its tangent come from
one pass of whole rows that makes its own row statistics. It must give what the forward
and the JVP give apart, for every option, and what PyTorch's autograd gives; and the calls
it must not take (reverse mode tracking, nested transforms) keep the Function's path."""

import contextlib

import pytest

torch = pytest.importorskip("torch")

import torch.autograd.forward_ad as forward_ad  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attngrad.torch import ran, scaled_dot_product_attention, use_backend  # noqa: E402
from attngrad.torch.backends.cpu_tiles import native  # noqa: E402
from attngrad.torch.op import ops  # noqa: E402
from attngrad.torch.op.dropout import Placement  # noqa: E402

from ...conftest import EXACT, rel_err  # noqa: E402
from ..cases import _randn, calls  # noqa: E402
from ..conftest import make_call, math_sdpa  # noqa: E402

needs_tiles = pytest.mark.skipif(native.library() is None, reason="the compiled tiles are not built here")


@needs_tiles
@settings(max_examples=40, deadline=None)
@given(calls(), st.booleans())
def test_the_one_pass_equals_the_forward_then_the_jvp(case, small_blocks):
    """float64, every option: out, the row statistics and out's tangent from the fused pass of
    the tiles equal the forward's and the JVP's, each pass the tiles' own and the torch-ops
    kernels' (which fuse nothing: the ops run them in turn). A row that sees no key has 0.
    Small blocks: 3 rows per block, and O = P V summed over slices of 4 keys."""
    call, tangents = case
    ran.clear()
    with native.TILING.override(block_rows=3, value_slice=4) if small_blocks else contextlib.nullcontext():
        out, row_max_f, inv_sum_f, out_t = ops.run_pass("forward_jvp", call, tangents)
    assert ran[("forward_jvp", "tiles")] == 1
    for backend in ("tiles", "torch-ops"):
        with use_backend(backend):
            ref_out, row_max, inv_sum = ops.run_pass("forward", call, {})
            ref_t = ops.run_pass("jvp", call, dict(row_max=row_max, inv_sum=inv_sum, **tangents))
            composed = ops.run_pass("forward_jvp", call, tangents) if backend == "torch-ops" else None
        assert rel_err(out, ref_out) < EXACT, backend
        assert rel_err(out_t, ref_t) < EXACT, backend
        assert rel_err(row_max_f, row_max) < EXACT and rel_err(inv_sum_f, inv_sum) < EXACT, backend
        if composed is not None:  # torch-ops has no fused pass: the same two passes, bit for bit
            assert all(torch.equal(a, b) for a, b in zip(composed, (ref_out, row_max, inv_sum, ref_t)))
    assert torch.isfinite(out).all() and torch.isfinite(out_t).all()
    if call.mask is not None:
        assert not out[..., 0, :].any() and not out_t[..., 0, :].any()


@needs_tiles
@pytest.mark.parametrize("masked", [False, True])
def test_forward_mode_runs_one_pass_and_matches_pytorch(masked):
    """torch.func.jvp, a dual level in eager, and vmap over torch.func.jvp: each runs the
    fused pass once, and out and its tangent match PyTorch's autograd through the math
    backend (float64, a float mask with its tangent, B > 1, H > 1, Lq != Lk, transposed q)."""
    g = torch.Generator().manual_seed(3)
    q = _randn(2, 3, 17, 8, g=g, transposed=True)
    k, v = _randn(2, 3, 29, 8, g=g), _randn(2, 3, 29, 8, g=g)
    bias = _randn(3, 17, 29, g=g).masked_fill(torch.rand(17, 29, generator=g) < 0.3, float("-inf")) if masked else \
        _randn(3, 17, 29, g=g)
    tangents = tuple(_randn(*t.shape, g=g) for t in (q, k, v)) + (_randn(3, 17, 29, g=g).masked_fill(bias.isinf(), 0),)
    ours = lambda q, k, v, b: scaled_dot_product_attention(q, k, v, attn_mask=b)  # noqa: E731
    theirs = lambda q, k, v, b: math_sdpa(q, k, v, attn_mask=b)  # noqa: E731
    ref = torch.func.jvp(theirs, (q, k, v, bias), tangents)

    ran.clear()
    got = torch.func.jvp(ours, (q, k, v, bias), tangents)
    with forward_ad.dual_level():
        dual = forward_ad.unpack_dual(ours(*(forward_ad.make_dual(p, t) for p, t in zip((q, k, v, bias), tangents))))
    batched = torch.func.vmap(lambda q, t: torch.func.jvp(lambda q: ours(q, k, v, bias), (q,), (t,)))(
        torch.stack([q, 2 * q]), torch.stack([tangents[0], tangents[0]]))
    assert dict(ran) == {("forward_jvp", "tiles"): 3}
    for out, out_t in (got, tuple(dual)):
        assert rel_err(out, ref[0]) < EXACT and rel_err(out_t, ref[1]) < EXACT
    ref_q = torch.func.jvp(lambda q: theirs(q, k, v, bias), (2 * q,), (tangents[0],))
    assert rel_err(batched[0][1], ref_q[0]) < EXACT and rel_err(batched[1][1], ref_q[1]) < EXACT


@needs_tiles
def test_jacfwd_runs_the_fused_pass_once_over_its_batch_of_tangents():
    """torch.func.jacfwd (vmap over jvp): one fused call for every column of the Jacobian,
    equal to PyTorch's (float64, causal, B > 1, H > 1, Lq != Lk)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = _randn(2, 2, 5, 4, g=g), _randn(2, 2, 7, 4, g=g), _randn(2, 2, 7, 3, g=g)
    ran.clear()
    ours = torch.func.jacfwd(lambda q: scaled_dot_product_attention(q, k, v, is_causal=True))(q)
    assert dict(ran) == {("forward_jvp", "tiles"): 1}
    assert rel_err(ours, torch.func.jacfwd(lambda q: math_sdpa(q, k, v, is_causal=True))(q)) < EXACT


@needs_tiles
def test_calls_that_reverse_mode_tracks_keep_the_functions_path():
    """The fused op has no autograd of its own, so where reverse mode tracks a tensor
    (autograd under torch.func.jvp, forward over reverse) the call keeps the Function and its
    backward, and its JVP's own reverse-mode derivative; the Function's forward waits for
    its jvp, which runs the fused pass. Where vmap sits inside the JVP, the Function runs its forward, then its jvp."""
    g = torch.Generator().manual_seed(5)
    q, k, v, tq = (_randn(1, 2, 6, 4, g=g) for _ in range(4))
    f = lambda q: scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731

    ran.clear()
    leaf = q.clone().requires_grad_()
    out, out_t = torch.func.jvp(f, (leaf,), (tq,))
    out.sum().backward()  # reverse mode through the forward: the Function's backward
    ref_out, ref_t = torch.func.jvp(lambda q: math_sdpa(q, k, v, is_causal=True), (q,), (tq,))
    assert rel_err(out, ref_out) < EXACT and rel_err(out_t, ref_t) < EXACT
    leaf_ref = q.clone().requires_grad_()
    math_sdpa(leaf_ref, k, v, is_causal=True).sum().backward()
    assert rel_err(leaf.grad, leaf_ref.grad) < EXACT
    assert dict(ran) == {("forward_jvp", "tiles"): 1, ("backward", "tiles"): 1}
    leaf.grad = None
    out_t.sum().backward()  # reverse mode through the JVP (`autograd.Tangent`)
    leaf_ref.grad = None
    torch.func.jvp(lambda q: math_sdpa(q, k, v, is_causal=True), (leaf_ref,), (tq,))[1].sum().backward()
    assert rel_err(leaf.grad, leaf_ref.grad) < EXACT

    ran.clear()
    torch.func.jvp(torch.func.grad(lambda q: f(q).sum()), (q,), (tq,))  # forward over reverse: an HVP
    assert dict(ran) == {("forward_jvp", "tiles"): 1, ("backward_with_jvp", "tiles"): 1}
    ran.clear()
    torch.func.jvp(lambda q: torch.func.vmap(f)(q), (q[None],), (tq[None],))  # vmap inside the JVP
    assert dict(ran) == {("forward", "tiles"): 1, ("jvp", "tiles"): 1}
    ours = torch.func.grad(lambda q: torch.func.jvp(f, (q,), (tq,))[1].sum())(q)  # reverse over forward
    theirs = torch.func.grad(lambda q: torch.func.jvp(lambda q: math_sdpa(q, k, v, is_causal=True), (q,),
                                                      (tq,))[1].sum())(q)
    assert rel_err(ours, theirs) < EXACT


@needs_tiles
def test_the_native_pass_refuses_a_part_of_each_rows_keys():
    """The fused pass takes each row's statistics from its keys: a ring step's call (its
    seed says the keys are a part of each row's) is refused by the op and by the tiles."""
    q = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    call = make_call(q, q, q, seed=Placement(3, 0, 4, 0, 1).tensor())
    with pytest.raises(ValueError, match="attention_forward_jvp needs each row's whole keys"):
        ops.run_pass("forward_jvp", call, dict(tq=q, tk=None, tv=None, tbias=None))
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="forward_jvp: the pass takes each row's statistics from its keys"):
        native._run("forward_jvp", call, native._Layout(block_rows=4), {}, q=q, k=q, v=q, tq=q, tk=None, tv=None,
                    tbias=None, out=out, tout=torch.empty_like(q), row_max=q.new_empty(q.shape[:3]),
                    inv_sum=q.new_empty(q.shape[:3]), key_ranges=None, centre=None, peak=None)


@needs_tiles
def test_a_row_with_one_key_takes_its_value_exactly_in_float32():
    """float32, large scores: a row that sees one key has P = 1 there (its own maximum), so
    its output is that key's value and its tangent that value's tangent, bit for bit, with
    the key's score tangent cancelled (P' = 0)."""
    g = torch.Generator().manual_seed(9)
    q, k = (30 * torch.randn(2, 2, n, 16, generator=g) for n in (5, 7))
    v, tq, tk, tv = (torch.randn(*t.shape, generator=g) for t in (k, q, k, k))
    mask = torch.rand(2, 1, 5, 7, generator=g) > 0.4
    mask[..., 2, :] = False
    mask[..., 2, 4] = True
    out, _, _, out_t = ops.run_pass("forward_jvp", make_call(q, k, v, mask=mask), dict(tq=tq, tk=tk, tv=tv, tbias=None))
    assert torch.equal(out[..., 2, :], v[..., 4, :]) and torch.equal(out_t[..., 2, :], tv[..., 4, :])


@needs_tiles
@pytest.mark.parametrize("len_k", [1, 7])
def test_every_jvp_pass_of_a_call_with_a_sink_agrees(len_k):
    """With a sink, rowsum(P) = 1 - P_sink, and the centred row sum adds c P_sink back: the
    tiles' plain JVP pass must be told of the sink as the fused one is (it was not, and gave
    O' off by 1.5 relative on one key). Both JVP passes of the tiles and torch-ops' agree."""
    g = torch.Generator().manual_seed(11)
    q, k, v = _randn(2, 3, 4, 5, g=g), _randn(2, 3, len_k, 5, g=g), _randn(2, 3, len_k, 6, g=g)
    tangents = dict(tq=_randn(2, 3, 4, 5, g=g), tk=_randn(2, 3, len_k, 5, g=g), tv=_randn(2, 3, len_k, 6, g=g),
                    tbias=None)
    call = make_call(q, k, v, sink=True, scale=0.5)
    results = []
    for backend in ("tiles", "torch-ops"):
        with use_backend(backend):
            _, row_max, inv_sum = ops.run_pass("forward", call, {})
            results.append(ops.run_pass("jvp", call, dict(row_max=row_max, inv_sum=inv_sum, **tangents)))
            results.append(ops.run_pass("forward_jvp", call, tangents)[-1])
    assert all(rel_err(r, results[-1]) < EXACT for r in results)
