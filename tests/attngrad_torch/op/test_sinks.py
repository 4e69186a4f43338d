"""Attention sinks (GPT-OSS): a learned logit per head in every row's softmax denominator,
checked on both implementations in every derivative (gradient, JVP, double backward,
forward over reverse), sinks included, against autograd of
the definition: softmax over the scores with one more column of the sink's logit, that
column dropped before multiplying by V.
"""

import math

import pytest

torch = pytest.importorskip("torch")

from attngrad.torch import attention  # noqa: E402

from ...conftest import EXACT, assert_all_close, rel_err  # noqa: E402
from ..conftest import op_attention  # noqa: E402
from ..masks.test_structured import DV, HKV, B, D, H, L, dense_keep, randn, small_tiles, transposed  # noqa: E402, F401


def with_sinks_by_definition(q, k, v, bias, sinks, keep, softcap, scale=None):
    """softmax([S | s_h]) without its last column, times V; S masked by `keep` with -inf.
    A row with no key gives 0 (as attngrad's do)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~keep, -math.inf)
    sink_column = sinks[:, None, None].expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, sink_column], dim=-1), dim=-1)[..., :-1]
    return p @ v


CASES = {
    "plain": dict(),
    "causal-gqa": dict(is_causal=True, gqa=True),
    "window-padding-bias": dict(is_causal=True, window=(3, None), key_padding=torch.tensor([L, 7]), bias=True),
    # window (0, 0): single-key rows, whose one key no longer has all the weight
    "single-key-rows": dict(window=(0, 0), is_causal=True),
    "one-key": dict(len_k=1),
    "no-key-left-softcap": dict(len_q=17, key_padding=torch.tensor([0, 5]), is_causal="bottom_right", softcap=1.5,
                                bias=True),
    # a bias constant along the keys joins the sink's: its gradient in closed form, summed over heads
    "bias-per-row": dict(is_causal=True, bias=(B, 1, L, 1)),
}


class SinkCase:
    def __init__(self, len_q=L, len_k=L, gqa=False, bias=False, softcap=None, is_causal=False, **structured):
        kv = HKV if gqa else H
        self.q, self.k, self.v = (transposed(B, h, n, e, seed=s) for s, (h, n, e) in
                                  enumerate(((H, len_q, D), (kv, len_k, D), (kv, len_k, DV))))
        # logits near the scores' size, so that the sink takes a real share of each row
        self.sinks = randn(H, seed=11)
        self.bias = randn(*(bias if isinstance(bias, tuple) else (B, 1, len_q, len_k)), seed=9) if bias else None
        self.options = dict(is_causal=is_causal, enable_gqa=gqa, softcap=softcap, **structured)
        self.keep = dense_keep(B, len_q, len_k, causal=is_causal, **structured)
        self.softcap = softcap

    @property
    def primals(self):
        return (self.q, self.k, self.v, self.sinks) + (() if self.bias is None else (self.bias,))

    def ours(self, q, k, v, sinks, bias=None):
        return attention(q, k, v, attn_bias=bias, sinks=sinks, **self.options)

    def theirs(self, q, k, v, sinks, bias=None):
        return with_sinks_by_definition(q, k, v, bias, sinks, self.keep, self.softcap)


NAMES = ("q", "k", "v", "sinks", "bias")


def grads(fn, primals, dout, create_graph=False):
    return torch.autograd.grad(fn(*primals), primals, dout, create_graph=create_graph)


@pytest.mark.parametrize("name", CASES)
def test_sinks_in_every_derivative_match_the_definition(backend, name):  # noqa: F811 (the fixture)
    case = SinkCase(**CASES[name])
    leaves = [p.detach().clone().requires_grad_() for p in case.primals]
    dout = randn(*case.q.shape[:-1], DV, seed=5)
    names = NAMES[:len(leaves)]
    results = {}
    for side, fn in (("ours", case.ours), ("theirs", case.theirs)):
        out = fn(*leaves)
        first = grads(fn, leaves, dout, create_graph=True)
        tangents = tuple(randn(*p.shape, seed=20 + i) for i, p in enumerate(leaves))
        out_t = torch.func.jvp(fn, tuple(p.detach() for p in leaves), tangents)[1]
        cotangents = tuple(randn(*p.shape, seed=40 + i) for i, p in enumerate(leaves))
        second = torch.autograd.grad(sum((g * c).sum() for g, c in zip(first, cotangents)), leaves)
        # forward over reverse: the backward's JVP
        hvp = torch.func.jvp(lambda *p: torch.func.vjp(fn, *p)[1](dout), tuple(p.detach() for p in leaves), tangents)[1]
        results[side] = dict(out=out, tangent=out_t, **{f"d{n}": g for n, g in zip(names, first)},
                             **{f"dd{n}": g for n, g in zip(names, second)}, **{f"hvp_{n}": g for n, g in zip(names, hvp)})
    assert not any(t.isnan().any() for t in results["ours"].values())
    assert_all_close(results["ours"], results["theirs"])


def every_derivative_beside_a_bias(q, k, v, bias, seed):
    """Every derivative (`every_derivative`) of attngrad's and of the definition's attention
    with sinks at -8 and -3 beside `bias`, scale 1, in q, k, v, the bias and the sinks."""
    from attngrad.check.torch_backend import every_derivative

    sinks = torch.tensor([-8.0, -3.0], dtype=torch.float64)
    keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)

    def ours(q, k, v, bias, sinks):
        return attention(q, k, v, attn_bias=bias, sinks=sinks, scale=1.0)

    def theirs(q, k, v, bias, sinks):
        return with_sinks_by_definition(q, k, v, bias, sinks, keep, None, scale=1.0)

    names = ("q", "k", "v", "bias", "sinks")
    return [every_derivative(fn, (q, k, v, bias, sinks), seed, names=names) for fn in (ours, theirs)]


@pytest.mark.parametrize("bias_shape", [(1, 2, 64, 64), (1, 1, 1, 1), (3, 1, 64, 1)],
                         ids=["key-varying", "one-number", "per-row"])
def test_sinks_beside_a_bias_are_exact_in_every_derivative(backend, bias_shape):  # noqa: F811 (the fixture)
    """Issue 58's case: sinks at -8 and -3 beside a bias, scale 1, L = E = 64. With the sinks
    a column of the bias, their gradient was a sum of the bias's, whose terms cancel: 4e-10 to
    1e-8 off in float64 beside a key-varying bias, 4e-12 to 3e-10 beside a key-constant one,
    in first order, the double backward and the backward's JVP. In closed form
    (`sink_logits`) every derivative, the gradient through the JVP too, is within 1e-12 of
    autograd of the definition.

    The definition's own derivatives of a bias constant along the keys cancel as the old
    ones did, so those are judged against the largest of all (`assert_all_close`'s zeros);
    for a bias of one number the sinks' accurate ones judge them instead: softmax([S + b, s])
    depends on s - b alone, so each derivative in b is minus the sum of those in s."""
    batch = bias_shape[0] if bias_shape[0] > 1 else 1
    q, k, v = (randn(batch, 2, 64, 64, seed=s) for s in range(3))
    results = every_derivative_beside_a_bias(q, k, v, randn(*bias_shape, seed=3), seed=7)
    key_constant = bias_shape[-1] == 1
    assert_all_close(*results, zeros={n for n in results[1] if n.endswith("bias")} if key_constant else set())
    if bias_shape == (1, 1, 1, 1):
        for kind in ("d", "gg_", "hvp_", "rof_", "rof_t"):
            by_bias, by_sinks = results[0][kind + "bias"], results[0][kind + "sinks"]
            assert rel_err(by_bias.reshape(()), -by_sinks.sum()) < EXACT, kind


def test_a_sink_takes_weight_from_every_row(backend):  # noqa: F811 (the fixture)
    """A large sink logit drives the output to 0; a very negative one gives plain attention."""
    case = SinkCase(is_causal=True)
    plain = attention(case.q, case.k, case.v, is_causal=True)
    far_below = attention(case.q, case.k, case.v, is_causal=True, sinks=torch.full((H,), -200.0, dtype=torch.float64))
    far_above = attention(case.q, case.k, case.v, is_causal=True, sinks=torch.full((H,), 200.0, dtype=torch.float64))
    assert_all_close(dict(out=far_below), dict(out=plain))
    assert far_above.abs().max() < 1e-60


def test_sinks_of_the_wrong_shape_are_refused():
    case = SinkCase()
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(4,\).*got \(2,\)"):
        attention(case.q, case.k, case.v, sinks=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="sinks must be a floating tensor"):
        attention(case.q, case.k, case.v, sinks=torch.zeros(H, dtype=torch.int64))
    for bad in (-math.inf, math.inf, math.nan):  # they shift the scores: -inf made every output NaN
        sinks = torch.zeros(H, dtype=torch.float64)
        sinks[1] = bad
        with pytest.raises(ValueError, match="sinks must be finite logits"):
            attention(case.q, case.k, case.v, sinks=sinks)


@pytest.mark.parametrize("seed", range(3))
def test_the_sink_gradient_has_float32_rounding_alone(backend, seed):  # noqa: F811 (the fixture)
    """ds_h = -sum over rows of P_sink D, a sum whose terms cancel by a factor kappa: in float32
    its error against the float64 truth stays within 4 u kappa (u = 2^-24; measured 0.07-0.5),
    here full attention over 512 keys, d = 64, where each sink takes a small share. Summing
    every score's dS instead, as for a bias of the scores' shape, cancels far more: 22-660 u
    kappa (key_constant_bias). Against PyTorch's autograd of the definition in float32 on 8
    seeds: 0.24-4.8x its error (median 1.2x)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(2, 4, 512, 64, generator=g, dtype=torch.float64) for _ in range(4))
    sinks = 2 * torch.randn(4, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = with_sinks_by_definition(*leaves[:3], None, leaves[3], torch.ones(512, 512, dtype=torch.bool), None)
    truth = torch.autograd.grad(out, leaves[3], dout)[0]
    p_sink = torch.sigmoid(sinks[:, None] - torch.logsumexp(q @ k.transpose(-1, -2) / 8, dim=-1))  # (B, H, L)
    terms = p_sink * (dout * out.detach()).sum(-1)
    kappa = float(terms.abs().sum((0, 2)).norm() / terms.sum((0, 2)).norm())
    leaves32 = [t.float().requires_grad_() for t in (q, k, v, sinks)]
    ours = torch.autograd.grad(attention(*leaves32[:3], sinks=leaves32[3]), leaves32[3], dout.float())[0]
    error = float((ours.double() - truth).norm() / truth.norm())
    assert error <= 4 * 2.0**-24 * kappa, f"sink gradient error {error / 2.0**-24 / kappa:.1f} u kappa"


def test_a_bias_constant_along_the_keys_has_gradient_zero_without_a_sink(backend):  # noqa: F811 (the fixture)
    """softmax is blind to a shift of a whole row: such a bias's gradient is 0 exactly, where
    summing the rows' dS leaves rounding noise (the definition's, checked here, is ~1e-17)."""
    case = SinkCase(is_causal=True, bias=(B, H, L, 1))
    dout = randn(*case.q.shape[:-1], DV, seed=5)
    q, k, v, bias = (p.detach().clone().requires_grad_() for p in (case.q, case.k, case.v, case.bias))
    dbias = torch.autograd.grad(attention(q, k, v, attn_bias=bias, is_causal=True), bias, dout)[0]
    assert torch.equal(dbias, torch.zeros_like(dbias))
    no_sink = torch.full((H,), -math.inf, dtype=torch.float64)
    reference = torch.autograd.grad(with_sinks_by_definition(q, k, v, bias, no_sink, case.keep, None), bias, dout)[0]
    assert reference.abs().max() < 1e-13


@pytest.mark.parametrize("order", ["hvp", "double-backward"])
def test_the_sinks_second_derivatives_in_float32_are_near_pytorchs(backend, order):  # noqa: F811 (the fixture)
    """The sinks' part of an HVP (forward over reverse) and of a double backward, full
    attention over 256 keys, d = 64: in float32 within 10x the error of PyTorch's autograd of
    the definition (seeds 0-3: 0.3-6.1x). Summing each row's g_S or dS' for the sinks'
    bias, where the passes now take its closed form, left 30-740x."""
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(2, 4, 256, 64, generator=g, dtype=torch.float64) for _ in range(4))
    sinks = 2 * torch.randn(4, generator=g, dtype=torch.float64)
    along = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (q, k, v, sinks)]
    keep = torch.ones(256, 256, dtype=torch.bool)

    def sinks_part(fn, dtype):
        primals = [t.to(dtype) for t in (q, k, v, sinks)]
        if order == "hvp":
            return torch.func.jvp(lambda *p: torch.func.vjp(fn, *p)[1](dout.to(dtype)), tuple(primals),
                                  tuple(t.to(dtype) for t in along))[1][3]
        leaves = [t.requires_grad_() for t in primals]
        first = torch.autograd.grad(fn(*leaves), leaves, dout.to(dtype), create_graph=True)
        return torch.autograd.grad(first, leaves, [t.to(dtype) for t in along])[3]

    def ours(q, k, v, s):
        return attention(q, k, v, sinks=s)

    def theirs(q, k, v, s):
        return with_sinks_by_definition(q, k, v, None, s, keep, None)

    truth = sinks_part(theirs, torch.float64)
    errors = [float((sinks_part(fn, torch.float32).double() - truth).norm() / truth.norm()) for fn in (ours, theirs)]
    assert errors[0] <= 10 * errors[1], f"the sinks' {order} error {errors[0]:.1e}, PyTorch's {errors[1]:.1e}"


