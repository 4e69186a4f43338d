"""`regime`: the one reader of PyTorch's private state. Each private API it reads is used
here the way attngrad uses it, so a torch that moves or changes one fails here first, by
name, rather than deep inside a call."""

import pytest

torch = pytest.importorskip("torch")
import torch.autograd.forward_ad as fwAD  # noqa: E402
from torch._functorch.pyfunctorch import TransformType  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from attngrad.torch import regime  # noqa: E402
from attngrad.torch.regime import Mode, Regime  # noqa: E402


def test_eager_with_nothing_around():
    now = Regime.now()
    assert now.mode is Mode.EAGER and now.transforms == () and now.level == -1
    x = torch.randn(3)
    assert now.untracked([x]) and not now.untracked([x.requires_grad_()])
    assert regime.unseen([torch.randn(2)])


def test_the_transforms_are_named_outermost_first():
    x = torch.randn(3)
    kinds = []

    def f(x):
        kinds.append(Regime.now().transforms)
        return x.sin().sum()

    torch.func.vmap(torch.func.grad(f))(torch.randn(2, 3))
    torch.func.jvp(f, (x,), (x,))
    assert kinds == [(TransformType.Vmap, TransformType.Grad), (TransformType.Jvp,)]


def test_forward_mode_levels_from_the_python_global_and_from_the_tensors():
    x, t = torch.randn(3), torch.randn(3)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, t)
        now = Regime.now()
        assert now.forward_level and now.forward_mode_innermost() and not now.untracked([dual])
        assert regime.carries_tangent(dual) and not regime.carries_tangent(x)
    # a level opened in C++ alone, as a compiled graph opens it: the tensors still say so
    level = torch._C._enter_dual_level()
    try:
        dual = torch._VF._make_dual(x, t, level)
        assert Regime.now().level == -1 and Regime.now(probe=(dual,)).level == 0
        assert regime.carries_tangent(dual)
    finally:
        torch._C._exit_dual_level(level)


def test_what_defers_to_a_fused_pass():
    x = torch.randn(3)
    seen = []

    def f(x):
        seen.append(Regime.now().defers())
        return x.sin().sum()

    torch.func.jvp(torch.func.grad(f), (x,), (x,))  # an HVP: yes
    torch.func.grad(f)(x)  # reverse mode alone: no
    torch.func.jvp(torch.func.vmap(f), (x[None],), (x[None],))  # vmap inside: no
    assert seen == [True, False, False]


def test_the_modes_while_compiling():
    """Dynamo's trace sees DYNAMO; code that runs while the graph is made (a custom op's
    fake) sees TRACING; the graph when it runs, EAGER."""
    seen = []
    lib = torch.library.Library("attngrad_test_regime", "DEF")
    lib.define("probe(Tensor x) -> Tensor")
    lib.impl("probe", lambda x: (seen.append(("kernel", regime.mode())), x.clone())[1], "CompositeExplicitAutograd")
    torch.library.register_fake("attngrad_test_regime::probe", lambda x: (seen.append(("fake", regime.mode())),
                                                                           torch.empty_like(x))[1], lib=lib)

    def f(x):
        return torch.ops.attngrad_test_regime.probe(x) + (1.0 if regime.mode() is Mode.DYNAMO else 0.0)

    torch._dynamo.reset()
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(torch.zeros(2))
    assert torch.equal(out, torch.ones(2))  # traced under DYNAMO
    assert ("fake", Mode.TRACING) in seen and seen[-1] == ("kernel", Mode.EAGER)


def test_unseen_under_modes_and_wrapped_tensors():
    class Nothing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.randn(2)
    with Nothing():
        assert not regime.unseen([x])
    torch.func.grad(lambda y: (regime.is_wrapped(y) or pytest.fail("not wrapped"), y.sum())[1])(x)
    assert regime.unwrapped(x) is x and not regime.is_wrapped(x)


def test_the_other_private_reads_exist():
    assert regime.storage_use_count is not None  # the tiles' buffer cache keeps nothing without it
    assert not regime.is_wrapper_subclass(torch.randn(2))
    with regime.indexable_under_vmap():
        pass
    pack = lambda t: t  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        assert regime.innermost_saved_tensor_hooks()[0] is pack
    assert regime.innermost_saved_tensor_hooks() is None
    assert not regime.dispatch_modes()
    if torch.distributed.is_available():
        from attngrad.torch.op import ops

        assert ops.OPS["forward"]._opoverload in regime.dtensor_op_handlers()  # attngrad's, registered at import
        assert regime.context_parallel_load_balanced() is False  # no context_parallel() in force
        assert regime.context_parallel_all_to_all() is False  # PyTorch's default rotate method: allgather


def test_an_operators_caller_is_read_from_its_frames():
    """Yes only for an operator's kernel called by a GraphModule of operators alone (what
    aot_eager runs); No eagerly and for a graph that calls a plain function."""
    seen = []
    library = torch.library.Library("attngrad_regime_probe", "DEF")
    library.define("probe(Tensor x) -> Tensor")
    library.impl("probe", lambda x: seen.append(regime.called_by_a_graph_run_op_by_op()) or x.clone(),
                 "CompositeExplicitAutograd")
    probe = torch.ops.attngrad_regime_probe.probe.default
    x = torch.randn(3)
    probe(x)
    ops_only = torch.fx.symbolic_trace(lambda x: probe(torch.ops.aten.sin.default(x)))
    ops_only(x)
    with_a_function = torch.fx.symbolic_trace(lambda x: probe(torch.sin(x)))  # torch.sin: not an operator
    with_a_function(x)
    assert seen == [False, True, False]
