"""Forward mode and second order of attngrad.torch against PyTorch's math kernel.

PyTorch's default CPU kernel refuses both; its math kernel is a composite of differentiable
ops, so autograd differentiates it to any order: that is the reference here, in float64.
"""

import pytest

torch = pytest.importorskip("torch")
import torch.autograd.forward_ad as forward_ad  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from attngrad.torch import MultiheadAttention, attention, ran, scaled_dot_product_attention  # noqa: E402
from attngrad.torch.op import hvp_fusion, ops  # noqa: E402

from ...conftest import EXACT, assert_all_close, rel_err  # noqa: E402
from ..conftest import op_attention  # noqa: E402
from ..test_functional import _keep_mask, make  # noqa: E402

B, H, HKV, LQ, LK = 2, 4, 2, 13, 21
DOUBLE = torch.float64


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DOUBLE)


class Case:
    """One configuration as a pair of functions of (q, k, v[, bias]): ours and the math kernel's."""

    def __init__(self, *, is_causal=False, mask=None, bias_shape=None, gqa=False, len_q=LQ, len_k=LK, dropout_p=0.0):
        self.q, self.k, self.v = (t.detach() for t in make(heads=H, kv_heads=HKV if gqa else H, len_q=len_q, len_k=len_k))
        self.bias = None if bias_shape is None else randn(*bias_shape, seed=9)
        self.mask, self.is_causal, self.gqa, self.dropout_p = mask, is_causal, gqa, dropout_p
        self.allowed = None
        if mask is not None or is_causal:
            allowed = torch.ones(len_q, len_k, dtype=torch.bool)
            allowed = allowed.tril() if is_causal else allowed
            self.allowed = allowed if mask is None else allowed & mask
        self.keep = None
        if dropout_p:
            self.keep = _keep_mask(B, H, len_q, len_k, 77, dropout_p)

    @property
    def primals(self):
        return (self.q, self.k, self.v) + (() if self.bias is None else (self.bias,))

    def ours(self, q, k, v, bias=None):
        if self.dropout_p:
            return op_attention(q, k, v, mask=self.mask, bias=bias, seed=torch.tensor(77),
                                causal=0 if self.is_causal else None, dropout_p=self.dropout_p)
        return attention(q, k, v, attn_mask=self.mask, attn_bias=bias, is_causal=self.is_causal, enable_gqa=self.gqa)

    def theirs(self, q, k, v, bias=None):
        attn_mask = bias
        if self.allowed is not None:  # the raw math op takes masks additively: spell them with -inf
            attn_mask = (bias if bias is not None else q.new_zeros(())).masked_fill(~self.allowed, float("-inf"))
        with sdpa_kernel(SDPBackend.MATH):
            out, _ = torch.ops.aten._scaled_dot_product_attention_math(
                q, k, v, attn_mask, self.dropout_p, False, self.keep, enable_gqa=self.gqa
            )
        return out


CASES = {
    "causal-gqa-bias": dict(is_causal=True, gqa=True, bias_shape=(1, H, LQ, LK)),
    "mask-bias": dict(mask=torch.rand(B, 1, LQ, LK, generator=torch.Generator().manual_seed(3)) > 0.3, bias_shape=(LQ, LK)),
    "causal-long-queries": dict(is_causal=True, len_q=LK, len_k=LQ),
    "dropout-bias": dict(dropout_p=0.3, bias_shape=(B, 1, LQ, LK)),
    "dropout-causal-gqa": dict(dropout_p=0.2, is_causal=True, gqa=True),
}


def tangents_like(primals, seed):
    return tuple(randn(*p.shape, seed=seed + i) for i, p in enumerate(primals))


@pytest.mark.parametrize("name", CASES)
def test_jvp_matches_math_kernel(many_blocks, name):
    case = Case(**CASES[name])
    tangents = tangents_like(case.primals, 20)
    out, out_t = torch.func.jvp(case.ours, case.primals, tangents)
    ref, ref_t = torch.func.jvp(case.theirs, case.primals, tangents)
    assert rel_err(out, ref) < EXACT and rel_err(out_t, ref_t) < EXACT
    with torch.autograd.forward_ad.dual_level():  # the autograd spelling, same numbers
        duals = [torch.autograd.forward_ad.make_dual(p, t) for p, t in zip(case.primals, tangents)]
        assert rel_err(torch.autograd.forward_ad.unpack_dual(case.ours(*duals)).tangent, ref_t) < EXACT


