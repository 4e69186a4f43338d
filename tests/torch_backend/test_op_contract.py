"""The attention ops as PyTorch operators: torch.library.opcheck over every op and variant,
torch.compile(fullgraph=True) on the transposed views models make, and a clear error for
every inconsistent direct call."""

import pytest

torch = pytest.importorskip("torch")

from attngrad.torch import MultiheadAttention, native, op, scaled_dot_product_attention  # noqa: E402

from ..conftest import EXACT, rel_err  # noqa: E402
from .test_functional import math_sdpa  # noqa: E402

B, H, HKV, LQ, LK, D, DV = 2, 4, 2, 5, 7, 8, 6


def _transposed(*shape, g, dtype=torch.float64):
    """A (B, H, L, E) tensor laid out as models make it: (B, L, H, E) storage, transposed."""
    b, h, length, e = shape
    return torch.randn(b, length, h, e, generator=g, dtype=dtype).transpose(1, 2)


VARIANTS = {
    "plain": dict(),
    "causal": dict(causal=0),
    "bottom-right": dict(causal=LK - LQ),
    "mask": dict(mask=True),
    "bias": dict(bias=(1, H, LQ, LK)),
    "bias-grad": dict(bias=(H, 1, LK), bias_grad=True),
    "dropout": dict(dropout_p=0.3),
    "gqa": dict(kv_heads=HKV),
    "bounds": dict(bounds=B),
    "softcap": dict(softcap=0.9, bias=(H, LQ, LK), bias_grad=True),
    "all": dict(causal=0, mask=True, bias=(B, 1, LQ, LK), bias_grad=True, dropout_p=0.2, kv_heads=HKV, bounds=1,
                softcap=2.0),
    # a sink: the forward's scaled statistics, the double backward's extra row term
    "sink": dict(causal=0, bias=(H, 1, 1), bias_grad=True, kv_heads=HKV, sink=True),
}


def _bounds(batch: int, g: torch.Generator) -> torch.Tensor:
    """Key bounds (batch, LQ, 2): a random [lo, hi) per row, some of them empty."""
    ends = torch.randint(0, LK + 1, (batch, LQ, 2), generator=g)
    return ends.sort(dim=-1).values


def _call_args(variant: str, layout: str, dtype=torch.float64):
    """Arguments of every op for one variant, as (forward, backward, jvp, backward_jvp, double_backward)."""
    spec = VARIANTS[variant]
    g = torch.Generator().manual_seed(len(variant))
    make = _transposed if layout == "transposed" else (lambda *s, g, dtype=dtype: torch.randn(*s, generator=g, dtype=dtype))
    kv = spec.get("kv_heads", H)
    q, k, v = make(B, H, LQ, D, g=g, dtype=dtype), make(B, kv, LK, D, g=g, dtype=dtype), make(B, kv, LK, DV, g=g, dtype=dtype)
    mask = (torch.rand(B, 1, LQ, LK, generator=g) > 0.3) if spec.get("mask") else None
    bias = torch.randn(spec["bias"], generator=g, dtype=dtype) if "bias" in spec else None
    bounds = _bounds(spec["bounds"], g) if "bounds" in spec else None
    seed = torch.tensor(1234 if spec.get("dropout_p") else 0)
    causal, dropout_p, bias_grad = spec.get("causal"), spec.get("dropout_p", 0.0), spec.get("bias_grad", False)
    scale, softcap = D**-0.5, spec.get("softcap", 0.0)
    sink = spec.get("sink", False)
    forward = (q, k, v, mask, bias, bounds, seed, causal, scale, softcap, dropout_p, sink)
    out, row_max, inv_sum = op.attention_forward(*forward)
    dout = make(B, H, LQ, DV, g=g, dtype=dtype)
    backward = (dout, q, k, v, mask, bias, bounds, seed, out, row_max, inv_sum, causal, scale, softcap, dropout_p, bias_grad)
    tq, tk, tv = (torch.randn(t.shape, generator=g, dtype=dtype) for t in (q, k, v))
    tbias = None if bias is None else torch.randn(bias.shape, generator=g, dtype=dtype)
    jvp = (q, k, v, mask, bias, bounds, seed, row_max, inv_sum, causal, scale, softcap, dropout_p, tq, tk, tv, tbias)
    backward_jvp = (*backward, torch.randn(dout.shape, generator=g, dtype=dtype), tq, tk, tv, tbias)
    double_backward = (*backward, True, tq, tk, tv, tbias if bias_grad else None, sink)
    return forward, backward, jvp, backward_jvp, double_backward


