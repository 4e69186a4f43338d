"""Every derivative under torch.compile: each transform crossed with eager, compiled,
compiled with fullgraph, and the transform of a compiled function, on every backend, against
the math path run the same way (float64, 1e-12).

A cell may raise only where the math path, run the same way, raises too (PyTorch's own
limit: a backward inside a fullgraph graph, double backward under compile). A cell that
returns must give the eager math path's numbers: never a zero tangent, never None.
"""

import contextlib
import math

import pytest

torch = pytest.importorskip("torch")
import torch.autograd.forward_ad as fwAD  # noqa: E402

from attngrad.torch import scaled_dot_product_attention, use_backend  # noqa: E402
from attngrad.torch.op import dispatch  # noqa: E402

from ...conftest import rel_err as error  # noqa: E402

BAR = 1e-12
COMPILE = "aot_eager"  # AOTAutograd's graphs run as they are: what differentiates them is under test


def math_attention(q, k, v, bias=None, is_causal=False):
    """The definition, in PyTorch operators (every derivative, any order)."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    if is_causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def attngrad_attention(q, k, v, bias=None, is_causal=False):
    return scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=is_causal)


def _backward(f, x, t, c):
    leaves = [a.detach().requires_grad_() for a in x]
    return torch.autograd.grad((f(*leaves) * c).sum(), leaves)


def _grad(f, x, t, c):
    return torch.func.grad(lambda *x: (f(*x) * c).sum(), argnums=tuple(range(len(x))))(*x)


def _jvp(f, x, t, c):
    return torch.func.jvp(f, x, t)


def _dual(f, x, t, c):
    with fwAD.dual_level():
        out = f(*(fwAD.make_dual(a, b) for a, b in zip(x, t)))
        return fwAD.unpack_dual(out)


def _hvp(f, x, t, c):
    return torch.func.jvp(torch.func.grad(lambda *x: (f(*x) * c).sum(), argnums=tuple(range(len(x)))), x, t)[1]


def _vjp_of_jvp(f, x, t, c):
    return torch.func.vjp(lambda *x: torch.func.jvp(f, x, t)[1], *x)[1](c)


def _vmap(f, x, t, c):
    return torch.func.vmap(lambda *x: f(*(a[None] for a in x))[0])(*x)


def _vmap_jacrev(f, x, t, c):
    q, *rest = x
    return torch.func.vmap(torch.func.jacrev(lambda q: f(q[None], *rest)[0]))(q)


def _hessian(f, x, t, c):
    q, *rest = x
    return torch.func.hessian(lambda q: (f(q, *rest) * c).sum())(q)


def _double_backward(f, x, t, c):
    leaves = [a.detach().requires_grad_() for a in x]
    grads = torch.autograd.grad((f(*leaves) * c).sum(), leaves, create_graph=True)
    return torch.autograd.grad(sum((g * b).sum() for g, b in zip(grads, t)), leaves)


TRANSFORMS = {"backward": _backward, "grad": _grad, "jvp": _jvp, "dual": _dual, "hvp": _hvp,
              "vjp_of_jvp": _vjp_of_jvp, "vmap": _vmap, "vmap_jacrev": _vmap_jacrev, "hessian": _hessian,
              "double_backward": _double_backward}
# fullgraph before compile: where a fullgraph graph is made, compile makes the same one,
# and runs only where fullgraph hits PyTorch's own limit (`_cells`)
MODES = ("eager", "fullgraph", "compile", "transform_of_compiled")


def _run(mode, transform, attention, x, t, c, options, backend=COMPILE):
    f = lambda *x: attention(*x, **options)  # noqa: E731
    if mode == "transform_of_compiled":
        f = torch.compile(f, backend=backend)
    program = lambda x, t, c: transform(f, x, t, c)  # noqa: E731
    if mode in ("compile", "fullgraph"):
        program = torch.compile(program, backend=backend, fullgraph=mode == "fullgraph")
    torch._dynamo.reset()  # each cell compiles afresh: no cell reuses another's graph
    return program(x, t, c)


def _flat(result):
    if isinstance(result, torch.Tensor) or result is None:
        return [result]
    return [part for r in result for part in _flat(r)]


def _inputs(variant, seed):
    g = torch.Generator().manual_seed(seed)
    b, h, lq, lk, e = 2, 2, 3, 5, 4
    q = torch.randn(b, h, lq, e, generator=g, dtype=torch.float64)
    k = torch.randn(b, h, lk, e, generator=g, dtype=torch.float64)
    v = torch.randn(b, h, e, lk, generator=g, dtype=torch.float64).transpose(-1, -2)  # not contiguous
    x = [q, k, v]
    options = {}
    if variant == "bias":
        x.append(torch.randn(h, lq, lk, generator=g, dtype=torch.float64))  # a learned bias, broadcast over B
    else:
        options["is_causal"] = True
    t = [torch.randn(a.shape, generator=g, dtype=torch.float64) for a in x]
    c = torch.randn(b, h, lq, e, generator=g, dtype=torch.float64)
    return tuple(x), tuple(t), c, options


BACKENDS = ("tiles", "torch-ops", "triton")


@contextlib.contextmanager
def _only(name):
    """Only backend `name` runs (skipped where it does not run here); fails if a pass ran
    elsewhere."""
    status = {b.name: b for b in dispatch.list_backends()}.get(name)
    if status is None or not status.available:
        pytest.skip(f"backend {name} does not run here")
    before = dict(dispatch.ran)
    with use_backend(name):
        yield
    ran = {key[1] for key, count in dispatch.ran.items() if count > before.get(key, 0)}
    assert ran <= {name}, f"passes ran on {ran}"


def _cells(only, names, variant):
    x, t, c, options = _inputs(variant, seed=sum(map(ord, only + variant)))
    for name in names:
        expected = _flat(_run("eager", TRANSFORMS[name], math_attention, x, t, c, options))
        one_graph = False
        for mode in MODES:
            if mode == "compile" and one_graph:
                continue
            try:
                math_result = _run(mode, TRANSFORMS[name], math_attention, x, t, c, options)
                math_raised = None
            except Exception as e:  # PyTorch's own limit in this cell
                math_raised = e
            try:
                got = _run(mode, TRANSFORMS[name], attngrad_attention, x, t, c, options)
            except Exception as e:
                assert math_raised is not None, f"{name} {mode}: attngrad raised where the math path did not: {e!r}"
                continue
            if math_raised is None:
                assert len(_flat(math_result)) == len(expected)
            one_graph = one_graph or mode == "fullgraph"
            got = _flat(got)
            assert len(got) == len(expected), f"{name} {mode}"
            for i, (a, b) in enumerate(zip(got, expected)):
                assert a is not None, f"{name} {mode}: result {i} is None"
                assert error(a, b) < BAR, f"{name} {mode}: result {i} off by {error(a, b):.2e}"


# Which cells each backend runs in the README's suite: every one on the tiles with a bias,
# and the forward-mode ones causal too; on torch-ops the first-order cells and the HVP, with
# a bias, and on Triton's interpreter (0.1-1 s a cell) the forward-mode ones (a compiled
# training step on Triton: test_launch.py). The full tier (ATTNGRAD_FULL=1,
# scripts/full_suite.sh) runs every cell everywhere (about 2 minutes on 2 cores).
GROUPS = {"forward": ("jvp", "dual", "hvp"), "reverse": ("backward", "grad", "vjp_of_jvp"),
          "second": ("vmap", "vmap_jacrev", "hessian", "double_backward")}
SUITE = [("tiles", group, "bias") for group in GROUPS] + [("tiles", "forward", "causal")] + \
    [("torch-ops", group, "bias") for group in ("forward", "reverse")] + [("triton", "forward", "bias")]
EVERY = [pytest.param(*cell, marks=() if cell in SUITE else pytest.mark.full)
         for cell in [(backend, group, variant) for backend in BACKENDS for group in GROUPS
                      for variant in ("bias", "causal")]]


@pytest.mark.parametrize("backend_name, group, variant", EVERY)
def test_every_cell_is_exact(backend_name, group, variant):
    """Before the operator, compiled forward mode gave zeros (jvp) or None (dual), and the
    compiled grad, HVP and reverse over forward raised."""
    with _only(backend_name):
        _cells(backend_name, GROUPS[group], variant)


def test_inductor_gives_the_exact_tangent_and_refuses_a_tangent_it_cannot_vouch_for():
    """The default backend: torch.func.jvp inside the compiled function is exact. A dual
    tensor handed to a compiled function whose graph was made without tangents is refused:
    the graph's fused kernels drop the tangents of what they compute (PyTorch's math path
    then gives None), and attngrad would see some inputs' tangents and not others'."""
    x, t, c, options = _inputs("bias", seed=3)
    f = lambda *x: attngrad_attention(*x, **options)  # noqa: E731
    expected = _jvp(lambda *x: math_attention(*x, **options), x, t, c)[1]
    torch._dynamo.reset()
    got = torch.compile(lambda x, t: torch.func.jvp(f, x, t)[1], fullgraph=True)(x, t)
    assert error(got, expected) < BAR
    math = torch.compile(lambda *x: math_attention(*x, **options), fullgraph=True)
    compiled = torch.compile(f, fullgraph=True)
    with fwAD.dual_level():
        duals = [fwAD.make_dual(a, b) for a, b in zip(x, t)]
        assert fwAD.unpack_dual(math(*duals)).tangent is None  # PyTorch's own limit
        with pytest.raises(NotImplementedError, match="made without it"):
            compiled(*duals)
    # without a dual tensor the same graph runs
    assert error(compiled(*x), math_attention(*x, **options)) < BAR


def _dropping_tangents(x):
    """A fused kernel as a graph compiler may put one: its result carries no tangent."""
    return torch.sin(x.detach())


def _fusing_compiler(graph_module, example_inputs):
    """Runs AOTAutograd's graph op by op, but for one node it fuses into a plain callable."""
    for node in graph_module.graph.nodes:
        if node.target is torch.ops.aten.sin.default:
            node.target = _dropping_tangents
    graph_module.recompile()
    return graph_module


