"""The attention ops as PyTorch operators: torch.library.opcheck over every op and variant,
torch.compile(fullgraph=True) on the transposed views models make, and a clear error for
every inconsistent direct call."""

import pytest

torch = pytest.importorskip("torch")

from attngrad.torch import MultiheadAttention, scaled_dot_product_attention  # noqa: E402
from attngrad.torch.backends.cpu_tiles import native  # noqa: E402
from attngrad.torch.masks import blocks as mask_blocks  # noqa: E402
from attngrad.torch.op import ops as op  # noqa: E402

from ...conftest import EXACT, rel_err  # noqa: E402
from ..conftest import make_call, math_sdpa  # noqa: E402

B, H, HKV, LQ, LK, D, DV = 2, 4, 2, 5, 7, 8, 6


def _transposed(*shape, g, dtype=torch.float64):
    """A (B, H, L, E) tensor laid out as models make it: (B, L, H, E) storage, transposed."""
    b, h, length, e = shape
    return torch.randn(b, length, h, e, generator=g, dtype=dtype).transpose(1, 2)


# The contract (schema, fakes, AOT dispatch) follows which tensors a call holds and their
# shapes: "all" holds every option at once, the others each absence the ops tell apart (no
# mask or bias, a mask alone, a bias with and without its gradient, of other broadcast
# shapes). A causal diagonal, dropout, GQA and key bounds change no tensor's presence beyond
# "all"'s (their single-option variants took 7 s of the suite; the property tests run them).
VARIANTS = {
    "plain": dict(),
    "mask": dict(mask=True),
    "bias": dict(bias=(1, H, LQ, LK)),
    "bias-grad": dict(bias=(H, 1, LK), bias_grad=True),
    "softcap": dict(softcap=0.9, bias=(H, LQ, LK), bias_grad=True),
    "all": dict(causal=0, mask=True, bias=(B, 1, LQ, LK), bias_grad=True, dropout_p=0.2, kv_heads=HKV, bounds=1,
                softcap=2.0),
    # sinks beside a key-constant bias: the forward's scaled statistics, the sinks' closed forms
    "sink": dict(causal=0, bias=(H, 1, 1), bias_grad=True, kv_heads=HKV, sinks=(1, H)),
    # per-batch sinks beside a bias that varies along the keys, with their tangents
    "sinks-bias": dict(bias=(1, H, LQ, LK), bias_grad=True, sinks=(B, H)),
    # a mask kept per block (`mask_blocks`), per batch entry, beside a bias and its gradient
    "blocks": dict(blocks=True, causal=LK - LQ, bias=(1, H, LQ, LK), bias_grad=True),
}


def _bounds(batch: int, g: torch.Generator) -> torch.Tensor:
    """Key bounds (batch, LQ, 2): a random [lo, hi) per row, some of them empty."""
    ends = torch.randint(0, LK + 1, (batch, LQ, 2), generator=g)
    return ends.sort(dim=-1).values


def _call_args(variant: str, layout: str, dtype=torch.float64):
    """Arguments of every op for one variant, as (forward, backward, jvp, forward_jvp,
    backward_jvp, double_backward, backward_with_jvp), each (the call's fields in order, the
    pass's inputs by name)."""
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
    extra = {}
    if "sinks" in spec:
        extra["sinks"] = torch.randn(spec["sinks"], generator=g, dtype=dtype)
    if spec.get("blocks"):
        kept = mask_blocks.from_dense(torch.rand(B, 1, LQ, LK, generator=g) > 0.4, (3, 4))
        extra.update(mask_blocks=kept.index, mask_tiles=kept.tiles)
    fields = (q, k, v, mask, bias, bounds, seed, causal, scale, softcap, dropout_p)
    out, row_max, inv_sum = op.attention_forward(*fields, **extra)
    dout = make(B, H, LQ, DV, g=g, dtype=dtype)
    stats = dict(out=out, row_max=row_max, inv_sum=inv_sum)
    tq, tk, tv = (torch.randn(t.shape, generator=g, dtype=dtype) for t in (q, k, v))
    tbias = None if bias is None else torch.randn(bias.shape, generator=g, dtype=dtype)
    tangents = dict(tq=tq, tk=tk, tv=tv, tbias=tbias)
    sinks_t = {name: torch.randn(extra["sinks"].shape, generator=g, dtype=dtype) for name in ("tsinks", "gsinks")
               if "sinks" in extra}
    tangents.update({n: t for n, t in sinks_t.items() if n == "tsinks"})
    backward = dict(dout=dout, **stats, bias_grad=bias_grad)
    blocks = extra
    backward_jvp = dict(**backward, tdout=torch.randn(dout.shape, generator=g, dtype=dtype), **tangents, **blocks)
    return (
        (fields, extra),
        (fields, dict(backward, **blocks)),
        (fields, dict(row_max=row_max, inv_sum=inv_sum, **tangents, **blocks)),
        (fields, dict(**tangents, **extra)),
        (fields, backward_jvp),
        (fields, dict(**backward, dout_grad=True, gq=tq, gk=tk, gv=tv, gbias=tbias if bias_grad else None,
                      gsinks=sinks_t.get("gsinks"), **extra)),
        (fields, backward_jvp),
    )


