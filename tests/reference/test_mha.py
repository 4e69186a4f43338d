"""Multi-head attention and its three flavors against torch.nn.MultiheadAttention."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attngrad import reference as ref
from attngrad.check import finite_difference_gradients

from ..conftest import EXACT, assert_all_close, rel_err

torch = pytest.importorskip("torch")
F = torch.nn.functional

E, H = 12, 3


def torch_module(params: ref.MHAParams, num_heads: int, dropout: float = 0.0) -> torch.nn.MultiheadAttention:
    module = torch.nn.MultiheadAttention(
        params.embed_dim, num_heads, dropout=dropout, bias=params.has_bias, kdim=params.kdim, vdim=params.vdim,
        batch_first=True, dtype=torch.float64,
    )
    module.load_state_dict({k: torch.as_tensor(v) for k, v in params.state_dict().items()})
    return module


def module_grads(module: torch.nn.MultiheadAttention) -> ref.MHAParams:
    """The module's parameter gradients, read back through our state_dict layout."""
    return ref.MHAParams.from_state_dict({name: p.grad for name, p in module.named_parameters()})


def assert_params_close(ours: ref.MHAParams, theirs: ref.MHAParams) -> None:
    """Every parameter gradient within EXACT; b^K, 0 in exact arithmetic (it shifts each
    score row by a constant), against the scale of all of them."""
    assert_all_close(dict(ours.items()), dict(theirs.items()), zeros=frozenset({"b_k"}))


# torch deprecates a boolean key_padding_mask beside a float attn_mask; it is still the
# combination users write, and the one this test means to compare
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kdim,vdim", [(E, E), (5, 7)])
def test_general_mha_matches_the_module(rng, bias, kdim, vdim):
    params = ref.MHAParams.random(E, H, kdim=kdim, vdim=vdim, bias=bias, rng=rng)
    query = rng.standard_normal((2, 4, E))
    key = rng.standard_normal((2, 6, kdim))
    value = rng.standard_normal((2, 6, vdim))
    kpm = np.zeros((2, 6), dtype=bool)
    kpm[0, 4:] = True
    attn_mask = rng.standard_normal((4, 6))

    out, cache = ref.mha_forward(query, key, value, params, H, key_padding_mask=kpm, attn_mask=attn_mask)
    dout = rng.standard_normal(out.shape)
    grads = ref.mha_backward(dout, cache)

    module = torch_module(params, H)
    tq, tk, tv, tm = (torch.tensor(a, requires_grad=True) for a in (query, key, value, attn_mask))
    tout, _ = module(tq, tk, tv, key_padding_mask=torch.as_tensor(kpm), attn_mask=tm, need_weights=False)
    tout.backward(torch.tensor(dout))

    assert rel_err(out, tout) < EXACT
    for ours, theirs in ((grads.dquery, tq), (grads.dkey, tk), (grads.dvalue, tv), (grads.dattn_mask, tm)):
        assert rel_err(ours, theirs.grad) < EXACT
    assert_params_close(grads.params, module_grads(module))