def double_backward(fn, primals, dout, cotangents, dout_grad=True):
    """Gradients of <cotangents, d<dout, fn>/d primals> with respect to the primals and, with
    `dout_grad`, dout (a gradient penalty's dout is a constant, and the kernel skips it)."""
    leaves = [p.clone().requires_grad_() for p in primals]
    dout = dout.clone().requires_grad_(dout_grad)
    grads = torch.autograd.grad(fn(*leaves), leaves, dout, create_graph=True)
    inner = sum((g * c).sum() for g, c in zip(grads, cotangents))
    return torch.autograd.grad(inner, leaves + ([dout] if dout_grad else []))


@pytest.mark.parametrize("dout_grad", [True, False])
@pytest.mark.parametrize("name", CASES)
def test_double_backward_matches_math_kernel(many_blocks, name, dout_grad):
    case = Case(**CASES[name])
    dout = randn(*case.q.shape[:-1], case.v.shape[-1], seed=30)
    cotangents = tangents_like(case.primals, 40)
    ours = double_backward(case.ours, case.primals, dout, cotangents, dout_grad)
    theirs = double_backward(case.theirs, case.primals, dout, cotangents, dout_grad)
    names = ["q", "k", "v", "bias"][: len(case.primals)] + (["dout"] if dout_grad else [])
    assert len(ours) == len(names)
    assert_all_close(dict(zip(names, ours)), dict(zip(names, theirs)))


def test_vmapped_double_backward_op_without_dout_gradient(many_blocks):
    """The op's batching rule passes an absent g_dout (an empty placeholder) through, as it
    does an absent bias gradient, and g_q, g_k, g_v do not depend on whether g_dout is asked."""
    q, k, v = (t.detach() for t in make(heads=H, len_q=LQ, len_k=LK))
    qs = torch.stack([q, 2 * q, q.flip(2)])
    dout = randn(*q.shape[:-1], v.shape[-1], seed=60)
    gq, gk, gv = (randn(*t.shape, seed=61 + i) for i, t in enumerate((q, k, v)))
    seed, options = torch.tensor(0), (None, 0.3, 0.0, 0.0)

    def second(q, dout_grad):
        out, row_max, inv_sum = ops.attention_forward(q, k, v, None, None, None, seed, *options)
        return ops.attention_double_backward(q, k, v, None, None, None, seed, *options, dout=dout, out=out,
                                             row_max=row_max, inv_sum=inv_sum, bias_grad=False, dout_grad=dout_grad,
                                             gq=gq, gk=gk, gv=gv, gbias=None)

    without = torch.func.vmap(lambda q: second(q, False))(qs)
    with_dout = torch.func.vmap(lambda q: second(q, True))(qs)
    assert without[0].numel() == 0 and with_dout[0].shape == (3, *dout.shape)
    for i in range(3):
        single = second(qs[i], False)
        for batched, full, alone in zip(without[1:4], with_dout[1:4], single[1:4]):
            assert torch.equal(batched[i], full[i])
            assert rel_err(batched[i], alone) < EXACT


def _gradient(fn):
    """(q, k, v[, bias], dout) -> the gradient of <dout, fn(q, k, v[, bias])>."""
    return lambda *x: torch.func.vjp(fn, *x[:-1])[1](x[-1])


