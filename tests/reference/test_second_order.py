"""NumPy JVP and Hessian-vector products against PyTorch and against finite differences."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attngrad import reference as ref

from ..conftest import EXACT, assert_all_close, rel_err

torch = pytest.importorskip("torch")


def torch_sdpa(q, k, v, bias=None, *, allowed=None, keep_scaled=None, scale=None, groups=1):
    """SDPA from torch primitives (any order of derivative), on float64 tensors."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = scale * q @ k.transpose(-1, -2)
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~torch.as_tensor(allowed), float("-inf"))
    p = torch.softmax(s, dim=-1)
    if keep_scaled is not None:
        p = p * torch.as_tensor(keep_scaled)
    return p @ v


def setup(rng, *, heads=4, kv_heads=2, len_q=5, len_k=7, bias_shape=(1, 4, 5, 7), masked=True, dropout=True, causal=False):
    q = rng.standard_normal((2, heads, len_q, 3))
    k = rng.standard_normal((2, kv_heads, len_k, 3))
    v = rng.standard_normal((2, kv_heads, len_k, 4))
    bias = None if bias_shape is None else rng.standard_normal(bias_shape)
    mask = None
    if masked:
        mask = rng.random((2, 1, len_q, len_k)) > 0.3
        mask[..., 0] = True  # no empty row: torch's plain softmax would give NaN there
    keep = rng.random((2, heads, len_q, len_k)) > 0.25 if dropout else None
    out, cache = ref.sdpa_forward(q, k, v, mask=mask, bias=bias, is_causal=causal, enable_gqa=heads != kv_heads,
                                  dropout_p=0.25 if dropout else 0.0, keep_mask=keep)
    allowed = cache.probs > 0 if (masked or causal) else None  # P > 0 exactly where allowed

    def fn(q, k, v, bias=None):
        return torch_sdpa(q, k, v, bias, allowed=allowed, keep_scaled=cache.keep_scaled, groups=heads // kv_heads)

    primals = (q, k, v) + (() if bias is None else (bias,))
    return out, cache, fn, primals


def tangents(rng, primals):
    return tuple(rng.standard_normal(p.shape) for p in primals)


NAMES = ("query", "key", "value", "bias")


@pytest.mark.parametrize("options", [dict(), dict(causal=True, masked=False), dict(bias_shape=(5, 7), dropout=False),
                                     dict(bias_shape=None, kv_heads=4)])
def test_sdpa_jvp_and_hvp_match_torch(rng, options):
    out, cache, fn, primals = setup(rng, **options)
    t = tangents(rng, primals)
    dout, dout_t = rng.standard_normal(out.shape), rng.standard_normal(out.shape)
    out_t = ref.sdpa_jvp(cache, **dict(zip(NAMES, t)))
    hvp = ref.sdpa_hvp(dout, cache, **dict(zip(NAMES, t)), dout_tangent=dout_t)

    tp = tuple(torch.tensor(a) for a in primals)
    tt = tuple(torch.tensor(a) for a in t)
    _, ref_t = torch.func.jvp(fn, tp, tt)
    assert rel_err(out_t, ref_t) < EXACT

    def gradient(*x):
        return torch.func.vjp(fn, *x[:-1])[1](x[-1])

    _, ref_h = torch.func.jvp(gradient, tp + (torch.tensor(dout),), tt + (torch.tensor(dout_t),))
    names = ["dq", "dk", "dv", "dbias"][: len(primals)]
    assert_all_close({n: getattr(hvp, n) for n in names}, dict(zip(names, ref_h)))
    assert hvp.dbias is None if len(primals) == 3 else hvp.dbias.shape == primals[3].shape


def shifted(primals, t, eps):
    return [p + eps * ti for p, ti in zip(primals, t)]


def test_sdpa_jvp_and_hvp_against_finite_differences(rng):
    """Central differences of the forward and of the backward along the tangent, step 1e-6:
    truncation error ~ step^2 and rounding ~ 1e-16 / step, so the bar is 1e-7."""
    out, cache, _, primals = setup(rng)
    t = tangents(rng, primals)
    dout = rng.standard_normal(out.shape)
    eps = 1e-6
    options = dict(mask=cache.probs > 0, enable_gqa=True, dropout_p=0.25, keep_mask=cache.keep_scaled > 0)
    plus, minus = (ref.sdpa_forward(*shifted(primals[:3], t, s)[:3], bias=primals[3] + s * t[3], **options) for s in (eps, -eps))
    out_t = ref.sdpa_jvp(cache, **dict(zip(NAMES, t)))
    assert rel_err(out_t, (plus[0] - minus[0]) / (2 * eps)) < 1e-7
    hvp = ref.sdpa_hvp(dout, cache, **dict(zip(NAMES, t)))
    g_plus, g_minus = ref.sdpa_backward(dout, plus[1]), ref.sdpa_backward(dout, minus[1])
    for name in ("dq", "dk", "dv", "dbias"):
        fd = (getattr(g_plus, name) - getattr(g_minus, name)) / (2 * eps)
        assert rel_err(getattr(hvp, name), fd) < 1e-7, name


def test_hvp_is_symmetric(rng):
    """The Hessian of sum(out * dout) is symmetric: <t1, H t2> = <t2, H t1>."""
    out, cache, _, primals = setup(rng)
    t1, t2 = tangents(rng, primals), tangents(rng, primals)
    dout = rng.standard_normal(out.shape)
    h1, h2 = (ref.sdpa_hvp(dout, cache, **dict(zip(NAMES, t))) for t in (t1, t2))
    lhs = sum(np.sum(a * b) for a, b in zip(t1, h2))
    rhs = sum(np.sum(a * b) for a, b in zip(t2, h1))
    assert abs(lhs - rhs) < EXACT * max(abs(lhs), 1.0)


def test_empty_rows_get_zero_tangents(rng):
    q, k, v = rng.standard_normal((1, 2, 3, 2)), rng.standard_normal((1, 2, 4, 2)), rng.standard_normal((1, 2, 4, 2))
    mask = np.ones((3, 4), dtype=bool)
    mask[1] = False
    out, cache = ref.sdpa_forward(q, k, v, mask=mask, bias=rng.standard_normal((3, 4)))
    t = tangents(rng, (q, k, v, np.zeros((3, 4))))
    out_t = ref.sdpa_jvp(cache, **dict(zip(NAMES, t)))
    hvp = ref.sdpa_hvp(rng.standard_normal(out.shape), cache, **dict(zip(NAMES, t)))
    assert (out_t[:, :, 1] == 0).all() and (hvp.dq[:, :, 1] == 0).all() and (hvp.dbias[1] == 0).all()
    assert all(np.isfinite(a).all() for a in (out_t, *hvp))


def test_omitted_tangents_are_zero(rng):
    out, cache, _, primals = setup(rng)
    t = tangents(rng, primals)
    full = ref.sdpa_jvp(cache, query=t[0], key=np.zeros_like(t[1]), value=np.zeros_like(t[2]), bias=np.zeros_like(t[3]))
    assert rel_err(ref.sdpa_jvp(cache, query=t[0]), full) < EXACT
    assert not ref.sdpa_jvp(cache).any()


def test_bad_tangents(rng):
    out, cache, _, primals = setup(rng, bias_shape=None)
    with pytest.raises(ValueError, match=r"tangent query must have its primal's shape \(2, 4, 5, 3\)"):
        ref.sdpa_jvp(cache, query=np.zeros((2, 4, 5, 2)))
    with pytest.raises(ValueError, match="the forward had no bias"):
        ref.sdpa_jvp(cache, bias=np.zeros((5, 7)))
    with pytest.raises(TypeError, match="float32 or float64"):
        ref.sdpa_hvp(np.zeros(out.shape), cache, key=np.zeros((2, 2, 7, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="dout_tangent"):
        ref.sdpa_hvp(np.zeros(out.shape), cache, dout_tangent=np.zeros((2, 4, 5)))


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 2), kv_heads=st.integers(1, 2), groups=st.integers(1, 2), len_q=st.integers(1, 5),
    len_k=st.integers(1, 5), causal=st.booleans(), with_bias=st.booleans(), seed=st.integers(0, 2**16),
)
def test_property_sdpa_hvp_matches_torch(batch, kv_heads, groups, len_q, len_k, causal, with_bias, seed):
    rng = np.random.default_rng(seed)
    heads = kv_heads * groups
    q, k, v = (rng.standard_normal((batch, h, n, 3)) for h, n in ((heads, len_q), (kv_heads, len_k), (kv_heads, len_k)))
    bias = rng.standard_normal((heads, len_q, len_k)) if with_bias else None
    if causal and len_k < len_q:
        causal = False  # rows past the last key would be fine, but torch's plain softmax gives them NaN
    out, cache = ref.sdpa_forward(q, k, v, bias=bias, is_causal=causal, enable_gqa=True)
    primals = (q, k, v) + (() if bias is None else (bias,))
    t = tangents(rng, primals)
    dout = rng.standard_normal(out.shape)
    hvp = ref.sdpa_hvp(dout, cache, **dict(zip(NAMES, t)))
    allowed = ref.causal_mask(len_q, len_k) if causal else None

    def fn(*x):
        return torch_sdpa(*x, allowed=allowed, groups=groups)

    tp = tuple(torch.tensor(a) for a in primals)
    _, ref_h = torch.func.jvp(lambda *x: torch.func.vjp(fn, *x)[1](torch.tensor(dout)), tp, tuple(torch.tensor(a) for a in t))
    names = ["dq", "dk", "dv", "dbias"][: len(primals)]
    assert_all_close({n: getattr(hvp, n) for n in names}, dict(zip(names, ref_h)), floor_fraction=1e-3)


# --- multi-head attention ---------------------------------------------------------------------


def mha_setup(rng, *, kdim=None, heads=4, kv_heads=None, causal=True):
    params = ref.MHAParams.random(8, heads, kdim=kdim, vdim=kdim, num_kv_heads=kv_heads, rng=rng)
    x = rng.standard_normal((2, 5, 8))
    memory = rng.standard_normal((2, 6, kdim or 8))
    attn_mask = rng.standard_normal((5, 6))
    out, cache = ref.mha_forward(x, memory, memory, params, heads, attn_mask=attn_mask, is_causal=causal)
    return params, (x, memory, attn_mask), out, cache


def random_params_like(rng, params):
    return ref.MHAParams(**{n: rng.standard_normal(a.shape) for n, a in params.items()})


def test_mha_jvp_and_hvp_match_torch_module(rng):
    params, (x, memory, attn_mask), out, cache = mha_setup(rng, kdim=3, causal=False)
    t_params = random_params_like(rng, params)
    tx, tm, tb = (rng.standard_normal(a.shape) for a in (x, memory, attn_mask))
    dout = rng.standard_normal(out.shape)
    out_t = ref.mha_jvp(cache, query=tx, key=tm, value=tm, params=t_params, attn_mask=tb)
    hvp = ref.mha_hvp(dout, cache, query=tx, key=tm, value=tm, params=t_params, attn_mask=tb)

    module = torch.nn.MultiheadAttention(8, 4, kdim=3, vdim=3, batch_first=True, dtype=torch.float64)
    module.load_state_dict({n: torch.tensor(a) for n, a in params.state_dict().items()})
    names = list(params.state_dict())

    def fn(x, memory, bias, *weights):
        out, _ = torch.func.functional_call(module, dict(zip(names, weights)), (x, memory, memory), dict(attn_mask=bias))
        return out

    primals = (x, memory, attn_mask, *params.state_dict().values())
    tans = (tx, tm, tb, *t_params.state_dict().values())
    tp, tt = tuple(torch.tensor(a) for a in primals), tuple(torch.tensor(a) for a in tans)
    _, ref_t = torch.func.jvp(fn, tp, tt)
    assert rel_err(out_t, ref_t) < EXACT
    _, ref_h = torch.func.jvp(lambda *a: torch.func.vjp(fn, *a)[1](torch.tensor(dout)), tp, tt)
    # the memory feeds key and value: its second derivative is the sum of the two paths
    ours = {"x": hvp.dquery, "memory": hvp.dkey + hvp.dvalue, "attn_mask": hvp.dattn_mask,
            **dict(zip(names, hvp.params.state_dict().values()))}
    theirs = dict(zip(["x", "memory", "attn_mask", *names], ref_h))
    assert_all_close(ours, theirs)  # in_proj_bias holds b^K's 0 beside b^Q's and b^V's nonzero parts
    assert np.abs(hvp.params.b_k).max() < EXACT * max(np.abs(v).max() for v in ours.values())


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_mha_jvp_and_hvp_against_finite_differences(rng, kv_heads):
    params, (x, memory, attn_mask), out, cache = mha_setup(rng, kv_heads=kv_heads)
    t_params = random_params_like(rng, params)
    tx, tm, tb = (rng.standard_normal(a.shape) for a in (x, memory, attn_mask))
    dout, dout_t = rng.standard_normal(out.shape), rng.standard_normal(out.shape)
    eps = 1e-6

    def at(s):
        moved = ref.MHAParams(**{n: a + s * getattr(t_params, n) for n, a in params.items()})
        return ref.mha_forward(x + s * tx, memory + s * tm, memory, moved, 4, attn_mask=attn_mask + s * tb, is_causal=True)

    (out_p, cache_p), (out_m, cache_m) = at(eps), at(-eps)
    out_t = ref.mha_jvp(cache, query=tx, key=tm, params=t_params, attn_mask=tb)
    assert rel_err(out_t, (out_p - out_m) / (2 * eps)) < 1e-7
    hvp = ref.mha_hvp(dout, cache, query=tx, key=tm, params=t_params, attn_mask=tb, dout_tangent=dout_t)
    g_p, g_m = ref.mha_backward(dout + eps * dout_t, cache_p), ref.mha_backward(dout - eps * dout_t, cache_m)
    for name in ("dquery", "dkey", "dvalue", "dattn_mask"):
        assert rel_err(getattr(hvp, name), (getattr(g_p, name) - getattr(g_m, name)) / (2 * eps)) < 1e-7, name
    for name, a in hvp.params.items():
        if name != "b_k":  # 0 in exact arithmetic: both sides are noise
            fd = (getattr(g_p.params, name) - getattr(g_m.params, name)) / (2 * eps)
            assert rel_err(a, fd) < 1e-7, name


def test_mha_bad_tangents(rng):
    params, _, out, cache = mha_setup(rng)
    with pytest.raises(ValueError, match="tangent query"):
        ref.mha_jvp(cache, query=np.zeros((2, 5, 7)))
    with pytest.raises(TypeError, match="MHAParams"):
        ref.mha_jvp(cache, params={"w_q": np.zeros((8, 8))})
    with pytest.raises(ValueError, match="params.w_k"):
        bad = random_params_like(rng, params)
        bad.w_k = np.zeros((8, 3))
        ref.mha_hvp(np.zeros(out.shape), cache, params=bad)
