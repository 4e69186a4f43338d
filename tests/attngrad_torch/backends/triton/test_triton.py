"""The Triton backend, every pass and every feature, against PyTorch's math path.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1,
which tests/conftest.py sets before anything imports triton); on a machine with CUDA,
`TRITON_INTERPRET=0 pytest -m gpu` runs the same tests compiled, on the GPU. References are written out in PyTorch operators, float64, so
autograd differentiates them to any order: output, gradients (with the bias or sinks),
the JVP, the double backward and forward-over-reverse Hessian-vector products.
"""

import math
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from attngrad.check.torch_backend import every_derivative  # noqa: E402
from attngrad.torch import attention, use_backend  # noqa: E402
from attngrad.torch.backends import triton as triton_backend  # noqa: E402
from attngrad.torch.backends.triton import launch  # noqa: E402
from attngrad.torch.backends.triton.kernels import dq_rank  # noqa: E402
from attngrad.torch.op import dispatch, dropout, ops  # noqa: E402
from attngrad.torch.op.call import HvpSums, RingSums, ScoreMasks  # noqa: E402

from ....conftest import EXACT, assert_all_close, rel_err  # noqa: E402
from ...conftest import make_call, op_attention  # noqa: E402
from ...op.test_forward_jvp import calls  # noqa: E402

B, H, HKV, LQ, LK, D, DV = 2, 2, 1, 19, 23, 16, 8
DOUBLE = torch.float64
INTERPRETED = triton_backend.interpreting()
# the tests are float64, which Triton compiles for a GPU from 3.9 on (the backend refuses it before)
DEVICES = (["cpu"] if INTERPRETED else []) + ([pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    triton_backend._old_triton(), reason="float64 on a GPU needs Triton 3.9 or later")])]
    if torch.cuda.is_available() and not INTERPRETED else [])
# the tests on CPU tensors: they need the interpreter
interpreted = pytest.mark.skipif(not INTERPRETED, reason="the Triton kernels are compiled (TRITON_INTERPRET=0)")


@pytest.fixture
def on_triton():
    """Only the triton backend runs; the test fails if a pass ran elsewhere."""
    before = dict(dispatch.ran)
    with use_backend("triton"):
        yield
    ran = {name for key, count in dispatch.ran.items() if count > before.get(key, 0) for name in key[1:]}
    assert ran <= {"triton"}, f"passes ran on {ran}"