@pytest.mark.parametrize("bias_shape", [(2, 1, 1), (1, 2, 7, 7)], ids=["key-constant", "key-varying"])
def test_sinks_with_dropout_and_a_cap_pass_gradcheck_to_second_order(backend, bias_shape):  # noqa: F811
    """The sinks' closed forms (first order, the double backward's and the backward JVP's) and
    a key-constant bias's assume nothing of dropout or the cap: D = rowsum(dO * O) with O the
    dropped output. The op with a fixed dropout seed, a causal mask, (1, H) sinks and a bias
    constant along the keys or not, against finite differences in q, the bias and the sinks:
    gradcheck, and gradgradcheck with forward over reverse."""
    q, k, v = (randn(1, 2, 7, 3, seed=s) for s in range(3))
    bias, sinks = randn(*bias_shape, seed=3), randn(1, 2, seed=4)

    def run(q, bias, sinks):
        return op_attention(q, k, v, bias=bias, causal=0, softcap=0.7, dropout_p=0.3, sinks=sinks,
                            seed=torch.tensor(1234))

    leaves = [t.requires_grad_() for t in (q, bias, sinks)]
    assert torch.autograd.gradcheck(run, leaves, atol=1e-9)
    assert torch.autograd.gradgradcheck(run, leaves, atol=1e-8, check_fwd_over_rev=True)


