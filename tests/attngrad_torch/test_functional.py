"""attngrad.torch.scaled_dot_product_attention against PyTorch's math backend."""

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from attngrad.torch import attention as capped_attention  # noqa: E402
from attngrad.torch import scaled_dot_product_attention  # noqa: E402
from attngrad.torch.backends.cpu_tiles import native  # noqa: E402
from attngrad.torch.backends.torch_ops import first_order  # noqa: E402
from attngrad.torch.op import dropout  # noqa: E402

from ..conftest import EXACT, rel_err  # noqa: E402
from .conftest import math_sdpa, op_attention  # noqa: E402


def make(batch=2, heads=4, kv_heads=None, len_q=13, len_k=21, dim=8, dim_v=6, dtype=torch.float64):
    kv_heads = heads if kv_heads is None else kv_heads
    g = torch.Generator().manual_seed(1)
    return (
        torch.randn(batch, heads, len_q, dim, generator=g, dtype=dtype, requires_grad=True),
        torch.randn(batch, kv_heads, len_k, dim, generator=g, dtype=dtype, requires_grad=True),
        torch.randn(batch, kv_heads, len_k, dim_v, generator=g, dtype=dtype, requires_grad=True),
    )


def assert_matches_math(q, k, v, attn_mask=None, **options):
    leaves = [q, k, v] + ([attn_mask] if attn_mask is not None and attn_mask.requires_grad else [])
    out = scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **options)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref = math_sdpa(q, k, v, attn_mask=attn_mask, **options)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    assert rel_err(out, ref) < EXACT
    for ours, theirs in zip(grads, ref_grads):
        assert ours.shape == theirs.shape
        assert rel_err(ours, theirs) < EXACT
    return out, grads


@pytest.mark.parametrize("len_q,len_k", [(13, 21), (21, 13), (16, 16), (1, 5)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_math_backend(many_blocks, backend, len_q, len_k, is_causal):
    assert_matches_math(*make(len_q=len_q, len_k=len_k), is_causal=is_causal)


@pytest.mark.parametrize("shape", [(2, 4, 13, 21), (2, 1, 13, 21), (13, 21), (4, 1, 21), (1, 4, 13, 21)])
def test_float_mask_gradient_is_reduced_to_its_shape(many_blocks, shape):
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    assert_matches_math(*make(), attn_mask=bias)


def test_boolean_mask_and_gqa(many_blocks):
    q, k, v = make(heads=6, kv_heads=2)
    mask = torch.rand(2, 1, 13, 21, generator=torch.Generator().manual_seed(3)) > 0.3
    assert_matches_math(q, k, v, attn_mask=mask, enable_gqa=True)
    assert_matches_math(q, k, v, is_causal=True, enable_gqa=True, scale=0.3)


def test_three_dimensional_inputs(many_blocks):
    q, k, v = (t[:, 0].detach().requires_grad_() for t in make())
    assert_matches_math(q, k, v, is_causal=True)


def test_fully_masked_rows_give_zero_and_no_nan(many_blocks):
    q, k, v = make()
    mask = torch.ones(2, 4, 13, 21, dtype=torch.bool)
    mask[0, 1, 5] = False
    mask[1] = False
    bias = torch.zeros(2, 4, 13, 21, dtype=torch.float64)
    bias[0, 2, 7] = float("-inf")
    bias.requires_grad_()
    for attn_mask in (mask, bias):
        out = scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        grads = torch.autograd.grad(out, [q, k, v], torch.randn_like(out))
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    out, grads = assert_matches_math(q, k, v, attn_mask=mask)
    assert (out[0, 1, 5] == 0).all() and (out[1] == 0).all() and (grads[0][1] == 0).all()


def test_gradcheck_float64(backend):
    q, k, v = make(batch=1, heads=2, len_q=4, len_k=5, dim=3, dim_v=2)
    bias = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: scaled_dot_product_attention(*t[:3], attn_mask=t[3]), (q, k, v, bias))
    assert torch.autograd.gradcheck(lambda *t: scaled_dot_product_attention(*t, is_causal=True), (q, k, v))


def _keep_mask(batch, heads, len_q, len_k, seed, dropout_p):
    """The keep-mask the kernels draw from the same seed: one entry per (b, h, i, j),
    whatever their blocks."""
    return dropout.keep_scale_into(torch.empty(batch, heads, len_q, len_k, dtype=torch.float64), seed, 0, dropout_p) > 0


@pytest.mark.parametrize("is_causal", [False, True])
def test_dropout_is_exact_with_the_regenerated_mask(many_blocks, is_causal):
    """The mask is never stored: the backward regenerates it. Rebuilt here from the same seed,
    PyTorch's math kernel with that mask gives the same output and gradients."""
    q, k, v = make()
    p, seed = 0.3, 12345
    seed_t = torch.tensor(seed)
    out = op_attention(q, k, v, seed=seed_t, causal=0 if is_causal else None, scale=8**-0.5, dropout_p=p)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v], dout)
    keep = _keep_mask(2, 4, 13, 21, seed, p)
    ref, _ = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, None, p, is_causal, keep)
    ref_grads = torch.autograd.grad(ref, [q, k, v], dout)
    assert rel_err(out, ref) < EXACT
    for ours, theirs in zip(grads, ref_grads):
        assert rel_err(ours, theirs) < EXACT
    drawn = keep if not is_causal else keep[..., torch.ones(13, 21, dtype=torch.bool).tril()]  # the causal part
    assert 0.6 < drawn.float().mean() < 0.8  # P(keep) = 1 - p


