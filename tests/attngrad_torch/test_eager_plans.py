"""Plans of repeated eager calls (attngrad.torch.eager_plans): the same bits as the full path,
forward and backward, made once per signature, never where something but reverse mode could
differentiate or see the call."""

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attngrad.torch import attention, eager_plans, scaled_dot_product_attention, use_backend  # noqa: E402
from attngrad.torch.arguments import ATTENTION  # noqa: E402
from attngrad.torch.backends.cpu_tiles import native  # noqa: E402
from attngrad.torch.op import dispatch  # noqa: E402

from ..conftest import EXACT, rel_err  # noqa: E402
from .conftest import full_path, math_sdpa  # noqa: E402

needs_tiles = pytest.mark.skipif(native.library() is None, reason=f"no compiled tiles: {native.build_info.reason}")


@pytest.fixture(autouse=True)
def _fresh_plans(fresh_plans):
    pass


def _count_builds(monkeypatch) -> list:
    builds = []
    build = eager_plans.build_call

    def counting(*args, **kwargs):
        builds.append(1)
        return build(*args, **kwargs)

    monkeypatch.setattr(eager_plans, "build_call", counting)
    return builds


# inputs of any rank: (shape of q, of k) with v like k; broadcast batch and heads, GQA
SHAPES = [((5, 8), (7, 8)), ((3, 5, 8), (3, 7, 8)), ((2, 4, 5, 8), (2, 2, 7, 8)), ((2, 3, 4, 5, 8), (1, 3, 1, 7, 8)),
          ((2, 4, 1, 8), (2, 4, 300, 8))]


@needs_tiles
@settings(max_examples=40, deadline=None)
@given(shapes=st.sampled_from(SHAPES), dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
       is_causal=st.sampled_from([False, True, "bottom_right", 2, -1]), scale=st.sampled_from([None, 0.3]),
       transposed=st.booleans(), seed=st.integers(0, 2**16))
def test_a_plan_gives_the_full_paths_bits(shapes, dtype, is_causal, scale, transposed, seed):
    """Across ranks, GQA, broadcast axes, dtypes, causal diagonals, scales and transposed
    (non-contiguous) inputs: the planned call equals the full path's bit for bit, at its
    first call and from its plan; float64 holds against PyTorch's math path."""
    q_shape, k_shape = shapes
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in (q_shape, k_shape, k_shape))
    if transposed:  # the same values, laid out with L and E swapped
        q, k, v = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v))
    gqa = len(q_shape) >= 3 and q_shape[-3] != k_shape[-3]
    options = dict(is_causal=is_causal, scale=scale, enable_gqa=gqa)
    with torch.no_grad():
        first, planned = attention(q, k, v, **options), attention(q, k, v, **options)
        full = full_path(q, k, v, **options)
    assert first.shape == full.shape and first.dtype == full.dtype
    assert torch.equal(first, full) and torch.equal(planned, full)
    if dtype == torch.float64 and is_causal in (False, True):
        ref = math_sdpa(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)
        assert rel_err(planned, ref) < EXACT


@needs_tiles
def test_a_signature_is_planned_once_and_counted(monkeypatch):
    """The first call of a signature builds its call, later ones run the plan alone; each
    is counted in dispatch.ran; new sizes, strides, options or dtypes are new signatures."""
    builds = _count_builds(monkeypatch)
    q, k, v = (torch.randn(2, 4, n, 16) for n in (1, 40, 40))
    before = dispatch.ran[("forward", "tiles")]
    with torch.no_grad():
        for _ in range(3):
            scaled_dot_product_attention(q, k, v)
        assert len(builds) == 1
        assert dispatch.ran[("forward", "tiles")] - before == 3
        scaled_dot_product_attention(q, k[:, :, :30], v[:, :, :30])  # other sizes
        scaled_dot_product_attention(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v)  # other strides
        scaled_dot_product_attention(q, k, v, scale=0.5)
        scaled_dot_product_attention(q.double(), k.double(), v.double())
        attention(q, k, v, is_causal=1)  # True == 1, but another diagonal
        attention(q, k, v, is_causal=True)
        attention(q, k, v, is_causal=True, attn_mask=None, dropout_p=0.0, window=None)  # defaults: the same plan
    assert len(builds) == 7
    assert eager_plans.KEYED < ATTENTION.names


