"""The Triton backend's host side (`launch`, `config`), what it chooses: the calls it refuses,
the tiles it takes (sm_90's own for light calls), the block map kept while its mask lives and
the walks made from it, the fused backward's order of dQ's parts, the ways its options choose
(float32's products, tensor descriptors, the backward fused or in the keys' orientation), a
compiled step, and a Hessian-vector product's row sums taken from the forward's walk. The
tests that run kernels (`interpreted`) take Triton's interpreter on CPU tensors (`cases`).
"""

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from attngrad.torch import attention, use_backend  # noqa: E402
from attngrad.torch.backends import triton as triton_backend  # noqa: E402
from attngrad.torch.backends.triton import config, launch  # noqa: E402
from attngrad.torch.backends.triton.kernels import dq_rank  # noqa: E402
from attngrad.torch.op import dispatch, ops  # noqa: E402
from attngrad.torch.op.call import HvpSums, RingSums, ScoreMasks  # noqa: E402

from ....conftest import EXACT, examples, rel_err  # noqa: E402
from ...cases import calls  # noqa: E402
from ...conftest import make_call  # noqa: E402
from .cases import DOUBLE, DV, LK, LQ, B, D, H, interpreted, math_attention, randn  # noqa: E402


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setattr(triton_backend, "interpreting", lambda: False)
    q = randn(1, 1, 4, 16, seed=1)
    with use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        attention(q, q, q)


@interpreted
def test_wide_heads_are_refused_by_name():
    q = randn(1, 1, 4, 257, seed=1)
    with use_backend("triton"), pytest.raises(RuntimeError, match="head widths up to 256; got d=257"):
        attention(q, q, q)


@interpreted
def test_triton_is_listed_among_the_backends():
    status = {b.name: b for b in dispatch.list_backends()}
    assert status["triton"].available
    assert dispatch.registered().index("triton") < dispatch.registered().index("torch-ops")


def test_light_calls_on_sm90_take_hoppers_tiles():
    """sm_90 gives light calls in half precision tiles of their own; another GPU, a call with
    a per-score operand or option, a dtype without an entry keep the general table."""
    half, light = torch.bfloat16, config._HOPPER_LIGHT[("backward", "half", 128)]
    assert config.blocks_for("backward", half, 128, False, arch=90, light=True) == light
    assert config.blocks_for("backward", half, 100, False, arch=90, light=True) == light  # padded to 128
    general = config._TABLE[("backward", "half", 128)]
    assert general != light
    assert config.blocks_for("backward", half, 128, False, arch=80, light=True) == general
    assert config.blocks_for("backward", half, 128, False, arch=90, light=False) == general
    assert config.blocks_for("backward", torch.float32, 128, False, arch=90, light=True) == \
        config._TABLE[("backward", "float32", 128)]
    assert config.blocks_for("backward", half, 128, True, arch=90, light=True) == config.TUNING().interpreted


@interpreted
@pytest.mark.parametrize("option, light", [
    ({}, True), (dict(is_causal=True), True), (dict(key_padding=torch.tensor([5, 9])), True),
    (dict(window=(3, None), is_causal=True), True), (dict(attn_mask=torch.ones(9, 9, dtype=torch.bool)), False),
    (dict(attn_bias=torch.zeros(9, 9)), False), (dict(softcap=5.0), False), (dict(sinks=torch.zeros(2)), False),
    (dict(dropout_p=0.1), False)])
def test_a_light_call_has_no_per_score_operand_or_option(monkeypatch, option, light):
    """What the plan asks the table for: light (sm_90's own tiles) for the causal diagonal,
    key bounds and nothing; not with a mask, a bias, soft cap, sinks (a bias) or dropout."""
    seen = []
    # on launch, where `_blocks` reads it (a name of config's imported there)
    monkeypatch.setattr(launch, "blocks_for", lambda *args, **kwargs: seen.append(kwargs["light"]) or config.TUNING().interpreted)
    monkeypatch.setattr(launch, "Plan", lambda call, blocks: (_ for _ in ()).throw(RuntimeError("planned")))
    q = randn(2, 2, 9, 16, seed=1)
    with use_backend("triton"), pytest.raises(RuntimeError, match="planned"):
        attention(q, q, q, **option)
    assert seen == [light]


