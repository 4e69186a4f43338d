"""The tiles' fast entry (csrc/fast_entry.cpp, `eager_plans.unmasked`): a repeated unmasked
forward that nothing differentiates, found by its own arguments in C++ and run by the planned
op. The same bits as the full path, counted, and never used where anything but plain eager
evaluation could see the call (a changed dispatch state: test_eager_plans)."""

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attngrad.torch import (  # noqa: E402
    MultiheadAttention,
    attention,
    eager_plans,
    scaled_dot_product_attention,
)
from attngrad.torch.backends.cpu_tiles import native  # noqa: E402
from attngrad.torch.op import dispatch  # noqa: E402

from ....conftest import EXACT, rel_err  # noqa: E402
from ...conftest import full_path, math_sdpa  # noqa: E402

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no compiled tiles: {native.build_info.reason}")


@pytest.fixture(autouse=True)
def _fresh_plans(fresh_plans):
    pass


@pytest.fixture
def served(monkeypatch) -> list:
    """The calls the fast entry served (its forward returned an output), as they happen."""
    calls = []

    def spy(*arguments):
        out = fast(*arguments)
        if out is not None:
            calls.append(arguments[3:6])
        return out

    fast = None
    original = eager_plans._publish

    def publishing(*arguments):
        nonlocal fast
        original(*arguments)
        if eager_plans._fast is not None and eager_plans._fast is not spy:
            fast = eager_plans._fast
            spy.clear = fast.clear
            monkeypatch.setattr(eager_plans, "_fast", spy)

    monkeypatch.setattr(eager_plans, "_publish", publishing)
    return calls


@settings(max_examples=40, deadline=None)
@given(heads=st.sampled_from([(1, 1), (4, 4), (4, 2)]), lengths=st.sampled_from([(1, 16), (5, 7), (40, 300)]),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]),
       is_causal=st.booleans(), scale=st.sampled_from([None, 0.3]), layout=st.sampled_from(["contiguous", "bhle",
                                                                                            "transposed"]),
       seed=st.integers(0, 2**16))
def test_a_served_call_gives_the_full_paths_bits(heads, lengths, dtype, is_causal, scale, layout, seed):
    """B=2, H > 1 and GQA, Lq != Lk, every floating dtype, is_causal, a scale, and inputs
    laid out as a model's projections make them ((B, L, H, E) transposed) or with L and E
    swapped: the fast entry's output equals the full path's bit for bit, in the inputs'
    dtype; float64 holds against PyTorch's math path; each call is counted."""
    (h, h_kv), (lq, lk) = heads, lengths
    g = torch.Generator().manual_seed(seed)
    sizes = ((2, h, lq, 16), (2, h_kv, lk, 16), (2, h_kv, lk, 16))
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in sizes)
    if layout == "bhle":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    elif layout == "transposed":
        q, k, v = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v))
    options = dict(is_causal=is_causal, scale=scale, enable_gqa=h != h_kv)
    eager_plans.clear()  # hypothesis's examples share the fixture
    with torch.no_grad():
        scaled_dot_product_attention(q, k, v, **options)  # makes the plan and publishes it
        before = dispatch.ran[("forward", "tiles")]
        fast = eager_plans.unmasked(q, k, v, **options)
        assert fast is not None and dispatch.ran[("forward", "tiles")] == before + 1
        full = full_path(q, k, v, **options)
    assert fast.dtype == dtype and fast.shape == full.shape and torch.equal(fast, full)
    if dtype == torch.float64:
        assert rel_err(fast, math_sdpa(q, k, v, **options)) < EXACT