@pytest.mark.parametrize("name", CASES)
def test_forward_over_reverse_hvp_matches_math_kernel(many_blocks, name):
    """jvp of the gradient (dout has a tangent too): the Hessian-vector product without a
    second backward pass. The forward waits for its jvp and the backward for its own, so each
    runs as one fused pass and nothing else runs; the gradient and its tangent are the math
    kernel's to 1e-12."""
    case = Case(**CASES[name])
    dout = randn(*case.q.shape[:-1], case.v.shape[-1], seed=31)
    primals, tangents = case.primals + (dout,), tangents_like(case.primals + (dout,), 50)
    ran.clear()
    grads, ours = torch.func.jvp(_gradient(case.ours), primals, tangents)
    assert dict(ran) == {("forward_jvp", "tiles"): 1, ("backward_with_jvp", "tiles"): 1}
    their_grads, theirs = torch.func.jvp(_gradient(case.theirs), primals, tangents)
    names = ["q", "k", "v", "bias"][: len(case.primals)]
    assert_all_close(dict(zip(names, ours)), dict(zip(names, theirs)))
    assert_all_close(dict(zip(names, grads)), dict(zip(names, their_grads)))


@pytest.mark.parametrize("name,dual_level", [("causal-long-queries", False), ("dropout-causal-gqa", False),
                                             ("dropout-causal-gqa", True), ("causal-gqa-bias", False)])
def test_an_hvp_runs_the_backwards_jvp_on_its_tiles_from_the_forwards_row_sums(monkeypatch, many_blocks, name,
                                                                              dual_level, tuned):
    """The forward's fused pass leaves each row's centre rowsum(P * S') and O'; the backward's,
    along the same tangents, takes them with D' (dout's tangent too, under torch.func) and runs
    on the backward's tiles (`native.attention_backward_jvp_given_sums`; 5-key blocks, so that
    rows take the given sums rather than their own), under torch.func or a dual level. With a
    bias gradient the whole-row pass runs instead. Either way the HVP is the math kernel's.
    Both fused passes given sums write their primal results (out and its statistics; the
    gradient) straight into the tensors the Functions returned: nothing is copied there."""
    from attngrad.torch.backends.cpu_tiles import native

    tuned(native.TILING, block_keys=5)
    case = Case(**CASES[name])
    given, copies = [], []
    passes, fill = native.attention_backward_jvp_given_sums, hvp_fusion.Deferred.fill
    monkeypatch.setattr(native, "attention_backward_jvp_given_sums", lambda *a, **k: given.append(1) or passes(*a, **k))

    def counted_fill(deferred, results):
        copies.append(sum(h.numel() > 0 and h.data_ptr() != hvp_fusion._plain(r).data_ptr()
                          for h, r in zip(deferred.results, results)))
        return fill(deferred, results)

    dout = randn(*case.q.shape[:-1], case.v.shape[-1], seed=37)
    tangents = tangents_like(case.primals, 70)
    results = {}
    for side, fn in (("ours", case.ours), ("theirs", case.theirs)):
        monkeypatch.setattr(hvp_fusion.Deferred, "fill", counted_fill if side == "ours" else fill)
        if dual_level:
            with forward_ad.dual_level():
                leaves = [forward_ad.make_dual(p.clone().requires_grad_(), t) for p, t in zip(case.primals, tangents)]
                grads = torch.autograd.grad(fn(*leaves), leaves, dout, create_graph=True)
                results[side] = [[forward_ad.unpack_dual(g)[i] for g in grads] for i in (0, 1)]
        else:
            results[side] = torch.func.jvp(_gradient(fn), case.primals + (dout,), tangents + (randn(*dout.shape, seed=79),))
    assert len(given) == (case.bias is None)
    assert copies == [0, 0 if case.bias is None else len(case.primals)]  # the forward's, then the backward's
    names = ["q", "k", "v", "bias"][: len(case.primals)]
    for i in (0, 1):  # the gradient, then its tangent (the HVP)
        assert_all_close(dict(zip(names, results["ours"][i])), dict(zip(names, results["theirs"][i])))


def test_a_call_no_tangent_reaches_runs_its_own_passes(many_blocks):
    """Under torch.func.jvp, a gradient whose attention sees no tangent (its inputs are the
    JVP's constants): the forward and the backward that waited for a jvp run their own
    passes when none comes, and the gradient is the one taken outside any transform, bit for
    bit."""
    case = Case(**CASES["mask-bias"])
    dout = randn(*case.q.shape[:-1], case.v.shape[-1], seed=33)
    x, tx = randn(3, seed=34), randn(3, seed=35)
    ran.clear()
    grads, grads_t = torch.func.jvp(lambda x: [x * g.sum() for g in _gradient(case.ours)(*case.primals, dout)], (x,),
                                    (tx,))
    assert dict(ran) == {("forward", "tiles"): 1, ("backward", "tiles"): 1}
    outside = _gradient(case.ours)(*case.primals, dout)
    for got, got_t, want in zip(grads, grads_t, outside):
        assert torch.equal(got, x * want.sum()) and torch.equal(got_t, tx * want.sum())