OPS = (op.attention_forward, op.attention_backward, op.attention_jvp, op.attention_backward_jvp,
       op.attention_double_backward)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_opcheck_every_op(variant, layout):
    """Schema, fake tensors (shapes, dtypes and strides of the real results) and
    AOT dispatch, on both implementations where the compiled tiles take the call."""
    for custom_op, args in zip(OPS, _call_args(variant, layout)):
        torch.library.opcheck(custom_op, args)


def test_fakes_say_what_the_real_ops_return():
    """The strides of every result are the real ones (contiguous), for transposed inputs too:
    the fake of the backward once returned empty_like(q), a transposed layout."""
    for custom_op, args in zip(OPS, _call_args("all", "transposed")):
        real = custom_op(*args)
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fake = custom_op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        real, fake = (r if isinstance(r, tuple) else (r,) for r in (real, fake))
        for r, f in zip(real, fake):
            assert r.shape == f.shape and r.stride() == f.stride() and r.dtype == f.dtype, custom_op


def _grads(fn, leaves, dout):
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, dout))


@pytest.mark.parametrize("is_causal", [False, True])
def test_compiled_sdpa_on_transposed_views_matches_eager(is_causal):
    """Inductor, fullgraph, float64, on q, k, v as models make them (a view, transposed):
    output and gradients equal eager's to 1e-12, and PyTorch's math backend's."""
    g = torch.Generator().manual_seed(5)
    leaves = [torch.randn(B, length, heads, width, generator=g, dtype=torch.float64, requires_grad=True)
              for length, heads, width in ((LQ, H, D), (LK, HKV, D), (LK, HKV, DV))]  # (B, L, H, E)
    dout = torch.randn(B, H, LQ, DV, generator=g, dtype=torch.float64)

    def fn(q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, L, E) views, as in a model
        return scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)

    def ref_fn(q, k, v):
        return math_sdpa(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=is_causal, enable_gqa=True)

    torch._dynamo.reset()
    compiled = _grads(torch.compile(fn, fullgraph=True), leaves, dout)
    eager = _grads(fn, leaves, dout)
    ref = _grads(ref_fn, leaves, dout)
    for c, e, r in zip(compiled, eager, ref):
        assert rel_err(c, e) < EXACT and rel_err(c, r) < EXACT


def test_compiled_multihead_attention_matches_eager():
    """attngrad's MultiheadAttention (whose heads are transposed views) under Inductor with
    fullgraph: the output and every parameter's gradient equal eager's to 1e-12."""
    torch.manual_seed(0)
    module = MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64)
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 6, 16, dtype=torch.float64)
    leaves = [x, *module.parameters()]

    def fn(x):
        return module(x, x, x, need_weights=False, is_causal=True)[0]

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    a = (compiled(x), *torch.autograd.grad(compiled(x), leaves, dout))
    b = (fn(x), *torch.autograd.grad(fn(x), leaves, dout))
    for c, e in zip(a, b):
        assert rel_err(c, e) < EXACT