def test_dropout_gradcheck_and_reproducibility():
    q, k, v = make(batch=1, heads=2, len_q=4, len_k=5, dim=3, dim_v=2)
    seed = torch.tensor(7)
    assert torch.autograd.gradcheck(lambda *t: op_attention(*t, seed=seed, scale=0.5, dropout_p=0.4), (q, k, v))
    torch.manual_seed(0)
    a = scaled_dot_product_attention(q, k, v, dropout_p=0.4)
    b = scaled_dot_product_attention(q, k, v, dropout_p=0.4)
    torch.manual_seed(0)
    c = scaled_dot_product_attention(q, k, v, dropout_p=0.4)
    assert torch.equal(a, c) and not torch.equal(a, b)


def test_deterministic_bits(many_blocks):
    q, k, v = make(dtype=torch.float32)
    bias = torch.randn(13, 21, requires_grad=True)
    runs = []
    for _ in range(2):
        out = scaled_dot_product_attention(q, k, v, attn_mask=bias)
        runs.append((out, *torch.autograd.grad(out.square().sum(), [q, k, v, bias])))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def normwise_err(ours, ref) -> float:
    """||ours - ref|| / ||ref||, Frobenius: the error of the whole tensor."""
    return float(((ours - ref).norm() / ref.norm()).detach())


def test_float32_error_is_below_pytorchs_default_backend():
    """B=2, H=4, L=1024, d=64: error against the float64 truth, ours beside PyTorch's flash kernel.

    The bar (issue 4) holds in the normwise error of every tensor: ours no larger than
    PyTorch's (0.76-0.94x of it over 8 seeds, full and causal; here the compiled tiles run).
    The forward's 128-key value slices are what bring the output below. The largest single-entry error is a noisier
    figure, where each kernel wins about half the time; within 1.5x is asserted for it.
    """
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 1024, 64, generator=g, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(2, 4, 1024, 64, generator=g, dtype=torch.float64)
    for is_causal in (False, True):
        errors = {}
        for name, fn, dtype in (("truth", math_sdpa, torch.float64), ("ours", scaled_dot_product_attention, torch.float32),
                                ("torch", F.scaled_dot_product_attention, torch.float32)):
            leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
            out = fn(*leaves, is_causal=is_causal)
            grads = torch.autograd.grad(out, leaves, dout.to(dtype))
            errors[name] = (out.double(), *(gr.double() for gr in grads))
        for i, tensor in enumerate(("out", "dq", "dk", "dv")):
            truth, ours, theirs = errors["truth"][i], errors["ours"][i], errors["torch"][i]
            assert normwise_err(ours, truth) <= normwise_err(theirs, truth), (is_causal, tensor)
            assert rel_err(ours, truth) <= 1.5 * rel_err(theirs, truth), (is_causal, tensor)