def test_a_dual_level_over_create_graph_runs_the_fused_passes(many_blocks):
    """Eager forward mode over autograd.grad(create_graph=True), on dual leaves that require
    grad: both Functions run their fused passes, and the gradient's tangent (an HVP) and a
    gradient taken through it are the math kernel's to 1e-12."""
    case = Case(**CASES["causal-gqa-bias"])
    dout = randn(*case.q.shape[:-1], case.v.shape[-1], seed=36)
    tangents = tangents_like(case.primals, 60)
    results = {}
    for side, fn in (("ours", case.ours), ("theirs", case.theirs)):
        ran.clear()
        leaves = [p.clone().requires_grad_() for p in case.primals]
        with forward_ad.dual_level():
            duals = [forward_ad.make_dual(p, t) for p, t in zip(leaves, tangents)]
            grads = torch.autograd.grad(fn(*duals), duals, dout, create_graph=True)
            hvp = [forward_ad.unpack_dual(g).tangent for g in grads]
            primal = [forward_ad.unpack_dual(g).primal for g in grads]
        penalty = torch.autograd.grad(sum((g * g).sum() for g in primal), leaves)
        results[side] = dict(zip(("hvp q", "hvp k", "hvp v", "hvp bias"), hvp), **dict(
            zip(("grad q", "grad k", "grad v", "grad bias"), primal)), **dict(
            zip(("penalty q", "penalty k", "penalty v", "penalty bias"), penalty)))
        if side == "ours":
            assert {p for p, _ in ran} == {"forward_jvp", "backward_with_jvp", "double_backward"}
    assert_all_close(results["ours"], results["theirs"])


def test_backward_jvp_is_the_transpose_of_double_backward(many_blocks):
    """<g, J t> = <J^T g, t> for the backward map J: the two second-order kernels agree."""
    case = Case(**CASES["causal-gqa-bias"])
    dout = randn(*case.q.shape[:-1], case.v.shape[-1], seed=32)
    primals = case.primals + (dout,)
    tangents, cotangents = tangents_like(primals, 60), tangents_like(case.primals, 70)
    _, forward = torch.func.jvp(lambda *x: torch.func.vjp(case.ours, *x[:-1])[1](x[-1]), primals, tangents)
    reverse = double_backward(case.ours, case.primals, dout, cotangents)
    lhs = sum((g * jt).sum() for g, jt in zip(cotangents, forward))
    rhs = sum((jg * t).sum() for jg, t in zip(reverse, tangents))
    assert abs(lhs - rhs) <= EXACT * abs(rhs)


def test_gradgradcheck_and_forward_ad_gradcheck():
    for options in (dict(is_causal=True, gqa=True, bias_shape=(1, H, 3, 4), len_q=3, len_k=4),
                    dict(dropout_p=0.4, bias_shape=(3, 4), len_q=3, len_k=4)):
        case = Case(**options)
        leaves = [p[:1, :, :, :3].clone().requires_grad_() if p.dim() == 4 and p is not case.bias else p.clone().requires_grad_()
                  for p in case.primals]
        assert torch.autograd.gradcheck(case.ours, leaves, check_forward_ad=True, check_backward_ad=True)
        assert torch.autograd.gradgradcheck(case.ours, leaves)


def test_hessian_through_torch_func():
    case = Case(is_causal=True, gqa=True, bias_shape=(1, H, 3, 4), len_q=3, len_k=4)
    small = tuple(p[:1, :, :, :2] if p.dim() == 4 and p is not case.bias else p for p in case.primals)

    def loss(fn):
        return lambda *x: fn(*x).sin().sum()

    ours = torch.func.hessian(loss(case.ours), argnums=(0, 1, 3))(*small)
    theirs = torch.func.hessian(loss(case.theirs), argnums=(0, 1, 3))(*small)
    for row_ours, row_theirs in zip(ours, theirs):
        for a, b in zip(row_ours, row_theirs):
            assert rel_err(a, b) < EXACT