# Each direct call below disagrees with itself in one way; the op must say which.
def _bad_calls():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((B, H, LQ, D), (B, HKV, LK, D), (B, HKV, LK, DV)))
    seed, scale = torch.tensor(0), D**-0.5
    forward = dict(q=q, k=k, v=v, mask=None, bias=None, bounds=None, seed=seed, causal=None, scale=scale, softcap=0.0, dropout_p=0.0)
    out, row_max, inv_sum = op.attention_forward(**forward)
    dout = torch.randn_like(out)
    backward = dict(dout=dout, q=q, k=k, v=v, mask=None, bias=None, bounds=None, seed=seed, out=out, row_max=row_max,
                    inv_sum=inv_sum, causal=None, scale=scale, softcap=0.0, dropout_p=0.0, bias_grad=False)
    return [
        ("3 query heads over 2 key heads", op.attention_forward, forward, dict(q=q[:, :3]), "multiple"),
        ("query width 16, key width 8", op.attention_forward, forward, dict(q=torch.randn(B, H, LQ, 16, dtype=torch.float64)), "width d"),
        ("key longer than value", op.attention_forward, forward, dict(k=torch.randn(B, HKV, LK + 1, D, dtype=torch.float64)), "(B, Hkv, Lk)"),
        ("batch 1 query over batch 2 keys", op.attention_forward, forward, dict(q=q[:1]), "batch size"),
        ("3-D q", op.attention_forward, forward, dict(q=q[0]), "4-D"),
        ("float64 q, float32 k", op.attention_forward, forward, dict(k=k.float()), "share a dtype"),
        ("a mask that does not broadcast", op.attention_forward, forward, dict(mask=torch.ones(3, LQ, LK, dtype=torch.bool)), "mask of shape"),
        ("a float mask", op.attention_forward, forward, dict(mask=torch.ones(LQ, LK)), "mask must be boolean"),
        ("a 5-D bias", op.attention_forward, forward, dict(bias=torch.zeros(1, 1, 1, LQ, LK, dtype=torch.float64)), "bias of shape"),
        ("a bias over too many keys", op.attention_forward, forward, dict(bias=torch.zeros(LQ, LK + 1, dtype=torch.float64)), "bias of shape"),
        ("dropout_p 1.5", op.attention_forward, forward, dict(dropout_p=1.5), "dropout_p"),
        ("a negative softcap", op.attention_forward, forward, dict(softcap=-1.0), "softcap"),
        ("bounds for 3 batch entries", op.attention_forward, forward, dict(bounds=torch.zeros(3, LQ, 2, dtype=torch.int64)),
         "bounds must have shape"),
        ("bounds per key", op.attention_forward, forward, dict(bounds=torch.zeros(B, LQ, LK, dtype=torch.int64)),
         "bounds must have shape"),
        ("int32 bounds", op.attention_forward, forward, dict(bounds=torch.zeros(B, LQ, 2, dtype=torch.int32)),
         "bounds must be an int64"),
        ("a float seed", op.attention_forward, forward, dict(seed=torch.tensor(1.0)), "seed"),
        ("a seed of 3 numbers", op.attention_forward, forward, dict(seed=torch.tensor([1, 2, 3])), "seed must be a 0-d"),
        ("a negative row offset", op.attention_forward, forward, dict(seed=torch.tensor([1, -2, 0, 0, 0])), "offsets must be >= 0"),
        ("a JVP on a part of each row's keys", op.attention_jvp,
         dict(q=q, k=k, v=v, mask=None, bias=None, bounds=None, seed=seed, row_max=row_max, inv_sum=inv_sum, causal=None, scale=scale,
              softcap=0.0, dropout_p=0.0, tq=None, tk=None, tv=None, tbias=None), dict(seed=torch.tensor([0, 0, 0, 0, 1])),
         "each row's whole keys"),
        ("dout over too few rows", op.attention_backward, backward, dict(dout=dout[:, :, 1:]), "dout must have shape"),
        ("out of the wrong width", op.attention_backward, backward, dict(out=out[..., 1:]), "out must have shape"),
        ("row_max of the wrong shape", op.attention_backward, backward, dict(row_max=row_max[..., 1:]), "row_max"),
        ("inv_sum of the wrong shape", op.attention_backward, backward, dict(inv_sum=inv_sum[:1]), "inv_sum"),
        ("bias_grad without a bias", op.attention_backward, backward, dict(bias_grad=True), "needs a bias"),
        ("a tangent of q's transpose", op.attention_jvp,
         dict(q=q, k=k, v=v, mask=None, bias=None, bounds=None, seed=seed, row_max=row_max, inv_sum=inv_sum, causal=None, scale=scale,
              softcap=0.0, dropout_p=0.0, tq=None, tk=None, tv=None, tbias=None), dict(tq=q.transpose(-1, -2)), "tq must have shape"),
        ("a tangent of the bias without a bias", op.attention_jvp,
         dict(q=q, k=k, v=v, mask=None, bias=None, bounds=None, seed=seed, row_max=row_max, inv_sum=inv_sum, causal=None, scale=scale,
              softcap=0.0, dropout_p=0.0, tq=None, tk=None, tv=None, tbias=None), dict(tbias=torch.zeros(LQ, LK, dtype=torch.float64)), "without a bias"),
        ("a tangent of dout over too few rows", op.attention_backward_jvp,
         dict(**backward, tdout=None, tq=None, tk=None, tv=None, tbias=None), dict(tdout=dout[:, :, 1:]), "tdout must have shape"),
        ("a cotangent of k over too many keys", op.attention_double_backward,
         dict(**backward, dout_grad=True, gq=None, gk=None, gv=None, gbias=None),
         dict(gk=torch.zeros(B, HKV, LK + 1, D, dtype=torch.float64)), "gk must have shape"),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda case: case[0] if isinstance(case, tuple) else None)
def test_inconsistent_direct_calls_raise_clearly(case):
    _, custom_op, good, change, fragment = case
    with pytest.raises((ValueError, TypeError), match="attngrad attention op: .*" + fragment.replace("(", r"\(").replace(")", r"\)")):
        custom_op(**{**good, **change})