@pytest.mark.parametrize("shape", ["2d", "3d"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_attn_mask_layouts_of_the_module(rng, shape, kind):
    params = ref.MHAParams.random(E, H, rng=rng)
    x = rng.standard_normal((2, 5, E))
    mask_shape = (5, 5) if shape == "2d" else (2 * H, 5, 5)
    if kind == "bool":
        attn_mask = rng.random(mask_shape) > 0.7  # True = NOT allowed, as in the module
        attn_mask[..., 0] = False
    else:
        attn_mask = rng.standard_normal(mask_shape)
    out, cache = ref.mha_forward(x, x, x, params, H, attn_mask=attn_mask)
    dout = rng.standard_normal(out.shape)
    grads = ref.mha_backward(dout, cache)

    module = torch_module(params, H)
    tx = torch.tensor(x, requires_grad=True)
    tm = torch.tensor(attn_mask, requires_grad=kind == "float")
    tout, _ = module(tx, tx, tx, attn_mask=tm, need_weights=False)
    tout.backward(torch.tensor(dout))
    assert rel_err(out, tout) < EXACT
    assert rel_err(grads.dquery + grads.dkey + grads.dvalue, tx.grad) < EXACT
    if kind == "float":
        assert grads.dattn_mask.shape == mask_shape
        assert rel_err(grads.dattn_mask, tm.grad) < EXACT
    else:
        assert grads.dattn_mask is None


def test_loads_a_torch_modules_state_dict_as_it_is(rng):
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(E, H, kdim=5, vdim=7, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        module.in_proj_bias.normal_()  # torch starts biases at 0: make them count
        module.out_proj.bias.normal_()
    params = ref.MHAParams.from_state_dict(module.state_dict())
    assert params.w_k.shape == (E, 5) and params.w_v.shape == (E, 7)
    query, key, value = rng.standard_normal((2, 3, E)), rng.standard_normal((2, 4, 5)), rng.standard_normal((2, 4, 7))
    out, _ = ref.mha_forward(query, key, value, params, H)
    tout, _ = module(*(torch.tensor(a) for a in (query, key, value)), need_weights=False)
    assert rel_err(out, tout) < EXACT
    # and back: our state_dict loads into a fresh module
    fresh = torch.nn.MultiheadAttention(E, H, kdim=5, vdim=7, batch_first=True, dtype=torch.float64)
    fresh.load_state_dict({k: torch.as_tensor(v) for k, v in params.state_dict().items()})
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, fresh.state_dict()[name])


def test_attention_weights_match_the_module(rng):
    params = ref.MHAParams.random(E, H, rng=rng)
    x = rng.standard_normal((2, 5, E))
    _, cache = ref.mha_forward(x, x, x, params, H)
    _, weights = torch_module(params, H)(*(torch.tensor(x),) * 3, need_weights=True, average_attn_weights=False)
    assert rel_err(cache.attn_weights, weights) < EXACT


def test_dropout_matches_the_modules_own_dropout(rng):
    """The module draws its dropout mask with F.dropout on the (B*H, Lq, Lk) weights; drawing
    the same shape from the same seed gives the mask it used, so ours can run with it."""
    p, seed = 0.3, 1234
    params = ref.MHAParams.random(E, H, rng=rng)
    x = rng.standard_normal((2, 5, E))
    torch.manual_seed(seed)
    keep = (F.dropout(torch.ones(2 * H, 5, 5, dtype=torch.float64), p) != 0).numpy().reshape(2, H, 5, 5)
    out, cache = ref.encoder_self_attention_forward(x, params, H, dropout_p=p, keep_mask=keep)
    dout = rng.standard_normal(out.shape)
    grads = ref.self_attention_backward(dout, cache)

    module = torch_module(params, H, dropout=p).train()
    tx = torch.tensor(x, requires_grad=True)
    torch.manual_seed(seed)
    tout, _ = module(tx, tx, tx, need_weights=True, average_attn_weights=False)
    tout.backward(torch.tensor(dout))
    assert rel_err(out, tout) < EXACT
    assert rel_err(grads.dx, tx.grad) < EXACT
    assert_params_close(grads.params, module_grads(module))


@pytest.mark.parametrize("flavor", ["encoder", "decoder"])
def test_self_attention_dx_is_the_sum_of_three_paths(rng, flavor):
    params = ref.MHAParams.random(E, H, rng=rng)
    x = rng.standard_normal((2, 6, E))
    kpm = np.zeros((2, 6), dtype=bool)
    kpm[1, 4:] = True
    forward = ref.encoder_self_attention_forward if flavor == "encoder" else ref.decoder_self_attention_forward
    out, cache = forward(x, params, H, key_padding_mask=kpm)
    dout = rng.standard_normal(out.shape)
    grads = ref.self_attention_backward(dout, cache)
    assert np.array_equal(grads.dx, grads.dx_via_query + grads.dx_via_key + grads.dx_via_value)

    module = torch_module(params, H)
    tx = torch.tensor(x, requires_grad=True)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    tout, _ = module(tx, tx, tx, key_padding_mask=torch.as_tensor(kpm),
                     attn_mask=None if flavor == "encoder" else ~causal, need_weights=False)
    tout.backward(torch.tensor(dout))
    assert rel_err(out, tout) < EXACT
    assert rel_err(grads.dx, tx.grad) < EXACT
    assert_params_close(grads.params, module_grads(module))
    # each path on its own is what autograd gives when only that role is differentiated
    for role, ours in (("query", grads.dx_via_query), ("key", grads.dx_via_key), ("value", grads.dx_via_value)):
        leaf = torch.tensor(x, requires_grad=True)
        const = torch.tensor(x)
        args = [leaf if r == role else const for r in ("query", "key", "value")]
        tout, _ = module(*args, key_padding_mask=torch.as_tensor(kpm),
                         attn_mask=None if flavor == "encoder" else ~causal, need_weights=False)
        (grad,) = torch.autograd.grad(tout, leaf, torch.tensor(dout))
        assert rel_err(ours, grad) < EXACT, role


def test_decoder_self_attention_is_causal(rng):
    params = ref.MHAParams.random(E, H, rng=rng)
    x = rng.standard_normal((1, 5, E))
    out, _ = ref.decoder_self_attention_forward(x, params, H)
    x2 = x.copy()
    x2[0, 3:] += 1.0  # change the future of position 2
    out2, _ = ref.decoder_self_attention_forward(x2, params, H)
    assert np.array_equal(out[0, :3], out2[0, :3])
    assert not np.allclose(out[0, 3:], out2[0, 3:])


def test_encoder_decoder_attention_memory_gets_key_and_value_paths(rng):
    params = ref.MHAParams.random(E, H, rng=rng)
    x = rng.standard_normal((2, 4, E))
    memory = rng.standard_normal((2, 7, E))
    kpm = np.zeros((2, 7), dtype=bool)
    kpm[0, 5:] = True
    out, cache = ref.encoder_decoder_attention_forward(x, memory, params, H, memory_key_padding_mask=kpm)
    dout = rng.standard_normal(out.shape)
    grads = ref.encoder_decoder_attention_backward(dout, cache)
    assert np.array_equal(grads.dmemory, grads.dmemory_via_key + grads.dmemory_via_value)

    module = torch_module(params, H)
    tx, tm = torch.tensor(x, requires_grad=True), torch.tensor(memory, requires_grad=True)
    tout, _ = module(tx, tm, tm, key_padding_mask=torch.as_tensor(kpm), need_weights=False)
    tout.backward(torch.tensor(dout))
    assert rel_err(out, tout) < EXACT
    assert rel_err(grads.dx, tx.grad) < EXACT
    assert rel_err(grads.dmemory, tm.grad) < EXACT
    assert_params_close(grads.params, module_grads(module))


def test_grouped_query_heads_against_torch_ops(rng):
    params = ref.MHAParams.random(E, 6, num_kv_heads=2, rng=rng)  # dh = 2, Ekv = 4
    assert params.w_k.shape == (4, E)
    x, memory = rng.standard_normal((2, 3, E)), rng.standard_normal((2, 5, E))
    out, cache = ref.encoder_decoder_attention_forward(x, memory, params, 6)
    dout = rng.standard_normal(out.shape)
    grads = ref.encoder_decoder_attention_backward(dout, cache)

    t = {name: torch.tensor(a, requires_grad=True) for name, a in params.items()}
    tx, tm = torch.tensor(x, requires_grad=True), torch.tensor(memory, requires_grad=True)
    heads = lambda y: y.unflatten(-1, (-1, 2)).transpose(1, 2)  # noqa: E731
    q = heads(F.linear(tx, t["w_q"], t["b_q"]))
    k = heads(F.linear(tm, t["w_k"], t["b_k"]))
    v = heads(F.linear(tm, t["w_v"], t["b_v"]))
    attn = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    tout = F.linear(attn.transpose(1, 2).reshape(2, 3, E), t["w_o"], t["b_o"])
    tout.backward(torch.tensor(dout))
    assert rel_err(out, tout) < EXACT
    assert rel_err(grads.dx, tx.grad) < EXACT and rel_err(grads.dmemory, tm.grad) < EXACT
    assert_params_close(grads.params, ref.MHAParams(**{n: t[n].grad.numpy() for n in t}))


def test_fully_padded_sequence_gives_bias_output_and_no_nan(rng):
    params = ref.MHAParams.random(E, H, rng=rng)
    x = rng.standard_normal((2, 4, E))
    kpm = np.zeros((2, 4), dtype=bool)
    kpm[1] = True
    out, cache = ref.encoder_self_attention_forward(x, params, H, key_padding_mask=kpm)
    np.testing.assert_array_equal(out[1], np.broadcast_to(params.b_o, (4, E)))
    grads = ref.self_attention_backward(rng.standard_normal(out.shape), cache)
    assert all(np.isfinite(g).all() for g in (grads.dx, *(a for _, a in grads.params.items())))
    assert (grads.dx[1] == 0).all()


def test_every_gradient_against_finite_differences(rng):
    params = ref.MHAParams.random(8, 2, num_kv_heads=1, rng=rng)
    x, memory = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 4, 8))
    bias = rng.standard_normal((3, 4))
    keep = rng.random((2, 2, 3, 4)) >= 0.2
    kpm = np.zeros((2, 4), dtype=bool)
    kpm[1, 3] = True
    options = dict(memory_key_padding_mask=kpm, dropout_p=0.2, keep_mask=keep)

    def forward(a):
        p = ref.MHAParams(**{n: a[n] for n in dict(params.items())})
        return ref.encoder_decoder_attention_forward(a["x"], a["memory"], p, 2, attn_mask=a["bias"], **options)[0]

    inputs = {"x": x, "memory": memory, "bias": bias, **dict(params.items())}
    out, cache = ref.encoder_decoder_attention_forward(x, memory, params, 2, attn_mask=bias, **options)
    dout = rng.standard_normal(out.shape)
    grads = ref.encoder_decoder_attention_backward(dout, cache)
    numeric = finite_difference_gradients(forward, inputs, dout)
    ours = {"x": grads.dx, "memory": grads.dmemory, "bias": grads.dattn_mask, **dict(grads.params.items())}
    for name, value in ours.items():
        if name == "b_k":
            assert np.abs(value - numeric[name]).max() < 1e-7 * np.abs(numeric["b_q"]).max()
        else:
            assert rel_err(value, numeric[name]) < 1e-7, name


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 3), heads=st.integers(1, 3), head_dim=st.integers(1, 3),
    len_q=st.integers(1, 5), len_k=st.integers(1, 5), kdim=st.integers(1, 6), vdim=st.integers(1, 6),
    bias=st.booleans(), padding=st.booleans(), attn_bias=st.booleans(), seed=st.integers(0, 2**32 - 1),
)
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning")
def test_property_random_shapes_match_the_module(batch, heads, head_dim, len_q, len_k, kdim, vdim, bias, padding, attn_bias, seed):
    rng = np.random.default_rng(seed)
    width = heads * head_dim
    params = ref.MHAParams.random(width, heads, kdim=kdim, vdim=vdim, bias=bias, rng=rng)
    query = rng.standard_normal((batch, len_q, width))
    key, value = rng.standard_normal((batch, len_k, kdim)), rng.standard_normal((batch, len_k, vdim))
    kpm = rng.random((batch, len_k)) < 0.3 if padding else None  # may pad a whole sequence
    mask = rng.standard_normal((len_q, len_k)) if attn_bias else None
    out, cache = ref.mha_forward(query, key, value, params, heads, key_padding_mask=kpm, attn_mask=mask)
    dout = rng.standard_normal(out.shape)
    grads = ref.mha_backward(dout, cache)

    module = torch_module(params, heads)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (query, key, value))
    tm = None if mask is None else torch.tensor(mask, requires_grad=True)
    tout, _ = module(tq, tk, tv, key_padding_mask=None if kpm is None else torch.as_tensor(kpm), attn_mask=tm, need_weights=False)
    tout.backward(torch.tensor(dout))
    assert rel_err(out, tout) < EXACT
    # with at most one key left per row the softmax is constant: nothing reaches the query
    # or key side, whose gradients are then 0 in exact arithmetic
    one_key = (len_k if kpm is None else (~kpm).sum(-1).max()) <= 1
    zeros = {"b_k"} | ({"w_q", "b_q", "w_k", "dquery", "dkey", "dattn_mask"} if one_key else set())
    ours = {"dquery": grads.dquery, "dkey": grads.dkey, "dvalue": grads.dvalue, **dict(grads.params.items())}
    theirs = {"dquery": tq.grad, "dkey": tk.grad, "dvalue": tv.grad, **dict(module_grads(module).items())}
    if tm is not None:
        ours["dattn_mask"], theirs["dattn_mask"] = grads.dattn_mask, tm.grad
    assert_all_close(ours, theirs, zeros=frozenset(zeros), floor_fraction=1e-3)