def test_fully_masked_rows_have_zero_tangents_and_second_derivatives(many_blocks):
    mask = torch.ones(B, H, LQ, LK, dtype=torch.bool)
    mask[0, 1, 5] = False
    mask[1, :, 2] = False
    case = Case(mask=mask, bias_shape=(LQ, LK))
    tangents = tangents_like(case.primals, 80)
    _, out_t = torch.func.jvp(case.ours, case.primals, tangents)
    dout = randn(B, H, LQ, 6, seed=33)
    second = double_backward(case.ours, case.primals, dout, tangents_like(case.primals, 90))
    assert all(torch.isfinite(t).all() for t in (out_t, *second))
    assert (out_t[0, 1, 5] == 0).all() and (out_t[1, :, 2] == 0).all()
    g_q, g_dout = second[0], second[-1]
    assert (g_q[0, 1, 5] == 0).all() and (g_dout[1, :, 2] == 0).all()
    _, ref_t = torch.func.jvp(case.theirs, case.primals, tangents)
    assert rel_err(out_t, ref_t) < EXACT


def test_third_derivatives_and_reverse_over_forward_raise():
    case = Case(is_causal=True, len_q=4, len_k=5)
    q, k, v = case.primals

    def loss(q):
        return case.ours(q, k, v).square().sum()

    with pytest.raises(NotImplementedError, match="up to second order"):
        torch.func.grad(lambda q: torch.func.grad(lambda q: torch.func.grad(loss)(q).sum())(q).sum())(q)
    leaf = q.clone().requires_grad_()
    (g,) = torch.autograd.grad(loss(leaf), leaf, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), leaf, create_graph=True)
    with pytest.raises(NotImplementedError, match="up to second order"):
        gg.sum().backward()
    tangent = randn(*q.shape, seed=5)

    def jvp_loss(q):
        return torch.func.jvp(lambda q: case.ours(q, k, v), (q,), (tangent,))[1].square().sum()

    with pytest.raises(NotImplementedError, match="up to second order"):  # reverse over reverse over forward
        torch.func.grad(lambda q: torch.func.grad(jvp_loss)(q).sum())(q)
    with pytest.raises(NotImplementedError, match="up to second order"):  # forward over reverse over forward
        torch.func.jvp(torch.func.grad(jvp_loss), (q,), (tangent,))


def reverse_over_forward(fn, primals, tangents, cotangent):
    """The gradient of <cotangent, J t> (J the Jacobian of fn at the primals, t the tangents)
    with respect to the primals and the tangents: torch.func.vjp of torch.func.jvp."""
    def weighted_jvp(*xs):
        n = len(primals)
        return (torch.func.jvp(fn, xs[:n], xs[n:])[1] * cotangent).sum()

    return torch.func.grad(weighted_jvp, argnums=tuple(range(2 * len(primals))))(*primals, *tangents)


@pytest.mark.parametrize("name", CASES)
def test_reverse_over_forward_matches_math_kernel(many_blocks, backend, name):
    """The gradient through a JVP, with respect to the primals (the backward's JVP along t)
    and the tangents (the backward of the cotangent), by torch.func and by autograd over a
    forward_ad dual level, each taking the fused forward + JVP pass, and a cotangent that
    reaches the tangent of the output alone."""
    case = Case(**CASES[name])
    tangents = tangents_like(case.primals, 110)
    cotangent = randn(*case.q.shape[:-1], case.v.shape[-1], seed=120)
    theirs = reverse_over_forward(case.theirs, case.primals, tangents, cotangent)
    names = [f"{prefix}{n}" for prefix in ("", "t") for n in ("q", "k", "v", "bias")[: len(case.primals)]]
    ran.clear()
    ours = reverse_over_forward(case.ours, case.primals, tangents, cotangent)
    # the tiles fuse each pair; torch-ops runs each pass of a pair in turn
    assert {name for name, _ in ran} <= {"forward_jvp", "backward_with_jvp", "forward", "jvp", "backward", "backward_jvp"}
    assert ("backward_with_jvp", "tiles") in ran or ("backward_jvp", "torch-ops") in ran
    assert_all_close(dict(zip(names, ours)), dict(zip(names, theirs)))
    leaves = [t.clone().requires_grad_() for t in case.primals + tangents]
    n = len(case.primals)
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(p, t) for p, t in zip(leaves[:n], leaves[n:])]
        out_t = forward_ad.unpack_dual(case.ours(*duals)).tangent
        (out_t * cotangent).sum().backward()  # inside the level: the gradients get no third-order tangents
    assert_all_close(dict(zip(names, [leaf.grad for leaf in leaves])), dict(zip(names, theirs)))