def randn(*shape, seed, dtype=DOUBLE, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(device)


def math_attention(q, k, v, *, allowed=None, bias=None, softcap=0.0, sinks=None, keep=None, dropout_p=0.0):
    """Softmax attention in PyTorch operators (differentiable to any order): GQA by repeating
    K and V, the cap before the bias, a sink as one more key of value 0, dropout's keep-mask."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[:, None, None].expand(*s.shape[:-1], 1)], -1)
    p = torch.softmax(s, -1)
    if sinks is not None:
        p = p[..., :-1]
    if keep is not None:
        p = p * keep / (1 - dropout_p)
    return p @ v


def _rows(lq, lk, device):
    return torch.arange(lq, device=device)[:, None], torch.arange(lk, device=device)[None, :]


class Case:
    """One configuration: primals (q, k, v and a learned bias or sinks), and the two functions."""

    def __init__(self, device, *, len_q=LQ, len_k=LK, causal=False, mask=False, bias=None, softcap=0.0, sinks=False,
                 window=None, documents=False, padding=False, dropout_p=0.0, d=D, dv=DV):
        self.device = device
        if documents:
            len_k = len_q
        self.q = randn(B, H, len_q, d, seed=1, device=device)
        self.k, self.v = randn(B, HKV, len_k, d, seed=2, device=device), randn(B, HKV, len_k, dv, seed=3, device=device)
        self.extra = None
        if bias is not None:
            self.extra = randn(*bias, seed=4, device=device)
        elif sinks:
            self.extra = randn(H, seed=4, device=device)
        self.options = dict(is_causal=causal, softcap=softcap or None, dropout_p=dropout_p, enable_gqa=True)
        self.softcap, self.dropout_p, self.bias_given, self.sinks = softcap, dropout_p, bias is not None, sinks
        i, j = _rows(len_q, len_k, device)
        allowed = torch.ones(B, 1, len_q, len_k, dtype=torch.bool, device=device)
        offset = 0 if causal in (False, True) else len_k - len_q
        if causal:
            allowed &= j <= i + offset
        if mask:
            self.mask = randn(B, 1, len_q, len_k, seed=5, device=device) > -0.7
            self.mask[..., 0] = True  # every row keeps a key
            if mask == "holes":  # kept whole but for a few tiles' entries: the others need no masking
                self.mask[:] = True
                self.mask[0, :, 3:12, 5:7] = False
                self.mask[:, :, 20:24, 20] = False
            self.options["attn_mask"] = self.mask
            allowed &= self.mask
        if window is not None:
            self.options["window"] = window
            allowed &= j >= i + offset - window[0]
        if documents:
            ids = torch.tensor([0] * 5 + [1] * 6 + [2] * (len_q - 11), device=device)
            self.options["document_ids"] = ids
            allowed &= ids[:, None] == ids[None, :]
        if padding:
            lengths = torch.tensor([len_k - 3, len_k - 6], device=device)  # every document keeps a key
            self.options["key_padding"] = lengths
            allowed &= (j < lengths[:, None, None, None])
        self.allowed = allowed
        self.keep = None
        if dropout_p:
            self.seed = 20261125
            self.keep = dropout.keep_scale_torch(torch.empty(B, H, len_q, len_k, dtype=DOUBLE), self.seed, 0,
                                                 dropout_p).to(device) > 0

    @property
    def primals(self):
        return (self.q, self.k, self.v) + (() if self.extra is None else (self.extra,))

    def ours(self, q, k, v, extra=None):
        options = dict(self.options)
        if self.bias_given:
            options["attn_bias"] = extra
        if self.sinks:
            options["sinks"] = extra
        if self.dropout_p:  # the op, whose seed is given
            causal = {False: None, True: 0, "bottom_right": k.shape[2] - q.shape[2]}[options["is_causal"]]
            return op_attention(q, k, v, bias=extra, causal=causal, seed=torch.tensor(self.seed),
                                dropout_p=self.dropout_p)
        return attention(q, k, v, **options)

    def theirs(self, q, k, v, extra=None):
        return math_attention(q, k, v, allowed=self.allowed, bias=extra if self.bias_given else None,
                              softcap=self.softcap, sinks=extra if self.sinks else None, keep=self.keep,
                              dropout_p=self.dropout_p)


# Each case puts several features together (the interpreter runs about 10^4 Triton
# operations a second). `blocks`: the interpreter's tile, 16 (several blocks per row and
# column, partly skipped) or 32 (one block: the fast cases); `slice`: the columns of the head
# width its products take at a time (0: all), here 16 of d = 24 and dv = 20 (padded to 32
# and 32), so every product over the width runs its loop of slices, the last one partial.
CASES = {
    "gqa": dict(blocks=32),
    "causal-mask-bias": dict(causal=True, mask=True, bias=(LQ, LK), blocks=16),
    "bottom-right-softcap-bias": dict(causal="bottom_right", len_q=11, softcap=2.0, bias=(B, H, 11, LK), blocks=32),
    "window-sinks": dict(causal=True, window=(5, None), len_q=LK, sinks=True, blocks=32),
    "documents-padding": dict(documents=True, padding=True, blocks=16),
    "dropout-per-key-bias": dict(dropout_p=0.3, causal=True, bias=(B, 1, 1, LK), blocks=32),
    "sliced-heads": dict(d=24, dv=20, causal="bottom_right", len_q=11, softcap=2.0, bias=(1, H, 1, LK), blocks=32,
                         slice=16),
    # tiles that need no masking (`block_map.unmasked_tiles`), walked in their own loop: of
    # the whole tiles (query blocks 0 and 1 of 3, key blocks 0 and 1 of 3), the diagonal (15)
    # and the mask's holes leave (1, 0) unmasked, (0, 0) in the second batch entry alone
    "interior-bias-softcap-holes": dict(causal="bottom_right", len_q=33, len_k=48, softcap=2.0, bias=(B, H, 33, 48),
                                        mask="holes", blocks=16),
}


def case_of(name, tiles_of, device="cpu"):
    options = dict(CASES[name])
    tiles_of(options.pop("blocks"), options.pop("slice", 0))
    return Case(device, **options)


def zero_gradients(name):
    """The derivatives that are 0 in exact arithmetic: a bias constant along the keys (softmax
    ignores a row's shift) has none; both sides hold rounding noise there."""
    return ("dextra", "gg_extra", "hvp_extra", "rof_extra", "rof_textra") if CASES[name].get("bias", (1,))[-1] == 1 \
        else ()


@pytest.fixture
def tiles_of(monkeypatch, tuned):
    """Set the interpreter's tile (rows = keys) and head-width slice."""
    def set_blocks(size, slice_=0):
        tuned(launch.TUNING, interpreted=launch.Blocks(size, size, 1, 1, slice_))
    return set_blocks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CASES)
def test_every_pass_matches_the_math_path(on_triton, tiles_of, device, name):
    case = case_of(name, tiles_of, device)
    ours = every_derivative(case.ours, case.primals, 30)
    theirs = every_derivative(case.theirs, case.primals, 30)
    assert_all_close({k: v.cpu() for k, v in ours.items()}, {k: v.cpu() for k, v in theirs.items()},
                     zeros=set(zero_gradients(name)))


@interpreted
def test_dropout_mask_is_the_cpu_tiles_bit_for_bit():
    """V = the identity and Q = 0 make every row's P = 1/Lk exactly, so O = Z / Lk recovers the
    keep-scale Z of every score: it must be dropout.py's, entry for entry, at an offset
    placement too (a ring step or head group of a larger call)."""
    lk, p = 32, 0.5  # Z = 2 and P = 1/32: O = Z / 32 exactly
    q = torch.zeros(2, 3, 21, 16, dtype=DOUBLE)
    k = randn(2, 3, lk, 16, seed=1)
    v = torch.eye(lk, dtype=DOUBLE).expand(2, 3, lk, lk)
    for placement in (dropout.Placement(987654321987), dropout.Placement(-5, 7, 3, 2)):
        with use_backend("triton"):
            out = op_attention(q, k, v, seed=placement.tensor(), dropout_p=p)
        expected = dropout.keep_scale_torch(torch.empty(2, 3, 21, lk, dtype=DOUBLE), placement.seed,
                                            placement.row_offset, p, placement.key_offset, placement.head_offset)
        assert torch.equal(out * lk, expected)
        with use_backend("tiles"):
            assert torch.equal(op_attention(q, k, v, seed=placement.tensor(), dropout_p=p), out)


@interpreted
@pytest.mark.parametrize("name", ["sliced-heads", "dropout-per-key-bias"])
def test_float32_error_is_within_twice_the_cpu_tiles(tiles_of, name):
    """IEEE float32 GEMMs: every derivative's error against float64 within 2x the compiled
    CPU tiles' (the two sum in other orders; neither is the truth)."""
    case = case_of(name, tiles_of)
    truth = every_derivative(case.theirs, case.primals, 40)
    single = tuple(p.float() for p in case.primals)
    errors = {}
    for implementation in ("triton", "tiles"):
        with use_backend(implementation):
            ours = every_derivative(case.ours, single, 40)
        errors[implementation] = {n: rel_err(ours[n].double(), truth[n]) for n in ours}
    for n, error in errors["triton"].items():
        if n in zero_gradients(name):
            continue
        assert error <= 2 * errors["tiles"][n] + 1e-7, f"{n}: triton {error:.2e}, tiles {errors['tiles'][n]:.2e}"


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_runs_in_its_own_type(on_triton, tiles_of, dtype):
    """float16 and bfloat16: products in the input type, sums and softmax statistics in
    float32, results in the inputs' dtype, within the type's rounding of float64."""
    case = case_of("bottom-right-softcap-bias", tiles_of)
    truth = every_derivative(case.theirs, case.primals, 50)
    ours = every_derivative(case.ours, tuple(p.to(dtype) for p in case.primals), 50)
    bar = 2e-2 if dtype == torch.bfloat16 else 3e-3
    for n in ("out", "dq", "dk", "dv", "dextra", "jvp"):
        assert ours[n].dtype == dtype
        assert rel_err(ours[n].double(), truth[n]) < bar, n


@pytest.mark.parametrize("device", DEVICES)
def test_same_inputs_same_bits(on_triton, tiles_of, device):
    """Every result is written by one program in a fixed order: no atomics, so a second run,
    the bias gradient reduced over batch and rows included, gives the same bits (on a GPU,
    where programs run concurrently, this is what it guards)."""
    case = case_of("dropout-per-key-bias", tiles_of, device)

    def first_order():
        leaves = [p.clone().requires_grad_() for p in case.primals]
        out = case.ours(*leaves)
        return (out, *torch.autograd.grad(out, leaves, randn(*out.shape, seed=61, device=device)))

    assert all(torch.equal(a, b) for a, b in zip(first_order(), first_order()))


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
    half, light = torch.bfloat16, launch._HOPPER_LIGHT[("backward", "half", 128)]
    assert launch.blocks_for("backward", half, 128, False, arch=90, light=True) == light
    assert launch.blocks_for("backward", half, 100, False, arch=90, light=True) == light  # padded to 128
    general = launch._TABLE[("backward", "half", 128)]
    assert general != light
    assert launch.blocks_for("backward", half, 128, False, arch=80, light=True) == general
    assert launch.blocks_for("backward", half, 128, False, arch=90, light=False) == general
    assert launch.blocks_for("backward", torch.float32, 128, False, arch=90, light=True) == \
        launch._TABLE[("backward", "float32", 128)]
    assert launch.blocks_for("backward", half, 128, True, arch=90, light=True) == launch.TUNING().interpreted


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
    monkeypatch.setattr(launch, "blocks_for", lambda *args, **kwargs: seen.append(kwargs["light"]) or launch.TUNING().interpreted)
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
        tuned(launch.TUNING, interior_tiles=split)
        counts.clear()
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, is_causal=True)
        return (out, *torch.autograd.grad(out, leaves, dout))

    split = step(True)
    assert counts and all(n > 0 for n in counts)
    tuned(launch.TUNING, interpreted=launch.Blocks(16, 16, 1, 1, split=False))
    one_loop = step(True)
    assert counts and all(n > 0 for n in counts)
    assert all(torch.equal(a, b) for a, b in zip(split, one_loop))
    whole = step(False)
    assert counts and not any(counts)
    for a, b in zip(split, whole):
        assert rel_err(a, b) <= 1e-14