def test_float64_on_a_gpu_needs_triton_39(monkeypatch):
    """Triton 3.6's compiler stops on the kernels' float64 products (seen on an H100): the
    backend's refusal names the cause there (the torch-ops kernels then take the call)."""
    monkeypatch.setattr(triton_backend, "_triton_version", lambda: "3.6.0")
    assert "needs Triton 3.9 or later (Triton 3.6.0's" in triton_backend._float64_needs_newer_triton(DOUBLE)
    assert triton_backend._float64_needs_newer_triton(torch.float32) is None
    cuda = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=DOUBLE, shape=(1, 1, 4, 16))
    call = types.SimpleNamespace(q=cuda, k=cuda, v=cuda, tensors=lambda: [cuda], fields=lambda: {})
    assert "needs Triton 3.9" in triton_backend._refuses(call, "forward", {})  # what the registry reads
    monkeypatch.setattr(triton_backend, "_triton_version", lambda: "3.10.1")
    assert triton_backend._float64_needs_newer_triton(DOUBLE) is None
    assert triton_backend._refuses(call, "forward", {}) is None


@interpreted
def test_the_block_map_is_kept_while_its_mask_lives_unchanged(on_triton, tiles_of, monkeypatch):
    """The tile map and walks are made once per mask, bounds and tile size, not per call
    (milliseconds of host time at long L); a write into the mask makes them anew."""
    from attngrad.torch.masks import version_cache as kept

    kept.clear()
    made = []
    real = launch.empty_tiles
    monkeypatch.setattr(launch, "empty_tiles", lambda *args: made.append(args[:2]) or real(*args))
    tiles_of(16)
    q, k, v = randn(2, 2, 37, 16, seed=1), randn(2, 2, 41, 16, seed=2), randn(2, 2, 41, 16, seed=3)
    mask = randn(2, 1, 37, 41, seed=4) > 0
    mask[..., 0] = True
    mask[..., 16:32] = False  # a whole key block of every row: skipped
    first = attention(q, k, v, attn_mask=mask)
    assert torch.equal(attention(q, k, v, attn_mask=mask), first) and len(made) == 1
    mask[..., 16:32] = True  # a stale map would skip it still
    after = attention(q, k, v, attn_mask=mask)
    assert len(made) == 2
    assert rel_err(after, math_attention(q, k, v, allowed=mask)) < 1e-12
    attention(q, k, v, is_causal=True), attention(q, k, v, is_causal=True)
    assert len(made) == 3  # no mask: one per shape and diagonal


@interpreted
def test_the_backward_gives_a_sinks_bias_its_closed_form_without_the_bias_side_walk(on_triton, monkeypatch):
    """Triton's own backward (before `ops` replaces it) gives a bias constant along the keys
    sum_i D_i P_sink,i from its row statistics, where `bias_side` would walk every score of a
    head in one program: float64 against autograd of the definition, and no bias-side launch."""
    from attngrad.torch.op import ops

    def refuse(*_args, **_kwargs):
        raise AssertionError("bias_side ran for a bias constant along the keys")

    monkeypatch.setattr(launch, "_bias_side", refuse)
    q, k, v, dout = (randn(B, H, n, e, seed=s) for s, (n, e) in enumerate(((LQ, D), (LK, D), (LK, DV), (LQ, DV))))
    bias = randn(H, 1, 1, seed=4)
    # the backends' call: a zero-logit sink, the bias holding the logits (`sink_logits.lowered`)
    masks = ScoreMasks(bias=bias, causal=LK - LQ, sink=True)
    call = ops.AttentionCall(q, k, v, masks, torch.tensor(0), D**-0.5)
    out, row_max, inv_sum = ops.run_pass("forward", call, {})
    dbias = launch.backward(call, dout=dout, out=out, row_max=row_max, inv_sum=inv_sum, bias_grad=True)[3]
    leaf = bias.clone().requires_grad_()
    allowed = torch.ones(LQ, LK, dtype=torch.bool).tril(LK - LQ)
    reference = math_attention(q, k, v, allowed=allowed, bias=leaf, sinks=torch.zeros(H, dtype=DOUBLE))
    expected = torch.autograd.grad(reference, leaf, dout)[0]
    assert rel_err(dbias, expected) < 1e-12