@needs_tiles
def test_a_plan_follows_the_backends_and_their_settings(monkeypatch, tuned):
    """use_backend, a change of the registry and the tiles' block sizes make a new
    signature: the plan never runs a backend that is not allowed, nor stale blocks, and
    neither does the tiles' fast entry (which the first call published): the override's
    plan publishes an entry of its own."""
    builds = _count_builds(monkeypatch)
    q, k, v = (torch.randn(1, 2, n, 16) for n in (3, 40, 40))
    with torch.no_grad():
        scaled_dot_product_attention(q, k, v)
        before = dispatch.ran[("forward", "torch-ops")]
        with use_backend("torch-ops"):
            scaled_dot_product_attention(q, k, v)
            scaled_dot_product_attention(q, k, v)
        assert dispatch.ran[("forward", "torch-ops")] - before == 2
        tuned(native.TILING, block_keys=8)
        recorded, original = [], native._planned_options
        monkeypatch.setattr(native, "_planned_options", lambda call, layout: recorded.append(native._options(
            call, layout)) or original(call, layout))
        scaled_dot_product_attention(q, k, v)
    assert recorded and recorded[0]["block_keys"] == 8
    assert len(builds) == 3 and native.fast_entry().published() == 2


@needs_tiles
@settings(max_examples=25, deadline=None)
@given(shapes=st.sampled_from(SHAPES), dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
       is_causal=st.sampled_from([False, True, "bottom_right", 2]), transposed=st.booleans(),
       grads=st.sampled_from(["qkv", "q", "kv"]), seed=st.integers(0, 2**16))
def test_a_differentiated_plan_gives_the_full_paths_bits(shapes, dtype, is_causal, transposed, grads, seed):
    """Inputs that require grad run the plan's forward and backward (`_Planned`): the output
    and every gradient equal the full path's bit for bit, at the first call and from the
    plan, for upstream gradients of any layout; float64 against PyTorch's math path."""
    q_shape, k_shape = shapes
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in (q_shape, k_shape, k_shape))
    if transposed:
        q, k, v = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v))
    gqa = len(q_shape) >= 3 and q_shape[-3] != k_shape[-3]
    options = dict(is_causal=is_causal, enable_gqa=gqa)
    wanted = [t for name, t in zip("qkv", (q, k, v)) if name in grads]
    for t in wanted:
        t.requires_grad_()
    dout = torch.randn(q_shape, generator=g, dtype=torch.float64).to(dtype).transpose(-1, -2).contiguous() \
        .transpose(-1, -2)  # a non-contiguous upstream gradient
    eager_plans.clear()  # hypothesis's examples share the test's fixture
    before = dispatch.ran[("backward", "tiles")]
    results = []
    for run in (attention, attention, full_path):
        out = run(q, k, v, **options)
        results.append((out.detach(), *torch.autograd.grad(out, wanted, dout)))
    assert dispatch.ran[("backward", "tiles")] - before == 3
    assert len(eager_plans._plans) == 1
    first, planned, full = results
    for a, b, c in zip(first, planned, full):
        assert torch.equal(a, c) and torch.equal(b, c)
    if dtype == torch.float64 and is_causal in (False, True):
        leaves = [t.detach().requires_grad_() for t in wanted]
        byname = dict(zip([n for n in "qkv" if n in grads], leaves))
        ref = math_sdpa(byname.get("q", q), byname.get("k", k), byname.get("v", v), is_causal=is_causal,
                        enable_gqa=gqa)
        for ours, theirs in zip(planned, (ref.detach(), *torch.autograd.grad(ref, leaves, dout))):
            assert rel_err(ours, theirs) < EXACT