@interpreted
def test_sinks_beside_a_key_varying_bias_are_exact_in_every_derivative(on_triton):
    """The sinks' closed forms on Triton (`sink_logits`; each row's term from the kernels' row
    sums, `launch._sink_rows`): every derivative within 1e-12 of autograd of the definition,
    per-batch sinks at -8 and -3 beside a bias that varies along the keys."""
    from ...op.test_sinks import every_derivative_beside_a_bias

    q, k, v = (randn(2, 2, n, 8, seed=s) for s, n in enumerate((9, 12, 12)))
    assert_all_close(*every_derivative_beside_a_bias(q, k, v, randn(1, 2, 9, 12, seed=3), seed=5))


@interpreted
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_the_jvp_centres_peaked_rows(on_triton, with_sinks):
    """The JVP's row sum t = rowsum(P S') cancels on a row whose softmax is peaked: summed
    uncentred, O' = P (S' - t) V erred 5.6e-11 at 1 - max P = 3.7e-11. Centred on each row's
    most probable key as the kernel walks (`kernels.jvp`), against the definition's JVP
    written centred in float64, it is within 1e-12 (with a sink's share too)."""
    worst = 0.0
    for seed in range(40):
        q, k, v = (randn(1, 1, n, 16, seed=100 + 3 * seed + i) for i, n in enumerate((3, 22, 22)))
        q = 1.8 * q
        tq = 10 * randn(1, 1, 3, 16, seed=7 + seed)
        sinks = torch.tensor([-0.5], dtype=DOUBLE) if with_sinks else None
        s = q @ k.transpose(-1, -2) * 2.0
        s_t = tq @ k.transpose(-1, -2) * 2.0
        full = s if sinks is None else torch.cat([s, sinks.expand(*s.shape[:-1], 1)], dim=-1)
        p = torch.softmax(full, dim=-1)[..., :s.shape[-1]]
        p_sink = 1 - p.sum(-1, keepdim=True) if sinks is None else torch.softmax(full, dim=-1)[..., -1:]
        c = s_t.gather(-1, p.argmax(-1, keepdim=True))
        t_less = (p * (s_t - c)).sum(-1, keepdim=True) - (0 if sinks is None else c * p_sink)
        truth = (p * ((s_t - c) - t_less)) @ v
        ours = torch.func.jvp(lambda q: attention(q, k, v, scale=2.0, sinks=sinks), (q,), (tq,))[1]
        worst = max(worst, rel_err(ours, truth))
    assert worst < 1e-12