# (Lq, Lk, d, H, Hkv, the float mask's shape), from benchmarks/float32_mask_grads.py's random draw
FLOAT32_MASK_CASES = {
    # one number per key: dmask sums B H Lq = 8544 entries of dS each
    "per-key": (534, 267, 32, 8, 2, (267,)),
    # a whole mask over two keys: dq and dmask from dP - D, where D's rounding shows
    "two-keys": (409, 2, 128, 4, 4, (2, 4, 409, 2)),
    # per head and key, GQA's 8 heads on one key/value head: dmask sums Lq entries
    "per-head-key": (334, 65, 40, 8, 1, (8, 1, 65)),
    # ALiBi (flash-attn's tests' slopes, no causal), rows over two of the tiles' key blocks:
    # the tiles took D = rowsum(dO O) there, and dmask was 1.64x PyTorch's error here (2.0002x
    # at the benchmark's draw); with each row in one key block (`Tiling.whole_row_keys`) 1.03x.
    # Held to 1.5x, so that the old way fails
    "alibi-gqa": (1024, 1023, 40, 8, 2, "alibi"),
}
FLOAT32_MASK_BARS = {"alibi-gqa": 1.5}


def alibi(heads: int, len_q: int, len_k: int) -> torch.Tensor:
    """(H, Lq, Lk): -slope_h |i + Lk - Lq - j|, slopes 2^(-8 (h + 1) / H)."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1, dtype=torch.float64) / heads)
    distance = (torch.arange(len_q)[:, None] + len_k - len_q - torch.arange(len_k)[None, :]).abs()
    return (-slopes[:, None, None] * distance).float()


@pytest.mark.parametrize("case", list(FLOAT32_MASK_CASES))
def test_float32_gradient_of_a_float_mask_is_within_twice_pytorchs_error(backend, case):
    """Issue 58: a float mask that requires grad, in float32. The error max|x - truth| /
    max|truth| against autograd of the definition in float64 on the same inputs, of out, dq
    and dmask, within 2x PyTorch's (its default SDPA, which runs the math path for such a
    mask on the CPU). Ours over PyTorch's here, before the fix -> after: tiles, per-key dmask
    6.46x -> 0.73x (summed one after another in float32 -> in double), per-head-key dmask
    2.0004x -> 0.48x; torch-ops, two-keys dq 1.73x -> 0.97x and dmask 2.45x -> 0.92x
    (D = rowsum(dO * O) -> rowsum(P dP)). The rest 0.46-1.18x on both."""
    len_q, len_k, dim, heads, kv_heads, mask_shape = FLOAT32_MASK_CASES[case]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, heads, len_q, dim, generator=g)
    k, v = (torch.randn(2, kv_heads, len_k, dim, generator=g) for _ in range(2))
    dout = torch.randn(2, heads, len_q, dim, generator=g)
    mask = alibi(heads, len_q, len_k) if mask_shape == "alibi" else torch.randn(mask_shape, generator=g)

    def definition(q, k, v, mask):
        groups = heads // kv_heads
        scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * dim**-0.5 + mask
        return torch.softmax(scores, dim=-1) @ v.repeat_interleave(groups, 1)

    results = {}
    for name, fn, dtype in (("truth", definition, torch.float64), ("torch", F.scaled_dot_product_attention, torch.float32),
                            ("ours", scaled_dot_product_attention, torch.float32)):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, mask)]
        out = fn(*leaves[:3], leaves[3]) if name == "truth" else fn(*leaves[:3], attn_mask=leaves[3], enable_gqa=True)
        dq, _, _, dmask = torch.autograd.grad(out, leaves, dout.to(dtype))
        results[name] = (out.double(), dq.double(), dmask.double())
    for i, tensor in enumerate(("out", "dq", "dmask")):
        truth, ours, theirs = results["truth"][i], results["ours"][i], results["torch"][i]
        bar = FLOAT32_MASK_BARS.get(case, 2.0) if tensor == "dmask" else 2.0
        assert rel_err(ours, truth) <= bar * rel_err(theirs, truth), (tensor, rel_err(ours, truth), rel_err(theirs, truth))


@pytest.mark.parametrize("len_k", [300, 1100])
def test_float32_probabilities_are_rounded_less_than_torch_softmax(len_k):
    """The float32 probabilities alone, from exact scores: with q = 0 the scores are the
    bias itself, and with V = I the output is P. The softmax's row sum l, kept in 16 float32
    lanes, rounded P about as much as torch.softmax does (0.97-1.03x its normwise error
    here); with 64 float32 partial sums added in double, 0.42-0.45x. 1100 keys: three key
    blocks, the sum rescaled between them."""
    if native.library() is None:
        pytest.skip(f"no compiled tiles: {native.build_info.reason}")
    g = torch.Generator().manual_seed(7)
    bias = 3 * torch.randn(3, 37, len_k, generator=g)
    q, k = torch.zeros(2, 3, 37, 16), torch.randn(2, 3, len_k, 16, generator=g)
    probs = scaled_dot_product_attention(q, k, torch.eye(len_k).expand(2, 3, len_k, len_k), attn_mask=bias)
    truth = torch.softmax(bias.double(), -1).expand(2, 3, 37, len_k)
    assert normwise_err(probs.double(), truth) <= 0.75 * normwise_err(torch.softmax(bias, -1).double(), truth[0])


@pytest.mark.parametrize("softcap,spread", [(50.0, 3.0), (5.0, 3.0), (1.0, 1.0)])
def test_softcap_float32_error_is_that_of_the_formula_in_pytorch(softcap, spread):
    """float32 soft-capped scores (the tiles' 16-lane tanh) against the float64 truth, beside
    the formula in PyTorch operators in float32: normwise error of out, dq, dk, dv within
    1.5x of PyTorch's (measured 0.84-1.25x at L=512, caps 1-50, inputs of spread 1-3)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (spread * torch.randn(2, 4, 256, 32, generator=g, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(2, 4, 256, 32, generator=g, dtype=torch.float64)
    future = torch.ones(256, 256, dtype=torch.bool).triu(1)

    def formula(q, k, v):
        scores = softcap * torch.tanh(q @ k.transpose(-1, -2) / (softcap * 32**0.5))
        return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v

    errors = {}
    for name, fn, dtype in (("truth", formula, torch.float64), ("torch", formula, torch.float32),
                            ("ours", lambda q, k, v: capped_attention(q, k, v, is_causal=True, softcap=softcap),
                             torch.float32)):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        errors[name] = (out.double(), *(gr.double() for gr in torch.autograd.grad(out, leaves, dout.to(dtype))))
    # The backward recomputes each score tile with the forward's own GEMM (same shape), so
    # its probabilities are the forward's: with the wider tiles it once used, MKL rounded the
    # scores apart on an Intel Xeon, and dq's error reached 4.9x with cap 50 (bars of 6x, 2.5x).
    bar = 1.5
    for tensor, truth, theirs, ours in zip(("out", "dq", "dk", "dv"), *errors.values()):  # as errors was filled
        assert normwise_err(ours, truth) <= bar * normwise_err(theirs, truth), tensor


def test_compiles_with_fullgraph():
    q, k, v = make(batch=1, heads=2, len_q=6, len_k=7, dim=4, dim_v=4)
    bias = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)

    def layer(q, k, v, bias):
        return scaled_dot_product_attention(q, k, v, attn_mask=bias).sin().sum()

    eager = torch.autograd.grad(layer(q, k, v, bias), [q, k, v, bias])
    traced = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert all(torch.equal(a, b) for a, b in zip(eager, torch.autograd.grad(traced(q, k, v, bias), [q, k, v, bias])))
    # the default backend, Inductor, generates C++ for the ops around ours (about 15 s here);
    # its sin() is its own, so the results agree to rounding rather than to the bit
    compiled = torch.compile(layer, fullgraph=True)
    assert all(rel_err(a, b) < EXACT for a, b in zip(torch.autograd.grad(compiled(q, k, v, bias), [q, k, v, bias]), eager))