def test_the_compiled_tiles_check_their_own_sizes():
    """Below the ops: an entry point of the library handed a buffer of the wrong size
    refuses the call (and says which) instead of reading past its end."""
    if native.library() is None:
        pytest.skip(f"no compiled tiles: {native.build_info.reason}")
    q, k, v = torch.randn(1, 3, 8, 16), torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)
    out, row_max, inv_sum = torch.empty(1, 3, 8, 8), torch.empty(1, 3, 8), torch.empty(1, 3, 8)

    def forward(q, k, v, out, row_max, inv_sum, mask=None, bias=None, **more):
        call = native.describe(q, k, v, None, 0.25, out=out, row_max=row_max, inv_sum=inv_sum,
                               **native._score_masks(mask, bias, torch.float32), **more)
        native._call("attngrad_forward", call)
        return call

    with pytest.raises(RuntimeError, match="heads mod kv_heads"):  # heads 3 over kv_heads 2
        forward(q, k, v, out, row_max, inv_sum)
    q = torch.randn(1, 2, 8, 16)  # width 16 against k's 8: k holds half of what the sizes say
    out, row_max, inv_sum = torch.empty(1, 2, 8, 8), torch.empty(1, 2, 8), torch.empty(1, 2, 8)
    with pytest.raises(RuntimeError, match="k is 128, expected 256"):
        forward(q, k, v, out, row_max, inv_sum)
    q = torch.randn(1, 2, 8, 8)
    with pytest.raises(RuntimeError, match="mask_sizes is 3, expected 8"):  # a mask over 3 keys of 8
        forward(q, k, v, out, row_max, inv_sum, mask=torch.ones(8, 3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="bias_sizes is 7, expected 8"):
        forward(q, k, v, out, row_max, inv_sum, bias=torch.ones(7, 8))
    bounds = torch.tensor([[0, 8]] * 8).reshape(1, 8, 2)
    forward(q, k, v, out, row_max, inv_sum, key_bounds=bounds)  # every key: a good call
    with pytest.raises(RuntimeError, match="a key bound is 9, expected 8"):  # a bound past the last key
        forward(q, k, v, out, row_max, inv_sum, key_bounds=bounds.clone().index_put_((torch.tensor(0), torch.tensor(3), torch.tensor(1)), torch.tensor(9)))
    with pytest.raises(RuntimeError, match="a key bound is -1"):
        forward(q, k, v, out, row_max, inv_sum, key_bounds=bounds - 1)
    with pytest.raises(RuntimeError, match="bounds_batch is 2, expected 1"):  # bounds for 2 batch entries of 1
        forward(q, k, v, out, row_max, inv_sum, key_bounds=bounds.expand(2, 8, 2).contiguous())
    with pytest.raises(RuntimeError, match="out is 0, expected 1"):  # a buffer the pass needs, missing
        forward(q, k, v, None, row_max, inv_sum)
    with pytest.raises(RuntimeError, match="gq is 128, expected 0"):  # a buffer this pass does not take
        forward(q, k, v, out, row_max, inv_sum, gq=q)
    call = native.describe(q, k, v, None, 0.25, out=out, row_max=row_max, inv_sum=inv_sum)
    call.dropout_key_offset = -1  # the draws' coordinates start below 0
    with pytest.raises(RuntimeError, match="dropout_key_offset is -1"):
        native._call("attngrad_forward", call)
    call = forward(q, k, v, out, row_max, inv_sum)  # a good call; then one whose count lies
    call.numel[native.BUFFERS.index("out")] -= 1
    with pytest.raises(RuntimeError, match="out is 127, expected 128"):
        native._call("attngrad_forward", call)
    call.numel[native.BUFFERS.index("out")] += 1
    call.chunks = 0
    with pytest.raises(RuntimeError, match="chunks is 0"):
        native._call("attngrad_forward", call)
    with pytest.raises(RuntimeError, match="call is 0"):
        native._call("attngrad_forward", None)
    with pytest.raises(RuntimeError, match="row_max as torch.float32; got torch.float64"):  # counts alone agree
        forward(q, k, v, out, row_max.double(), inv_sum)
    with pytest.raises(RuntimeError, match="numel"):
        native._call("attngrad_dropout_keep_scale", 0, out.data_ptr(), out.numel() + 1, 1, 3, 0, 8, 0, 8, 7, 1 << 31, 2.0, 1)