OPS = (op.attention_forward, op.attention_backward, op.attention_jvp, op.attention_forward_jvp,
       op.attention_backward_jvp, op.attention_double_backward, op.attention_backward_with_jvp)


# Transposed views for "all", which holds every feature but a sink's and a mask kept per
# block (strides are handled the same for all of them, in `_work` and the ops' checks, before
# any feature's code; the 13 x 2 grid took a sixth of the suite's time)
LAYOUTS = [(variant, "contiguous") for variant in VARIANTS] + [("all", "transposed")]


# AOT dispatch, nine tenths of opcheck's time, on the variants with every optional tensor
# ("all"), none ("plain"), a sink and a mask kept per block; the others' fakes are checked
# against their real results (test_faketensor), which is where their results differ
AOT_VARIANTS = ("plain", "all", "sinks-bias", "blocks")


@pytest.mark.parametrize("variant, layout", LAYOUTS, ids=[f"{v}-{layout}" for v, layout in LAYOUTS])
def test_opcheck_every_op(variant, layout):
    """Schema, fake tensors (shapes, dtypes and strides of the real results) and
    AOT dispatch, on both implementations where the compiled tiles take the call."""
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    utils += ("test_aot_dispatch_dynamic",) * (variant in AOT_VARIANTS)
    for custom_op, (args, kwargs) in zip(OPS, _call_args(variant, layout)):
        torch.library.opcheck(custom_op, args, kwargs, test_utils=utils)


def test_fakes_say_what_the_real_ops_return():
    """The strides of every result are the real ones (contiguous), for transposed inputs too:
    the fake of the backward once returned empty_like(q), a transposed layout."""
    for custom_op, (args, kwargs) in zip(OPS, _call_args("all", "transposed")):
        real = custom_op(*args, **kwargs)
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fake = custom_op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args),
                             **{n: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for n, a in kwargs.items()})
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


def _tiles_ops():
    if native.library() is None:
        pytest.skip(f"no compiled tiles: {native.build_info.reason}")
    return torch.ops.attngrad_tiles