def test_reverse_over_forward_of_a_tangent_alone_and_a_loss_of_both():
    """A tangent on q alone still gives k, v and the bias gradients (J depends on them), and a
    loss of the output and its tangent together (MeanFlow keeping du/dt's gradient) sums the
    backward's and the Tangent's parts."""
    case = Case(**CASES["causal-gqa-bias"])
    tq = randn(*case.q.shape, seed=130)
    w, c = randn(*case.q.shape[:-1], 6, seed=131), randn(*case.q.shape[:-1], 6, seed=132)

    def loss(fn):
        def of(q, k, v, bias):
            out, out_t = torch.func.jvp(lambda q: fn(q, k, v, bias), (q,), (tq,))
            return (out * w).sum() + (out_t * c).sum()
        return torch.func.grad(of, argnums=(0, 1, 2, 3))(*case.primals)

    assert_all_close(dict(zip("qkvb", loss(case.ours))), dict(zip("qkvb", loss(case.theirs))))


def test_a_tangent_that_reverse_mode_tracks_over_constant_primals(backend):
    """Forward mode alone sees the primals, but reverse mode tracks the tangent: the call
    takes the Functions' path, not the untracked fused op, and the tangent gets J^T c."""
    case = Case(mask=CASES["mask-bias"]["mask"])
    q, k, v = case.primals
    cotangent = randn(*q.shape[:-1], 6, seed=150)

    def gradient_of_tangent(fn):
        tq = randn(*q.shape, seed=151).requires_grad_()
        with forward_ad.dual_level():
            out_t = forward_ad.unpack_dual(fn(forward_ad.make_dual(q, tq), k, v)).tangent
        return torch.autograd.grad((out_t * cotangent).sum(), tq)[0]

    assert rel_err(gradient_of_tangent(case.ours), gradient_of_tangent(case.theirs)) < EXACT


def test_jacrev_of_jacfwd_is_the_math_kernels_hessian(many_blocks, backend):
    """torch.func.jacrev(torch.func.jacfwd(f)): reverse over forward under vmap on both sides,
    which takes the plain jvp pass (no fused forward under vmap)."""
    case = Case(is_causal=True, len_q=3, len_k=5, gqa=True)
    q, k, v = (t[:1] for t in case.primals)
    w = randn(1, H, 3, 6, seed=140)

    def scalar(fn):
        return lambda k: (fn(q, k, v) * w).sum()

    ours = torch.func.jacrev(torch.func.jacfwd(scalar(case.ours)))(k)
    theirs = torch.func.jacrev(torch.func.jacfwd(scalar(case.theirs)))(k)
    assert ours.shape == (*k.shape, *k.shape)
    assert rel_err(ours, theirs) < EXACT


def test_float32_second_order_against_float64():
    """float32 inputs: the second-order kernels compute in float32 and land within its rounding."""
    case = Case(is_causal=True, bias_shape=(1, H, LQ, LK))
    dout = randn(B, H, LQ, 6, seed=34)
    cot = tangents_like(case.primals, 100)
    truth = double_backward(case.theirs, case.primals, dout, cot)
    single = double_backward(case.ours, [p.float() for p in case.primals], dout.float(), [c.float() for c in cot])
    assert all(s.dtype == torch.float32 for s in single)
    assert all(rel_err(s.double(), t) < 1e-5 for s, t in zip(single, truth))  # float32 eps 6e-8, sums over L