@needs_tiles
def test_a_planned_backward_differentiated_again_takes_the_full_paths():
    """create_graph: the gradients are differentiated once more (a gradient penalty), through
    the full path's backward, equal to it bit for bit."""
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64, requires_grad=True) for n in (5, 7, 7))
    w = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    results = []
    for run in (attention, attention, full_path):
        grads = torch.autograd.grad((run(q, k, v, is_causal=True) * w).sum(), (q, k, v), create_graph=True)
        results.append(torch.autograd.grad(sum(g.square().sum() for g in grads), (q, k, v)))
    for a, b, c in zip(*results):
        assert torch.equal(a, c) and torch.equal(b, c)
    assert type(attention(q, k, v).grad_fn).__name__ == "_PlannedBackward"


@needs_tiles
def test_no_plan_where_something_could_differentiate_or_see_the_call():
    """A forward-mode level, torch.func transforms, a function mode, masks and dropout take
    the full path: the plan cache stays empty."""
    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64) for n in (3, 5, 5))
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q, torch.ones_like(q))
        tangent = torch.autograd.forward_ad.unpack_dual(scaled_dot_product_attention(dual, k, v)).tangent
        assert tangent is not None
    torch.func.jvp(lambda x: scaled_dot_product_attention(x, k, v), (q,), (torch.ones_like(q),))
    torch.func.vmap(lambda x: scaled_dot_product_attention(x, k, v))(q[None].expand(3, *q.shape))

    class Seen(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        with Seen():
            scaled_dot_product_attention(q, k, v)
        scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        attention(q, k, v, softcap=5.0)
        attention(q, k, v, key_padding=torch.zeros(2, 5, dtype=torch.bool))
    learned = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)  # its gradient: the full path's
    assert scaled_dot_product_attention(q, k, v, attn_mask=learned).grad_fn is not None
    assert len(eager_plans._plans) == 0


MASK_SHAPES = [(5, 7), (1, 1, 5, 7), (2, 1, 5, 7), (2, 4, 5, 7), (2, 4, 1, 7)]  # broadcast to (2, 4, 5, 7)