def test_the_entry_serves_only_what_plain_eager_evaluation_would_see(served):
    """Once published: reverse mode tracking an input, a forward-mode level, torch.func's
    jvp, vmap and grad, a function mode, a dispatch mode, torch.compile and a tensor
    subclass all take the Python path, and get their right results there; torch.jit.trace,
    which would hold the call as a constant, is refused by name."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64) for n in (5, 7, 7))
    t = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64)
    with torch.no_grad():
        expected = scaled_dot_product_attention(q, k, v)
        assert torch.equal(scaled_dot_product_attention(q, k, v), expected) and len(served) == 1
    tracked = q.clone().requires_grad_()
    out = scaled_dot_product_attention(tracked, k, v)
    assert out.grad_fn is not None and torch.equal(out.detach(), expected)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q, t)
        assert torch.autograd.forward_ad.unpack_dual(scaled_dot_product_attention(dual, k, v)).tangent is not None
    _, tangent = torch.func.jvp(lambda x: scaled_dot_product_attention(x, k, v), (q,), (t,))
    assert tangent.abs().sum() > 0
    batched = torch.func.vmap(lambda x: scaled_dot_product_attention(x, k, v))(q[None].expand(2, *q.shape))
    assert torch.equal(batched[0], expected)
    torch.func.grad(lambda x: scaled_dot_product_attention(x, k, v).sum())(q)

    class Seen(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    class Dispatched(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        pass

    seen = []
    with torch.no_grad():
        with Seen():
            scaled_dot_product_attention(q, k, v)
        with Dispatched():
            scaled_dot_product_attention(q, k, v)
        assert len(seen) >= 2
        compiled = torch.compile(scaled_dot_product_attention, backend="eager", fullgraph=True)
        assert torch.equal(compiled(q, k, v), expected)
        layer = MultiheadAttention(8, 2, batch_first=True).double()
        for entry in (scaled_dot_product_attention, attention, layer):  # refused by name, not traced into a constant
            name = getattr(entry, "__name__", type(entry).__name__)
            with pytest.warns(DeprecationWarning, match="torch.jit.trace` is deprecated"), \
                    pytest.raises(NotImplementedError, match=f"attngrad's {name} does not run under torch.jit.trace"):
                torch.jit.trace(lambda *x: entry(*x), (q, k, v), check_trace=False)
        assert torch.equal(scaled_dot_product_attention(q.as_subclass(Sub), k, v).as_subclass(torch.Tensor), expected)
    assert len(served) == 1


def test_the_entry_checks_its_tensors_itself():
    """A functorch-wrapped tensor handed straight to the entry (a transform's, which Python
    would have kept away) is refused in C++, and publish names what it takes."""
    q, k, v = (torch.randn(1, 2, n, 8) for n in (3, 6, 6))
    with torch.no_grad():
        scaled_dot_product_attention(q, k, v)
    entry = native.fast_entry()
    assert entry.forward(q, k, v, False, None, False, dispatch.state()) is not None
    assert entry.forward(q, k, v, True, None, False, dispatch.state()) is None  # not published
    results = []
    torch.func.vmap(lambda x: results.append(entry.forward(x, k, v, False, None, False, dispatch.state())) or x)(
        q[None].expand(2, *q.shape))
    assert results == [None]
    with pytest.raises(RuntimeError, match="plain 4-D CPU tensors of one floating dtype"):
        entry.publish(q[0], k[0], v[0], False, None, False, 0, torch.zeros(1, 1, 2, dtype=torch.int64),
                      torch.zeros(19, dtype=torch.int64))


@pytest.mark.parametrize("is_causal", [False, True])
def test_a_served_calls_bits_do_not_depend_on_the_thread_count(served, is_causal):
    """The entry's forward on 1, 2 and 4 threads, at sizes of several query blocks and key
    chunks: bit-equal outputs, every one served by the entry."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, n, 32, generator=g).transpose(1, 2).contiguous().transpose(1, 2)
               for n in (300, 700, 700))
    threads, outputs = torch.get_num_threads(), []
    try:
        with torch.no_grad():
            scaled_dot_product_attention(q, k, v, is_causal=is_causal)  # publishes
            for count in (1, 2, 4):
                torch.set_num_threads(count)
                outputs.append(scaled_dot_product_attention(q, k, v, is_causal=is_causal))
    finally:
        torch.set_num_threads(threads)
    assert len(served) == 3
    assert all(torch.equal(outputs[0], out) for out in outputs[1:])


def test_the_table_is_bounded_and_cleared_with_the_plans():
    k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    with torch.no_grad():
        for length in range(1, eager_plans.KEPT + 6):
            scaled_dot_product_attention(torch.randn(1, 2, length, 8), k, v)
    assert native.fast_entry().published() == eager_plans.KEPT
    eager_plans.clear()
    assert native.fast_entry().published() == 0 and eager_plans._fast is None