def test_walks_with_a_hole_are_not_dense():
    """`launch._dense`: walks are dense when the tiles from each one's first to its stop are
    all kept (a causal map's rows and columns), not where a row keeps tiles on both sides of
    an empty one (a mask's hole)."""
    causal = torch.ones(3, 3, dtype=torch.bool).triu(1)[None, None]  # True: empty
    holed = causal.clone()
    holed[..., 2, 1] = True
    for empty, dense in ((causal, True), (holed, False)):
        key_walks, query_walks = launch._walks(empty)
        assert (launch._dense(empty, key_walks) and launch._dense(empty, query_walks)) == dense
    assert launch._dense(holed, launch._walks(holed)[1])  # its columns have no hole: its row has


def test_walk_lists_take_the_tiles_that_need_no_masking_first():
    """`launch._walk_lists`: per block, [n unmasked, n kept, the unmasked blocks in order, then
    the other kept ones in order, padding], for each query block's key blocks and each key
    block's query blocks."""
    empty = torch.ones(4, 4, dtype=torch.bool).triu(1)[None, None]  # causal: True is skipped
    empty[..., 3, 1] = True  # a hole
    interior = torch.ones(4, 4, dtype=torch.bool).tril(-1)[None, None]  # below the diagonal
    keys, queries = launch._walk_lists(empty, interior)
    assert keys.dtype == torch.int32 and keys.shape == (1, 1, 4, 6)
    assert [row[:2 + int(row[1])] for row in keys[0, 0].tolist()] == [
        [0, 1, 0], [1, 2, 0, 1], [2, 3, 0, 1, 2], [2, 3, 0, 2, 3]]
    assert [row[:2 + int(row[1])] for row in queries[0, 0].tolist()] == [
        [3, 4, 1, 2, 3, 0], [1, 2, 2, 1], [1, 2, 3, 2], [0, 1, 3]]


@interpreted
def test_walks_split_or_whole_agree(on_triton, tiles_of, monkeypatch, tuned):
    """Walks that take the tiles needing no masking in a loop of their own (the default) and
    walks that take every tile in the masked loop (`Options.interior_tiles` off) agree to
    float64's rounding; the lists hold such tiles only where asked. A tile's entry in the
    masked loop has the bits it has unmasked: kernels whose walks take the same list in one
    loop (`Blocks.split` off) give the split walks' bits."""
    tiles_of(16)
    counts = []
    made = launch.Plan.__init__

    def spy(self, *args, **kwargs):
        made(self, *args, **kwargs)
        counts.append(int(self.lists["keys"][0][..., 0].sum()))

    monkeypatch.setattr(launch.Plan, "__init__", spy)
    q, k, v = (randn(2, 2, 40, 16, seed=s) for s in range(3))
    dout = randn(2, 2, 40, 16, seed=4)

    def step(split: bool) -> tuple:
        tuned(config.TUNING, interior_tiles=split)
        counts.clear()
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, is_causal=True)
        return (out, *torch.autograd.grad(out, leaves, dout))

    split = step(True)
    assert counts and all(n > 0 for n in counts)
    tuned(config.TUNING, interpreted=config.Blocks(16, 16, 1, 1, split=False))
    one_loop = step(True)
    assert counts and all(n > 0 for n in counts)
    assert all(torch.equal(a, b) for a, b in zip(split, one_loop))
    whole = step(False)
    assert counts and not any(counts)
    for a, b in zip(split, whole):
        assert rel_err(a, b) <= 1e-14