def test_torch_func_grad_and_vjp():
    q, k, v = (t.detach() for t in make(batch=1, heads=2, len_q=5, len_k=6))

    def loss(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=True).square().sum()

    grads = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(loss(*leaves), leaves)
    assert all(rel_err(a, b) < EXACT for a, b in zip(grads, ref))
    out, pullback = torch.func.vjp(lambda q: scaled_dot_product_attention(q, k, v), q)
    assert rel_err(pullback(torch.ones_like(out))[0], torch.func.grad(lambda q: scaled_dot_product_attention(q, k, v).sum())(q)) < EXACT


@pytest.mark.parametrize(
    "kwargs,exc,fragment",
    [
        (dict(key=torch.randn(2, 4, 21, 5)), ValueError, "last dimension"),
        (dict(value=torch.randn(2, 4, 20, 6)), ValueError, "key and value"),
        (dict(key=torch.randn(2, 2, 21, 8), value=torch.randn(2, 2, 21, 6)), ValueError, "enable_gqa"),
        (dict(key=torch.randn(2, 3, 21, 8), value=torch.randn(2, 3, 21, 6)), ValueError, "4 heads but key/value 3"),
        (dict(key=torch.randn(3, 4, 21, 8), value=torch.randn(3, 4, 21, 6)), ValueError, "batch dimensions"),
        (dict(query=torch.randn(8)), ValueError, "at least 2 dimensions"),
        (dict(query=torch.randint(0, 3, (2, 4, 13, 8))), TypeError, "floating"),
        (dict(key=torch.randn(2, 4, 21, 8, dtype=torch.float64)), TypeError, "share a dtype"),
        (dict(key=torch.randn(2, 4, 21, 8, device="meta")), ValueError, "one device"),
        (dict(attn_mask=torch.zeros(3, 13, 21)), ValueError, "does not broadcast"),
        (dict(attn_mask=torch.zeros(13, 21, dtype=torch.int64)), TypeError, "boolean or floating"),
        (dict(attn_mask=torch.zeros(13, 21), is_causal=True), ValueError, "not both"),
        (dict(dropout_p=1.5), ValueError, "dropout_p"),
        (dict(attn_mask=torch.zeros(1, 2, 4, 13, 21)), ValueError, "does not broadcast"),
        (dict(attn_mask=[[True] * 21] * 13), TypeError, "attn_mask must be a torch.Tensor or a CausalBias"),
        (dict(is_causal="bottom_right"), TypeError, "is_causal must be a bool"),  # was read as top-left
        (dict(is_causal=1), TypeError, "is_causal must be a bool"),
        (dict(is_causal=None), TypeError, "is_causal must be a bool"),
    ],
)
def test_bad_input(kwargs, exc, fragment):
    args = dict(query=torch.randn(2, 4, 13, 8), key=torch.randn(2, 4, 21, 8), value=torch.randn(2, 4, 21, 6))
    args.update(kwargs)
    with pytest.raises(exc, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        scaled_dot_product_attention(**args)


@pytest.mark.parametrize("entry,name", [("scaled_dot_product_attention", "attn_mask"), ("attention", "attn_bias")])
def test_a_float_mask_of_the_wrong_shape_is_named_as_passed(entry, name):
    """scaled_dot_product_attention hands a float attn_mask on as attention()'s attn_bias:
    the error still names the argument its caller passed, with the shapes."""
    import attngrad.torch

    q, k, v = torch.randn(2, 4, 13, 8), torch.randn(2, 4, 21, 8), torch.randn(2, 4, 21, 6)
    expected = (f"{name} of shape (3, 13, 21) does not broadcast to the scores' shape (2, 4, 13, 21) "
                f"(query (2, 4, 13, 8), key (2, 4, 21, 8), value (2, 4, 21, 6))")
    with pytest.raises(ValueError) as raised:
        getattr(attngrad.torch, entry)(q, k, v, **{name: torch.zeros(3, 13, 21, requires_grad=True)})
    assert str(raised.value) == expected


def test_attention_entry_point_takes_mask_bias_and_causal_together(many_blocks):
    from attngrad.torch import attention

    q, k, v = make(heads=4, kv_heads=2)
    mask = torch.rand(2, 1, 13, 21, generator=torch.Generator().manual_seed(5)) > 0.2
    bias = torch.randn(4, 13, 21, dtype=torch.float64, requires_grad=True)
    out = attention(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True, enable_gqa=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v, bias], dout)
    allowed = mask & torch.ones(13, 21, dtype=torch.bool).tril()
    ref = math_sdpa(q, k, v, attn_mask=bias.masked_fill(~allowed, float("-inf")), enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, [q, k, v, bias], dout)
    assert rel_err(out, ref) < EXACT
    assert all(rel_err(a, b) < EXACT for a, b in zip(grads, ref_grads))
    with pytest.raises(TypeError, match="pass a float mask as attn_bias"):
        attention(q, k, v, attn_mask=bias)
    with pytest.raises(TypeError, match="attn_bias must be floating"):
        attention(q, k, v, attn_bias=mask)


