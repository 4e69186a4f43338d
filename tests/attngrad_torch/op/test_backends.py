"""The backend registry: what it lists, how a call chooses, and that a backend defined in the
tests alone (`tests/counting_backend.py`) runs every pass of every entry point without an
edit anywhere else."""

import pytest

torch = pytest.importorskip("torch")

from attngrad.torch import (  # noqa: E402
    MultiheadAttention,
    attention,
    list_backends,
    ran,
    scaled_dot_product_attention,
    use_backend,
)
from attngrad.torch.op import dispatch  # noqa: E402
from attngrad.torch.op.call import PASSES, HvpSums, RingSums, schema  # noqa: E402

from ...conftest import EXACT, rel_err  # noqa: E402
from ..conftest import make_call, math_sdpa  # noqa: E402


def randn(*shape, seed, grad=True):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64, requires_grad=grad)


def test_the_old_names_still_work_and_say_they_are_deprecated():
    """`use_implementation` was renamed `use_backend`; the old name still works, with a
    FutureWarning. `attngrad.torch.backends` is the package of the backends, a plain module
    (calling it, the deprecated `backends()` that `list_backends()` replaced, ended:
    CHANGELOG.md)."""
    import importlib
    import types

    import attngrad.torch

    with pytest.warns(FutureWarning, match="use_backend"):
        with attngrad.torch.use_implementation("torch-ops"):
            assert dispatch.allowed() == ("torch-ops",)
    assert type(attngrad.torch.backends) is types.ModuleType
    with pytest.raises(TypeError, match="not callable"):
        attngrad.torch.backends()
    native = importlib.import_module("attngrad.torch.backends.cpu_tiles.native")
    assert attngrad.torch.backends.cpu_tiles.native is native


def test_backends_lists_tiles_and_torch_ops_and_says_why_one_does_not_run():
    statuses = {b.name: b for b in list_backends()}
    assert list(statuses)[:3] == ["tiles", "triton", "torch-ops"]  # the order of preference
    assert statuses["torch-ops"].available and statuses["torch-ops"].reason is None
    tiles = statuses["tiles"]
    assert tiles.available == (tiles.reason is None)


def test_every_pass_of_every_entry_point_runs_on_a_new_backend(counting_backend):
    """Forward, backward, JVP, the backward's JVP and double backward of the drop-in, of
    `attention` with a learned bias, and of MultiheadAttention, all on the tests' backend,
    and exact."""
    q, k, v = randn(2, 4, 9, 8, seed=1), randn(2, 2, 11, 8, seed=2), randn(2, 2, 11, 6, seed=3)
    bias = randn(4, 9, 11, seed=4)
    out = attention(q, k, v, attn_bias=bias, is_causal="bottom_right", enable_gqa=True)
    dout = randn(*out.shape, seed=5, grad=False)
    grads = torch.autograd.grad(out, (q, k, v, bias), dout, create_graph=True)
    sum(g.square().sum() for g in grads).backward()
    with torch.no_grad():
        tangents = [randn(*t.shape, seed=6 + i, grad=False) for i, t in enumerate((q, k, v))]
    torch.func.jvp(lambda *t: scaled_dot_product_attention(*t, is_causal=True), (q.detach(), q.detach(), q.detach()),
                   tuple(tangents[:1] * 3))
    hvp = torch.func.jvp(torch.func.grad(lambda q: attention(q, k.detach(), v.detach(), enable_gqa=True).sin().sum()),
                         (q.detach(),), (tangents[0],))
    module = MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    module(q[0], q[0], q[0])[0].sum().backward()
    required = set(PASSES) - set(dispatch.OPTIONAL_PASSES)  # forward_jvp: the forward, then the jvp
    for pass_name in required:
        assert counting_backend.count(pass_name) > 0, (pass_name, counting_backend.calls)
    assert {name for name, _ in ran if _ == "counting"} == required
    # and the numbers are attention's
    ref = math_sdpa(q, k, v, attn_mask=bias.masked_fill(~torch.ones(9, 11, dtype=torch.bool).tril(2), float("-inf")),
                    enable_gqa=True)
    assert rel_err(out, ref) < EXACT
    assert hvp[1].shape == q.shape


def test_a_call_no_allowed_backend_takes_raises_with_each_ones_reason():
    q = randn(1, 1, 3, 2, seed=1, grad=False)
    with use_backend("torch-ops"):
        before = dict(ran)
        attention(q, q, q)
        assert ran[("forward", "torch-ops")] == before.get(("forward", "torch-ops"), 0) + 1
    empty = q[..., :0, :]
    with use_backend("tiles"):
        with pytest.raises(RuntimeError, match="no allowed backend runs this forward call.*tiles: it (takes no empty|is "
                                               "unavailable)"):
            attention(q, empty, empty)
    with pytest.raises(ValueError, match="use_backend takes one or more of"):
        with use_backend("flash"):
            pass