@triton.jit
def _rotated_ranks(OUT, n_q, n_k):
    """Each key block's rank at each step of its rotated walk, as the fused backward takes it."""
    kb = tl.program_id(0)
    for step in range(0, n_q):
        qb = (kb + step) % n_q
        tl.store(OUT + (kb * n_q + step) * 2, qb)
        tl.store(OUT + (kb * n_q + step) * 2 + 1, dq_rank(kb, qb, step, n_q, n_k, 0, True))


def _run_in_step(walks: dict) -> int:
    """Runs key blocks' walks [(query block, rank), ...] together, a step of every block that
    may go at a time (its rank is the count of parts already in), and returns the rounds taken;
    fails on a deadlock."""
    done = {m: 0 for walk in walks.values() for m, _ in walk}
    at = dict.fromkeys(walks, 0)
    rounds = 0
    while any(at[n] < len(walk) for n, walk in walks.items()):
        ready = [n for n, walk in walks.items() if at[n] < len(walk) and done[walk[at[n]][0]] == walk[at[n]][1]]
        assert ready, f"deadlock after {rounds} rounds"
        for n in ready:
            done[walks[n][at[n]][0]] += 1
            at[n] += 1
        rounds += 1
    return rounds


@interpreted
@pytest.mark.parametrize("n_q, n_k", [(1, 1), (5, 5), (7, 3), (3, 7), (4, 8), (6, 4), (2, 9)])
def test_the_fused_backwards_dq_order_is_fixed_and_keeps_the_key_blocks_in_step(n_q, n_k):
    """`kernels.dq_rank` in rotation: at every query block, the key blocks' ranks are 0 .. n_k - 1
    (each part has its place in the sum), and the walks, run together, finish without a
    deadlock, in n_q rounds where there are as many key blocks as query blocks (none waits)."""
    out = torch.zeros(n_k, n_q, 2, dtype=torch.int32)
    _rotated_ranks[(n_k,)](out, n_q, n_k)
    walks = {n: [tuple(pair) for pair in out[n].tolist()] for n in range(n_k)}
    for m in range(n_q):
        assert sorted(rank for walk in walks.values() for qb, rank in walk if qb == m) == list(range(n_k))
    rounds = _run_in_step(walks)
    assert rounds == n_q if n_q == n_k else rounds <= n_q * -(-n_k // n_q) + n_k


@interpreted
@pytest.mark.parametrize("options, len_q", [(dict(), 50), (dict(is_causal=True), 37),
                                            (dict(is_causal="bottom_right"), 50), (dict(window=(9, 4)), 50),
                                            (dict(key_padding=torch.tensor([41, 30])), 37)],
                         ids=["full", "causal", "bottom-right", "window", "padding"])
def test_a_light_calls_backward_fused_or_in_the_keys_orientation_matches_key_side(on_triton, tiles_of, monkeypatch,
                                                                                   options, len_q, tuned):
    """A light call's backward three ways agree to float64 rounding: key_side fused with dQ's
    parts added in `dq_rank`'s order (`Options.fused_backward`), query_side with key_side_light
    (`Options.light_key_side`), and query_side with key_side; each runs the way asked. Lq != Lk, GQA,
    a non-contiguous q, rotated (full) and banded walks."""
    taken = []
    launches = {name: getattr(launch.kernels, name) for name in ("key_side", "key_side_light", "query_side")}
    for name, kernel in launches.items():
        monkeypatch.setattr(launch.kernels, name, _Spy(kernel, name, taken))
    tiles_of(16)
    q = randn(2, len_q, 2, 24, seed=1).transpose(1, 2)  # (B, H, Lq, d), not contiguous
    k, v = randn(2, 1, 41, 24, seed=2), randn(2, 1, 41, 20, seed=3)
    dout = randn(2, 2, len_q, 20, seed=4)
    results = {}
    for way, fused, light in (("fused", True, False), ("light", False, True), ("split", False, False)):
        tuned(config.TUNING, fused_backward=fused, light_key_side=light)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, enable_gqa=True, **options)
        taken.clear()
        results[way] = torch.autograd.grad(out, leaves, dout)
        assert taken == {"fused": ["key_side fused"], "light": ["query_side", "key_side_light"],
                         "split": ["query_side", "key_side"]}[way]
    for way in ("fused", "light"):
        for a, b in zip(results[way], results["split"]):
            assert rel_err(a, b) <= 1e-13