def _tiles_calls():
    """(name, op, good arguments, a change, what the refusal says) for the compiled tiles'
    ops, called directly: each change is a tensor of the wrong shape, dtype or layout, or
    an option out of range, that would have the tiles read or write past a buffer."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 8, generator=g) for _ in range(3))
    out, dout = torch.empty(1, 2, 8, 8), torch.randn(1, 2, 8, 8, generator=g)
    row_max, inv_sum, delta = torch.zeros(1, 2, 8), torch.ones(1, 2, 8), torch.empty(1, 2, 8)
    options = native._options(make_call(q, k, v, scale=0.25), native._Layout(block_rows=4, block_keys=4))
    masks = dict(mask=None, bias=None, key_bounds=None)
    forward = dict(q=q, k=k, v=v, **masks, out=out, row_max=row_max, inv_sum=inv_sum, **options)
    after = dict(q=q, k=k, v=v, **masks, out=out, row_max=row_max, inv_sum=inv_sum, dout=dout, delta=delta, **options)
    backward = dict(**after, dq_parts=torch.zeros(1, 1, 2, 8, 8), dk=torch.zeros(1, 2, 8, 8), dv=torch.zeros(1, 2, 8, 8),
                    dbias_parts=None)
    double = dict(**after, gq=None, gk=None, gv=None, gbias=None, g_dout=None, g_q=torch.empty(1, 2, 8, 8),
                  gk_parts=torch.zeros(1, 1, 2, 8, 8), gv_parts=torch.zeros(1, 1, 2, 8, 8), g_bias_parts=None)
    jvp = dict(q=q, k=k, v=v, **masks, row_max=row_max, inv_sum=inv_sum, tq=None, tk=None, tv=None, tbias=None,
               tout=torch.empty(1, 2, 8, 8), **options)
    forward_jvp = dict(q=q, k=k, v=v, **masks, tq=None, tk=None, tv=None, tbias=None, out=out,
                       tout=torch.empty(1, 2, 8, 8), row_max=torch.empty(1, 2, 8), inv_sum=torch.empty(1, 2, 8), **options)
    backward_jvp = dict(**after, tdout=None, tq=None, tk=None, tv=None, tbias=None, tdq=torch.empty(1, 2, 8, 8),
                        tdk_parts=torch.zeros(1, 1, 2, 8, 8), tdv_parts=torch.zeros(1, 1, 2, 8, 8), tdbias_parts=None,
                        dq=None, dk_parts=None, dv_parts=None, dbias_row_parts=None)
    with_backward = dict(backward_jvp, dq=torch.empty(1, 2, 8, 8), dk_parts=torch.zeros(1, 1, 2, 8, 8),
                         dv_parts=torch.zeros(1, 1, 2, 8, 8))
    bounds = torch.tensor([[0, 8]] * 8).reshape(1, 8, 2)
    planned_call = make_call(q, k, v, scale=0.25)
    packed = native._planned_options(planned_call, native._Layout(block_rows=4, block_keys=4))
    ranges = native._causal_key_ranges(8, 8, None, 4)
    forward_planned = dict(q=q, k=k, v=v, mask=None, bias=None, tile_map=None, key_ranges=ranges, options=packed)
    backward_planned = dict(q=q, k=k, v=v, mask=None, bias=None, out=out, row_max=row_max, inv_sum=inv_sum, dout=dout,
                            tile_map=None, key_ranges=ranges, options=packed)
    chunks_at = 2 + [n for n in native._op("forward")[1] if n in options].index("chunks") - 1  # after causal's two
    keep = dict(out=torch.empty(1, 3, 8, 8), seed=7, row_start=0, key_start=0, threshold=1 << 31, value=2.0)
    return [
        ("heads 3 over kv_heads 2", "forward", forward,
         dict(q=torch.randn(1, 3, 8, 8), k=k[:, :1].expand(1, 2, 8, 8).contiguous(), out=torch.empty(1, 3, 8, 8),
              row_max=torch.empty(1, 3, 8), inv_sum=torch.empty(1, 3, 8)), r"heads \(3\) must be a multiple of kv_heads \(2\)"),
        ("k narrower than q", "forward", forward, dict(q=torch.randn(1, 2, 8, 16)),
         r"k has shape \[1, 2, 8, 8\], expected \[1, 2, 8, 16\] \(q \[1, 2, 8, 16\]"),
        ("v over fewer keys than k", "forward", forward, dict(v=v[:, :, :7].contiguous()),
         r"v has shape \[1, 2, 7, 8\], expected \[1, 2, 8, 8\]"),
        ("v of another batch", "forward", forward, dict(v=torch.randn(2, 2, 8, 8)), r"v has shape \[2, 2, 8, 8\]"),
        ("q not contiguous", "forward", forward, dict(q=q.transpose(2, 3)), "q must be contiguous"),
        ("k not contiguous", "backward", backward, dict(k=k.transpose(2, 3)), "k must be contiguous"),
        ("q of integers", "forward", forward, dict(q=torch.ones(1, 2, 8, 8, dtype=torch.int32)), "q must be float32 or float64"),
        ("k float64 beside float32 q", "forward", forward, dict(k=k.double()), "k must be Float, got Double"),
        ("q 3-D", "forward", forward, dict(q=q[0]), "q, k and v must be 4-D"),
        ("a mask over 3 keys of 8", "forward", forward, dict(mask=torch.ones(1, 1, 8, 3, dtype=torch.bool)),
         r"mask has shape \[1, 1, 8, 3\]; each size must be 1 or the scores' \[1, 2, 8, 8\]"),
        ("a mask of floats", "forward", forward, dict(mask=torch.ones(1, 1, 8, 8)), "mask must be Bool, got Float"),
        ("a 2-D mask", "forward", forward, dict(mask=torch.ones(8, 8, dtype=torch.bool)), "mask must be 4-D"),
        ("a mask not contiguous", "forward", forward,
         dict(mask=torch.ones(1, 2, 8, 8, dtype=torch.bool).transpose(2, 3)), "mask must be contiguous"),
        ("a bias over 7 rows", "forward", forward, dict(bias=torch.ones(1, 1, 7, 8)), r"bias has shape \[1, 1, 7, 8\]"),
        ("a float64 bias", "forward", forward, dict(bias=torch.ones(1, 1, 8, 8, dtype=torch.float64)),
         "bias must be Float, got Double"),
        ("a key bound past the last key", "forward", forward,
         dict(key_bounds=bounds.clone().index_put_((torch.tensor(0), torch.tensor(3), torch.tensor(1)), torch.tensor(9))),
         "a key bound is 9, expected 0 to len_k 8"),
        ("a key bound below 0", "forward", forward, dict(key_bounds=bounds - 1), "a key bound is -1"),
        ("key bounds for 2 batch entries of 1", "forward", forward, dict(key_bounds=bounds.expand(2, 8, 2).contiguous()),
         r"key_bounds has shape \[2, 8, 2\], expected \(1 or batch 1, 8, 2\)"),
        ("key bounds of int32", "forward", forward, dict(key_bounds=bounds.int()), "key_bounds must be Long, got Int"),
        ("key bounds over 7 rows", "forward", forward, dict(key_bounds=bounds[:, :7].contiguous()), "key_bounds has shape"),
        ("out over one row too few", "forward", forward, dict(out=out[:, :, 1:]), r"out has shape \[1, 2, 7, 8\]"),
        ("row_max float64", "forward", forward, dict(row_max=row_max.double()), "row_max must be Float, got Double"),
        ("inv_sum over one head", "forward", forward, dict(inv_sum=inv_sum[:, :1]), r"inv_sum has shape \[1, 1, 8\]"),
        ("an empty query axis", "forward", forward,
         dict(q=q[:, :, :0], out=out[:, :, :0], row_max=row_max[:, :, :0], inv_sum=inv_sum[:, :, :0]),
         "len_q is 0, expected 1 to 2"),
        ("a causal offset past 2^31", "forward", forward, dict(causal=1 << 40), "causal is 1099511627776"),
        ("whole-row tiles past 2^40 numbers", "jvp", jvp,
         dict(k=torch.randn(1, 2, 1024, 8), v=torch.randn(1, 2, 1024, 8), block_rows=(1 << 31) - 1),
         "block_rows \\* len_k is 2199023254528, expected at most 2\\^40"),
        ("chunks 0", "forward", forward, dict(chunks=0), "chunks is 0"),
        ("block_rows 0", "backward", backward, dict(block_rows=0), "block_rows is 0"),
        ("value_slice -1", "forward", forward, dict(value_slice=-1), "value_slice is -1"),
        ("a dropout key offset below 0", "forward", forward, dict(key_offset=-1), "key_offset is -1"),
        ("a dropout row offset past 2^31", "forward", forward, dict(row_offset=1 << 31), "row_offset is 2147483648"),
        ("a dropout head offset below 0", "forward", forward, dict(head_offset=-1), "head_offset is -1"),
        ("a dropout threshold past 2^32", "forward", forward, dict(threshold=(1 << 32) + 1), "threshold is 4294967297"),
        ("dout over one row too few", "backward", backward, dict(dout=dout[:, :, 1:]), r"dout has shape \[1, 2, 7, 8\]"),
        ("delta not contiguous", "backward", backward, dict(delta=torch.empty(1, 8, 2).transpose(1, 2)),
         "delta must be contiguous"),
        ("dq_parts for 1 chunk of 2", "backward", backward, dict(chunks=2), r"dq_parts has shape \[1, 1, 2, 8, 8\], expected \[2, 1, 2, 8, 8\]"),
        ("dk over one key too few", "backward", backward, dict(dk=torch.zeros(1, 2, 7, 8)), r"dk has shape \[1, 2, 7, 8\]"),
        ("a bias gradient without a bias", "backward", backward, dict(dbias_parts=torch.zeros(1, 1, 1, 1, 1)),
         "dbias_parts was given without a bias"),
        ("a key-constant bias's gradient in 1 part of 3 chunks", "backward", backward,
         dict(bias=torch.zeros(1, 1, 8, 1), chunks=3, dq_parts=torch.zeros(3, 1, 2, 8, 8),
              dbias_parts=torch.zeros(1, 1, 1, 8, 1)), r"dbias_parts has shape \[1, 1, 1, 8, 1\], expected \[3, 1, 1, 8, 1\]"),
        ("a cotangent of k over too many keys", "double_backward", double, dict(gk=torch.zeros(1, 2, 9, 8)),
         r"gk has shape \[1, 2, 9, 8\]"),
        ("g_dout over one row too few", "double_backward", double, dict(g_dout=torch.empty(1, 2, 7, 8)), "g_dout has shape"),
        ("gv_parts for 1 chunk of 2", "double_backward", double, dict(chunks=2, gk_parts=torch.zeros(2, 1, 2, 8, 8)),
         r"gv_parts has shape \[1, 1, 2, 8, 8\], expected \[2, 1, 2, 8, 8\]"),
        ("a cotangent of the bias without a bias", "double_backward", double, dict(gbias=torch.zeros(1, 1, 1, 1)),
         "gbias was given without a bias"),
        # whole-row passes on a ring step's part of each row: their row sums (and a bias constant
        # along the keys, whose rows they sum in closed form) need all of it
        ("the double backward on a part of each row", "double_backward", double, dict(partial_rows=True),
         "the pass sums each row over its keys; partial_rows says"),
        ("the backward's JVP on a part of each row", "backward_jvp", backward_jvp, dict(partial_rows=True),
         "the pass sums each row over its keys; partial_rows says"),
        ("a tangent of q of float64", "jvp", jvp, dict(tq=torch.zeros(1, 2, 8, 8, dtype=torch.float64)),
         "tq must be Float, got Double"),
        ("a tangent of the bias in other sizes than the bias", "jvp", jvp,
         dict(bias=torch.zeros(1, 1, 8, 8), tbias=torch.zeros(1, 2, 8, 8)), r"tbias has shape \[1, 2, 8, 8\], expected \[1, 1, 8, 8\]"),
        ("tout not contiguous", "jvp", jvp, dict(tout=torch.empty(1, 2, 8, 8).transpose(2, 3)), "tout must be contiguous"),
        ("out of one row too few, with the tangent", "forward_jvp", forward_jvp, dict(out=out[:, :, 1:]),
         r"out has shape \[1, 2, 7, 8\]"),
        ("a tangent of v of another width", "forward_jvp", forward_jvp, dict(tv=torch.zeros(1, 2, 8, 4)),
         r"tv has shape \[1, 2, 8, 4\], expected \[1, 2, 8, 8\]"),
        ("a tangent of dout over too few rows", "backward_jvp", backward_jvp, dict(tdout=dout[:, :, 1:]),
         r"tdout has shape \[1, 2, 7, 8\]"),
        ("tdk_parts of another width", "backward_jvp", backward_jvp, dict(tdk_parts=torch.zeros(1, 1, 2, 8, 4)),
         "tdk_parts has shape"),
        ("row_max over one row too few, with the tangent", "forward_jvp", forward_jvp,
         dict(row_max=torch.empty(1, 2, 7)), r"row_max has shape \[1, 2, 7\]"),
        ("dq without dk_parts and dv_parts", "backward_jvp", backward_jvp, dict(dq=torch.empty(1, 2, 8, 8)),
         "given together or not at all"),
        ("dv_parts for 2 chunks of 1", "backward_jvp", with_backward, dict(dv_parts=torch.zeros(2, 1, 2, 8, 8)),
         r"dv_parts has shape \[2, 1, 2, 8, 8\], expected \[1, 1, 2, 8, 8\]"),
        ("dq of float64", "backward_jvp", with_backward, dict(dq=torch.empty(1, 2, 8, 8, dtype=torch.float64)),
         "dq must be Float, got Double"),
        # the planned ops (a plan's options packed once): they make their results from q, k, v's sizes
        ("a planned forward's q 3-D", "forward_planned", forward_planned, dict(q=q[0]), "q, k and v must be 4-D"),
        ("a planned forward's options of int32", "forward_planned", forward_planned, dict(options=packed.int()),
         "options must be Long, got Int"),
        ("a planned forward's options one short", "forward_planned", forward_planned, dict(options=packed[:-1]),
         r"options has shape \[18\], expected \[19\]"),
        ("a planned backward's chunks 0", "backward_planned", backward_planned,
         dict(options=packed.clone().index_fill_(0, torch.tensor(chunks_at), 0)), "chunks is 0"),
        ("a planned backward's chunks past 2^31", "backward_planned", backward_planned,
         dict(options=packed.clone().index_fill_(0, torch.tensor(chunks_at), 1 << 40)), "chunks is 1099511627776"),
        ("a planned backward's dout over one row too few", "backward_planned", backward_planned,
         dict(dout=dout[:, :, 1:]), r"dout has shape \[1, 2, 7, 8\]"),
        ("a planned backward's mask over 3 keys of 8", "backward_planned", backward_planned,
         dict(mask=torch.ones(1, 1, 8, 3, dtype=torch.bool)), r"mask has shape \[1, 1, 8, 3\]"),
        ("a planned forward's key ranges past the last key", "forward_planned", forward_planned,
         dict(key_ranges=ranges + 1), "key_ranges holds"),
        ("a keep-scale tile not contiguous", "dropout_keep_scale", keep, dict(out=torch.empty(1, 3, 8, 8).transpose(2, 3)),
         "out must be contiguous"),
        ("a keep-scale tile of float16", "dropout_keep_scale", keep, dict(out=torch.empty(1, 3, 8, 8, dtype=torch.float16)),
         "out must be float32 or float64"),
        ("a keep-scale tile from row -1", "dropout_keep_scale", keep, dict(row_start=-1), "row_start is -1"),
        ("a 3-D keep-scale tile", "dropout_keep_scale", keep, dict(out=torch.empty(3, 8, 8)), "out must be 4-D"),
        ("a keep-scale threshold below 0", "dropout_keep_scale", keep, dict(threshold=-1), "threshold is -1"),
        ("a keep-scale tile from key 2^31 + 1", "dropout_keep_scale", keep, dict(key_start=(1 << 31) + 1),
         "key_start is 2147483649"),
    ]


@pytest.mark.parametrize("case", _tiles_calls(), ids=lambda case: case[0] if isinstance(case, tuple) else None)
def test_the_compiled_tiles_check_every_tensor(case):
    """Below the ops: each of the compiled tiles' ops (torch.ops.attngrad_tiles), handed a
    tensor of the wrong shape, dtype or layout or an option out of range, refuses the call
    with a RuntimeError naming the argument and the shapes, before it reads or writes any
    tensor; the good call runs."""
    _, name, good, change, fragment = case
    op = getattr(_tiles_ops(), name)
    op(**good)
    with pytest.raises(RuntimeError, match=f"attngrad_tiles.{name}: .*{fragment}"):
        op(**{**good, **change})



def test_pass_inputs_name_every_passs_inputs():
    """`call.PassInputs`, the type of what every backend's pass takes by name, holds each
    input `call.PASSES` lists and the two `dispatch` may add, and nothing else."""
    from attngrad.torch.op.call import PASS_FIELDS, PASSES, PassInputs

    named = {field.name for field in PASS_FIELDS}
    assert {name for p in PASSES.values() for name in p.inputs} <= named
    assert set(PassInputs.__annotations__) == named | {"row_sums", "sink_rows"}


@pytest.mark.parametrize("variant", ["plain", "all", "sinks-bias", "blocks"])
def test_opcheck_the_whole_call_operators(variant):
    """`attngrad::attention` (a whole differentiable call, what Dynamo's graphs hold) and
    `attngrad::attention_in_graph` (the forward a graph keeps where nothing differentiated
    it): schema, fakes against the real results, the autograd kernel's registration, and
    AOT dispatch (forward and backward through the operator's kernels) on the first."""
    from attngrad.torch.op import traced_op

    args, kwargs = _call_args(variant, "contiguous")[0]
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(traced_op.OP, args, kwargs, test_utils=utils[:3] + utils[3:] * (variant == "all"))
    torch.library.opcheck(traced_op.IN_GRAPH, args, kwargs, test_utils=("test_schema", "test_faketensor"))


def test_a_function_takes_the_call_as_its_options_and_its_tensors():
    """What an autograd Function keeps on its ctx (`AttentionCall.options`) holds no tensor,
    and the call comes back whole from it and the tensors autograd hands back, every
    optional tensor included (a sink, a mask kept per block)."""
    from attngrad.torch.op.call import TENSOR_SLOTS, AttentionCall

    for variant in ("all", "sinks-bias", "blocks"):
        fields, extra = _call_args(variant, "contiguous")[0]
        call = AttentionCall.from_fields({**op.DEFAULTS, **dict(zip(op.CALL_NAMES, fields)), **extra})
        slots = call.tensor_slots()
        assert len(slots) == len(TENSOR_SLOTS) and call.options().tensors() == ()
        assert all(getattr(call.options(), name, None) is None for name in ("q", "k", "v", "seed"))
        again = call.options().with_tensors(slots)
        assert again.fields().keys() == call.fields().keys()
        for name, value in call.fields().items():
            assert again.fields()[name] is value, (variant, name)