def test_attention_shows_its_declared_options_and_names_an_unknown_one():
    """attention(query, key, value, **options) shows every declared option as a keyword-only
    parameter with its type and default (help, inspect), and an unknown name raises
    TypeError naming it, the nearest declared one and the rest, as Python would."""
    import inspect

    from attngrad.torch import attention
    from attngrad.torch.arguments import DEFAULTS, AttentionOptions

    parameters = inspect.signature(attention).parameters
    assert list(parameters)[:3] == ["query", "key", "value"]
    options = {name: p for name, p in parameters.items() if p.kind == inspect.Parameter.KEYWORD_ONLY}
    assert set(options) == set(AttentionOptions.__annotations__) == set(parameters) - {"query", "key", "value"}
    assert {name: p.default for name, p in options.items()} == {name: DEFAULTS.get(name) for name in options}
    assert options["is_causal"].default is False and options["attn_mask"].annotation is not inspect.Parameter.empty
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match=r"attention\(\) got an unexpected keyword argument 'attn_msk'\. "
                                        r"Did you mean 'attn_mask'\? It takes query, key, value and attn_mask, "):
        attention(q, q, q, attn_msk=None)  # None: the plain call's path checks it too
    with pytest.raises(TypeError, match="unexpected keyword argument 'causal'"):
        attention(q, q, q, causal=True)