@pytest.mark.parametrize("fused", [False, True])
def test_dual_tensors_handed_in_are_taken_where_every_tangent_reaches_the_call(fused):
    """AOTAutograd's graph run op by op (aot_eager): each operator before the call carried its
    tangent, so attngrad gives the exact one. A graph that holds anything but operators may
    have dropped tangents (here a fused sin): refused, where PyTorch's math path gives a
    tangent silently short of sin's part."""
    from torch._dynamo.backends.common import aot_autograd

    x, t, _, options = _inputs("bias", seed=11)
    backend = aot_autograd(fw_compiler=_fusing_compiler) if fused else "aot_eager"
    f = lambda q, k, v, b: attngrad_attention(q.sin(), k, v, b, **options)  # noqa: E731
    expected = torch.func.jvp(lambda q, k, v, b: math_attention(q.sin(), k, v, b, **options), x, t)[1]
    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    with fwAD.dual_level():
        duals = [fwAD.make_dual(a, b) for a, b in zip(x, t)]
        if fused:
            math = torch.compile(lambda q, k, v, b: math_attention(q.sin(), k, v, b, **options), backend=backend,
                                 fullgraph=True)
            assert error(fwAD.unpack_dual(math(*duals)).tangent, expected) > 1e-3  # what attngrad refuses to give
            with pytest.raises(NotImplementedError, match="made without it"):
                compiled(*duals)
        else:
            assert error(fwAD.unpack_dual(compiled(*duals)).tangent, expected) < BAR


def test_dynamos_own_backend_after_another_compile():
    """backend="eager" (Dynamo's graph run as it is): a transform of a compiled function,
    after another function was compiled in the process, where Dynamo's flag outlived its
    trace and the call ran eagerly under it (it raised; the kernels now read it as theirs)."""
    x, t, c, options = _inputs("bias", seed=5)
    for name in ("jvp", "vjp_of_jvp"):
        expected = _flat(_run("eager", TRANSFORMS[name], math_attention, x, t, c, options))
        for mode in ("fullgraph", "transform_of_compiled"):
            got = _flat(_run(mode, TRANSFORMS[name], attngrad_attention, x, t, c, options, backend="eager"))
            assert all(error(a, b) < BAR for a, b in zip(got, expected)), (name, mode)