def _exact_hvp(q, k, v, dout, tangents, scale, sink=None):
    """H t for L = <attention(q, k, v), dO>, from mpmath at 60 digits: the gradient written
    out (dS = P (dP - D)), differenced along t with a step of 1e-25, far below float64's
    rounding. One (b, h) slice; a sink is one more entry of the row, of value 0."""
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 60

    def matrix(t):
        return mp.matrix([[mp.mpf(x) for x in row] for row in t[0, 0].tolist()])

    def gradient(q, k, v, do):
        s = q * k.T * scale
        p = mp.matrix(s.rows, s.cols)
        for i in range(s.rows):
            row = [s[i, j] for j in range(s.cols)] + ([mp.mpf(sink)] if sink is not None else [])
            top = max(row)
            e = [mp.exp(x - top) for x in row]
            for j in range(s.cols):
                p[i, j] = e[j] / sum(e)
        o, dp = p * v, do * v.T
        ds = mp.matrix(s.rows, s.cols)
        for i in range(s.rows):
            delta = sum(do[i, c] * o[i, c] for c in range(v.cols))
            for j in range(s.cols):
                ds[i, j] = p[i, j] * (dp[i, j] - delta)
        return ds * k * scale, ds.T * q * scale, p.T * do

    step = mp.mpf(10) ** -25
    primals, along, do = [matrix(x) for x in (q, k, v)], [matrix(t) for t in tangents], matrix(dout)
    ahead = gradient(*[x + step * t for x, t in zip(primals, along)], do)
    behind = gradient(*[x - step * t for x, t in zip(primals, along)], do)
    return [torch.tensor([[float((a[i, j] - b[i, j]) / (2 * step)) for j in range(a.cols)] for i in range(a.rows)],
                         dtype=DOUBLE)[None, None] for a, b in zip(ahead, behind)]