@pytest.mark.parametrize("shapes", [((2, H, 0, D), (2, H, 5, D)), ((0, H, 4, D), (0, H, 5, D))], ids=["Lq=0", "B=0"])
def test_sinks_over_no_rows_get_a_zero_gradient(shapes):
    """No row sees the sinks: their gradient is 0 (the closed form sums an empty set of rows)."""
    q_shape, k_shape = shapes
    q, k, v = (randn(*shape, seed=s).requires_grad_() for s, shape in enumerate((q_shape, k_shape, k_shape)))
    sinks = randn(H, seed=3).requires_grad_()
    out = attention(q, k, v, sinks=sinks)
    (dsinks,) = torch.autograd.grad(out, sinks, torch.ones_like(out), allow_unused=True)
    assert dsinks is not None and torch.equal(dsinks, torch.zeros(H, dtype=torch.float64))


def test_the_backward_is_asked_for_no_sum_of_a_key_constant_bias(backend, monkeypatch):  # noqa: F811 (the fixture)
    """A key-constant bias (the sinks' included) takes its gradient from the closed form
    alone: the backend's backward runs without a bias gradient, skipping the sum over every
    score that would be discarded; a bias that varies along the keys still asks for one."""
    from attngrad.torch.op import dispatch

    asked = []
    run = dispatch.run

    def recording(pass_name, call, **inputs):
        if pass_name == "backward":
            asked.append(inputs["bias_grad"])
        return run(pass_name, call, **inputs)

    monkeypatch.setattr(dispatch, "run", recording)
    case = SinkCase(is_causal=True, bias=(B, 1, L, 1))
    dout = randn(*case.q.shape[:-1], DV, seed=5)
    for bias in (case.bias, randn(B, 1, L, L, seed=4)):
        q, k, v, b, sinks = (p.detach().clone().requires_grad_() for p in (case.q, case.k, case.v, bias, case.sinks))
        ours = torch.autograd.grad(attention(q, k, v, attn_bias=b, sinks=sinks, is_causal=True), (b, sinks), dout)
        theirs = torch.autograd.grad(with_sinks_by_definition(q, k, v, b, sinks, case.keep, None), (b, sinks), dout)
        assert_all_close(dict(zip(("dbias", "dsinks"), ours)), dict(zip(("dbias", "dsinks"), theirs)))
    assert asked == [False, True]


