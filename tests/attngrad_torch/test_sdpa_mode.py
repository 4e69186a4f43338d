"""replace_sdpa(): PyTorch's scaled_dot_product_attention, called by any code, runs attngrad
with PyTorch's semantics, under torch.func, double backward and torch.compile; what it does
not take goes to PyTorch's own, counted and reported once."""

import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402

from attngrad.torch import replace_sdpa, sdpa_mode  # noqa: E402
from attngrad.torch.op import dispatch  # noqa: E402

from ..conftest import EXACT, assert_all_close, rel_err  # noqa: E402
from ..replaced_sdpa import replaced_and_math  # noqa: E402
from .conftest import math_sdpa  # noqa: E402

f64 = dict(dtype=torch.float64)


def _inputs(seed, b, h, h_kv, lq, lk, e, ev, transposed=False):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, h, lq, e), (b, h_kv, lk, e), (b, h_kv, lk, ev))
    if transposed:  # (B, L, H, E) storage, as models that split heads after the projection make
        return [torch.randn(s[0], s[2], s[1], s[3], generator=g, **f64).transpose(1, 2) for s in shapes]
    return [torch.randn(s, generator=g, **f64) for s in shapes]


def _mask(kind, b, h, lq, lk, seed):
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    if kind == "bool":
        return torch.rand(b, 1, lq, lk, generator=g) > 0.5  # short rows are often all masked: 0 in both
    if kind == "bool 2d":  # broadcast over batch and heads
        return torch.rand(lq, lk, generator=g) > 0.3
    return torch.randn(1, h, lq, lk, generator=g, **f64).requires_grad_()  # a learned bias


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), h_kv=st.integers(1, 2), group=st.integers(1, 3), lq=st.integers(1, 19), lk=st.integers(1, 23),
       e=st.sampled_from([4, 8]), mask=st.sampled_from([None, "bool", "bool 2d", "float"]), causal=st.booleans(),
       scale=st.sampled_from([None, 0.3]), transposed=st.booleans(), seed=st.integers(0, 2**16))
def test_every_argument_means_what_it_means_in_pytorch(b, h_kv, group, lq, lk, e, mask, causal, scale, transposed, seed):
    if mask is not None:
        causal = False  # PyTorch takes one or the other
    q, k, v = _inputs(seed, b, h_kv * group, h_kv, lq, lk, e, e + 1, transposed)
    attn_mask = _mask(mask, b, h_kv * group, lq, lk, seed)
    leaves = [t.requires_grad_() for t in (q, k, v)] + ([attn_mask] if mask == "float" else [])
    kwargs = dict(attn_mask=attn_mask, is_causal=causal, scale=scale, enable_gqa=group > 1)
    dout = torch.randn(b, h_kv * group, lq, e + 1, generator=torch.Generator().manual_seed(seed + 1), **f64)

    with replace_sdpa(strict=True) as calls:
        ours = F.scaled_dot_product_attention(q, k, v, **kwargs)
    theirs = math_sdpa(q, k, v, **kwargs)
    ours_grads = torch.autograd.grad(ours, leaves, dout)
    theirs_grads = torch.autograd.grad(theirs, leaves, dout)
    names = ["out", "dq", "dk", "dv", "dmask"]
    assert_all_close(dict(zip(names, (ours, *ours_grads))), dict(zip(names, (theirs, *theirs_grads))))
    assert calls.attngrad == 1 and calls.pytorch == {}


def test_positional_and_keyword_arguments_and_the_decorator():
    q, k, v = _inputs(0, 2, 2, 2, 5, 7, 4, 4)
    bias = torch.randn(5, 7, **f64)

    @replace_sdpa()
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, bias, 0.0, False, scale=0.7)

    before = dispatch.ran[("forward", "tiles")] + dispatch.ran[("forward", "torch-ops")]
    out = attend(q, k, v)
    assert dispatch.ran[("forward", "tiles")] + dispatch.ran[("forward", "torch-ops")] == before + 1
    assert rel_err(out, math_sdpa(q, k, v, attn_mask=bias, scale=0.7)) <= EXACT