def _peaked_rows_error(seed: int, with_sinks: bool) -> float:
    """The largest error of the HVP and the double backward against `_exact_hvp` on three
    query rows, some of them peaked (1.8 q, scale 2)."""
    q, k, v = (randn(1, 1, n, 16, seed=100 + 3 * seed + i) for i, n in enumerate((3, 22, 22)))
    q = 1.8 * q
    tangents = (10 * randn(1, 1, 3, 16, seed=7 + seed), randn(1, 1, 22, 16, seed=9 + seed),
                randn(1, 1, 22, 16, seed=11 + seed))
    dout = randn(1, 1, 3, 16, seed=13 + seed)
    sinks = torch.tensor([-0.5], dtype=DOUBLE) if with_sinks else None

    def ours(q, k, v):
        return attention(q, k, v, scale=2.0, sinks=sinks)

    truth = _exact_hvp(q, k, v, dout, tangents, 2.0, None if sinks is None else -0.5)
    hvp = torch.func.jvp(lambda *x: torch.func.vjp(ours, *x)[1](dout), (q, k, v), tangents)[1]
    primals = [x.detach().requires_grad_() for x in (q, k, v)]
    grads = torch.autograd.grad(ours(*primals), primals, dout, create_graph=True)
    second = torch.autograd.grad(sum((g * t).sum() for g, t in zip(grads, tangents)), primals)
    return max(rel_err(a, b) for got in (hvp, second) for a, b in zip(got, truth))