def test_torch_func_transforms_over_the_sinks(backend):  # noqa: F811 (the fixture)
    """jacrev, jacfwd and hessian in the sinks (whose batching rule folds (N, H) logits into
    the batch, `vmap_rules`), and vmap over a batch of sinks, against the definition's."""
    q, k, v = (randn(2, 2, 5, 4, seed=s) for s in range(3))
    bias, sinks, batch = randn(1, 2, 5, 5, seed=3), randn(2, seed=4), randn(3, 2, seed=5)
    keep = torch.ones(5, 5, dtype=torch.bool)

    def ours(s):
        return attention(q, k, v, attn_bias=bias, sinks=s)

    def theirs(s):
        return with_sinks_by_definition(q, k, v, bias, s, keep, None)

    for transform, f in ((torch.func.jacrev, lambda fn: fn), (torch.func.jacfwd, lambda fn: fn),
                         (torch.func.hessian, lambda fn: (lambda s: (fn(s) ** 2).sum()))):
        assert rel_err(transform(f(ours))(sinks), transform(f(theirs))(sinks)) < EXACT, transform.__name__
    assert rel_err(torch.func.vmap(ours)(batch), torch.stack([theirs(s) for s in batch])) < EXACT
    grad = torch.func.grad(lambda s: (ours(s) ** 2).sum())
    expected = torch.stack([torch.func.grad(lambda s: (theirs(s) ** 2).sum())(s) for s in batch])
    assert rel_err(torch.func.vmap(grad)(batch), expected) < EXACT
