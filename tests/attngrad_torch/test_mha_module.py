"""attngrad.torch.MultiheadAttention against torch.nn.MultiheadAttention with one state_dict."""

import pytest

torch = pytest.importorskip("torch")

from attngrad.torch import MultiheadAttention  # noqa: E402

from ..conftest import EXACT, assert_all_close, rel_err  # noqa: E402


def pair(batch_first=True, kdim=None, bias=True, dropout=0.0, **extra):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(12, 3, dropout=dropout, bias=bias, kdim=kdim, vdim=kdim,
                                      batch_first=batch_first, dtype=torch.float64, **extra)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()  # torch starts the biases at 0: make every parameter count
    ours = MultiheadAttention(12, 3, dropout=dropout, bias=bias, kdim=kdim, vdim=kdim,
                              batch_first=batch_first, dtype=torch.float64, **extra)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def run(module, x, memory, dout, **kwargs):
    out, weights = module(x, memory, memory, **kwargs)
    leaves = [x, memory] + [p for _, p in sorted(module.named_parameters())]
    return out, weights, torch.autograd.grad(out, leaves, dout)


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning")
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kdim", [None, 5])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("extra", [dict(), dict(add_bias_kv=True), dict(add_zero_attn=True),
                                   dict(add_bias_kv=True, add_zero_attn=True)])
def test_outputs_weights_and_gradients_match(batch_first, kdim, bias, extra):
    """Outputs, weights and every gradient, with a padding mask and a float mask; with
    add_bias_kv (learned bias_k, bias_v appended to every sequence, and their gradients) and
    add_zero_attn (a zero key and value) the masks widen over the appended keys."""
    ref, ours = pair(batch_first, kdim, bias, **extra)
    assert sorted(ours.state_dict()) == sorted(ref.state_dict())
    shape = (lambda n, w: (2, n, w)) if batch_first else (lambda n, w: (n, 2, w))
    x = torch.randn(*shape(4, 12), dtype=torch.float64, requires_grad=True)
    memory = torch.randn(*shape(6, kdim or 12), dtype=torch.float64, requires_grad=True)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[0, 4:] = True
    bias_mask = torch.randn(4, 6, dtype=torch.float64)
    dout = torch.randn(*shape(4, 12), dtype=torch.float64)
    a = run(ref, x, memory, dout, key_padding_mask=kpm, attn_mask=bias_mask)
    b = run(ours, x, memory, dout, key_padding_mask=kpm, attn_mask=bias_mask)
    assert rel_err(b[0], a[0]) < EXACT and rel_err(b[1], a[1]) < EXACT
    names = ["x", "memory"] + [n for n, _ in sorted(ours.named_parameters())]
    assert_all_close(dict(zip(names, b[2])), dict(zip(names, a[2])))


def test_causal_self_attention_and_learned_bias_gradient():
    ref, ours = pair()
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    causal = ~torch.ones(5, 5, dtype=torch.bool).tril()
    dout = torch.randn(2, 5, 12, dtype=torch.float64)
    a = run(ref, x, x, dout, attn_mask=causal, need_weights=False)
    b = run(ours, x, x, dout, is_causal=True, need_weights=False)  # ours applies is_causal itself
    assert b[1] is None and rel_err(b[0], a[0]) < EXACT
    assert all(rel_err(p, q) < EXACT for p, q in zip(b[2][:1], a[2][:1]))
    bias = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
    out, _ = ours(x, x, x, attn_mask=bias, need_weights=False)
    (grad,) = torch.autograd.grad(out, bias, dout)
    out_ref, _ = ref(x, x, x, attn_mask=bias, need_weights=False)
    (grad_ref,) = torch.autograd.grad(out_ref, bias, dout)
    assert rel_err(grad, grad_ref) < EXACT


def test_dropout_only_in_training():
    _, ours = pair(dropout=0.5)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    ours.eval()
    a, _ = ours(x, x, x, need_weights=False)
    b, _ = ours(x, x, x, need_weights=False)
    assert torch.equal(a, b)
    ours.train()
    c, _ = ours(x, x, x, need_weights=False)
    assert not torch.equal(a, c)


def test_unbatched_input():
    ref, ours = pair()
    x = torch.randn(5, 12, dtype=torch.float64)
    assert rel_err(ours(x, x, x)[0], ref(x, x, x)[0]) < EXACT


def test_bad_configuration_and_input():
    with pytest.raises(ValueError, match="divisible"):
        MultiheadAttention(10, 3)
    _, ours = pair()
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    with pytest.raises(ValueError, match="key_padding_mask must be"):
        ours(x, x, x, key_padding_mask=torch.zeros(5, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask must be"):
        ours(x, x, x, attn_mask=torch.zeros(2, 5, 5))
    with pytest.raises(ValueError, match="expected widths"):
        ours(x[..., :10], x, x)
    # as torch: an integer mask is neither kind (a uint8 padding mask was added as +1)
    with pytest.raises(TypeError, match="key_padding_mask must be boolean .* or floating .*; got torch.uint8"):
        ours(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.uint8))
    with pytest.raises(TypeError, match="attn_mask must be boolean .* or floating .*; got torch.int64"):
        ours(x, x, x, attn_mask=torch.zeros(5, 5, dtype=torch.int64))


def test_causal_with_a_learned_bias_and_padding():
    ref, ours = pair()
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1, 3:] = True
    dout = torch.randn(2, 5, 12, dtype=torch.float64)
    tri = torch.ones(5, 5, dtype=torch.bool).tril()
    out, _ = ours(x, x, x, attn_mask=bias, key_padding_mask=kpm, is_causal=True, need_weights=False)
    grads = torch.autograd.grad(out, [x, bias], dout)
    out_ref, _ = ref(x, x, x, attn_mask=bias.masked_fill(~tri, float("-inf")), key_padding_mask=kpm.double().masked_fill(kpm, float("-inf")), need_weights=False)
    grads_ref = torch.autograd.grad(out_ref, [x, bias], dout)
    assert rel_err(out, out_ref) < EXACT
    assert all(rel_err(a, b) < EXACT for a, b in zip(grads, grads_ref))


def test_weights_are_after_dropout_with_the_outputs_mask():
    """In training, torch's module returns the attention weights after dropout. Ours returns
    them with the keep-mask its own attention drew: the output is exactly those weights
    applied to the values, through the output projection."""
    _, ours = pair(dropout=0.4)
    ours.train()
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    torch.manual_seed(3)
    out, weights = ours(x, x, x, average_attn_weights=False)
    assert weights.shape == (2, 3, 5, 5)
    dropped = (weights == 0).double().mean()
    assert 0.2 < float(dropped) < 0.6  # about p = 0.4 of 150 entries
    w_v = ours.in_proj_weight.chunk(3)[2]
    b_v = ours.in_proj_bias.chunk(3)[2]
    v = (x @ w_v.T + b_v).unflatten(-1, (3, 4)).transpose(1, 2)  # (N, H, S, dh)
    mixed = (weights @ v).transpose(1, 2).reshape(2, 5, 12)
    assert rel_err(ours.out_proj(mixed), out) < EXACT