def test_multihead_attention_module_second_order():
    """attngrad.torch.MultiheadAttention: jvp and double backward through the projections
    match torch.nn.MultiheadAttention (math kernel) with the same state_dict."""
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(12, 3, batch_first=True, dtype=DOUBLE)
    ours = MultiheadAttention(12, 3, batch_first=True, dtype=DOUBLE)
    ours.load_state_dict(ref.state_dict())
    x, memory = randn(2, 4, 12, seed=1), randn(2, 6, 12, seed=2)
    bias = randn(4, 6, seed=3)
    params = {n: p.detach() for n, p in ref.named_parameters()}

    def call(module):
        def fn(x, memory, bias, params):
            out, _ = torch.func.functional_call(module, params, (x, memory, memory), dict(attn_mask=bias, need_weights=False))
            return out
        return fn

    primals = (x, memory, bias, params)
    tangents = (randn(2, 4, 12, seed=4), randn(2, 6, 12, seed=5), randn(4, 6, seed=6),
                {n: randn(*p.shape, seed=7 + i) for i, (n, p) in enumerate(params.items())})
    with sdpa_kernel(SDPBackend.MATH):
        _, ref_t = torch.func.jvp(call(ref), primals, tangents)
        ref_h = torch.func.jvp(torch.func.grad(lambda *a: call(ref)(*a).sin().sum(), argnums=(0, 1, 2, 3)), primals, tangents)[1]
    _, our_t = torch.func.jvp(call(ours), primals, tangents)
    our_h = torch.func.jvp(torch.func.grad(lambda *a: call(ours)(*a).sin().sum(), argnums=(0, 1, 2, 3)), primals, tangents)[1]
    assert rel_err(our_t, ref_t) < EXACT
    flat = lambda h: {"x": h[0], "memory": h[1], "bias": h[2], **h[3]}  # noqa: E731
    assert_all_close(flat(our_h), flat(ref_h))


def test_drop_in_function_second_order():
    """The drop-in spelling: a float attn_mask that requires grad gets its second derivatives."""
    q, k, v = make(batch=1, heads=2, len_q=5, len_k=6)
    bias = randn(5, 6, seed=8).requires_grad_()
    out = scaled_dot_product_attention(q, k, v, attn_mask=bias)
    (g_bias,) = torch.autograd.grad(out.sin().sum(), bias, create_graph=True)
    ours = torch.autograd.grad(g_bias.square().sum(), [q, k, v, bias])
    with sdpa_kernel(SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    (g_ref,) = torch.autograd.grad(ref.sin().sum(), bias, create_graph=True)
    theirs = torch.autograd.grad(g_ref.square().sum(), [q, k, v, bias])
    assert_all_close(dict(zip("qkvb", ours)), dict(zip("qkvb", theirs)))


@pytest.mark.filterwarnings("error:There is a performance drop:UserWarning")
@pytest.mark.parametrize("name", ["causal-gqa-bias", "mask-bias", "dropout-bias"])
def test_vmap_batching_rules_match_a_loop(many_blocks, counting_backend, name):
    """vmap folds its axis into the batch (dropout: one call per slice), so each pass runs
    once (counted on the tests' backend); per-sample gradients, bias gradients included,
    equal a Python loop over the samples, and PyTorch's slow fallback (which warns) is never
    taken."""
    case = Case(**CASES[name])
    q, k, v, bias = case.primals
    qs = torch.stack([q, 2 * q, q.flip(2)])

    def loss(q, bias):
        return case.ours(q, k, v, bias).sin().sum()

    batched = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(0, None))(qs, bias)
    calls = 3 if case.dropout_p else 1  # with dropout each slice draws its own blocks' masks
    assert counting_backend.count("forward") == calls and counting_backend.count("backward") == calls
    for i in range(3):
        single = torch.func.grad(loss, argnums=(0, 1))(qs[i], bias)
        assert all(rel_err(b[i], s) < EXACT for b, s in zip(batched, single))
    tangents = torch.randn_like(qs)
    _, out_t = torch.func.vmap(lambda t: torch.func.jvp(lambda q: case.ours(q, k, v, bias), (q,), (t,)))(tangents)
    assert rel_err(out_t[1], torch.func.jvp(lambda q: case.ours(q, k, v, bias), (q,), (tangents[1],))[1]) < EXACT