@interpreted
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("seed", [16, 37])
def test_the_backward_type_passes_centre_peaked_rows(on_triton, seed, with_sinks):
    """The backward's JVP and the double backward take t = rowsum(P S') (or rowsum(P T)) and
    u from `row_sums`, and on a peaked row P (S' - t) and P (g_P - u) cancel t's and u's
    rounding. Centred on each row's peak key, whose index the walks read so that its term is
    0 in every kernel, both are within 1e-12 of an exact HVP (mpmath) on the rows where
    uncentred they erred 1.4e-12 to 1.3e-11 (centred: at most 4.7e-13)."""
    assert _peaked_rows_error(seed, with_sinks) < 1e-12


@interpreted
def test_the_walks_zero_the_peak_by_its_index(on_triton, monkeypatch):
    """A compiled walk need not compute S' at the peak key with the row sums' bits. With the
    centres c and c2 moved by a few ulps, as another kernel's rounding might move them, the
    peak's term stays 0 (`tile_ops.off_peak`) and the passes stay within 1e-12 of the exact HVP;
    subtracting the centre there instead erred 3.5e-11. The HVP's backward takes its sums from
    the forward's walk (`launch._given_row_sums`), the double backward from `row_sums`."""
    def rounded_elsewhere(make):
        def made(plan, inputs, *args):
            make(plan, inputs, *args)
            inputs.sums[:, :, 2:4] *= 1 + 2.0 ** -50
        return made

    monkeypatch.setattr(launch, "_row_sums", rounded_elsewhere(launch._row_sums))
    monkeypatch.setattr(launch, "_given_row_sums", rounded_elsewhere(launch._given_row_sums))
    assert _peaked_rows_error(37, False) < 1e-12


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
        tuned(launch.TUNING, fused_backward=fused, light_key_side=light)
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
    tuned(launch.TUNING, float32_products="tf32x3")
    assert launch.input_precision(torch.float32, cuda) == "tf32x3"
    assert launch.input_precision(torch.float16, cuda) == "ieee"
    assert launch.input_precision(torch.float32, torch.device("cpu")) == "ieee"  # the interpreter's products
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert launch.input_precision(torch.float32, cuda) == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    tuned(launch.TUNING, float32_products="fp32x9")
    with pytest.raises(ValueError, match="float32_products='fp32x9'"):
        launch.input_precision(torch.float32, cuda)


@interpreted
@settings(max_examples=30, deadline=None)
@given(calls())
def test_the_forward_and_its_jvp_take_one_walk(case):
    """float64, every option (masks whose rows see one key or none, bias and its tangent,
    causal, soft cap, dropout, a sink, GQA, Lq != Lk, transposed inputs, absent tangents):
    out, the row statistics (a sink's share in them) and out's tangent from the one walk
    (`kernels.forward_jvp`) equal the tiles' forward (with `ops.add_sink`) and JVP."""
    call, tangents = case
    before = dispatch.ran[("forward_jvp", "triton")]
    with use_backend("triton"):
        fused = ops.run_pass("forward_jvp", call, tangents)
    assert dispatch.ran[("forward_jvp", "triton")] == before + 1
    with use_backend("tiles"):
        out, row_max, inv_sum = ops.run_pass("forward", call, {})
        out_t = ops.run_pass("jvp", call, dict(row_max=row_max, inv_sum=inv_sum, **tangents))
    for name, got, want in zip(("out", "row_max", "inv_sum", "out_t"), fused, (out, row_max, inv_sum, out_t)):
        assert rel_err(got, want) < EXACT, name