@pytest.mark.parametrize("dtype,bar", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_half_precision_inputs_compute_in_float32(dtype, bar):
    """Inputs and outputs stay in their dtype; the blocks are computed in float32, so the
    error is the dtype's own rounding (fp16 eps 1e-3, bf16 eps 8e-3), not more."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in make())
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    grads = torch.autograd.grad(out, [q, k, v], torch.ones_like(out))
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    ref = math_sdpa(*(t.detach().double() for t in (q, k, v)), is_causal=True)
    assert rel_err(out.double(), ref) < bar


@pytest.mark.parametrize("heads", [1, 3])
def test_full_size_bias_gradient_with_causal_single_row_blocks(monkeypatch, heads, tuned):
    """A full-size bias's gradient is written block by block in place; with one head and
    one-row causal blocks the unseen keys of each row must still come back as 0."""
    from attngrad.torch import attention

    tuned(first_order.TILING, tile_elements=1, min_rows=1)
    q, k, v = make(batch=1, heads=heads, len_q=7, len_k=7)
    bias = torch.randn(1, heads, 7, 7, dtype=torch.float64, requires_grad=True)
    out = attention(q, k, v, attn_bias=bias, is_causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v, bias], dout)
    tri = torch.ones(7, 7, dtype=torch.bool).tril()
    ref = math_sdpa(q, k, v, attn_mask=bias.masked_fill(~tri, float("-inf")))
    ref_grads = torch.autograd.grad(ref, [q, k, v, bias], dout)
    assert all(rel_err(a, b) < EXACT for a, b in zip(grads, ref_grads))
    assert (grads[3][..., ~tri] == 0).all()


@pytest.mark.parametrize("shapes", [((2, 1), (3,)), ((), (4,)), ((1,), (1,)), ((5, 1, 3), (4, 1), (1,)), ((2,), (3,)),
                                    ((0,), (1,)), ((0,), (2,))])
def test_broadcast_shapes_is_pytorchs(shapes):
    from attngrad.torch.layout import broadcast_shapes

    try:
        expected = torch.broadcast_shapes(*shapes)
    except RuntimeError:
        with pytest.raises(RuntimeError):
            broadcast_shapes(*shapes)
    else:
        assert broadcast_shapes(*shapes) == expected