@needs_tiles
@settings(max_examples=30, deadline=None)
@given(mask_shape=st.sampled_from(MASK_SHAPES), boolean=st.booleans(), expanded=st.booleans(),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]), grads=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_masked_plan_gives_the_full_paths_bits(mask_shape, boolean, expanded, dtype, grads, seed):
    """A boolean or float attn_mask, broadcast or expanded (stride 0), through
    scaled_dot_product_attention's plan: output and gradients equal the full path's bit for
    bit, from the plan; float64 against PyTorch's math path. A new mask of the same
    signature, or the same mask written in place, gives its own result: its tile map and
    key ranges are its own (the plan is made on a mask that masks nothing)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 4, n, 8, generator=g, dtype=torch.float64).to(dtype) for n in (5, 7, 7))
    for t in (q, k, v):
        t.requires_grad_(grads)
    keep = torch.rand(mask_shape, generator=g) > 0.4
    keep[..., 0] = True  # every row sees a key: PyTorch's math path gives NaN where none
    mask = keep if boolean else torch.where(keep, torch.randn(mask_shape, generator=g, dtype=torch.float64),
                                            -torch.inf).to(dtype)
    base = mask
    if expanded:
        mask = mask.expand(2, 4, 5, 7)
    dout = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64).to(dtype)
    eager_plans.clear()

    def run(fn, m):
        out = fn(q, k, v, attn_mask=m)
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout)) if grads else (out,)

    def full(query, key, value, attn_mask):
        name = "attn_mask" if attn_mask.dtype == torch.bool else "attn_bias"
        return full_path(query, key, value, **{name: attn_mask})

    whole = torch.ones_like(base) if boolean else torch.zeros_like(base)  # every tile taken without the mask
    whole = whole.expand(2, 4, 5, 7) if expanded else whole
    assert all(torch.equal(a, b) for a, b in zip(run(scaled_dot_product_attention, whole), run(full, whole)))
    first, planned, reference = run(scaled_dot_product_attention, mask), run(scaled_dot_product_attention, mask), \
        run(full, mask)
    assert len(eager_plans._plans) == 1
    for a, b, c in zip(first, planned, reference):
        assert torch.equal(a, c) and torch.equal(b, c)
    if dtype == torch.float64:
        math = run(math_sdpa, mask)
        for ours, theirs in zip(planned, math):
            assert rel_err(ours, theirs) < EXACT
    other = base.flip(-1).clone()  # the same signature, other values
    other = other.expand(2, 4, 5, 7) if expanded else other
    assert all(torch.equal(a, b) for a, b in zip(run(scaled_dot_product_attention, other), run(full, other)))
    saved = base.clone()
    with torch.no_grad():
        base.copy_(torch.ones_like(base) if boolean else torch.zeros_like(base))  # every tile taken whole
    assert all(torch.equal(a, b) for a, b in zip(run(scaled_dot_product_attention, mask), run(full, mask)))
    with torch.no_grad():
        base.copy_(saved)  # an in-place write: its version moves on, its tiles masked again
    assert all(torch.equal(a, b) for a, b in zip(run(scaled_dot_product_attention, mask), run(full, mask)))
    assert len(eager_plans._plans) == 1


@needs_tiles
def test_a_bad_call_raises_every_time_and_leaves_no_plan():
    """A call the checks refuse raises their error at every call, not only the first; an
    option of a type no signature takes (unhashable, say) gets the full path's error."""
    q, k, v = torch.randn(2, 3, 8), torch.randn(2, 4, 8), torch.randn(2, 5, 8)
    with torch.no_grad():
        for _ in range(2):
            with pytest.raises(ValueError, match="key and value must have the same length"):
                scaled_dot_product_attention(q, k, v)
        with pytest.raises(ValueError, match="is_causal must be True, False"):
            attention(q, k, k, is_causal=[1])
    assert len(eager_plans._plans) == 0


@needs_tiles
def test_a_plan_holds_no_tensor_and_the_cache_is_bounded():
    """A plan keeps sizes and options, never the tensors of the call that made it; the oldest
    signatures go first past KEPT."""
    q, k, v = (torch.randn(1, 2, n, 8) for n in (3, 6, 6))
    watched = weakref.ref(q)
    with torch.no_grad():
        scaled_dot_product_attention(q, k, v)
    scaled_dot_product_attention(q.requires_grad_(), k, v).sum().backward()  # a differentiated plan
    scaled_dot_product_attention(q, k, v).sum().backward()
    del q
    gc.collect()
    assert watched() is None
    with torch.no_grad():
        for length in range(1, eager_plans.KEPT + 6):
            scaled_dot_product_attention(torch.randn(1, 2, length, 8), k, v)
    assert len(eager_plans._plans) == eager_plans.KEPT


@needs_tiles
@pytest.mark.parametrize("masked", [False, True])
def test_a_plans_bits_do_not_depend_on_the_thread_count(masked):
    """The planned ops (forward_planned, backward_planned) on 1, 2 and 4 threads, with and
    without a mask: output and gradients bit-equal, at sizes whose backward splits its keys
    into chunks."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, n, 32, generator=g, requires_grad=True) for n in (300, 700, 700))
    dout = torch.randn(2, 2, 300, 32, generator=g)
    mask = torch.rand(2, 1, 300, 700, generator=g) > 0.3 if masked else None
    threads, results = torch.get_num_threads(), {}
    try:
        for count in (1, 2, 4):
            torch.set_num_threads(count)
            out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
            results[count] = (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))
    finally:
        torch.set_num_threads(threads)
    assert type(out.grad_fn).__name__ == "_PlannedBackward"
    for count in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(results[1], results[count])), count