@interpreted
@pytest.mark.parametrize("key_side", ["split", "light", "fused"])
def test_scores_in_base_two_give_every_derivative_and_natural_row_maxima(on_triton, tiles_of, tuned, key_side):
    """log2(e) folded into the scale (`Options.exp2_dtypes`, half precision by default),
    forced here for float64: a light call's every derivative (causal bottom-right, GQA,
    Lq != Lk, several blocks) within 1e-12 of the math path, on each way the backward takes
    a light call's key side; and the row maxima the forward and its fused JVP store are in
    natural units, as the kernels that take no base 2 (`jvp`, `row_sums`) read them."""
    tiles_of(16)
    tuned(launch.TUNING, light_key_side=key_side == "light", fused_backward=key_side == "fused")
    case = Case("cpu", causal="bottom_right", len_q=21, len_k=37)
    call = make_call(case.q, case.k, case.v, causal=16, sink=True)
    tangents = dict(tq=randn(*case.q.shape, seed=8), tk=None, tv=None, tbias=None)
    natural = [launch.forward(call), ops.run_pass("forward_jvp", call, tangents)]
    with launch.TUNING.override(exp2_dtypes=(DOUBLE,)):
        assert launch.Plan(call, launch.TUNING().interpreted).switches.EXP2
        in_base_two = [launch.forward(call), ops.run_pass("forward_jvp", call, tangents)]
        ours = every_derivative(case.ours, case.primals, 30)
    for got, want in zip(in_base_two, natural):
        for a, b in zip(got, want):
            assert rel_err(a, b) < 1e-14
    assert_all_close(ours, every_derivative(case.theirs, case.primals, 30))


@interpreted
@pytest.mark.parametrize("name", ["gqa", "window-sinks", "documents-padding"])
def test_tensor_descriptors_load_what_the_pointers_load(on_triton, tiles_of, tuned, monkeypatch, name):
    """K and V (the forward, its fused JVP, the backward's query side, their tangents) and Q
    and dO (the key side) through tensor descriptors (`Options.tensor_descriptors`, TMA on a
    GPU): every derivative bit for bit what the pointer loads give, and the descriptors taken
    in each of those kernels."""
    case = case_of(name, tiles_of)
    taken = []
    made = launch._descriptors

    def counted(plan, rows, *tensors):
        descriptors = made(plan, rows, *tensors)
        taken.append(descriptors is not None)
        return descriptors

    monkeypatch.setattr(launch, "_descriptors", counted)
    pointers = every_derivative(case.ours, case.primals, 30)
    assert taken and not any(taken)
    taken.clear()
    tuned(launch.TUNING, tensor_descriptors=True)
    described = every_derivative(case.ours, case.primals, 30)
    assert taken and all(taken)
    for key, value in pointers.items():
        assert torch.equal(described[key], value), key


def test_tensor_descriptors_only_where_tma_takes_the_tensors(tuned):
    """`launch._descriptors`: none unless asked; none for a tensor whose last axis is not
    contiguous, whose row stride is not a multiple of 16 bytes, or for products taken by
    slices of the width; else one per tensor, blocks of one head's rows by the padded width."""
    q, k = randn(2, 4, 19, 24, seed=1), randn(2, 2, 23, 24, seed=2)
    v = randn(2, 2, 23, 8, seed=3)
    call = make_call(q, k, v)
    plan = launch.Plan(call, launch.Blocks(16, 32, 1, 1))
    assert launch._descriptors(plan, 32, k, v) is None
    tuned(launch.TUNING, tensor_descriptors=True)
    k_d, v_d, absent = launch._descriptors(plan, 32, k, v, None)
    assert (k_d.block_shape, v_d.block_shape, absent) == ([1, 1, 32, 32], [1, 1, 32, 16], None)
    assert launch._descriptors(plan, 32, k.transpose(-1, -2).contiguous().transpose(-1, -2), v) is None
    assert launch._descriptors(plan, 32, k, randn(2, 2, 23, 3, seed=4)) is None  # rows of 24 bytes
    sliced = launch.Plan(call, launch.Blocks(16, 32, 1, 1, slice=16))
    assert launch._descriptors(sliced, 32, k, v) is None


def _hvp_sums(call):
    """The rows' sums a Hessian-vector product's forward asks of forward_jvp (`hvp_fusion.ForwardSums`)."""
    rows = (*call.q.shape[:3], 1)
    return HvpSums(centre_sums=call.q.new_empty(rows), peak_sums=call.q.new_empty(rows),
                   peak_index=call.q.new_full(rows, -1, dtype=torch.int32))


@interpreted
@settings(max_examples=10, deadline=None)  # 300 more by hand: every one within EXACT
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