class _Spy:
    """A kernel whose launches are noted by name (and "fused" where key_side takes dQ)."""

    def __init__(self, kernel, name, into):
        self.kernel, self.name, self.into = kernel, name, into

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            self.into.append(self.name + (" fused" if kwargs.get("FUSED") else ""))
            return self.kernel[grid](*args, **kwargs)
        return launch_


@interpreted
def test_a_compiled_step_on_triton_is_one_graph_with_eagers_bits(on_triton):
    """torch.compile(fullgraph=True) over a call to attention on the Triton backend: Dynamo
    traces it whole (the op is opaque to it), AOTAutograd its backward, and the output and
    gradients are eager's bits."""
    torch._dynamo.reset()
    q, k, v = (randn(2, 2, 20, 16, seed=s).requires_grad_() for s in range(3))
    dout = randn(2, 2, 20, 16, seed=3)

    def step(forward):
        out = forward(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    def forward(q, k, v):
        return attention(q, k, v, is_causal=True) * 2.0

    compiled = step(torch.compile(forward, fullgraph=True, backend="aot_eager"))
    assert all(torch.equal(a, b) for a, b in zip(compiled, step(forward)))


def test_float32_products_are_chosen_by_the_option(tuned):
    """IEEE float32 on a GPU multiplies as `Options.float32_products` says (FMA by default, or
    a split product on the tensor cores); allow_tf32 still means TF32, and
    a name Triton does not take is refused by name."""
    cuda = torch.device("cuda")
    assert launch.input_precision(torch.float32, cuda) == "ieee"
    tuned(config.TUNING, float32_products="tf32x3")
    assert launch.input_precision(torch.float32, cuda) == "tf32x3"
    assert launch.input_precision(torch.float16, cuda) == "ieee"
    assert launch.input_precision(torch.float32, torch.device("cpu")) == "ieee"  # the interpreter's products
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert launch.input_precision(torch.float32, cuda) == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    tuned(config.TUNING, float32_products="fp32x9")
    with pytest.raises(ValueError, match="float32_products='fp32x9'"):
        launch.input_precision(torch.float32, cuda)


def test_tensor_descriptors_only_where_tma_takes_the_tensors(tuned):
    """`launch._descriptors`: none unless asked; none for a tensor whose last axis is not
    contiguous, whose row stride is not a multiple of 16 bytes, or for products taken by
    slices of the width; else one per tensor, blocks of one head's rows by the padded width."""
    q, k = randn(2, 4, 19, 24, seed=1), randn(2, 2, 23, 24, seed=2)
    v = randn(2, 2, 23, 8, seed=3)
    call = make_call(q, k, v)
    plan = launch.Plan(call, config.Blocks(16, 32, 1, 1))
    assert launch._descriptors(plan, 32, k, v) is None
    tuned(config.TUNING, tensor_descriptors=True)
    k_d, v_d, absent = launch._descriptors(plan, 32, k, v, None)
    assert (k_d.block_shape, v_d.block_shape, absent) == ([1, 1, 32, 32], [1, 1, 32, 16], None)
    assert launch._descriptors(plan, 32, k.transpose(-1, -2).contiguous().transpose(-1, -2), v) is None
    assert launch._descriptors(plan, 32, k, randn(2, 2, 23, 3, seed=4)) is None  # rows of 24 bytes
    sliced = launch.Plan(call, config.Blocks(16, 32, 1, 1, slice=16))
    assert launch._descriptors(sliced, 32, k, v) is None


def _hvp_sums(call):
    """The rows' sums a Hessian-vector product's forward asks of forward_jvp (`hvp_fusion.ForwardSums`)."""
    rows = (*call.q.shape[:3], 1)
    return HvpSums(centre_sums=call.q.new_empty(rows), peak_sums=call.q.new_empty(rows),
                   peak_index=call.q.new_full(rows, -1, dtype=torch.int32))


@interpreted
@settings(max_examples=examples(4, 10), deadline=None)  # 300 more by hand: every one within EXACT
@given(calls(), st.booleans(), st.booleans())
def test_an_hvps_backward_takes_its_row_sums_from_the_forwards_walk(case, with_tdout, bias_grad):
    """float64, every option: forward_jvp leaves each row's t - c, c and peak key, and the
    backward's JVP along the same tangents makes its row sums from them and O'
    (`kernels.given_row_sums`, no `row_sums` walk), with dO's tangent or without, with the
    bias's gradient or without; its results equal the tiles' whole-row backward's JVP."""
    call, tangents = case
    g = torch.Generator().manual_seed(call.q.shape[2] * 7 + call.k.shape[2])
    dout = torch.randn(*call.q.shape[:3], call.v.shape[-1], generator=g, dtype=DOUBLE)
    tdout = torch.randn(dout.shape, generator=g, dtype=DOUBLE) if with_tdout else None
    bias_grad = bias_grad and call.bias is not None
    sums = _hvp_sums(call)
    with use_backend("triton"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "_row_sums", lambda *args: pytest.fail("the row_sums walk ran"))
        out, row_max, inv_sum, out_t = ops.run_pass("forward_jvp", call, {**tangents, "row_sums": sums})
        given_sums = HvpSums(centre=sums["centre_sums"], peak=sums["peak_sums"], peak_index=sums["peak_index"],
                             out_t=out_t)
        inputs = dict(dout=dout, out=out, row_max=row_max, inv_sum=inv_sum, bias_grad=bias_grad, tdout=tdout,
                      **tangents)
        before = dispatch.ran[("backward_jvp", "triton")]
        got = ops.run_pass("backward_jvp", call, {**inputs, "row_sums": given_sums})
        assert dispatch.ran[("backward_jvp", "triton")] == before + 1
    with use_backend("tiles"):
        want = ops.run_pass("backward_jvp", call, inputs)
    for name, a, b in zip(("tq", "tk", "tv", "tbias"), got, want):
        if b.numel():
            assert rel_err(a, b) < EXACT, name


@interpreted
def test_triton_takes_an_hvps_row_sums_and_no_ring_steps():
    """Triton takes the rows' sums a Hessian-vector product's passes carry, and refuses a ring
    step's (a part of each row's keys: torch-ops takes those); torch-ops refuses an HVP's,
    whose t - c it would read as a ring step's t."""
    q = randn(1, 2, 5, 4, seed=2)
    call = make_call(q, q, q)
    centre = q.new_zeros(1, 2, 5, 1)
    forward_sums = _hvp_sums(call)
    backward_sums = HvpSums(centre=centre, peak=centre, peak_index=forward_sums["peak_index"], out_t=q)
    with use_backend("triton"):
        assert dispatch.choose("forward_jvp", call, {"row_sums": forward_sums}).name == "triton"
        assert dispatch.choose("backward_jvp", call, {"row_sums": backward_sums, "bias_grad": False}).name == "triton"
        for pass_name, ring_sums in (("backward_jvp", RingSums(centre=centre, delta_t=centre)),
                                     ("jvp", RingSums(centre=centre, centre_sums=centre)),
                                     ("double_backward", RingSums(centre=centre, g_centre=centre))):
            with pytest.raises(RuntimeError, match="a ring step's"):
                dispatch.choose(pass_name, call, {"row_sums": ring_sums, "bias_grad": False})
    with use_backend("torch-ops"), pytest.raises(RuntimeError, match="a ring step's rows' sums"):
        dispatch.choose("backward_jvp", call, {"row_sums": backward_sums, "bias_grad": False})
    # the kernel writes them by row index: a strided or short tensor is refused by name
    strided = HvpSums(forward_sums, peak_sums=q.new_empty(1, 2, 5, 2)[..., :1])
    with use_backend("triton"), pytest.raises(ValueError, match=r"row_sums' peak_sums must be contiguous .* \(1, 2, 5\)"):
        ops.run_pass("forward_jvp", call, {"tq": q, "tk": None, "tv": None, "tbias": None, "row_sums": strided})