def test_which_rows_sums_the_tiles_take():
    """Of the passes given rows' sums (a ring step's, or an HVP's from the forward's JVP), the
    tiles take the backward's JVP given the centre and D' without a bias gradient, and the
    forward's JVP asked for the centre; everything else goes to a backend that takes it all
    (torch-ops), as do sums held by a torch.func transform's tensors."""
    if dict((b.name, b.available) for b in list_backends())["tiles"] is not True:
        pytest.skip("the compiled tiles are not built here")
    q = randn(1, 2, 5, 4, seed=2, grad=False)
    call = make_call(q, q, q, bias=randn(5, 5, seed=3, grad=False))
    centre, delta_t = q.new_zeros(1, 2, 5, 1), q.new_zeros(1, 2, 5, 1)
    given = {"row_sums": RingSums(centre=centre, delta_t=delta_t)}
    assert dispatch.choose("backward_jvp", call, {**given, "bias_grad": False}).name == "tiles"
    assert dispatch.choose("backward_with_jvp", call, {**given, "bias_grad": False}).name == "tiles"
    assert dispatch.choose("backward_jvp", call, {**given, "bias_grad": True}).name == "torch-ops"
    assert dispatch.choose("forward_jvp", call, {"row_sums": RingSums(centre_sums=centre)}).name == "tiles"
    # an HVP's: the forward's JVP leaves t - c, c (and a peak index the tiles do not name), the
    # backward's JVP takes them with O'; in float32 and float64, where the tiles centre
    peak_index = torch.full((1, 2, 5, 1), -1, dtype=torch.int32)
    forward_sums = HvpSums(centre_sums=centre, peak_sums=centre, peak_index=peak_index, results=())
    backward_sums = HvpSums(centre=centre, peak=centre, peak_index=peak_index, out_t=q, results=())
    assert dispatch.choose("forward_jvp", call, {"row_sums": forward_sums}).name == "tiles"
    assert dispatch.choose("backward_with_jvp", call, {"row_sums": backward_sums, "bias_grad": False}).name == "tiles"
    half = make_call(*(q.to(torch.bfloat16),) * 3)
    assert not dispatch.offered("forward_jvp", half, {"row_sums": forward_sums})
    assert dispatch.choose("jvp", call, {"row_sums": RingSums(centre=centre, centre_sums=centre)}).name == "torch-ops"
    assert dispatch.choose("double_backward", call, {"row_sums": RingSums(centre=centre, g_centre=centre)}).name == \
        "torch-ops"
    # the type names the protocol: an HVP's sums are never read as a ring step's, nor untyped ones at all
    with pytest.raises(RuntimeError, match="not a HvpSums"):
        dispatch.choose("backward_jvp", call, {"row_sums": HvpSums(centre=centre, delta_t=delta_t), "bias_grad": False})
    with pytest.raises(RuntimeError, match="not a dict"):
        dispatch.choose("backward_jvp", call, {"row_sums": {"centre": centre, "delta_t": delta_t}, "bias_grad": False})
    seen = {}

    def choose(delta_t):
        seen["name"] = dispatch.choose("backward_jvp", call, {"row_sums": RingSums(centre=centre, delta_t=delta_t),
                                                               "bias_grad": False}).name
        return delta_t

    torch.func.grad(lambda x: choose(x * 2).sum())(delta_t)  # a transform's tensor among the sums
    assert seen["name"] == "torch-ops"


def test_registering_checks_the_passes_and_the_order():
    with pytest.raises(ValueError, match="unknown passes"):
        dispatch.register(dispatch.Backend(name="odd", passes=dict(sideways=lambda call: None)))
    with pytest.raises(ValueError, match="no backend 'nowhere'"):
        dispatch.register(dispatch.Backend(name="odd", passes={}), before="nowhere")
    dispatch.register(dispatch.Backend(name="odd", passes={}), before="torch-ops")
    try:
        assert dispatch.registered().index("odd") == dispatch.registered().index("torch-ops") - 1
        q = randn(1, 1, 3, 2, seed=1, grad=False)
        attention(q, q, q)  # "odd" has no forward: the next one takes the call
    finally:
        dispatch.unregister("odd")
    assert "odd" not in dispatch.registered()


def test_the_op_schemas_come_from_the_table():
    assert schema("forward").startswith("(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? bias, Tensor? bounds")
    assert "Tensor? tbias" in schema("backward_jvp")
    assert schema("backward_jvp").endswith("Tensor? tsinks=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
    # mask, bias, bounds; gq, gk, gv, gbias; sinks, mask_blocks, mask_tiles; gsinks
    assert str(torch.ops.attngrad.attention_double_backward.default._schema).count("Tensor?") == 3 + 4 + 3 + 1


def test_eager_calls_skip_the_dispatcher_and_everything_else_sees_the_op(monkeypatch):
    """In plain eager code the op's implementation runs directly (the dispatcher would only
    route it back); the bits are the op's. Under a function or dispatch mode (as under torch.compile's
    tracing or torch.func) the op itself is called, so those still see one opaque operator."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from attngrad.torch.op import ops

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=g, dtype=torch.float64) for _ in range(3))
    through_op = ops.OPS["forward"](*(make_call(q, k, v).fields()[name] for name in ops.ARGUMENTS["forward"]))

    def recording(mode_class, hook):
        """A mode of `mode_class` that records the name of every function or op it sees."""
        def record(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))
        return type("Recording", (mode_class,), {"seen": None, hook: record})

    for mode_class, hook in ((TorchDispatchMode, "__torch_dispatch__"),
                             (torch.overrides.TorchFunctionMode, "__torch_function__")):
        mode = recording(mode_class, hook)()
        mode.seen = []
        with mode:
            assert all(torch.equal(a, b) for a, b in zip(ops.run_op("forward", make_call(q, k, v)), through_op))
        assert "attngrad.attention_forward.default" in mode.seen, mode_class

    def refuse(*args):
        raise AssertionError("the dispatcher was called in plain eager code")

    monkeypatch.setitem(ops.OPS, "forward", refuse)
    direct = ops.run_op("forward", make_call(q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(direct, through_op))