def test_dropout_follows_pytorchs_generator():
    q, k, v = _inputs(1, 2, 2, 2, 16, 16, 8, 8)
    with replace_sdpa() as calls:
        torch.manual_seed(3)
        first = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        torch.manual_seed(3)
        again = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        other = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert calls.attngrad == 3
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert not torch.allclose(first, math_sdpa(q, k, v))


def test_bad_input_raises_attngrads_error_naming_the_shapes():
    q, k, v = _inputs(0, 1, 2, 2, 4, 5, 8, 8)
    with replace_sdpa() as calls, pytest.raises(ValueError, match=r"query and key must share their last dimension"):
        F.scaled_dot_product_attention(q, k[..., :4], v)
    with replace_sdpa() as calls, pytest.raises(TypeError, match=r"query must be a floating tensor; got torch.int64"):
        F.scaled_dot_product_attention(*(t.long() for t in (q, k, v)))
    assert calls.attngrad == 0 and calls.pytorch == {}


def test_a_call_attngrad_does_not_take_goes_to_pytorch_counted_and_reported_once(monkeypatch):
    from torch.testing._internal.two_tensor import TwoTensor  # a tensor subclass, as DTensor is

    monkeypatch.setattr(sdpa_mode, "_reported", set())
    q, k, v = (TwoTensor(t, t.clone()) for t in _inputs(2, 1, 2, 2, 4, 6, 8, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with replace_sdpa() as calls:
            outs = [F.scaled_dot_product_attention(q, k, v) for _ in range(3)]
    [reason] = calls.pytorch
    assert "TwoTensor" in reason and calls.pytorch[reason] == 3 and calls.attngrad == 0
    assert len([w for w in caught if "replace_sdpa" in str(w.message)]) == 1
    assert rel_err(outs[0].a, math_sdpa(q.a, k.a, v.a)) <= EXACT
    with replace_sdpa(strict=True), pytest.raises(RuntimeError, match="TwoTensor"):
        F.scaled_dot_product_attention(q, k, v)


def test_arguments_attngrad_refuses_and_pytorch_takes_go_to_pytorch(monkeypatch):
    def refuses(**_):
        raise ValueError("no such option here")

    monkeypatch.setattr(sdpa_mode, "attngrad_sdpa", refuses)
    monkeypatch.setattr(sdpa_mode, "_reported", set())
    q, k, v = _inputs(3, 1, 2, 2, 4, 6, 8, 8)
    with pytest.warns(UserWarning, match="no such option here"), replace_sdpa() as calls:
        out = F.scaled_dot_product_attention(q, k, v)
    assert calls.pytorch == {"attngrad refused it: no such option here": 1}
    assert rel_err(out, math_sdpa(q, k, v)) <= EXACT
    with replace_sdpa(), pytest.raises(ValueError, match="no such option here"):  # both refuse: attngrad's error
        F.scaled_dot_product_attention(q, k[..., :4], v)


def _attend(q, k, v, bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


@pytest.mark.parametrize("transform", ["jvp", "vjp", "grad", "hessian", "vmap", "double backward"])
def test_torch_func_and_double_backward(transform):
    q, k, v = _inputs(4, 2, 2, 2, 3, 5, 4, 4)
    bias = torch.randn(2, 3, 5, **f64)
    t = [torch.randn_like(x) for x in (q, k, v)]

    def run():
        if transform == "jvp":
            return torch.func.jvp(lambda *x: _attend(*x, bias), (q, k, v), tuple(t))
        if transform == "vjp":
            out, pullback = torch.func.vjp(lambda *x: _attend(*x, bias), q, k, v)
            return out, pullback(torch.ones_like(out))
        if transform == "grad":
            return torch.func.grad(lambda q: (_attend(q, k, v, bias) ** 2).sum())(q)
        if transform == "hessian":
            return torch.func.hessian(lambda x: _attend(x.reshape(1, 1, 1, 4), k[:1, :1], v[:1, :1], None).sin().sum())(q[0, 0, 0])
        if transform == "vmap":
            return torch.func.vmap(lambda q, k, v: _attend(q, k, v, bias))(q, k, v)
        qq = q.detach().requires_grad_()
        (g,) = torch.autograd.grad((_attend(qq, k, v, bias) ** 2).sum(), qq, create_graph=True)
        return torch.autograd.grad((g * g).sum(), qq)

    with replace_sdpa(strict=True) as calls:
        ours = torch.utils._pytree.tree_leaves(run())
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        theirs = torch.utils._pytree.tree_leaves(run())
    assert calls.attngrad >= 1
    assert_all_close({str(i): x for i, x in enumerate(ours)}, {str(i): x for i, x in enumerate(theirs)})


def _encoder_layer():
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, **f64).train()


def test_transformer_encoder_layer_in_training_to_second_order():
    layer = _encoder_layer()
    x = torch.randn(2, 6, 16, **f64)
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    ours, theirs, calls = replaced_and_math(lambda x: layer(x, src_key_padding_mask=padding), {"x": x}, layer)
    assert_all_close(ours, theirs)
    assert calls.attngrad == 2 and calls.pytorch == {}  # the gradients' forward and the JVP's


def test_transformer_decoder_layer_causal_and_cross_attention():
    torch.manual_seed(1)
    layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True, **f64).train()
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    memory_padding = torch.tensor([[False] * 7, [False] * 3 + [True] * 4])

    def forward(x, memory):
        return layer(x, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=memory_padding)

    inputs = {"x": torch.randn(2, 5, 16, **f64), "memory": torch.randn(2, 7, 16, **f64)}
    ours, theirs, calls = replaced_and_math(forward, inputs, layer)
    assert_all_close(ours, theirs)
    assert calls.attngrad == 4 and calls.pytorch == {}


def test_multihead_attention_reaches_attngrad_unless_it_returns_weights():
    layer = _encoder_layer().self_attn
    x = torch.randn(3, 4, 16, **f64)
    with replace_sdpa() as calls:
        out, weights = layer(x, x, x, need_weights=False)
        layer(x, x, x)  # need_weights=True, the default: PyTorch writes the weights out itself, no SDPA call
    assert weights is None and calls.attngrad == 1
    assert rel_err(out, layer(x, x, x, need_weights=False)[0]) <= EXACT


def test_under_torch_compile_fullgraph_inside_and_outside():
    from torch._dynamo.testing import CompileCounterWithBackend

    layer = _encoder_layer().float()
    x = torch.randn(2, 6, 16, requires_grad=True)
    w = torch.randn(2, 6, 16)  # not the sum: the final LayerNorm makes its gradient 0
    reference = layer(x)
    (expected,) = torch.autograd.grad((reference * w).sum(), x)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def entered_inside(x):
        with replace_sdpa():
            return layer(x)

    before = dispatch.ran.copy()
    with replace_sdpa() as calls:
        outside = compiled(x)
    inside = entered_inside(x)
    for out in (outside, inside):
        (grad,) = torch.autograd.grad((out * w).sum(), x)
        assert rel_err(out, reference) <= 1e-6 and rel_err(grad, expected) <= 1e-6  # float32 rounding
    assert counter.frame_count == 1 and calls.attngrad == 1
    ran = dispatch.ran - before
    assert sum(n for (pass_name, _), n in ran.items() if pass_name == "forward") == 2
    assert sum(n for (pass_name, _), n in ran.items() if pass_name == "backward") == 2


def test_nested_jagged_inputs():
    lengths = [3, 5]
    parts = [[torch.randn(2, n, 4, **f64) for n in lengths] for _ in range(3)]
    q, k, v = (torch.nested.nested_tensor([p.transpose(0, 1) for p in ps], layout=torch.jagged).transpose(1, 2)
               for ps in parts)
    with replace_sdpa(strict=True) as calls:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for i in range(2):
        one = [p[i][None] for p in parts]
        assert rel_err(out.unbind()[i], math_sdpa(*one, is_causal=True)[0]) <= EXACT
    assert calls.attngrad == 1