@pytest.mark.parametrize("given_sums", [True, False], ids=["given-sums", "whole-rows"])
@pytest.mark.parametrize("seed", [9, 36, 39])
def test_one_peaked_query_row_keeps_its_second_order_exact(backend, monkeypatch, seed, given_sums):
    """One query row whose softmax is nearly one-hot (scale 2.5, d=33: the largest P is
    1 - 1e-5 or closer): t = rowsum(P S') is nearly S' at the peak, and P (S' - t) cancels t's
    rounding unless the row is centred on its peak. The HVP (the backward's JVP, on the
    tiles from the forward's given sums or on whole rows) and the double backward against
    float64 autograd: uncentred they erred 6e-13 to 3e-12 at these seeds, centred below 1.3e-13
    (3.2e-13 in the sanitizer's build)."""
    if not given_sums:
        monkeypatch.setattr(hvp_fusion.ForwardSums, "along", lambda self, tangents: False)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 4, n, w, generator=g, dtype=DOUBLE) for n, w in ((1, 33), (13, 33), (13, 3)))
    dout = torch.randn(1, 4, 1, 3, generator=g, dtype=DOUBLE)
    tangents = tuple(torch.randn(t.shape, generator=g, dtype=DOUBLE) for t in (q, k, v))
    mask = torch.rand(4, 1, 13, generator=g) > 0.3

    def ours(q, k, v):
        return attention(q, k, v, attn_mask=mask, scale=2.5)

    def theirs(q, k, v):
        return torch.softmax((q @ k.transpose(-1, -2) * 2.5).masked_fill(~mask, float("-inf")), -1) @ v

    def hvp(fn):
        return torch.func.jvp(lambda *x: torch.func.vjp(fn, *x)[1](dout), (q, k, v), tangents)[1]

    bar = 5e-13  # tighter than EXACT, which the uncentred passes met on some of these rows (the sanitizer's build: 3.2e-13)
    assert max(rel_err(a, b) for a, b in zip(hvp(ours), hvp(theirs))) < bar
    ours_second = double_backward(ours, (q, k, v), dout, tangents)
    theirs_second = double_backward(theirs, (q, k, v), dout, tangents)
    assert max(rel_err(a, b) for a, b in zip(ours_second, theirs_second)) < bar


def test_an_hvp_with_fixed_sinks_on_the_tiles_given_sums_matches_the_definition(backend):
    """Sinks that are not differentiated leave the bias without a gradient, so the tiles'
    HVP runs its backward on the backward's tiles from the forward's sums: the centred sums
    there need the sink's share (without it the HVP was off by 0.26-0.34 relative)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, n, w, generator=g, dtype=DOUBLE) for n, w in ((5, 6), (9, 6), (9, 4)))
    sinks = torch.randn(3, generator=g, dtype=DOUBLE)
    dout = torch.randn(2, 3, 5, 4, generator=g, dtype=DOUBLE)
    tangents = tuple(torch.randn(t.shape, generator=g, dtype=DOUBLE) for t in (q, k, v))

    def ours(q, k, v):
        return attention(q, k, v, sinks=sinks)

    def theirs(q, k, v):
        scores = torch.cat([q @ k.transpose(-1, -2) / 6**0.5, sinks[:, None, None].expand(2, 3, 5, 1)], -1)
        return torch.softmax(scores, -1)[..., :-1] @ v

    def hvp(fn):
        return torch.func.jvp(lambda *x: torch.func.vjp(fn, *x)[1](dout), (q, k, v), tangents)[1]

    ran.clear()
    assert max(rel_err(a, b) for a, b in zip(hvp(ours), hvp(theirs))) < EXACT
    if backend == "tiles":
        assert dict(ran) == {("forward_jvp", "tiles"): 1, ("backward_with_jvp", "tiles"): 1}
