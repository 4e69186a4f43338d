"""The Triton backend, every pass and every feature, against PyTorch's math path; float32's
error against the CPU tiles', half precision within its type's rounding; dropout's bits, the
same bits run to run, rows centred on their peak key, and scores in base 2 and loads through
tensor descriptors giving what the plain walks give.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1,
which tests/conftest.py sets before anything imports triton); on a machine with CUDA,
`TRITON_INTERPRET=0 pytest -m gpu` runs the same tests compiled, on the GPU. References are
written out in PyTorch operators, float64 (`cases.math_attention`), so autograd
differentiates them to any order: output, gradients (with the bias or sinks), the JVP, the
double backward and forward-over-reverse Hessian-vector products.
"""

import pytest
from hypothesis import given, settings

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

from attngrad.check.torch_backend import every_derivative  # noqa: E402
from attngrad.torch import attention, use_backend  # noqa: E402
from attngrad.torch.backends.triton import config, launch  # noqa: E402
from attngrad.torch.op import dispatch, dropout, ops  # noqa: E402

from ....conftest import EXACT, assert_all_close, examples, rel_err  # noqa: E402
from ...cases import calls  # noqa: E402
from ...conftest import make_call, op_attention  # noqa: E402
from .cases import CASES, DEVICES, DOUBLE, Case, case_of, interpreted, randn, zero_gradients  # noqa: E402

# Cases whose features the suite's other cases and draws hold (GQA, a window and sinks,
# bottom-right causal with a soft cap and a bias): the full tier runs them on the interpreter.
FULL_TIER_CASES = ("gqa", "window-sinks", "bottom-right-softcap-bias")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.full) if name in FULL_TIER_CASES else name
                                  for name in CASES])
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
@pytest.mark.parametrize("name", [pytest.param("sliced-heads", marks=pytest.mark.full), "dropout-per-key-bias"])
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


@interpreted
@settings(max_examples=examples(10, 30), deadline=None)
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
@pytest.mark.parametrize("key_side", [pytest.param("split", marks=pytest.mark.full), "light", "fused"])
def test_scores_in_base_two_give_every_derivative_and_natural_row_maxima(on_triton, tiles_of, tuned, key_side):
    """log2(e) folded into the scale (`Options.exp2_dtypes`, half precision by default),
    forced here for float64: a light call's every derivative (causal bottom-right, GQA,
    Lq != Lk, several blocks) within 1e-12 of the math path, on each way the backward takes
    a light call's key side; and the row maxima the forward and its fused JVP store are in
    natural units, as the kernels that take no base 2 (`jvp`, `row_sums`) read them."""
    tiles_of(16)
    tuned(config.TUNING, light_key_side=key_side == "light", fused_backward=key_side == "fused")
    case = Case("cpu", causal="bottom_right", len_q=21, len_k=37)
    call = make_call(case.q, case.k, case.v, causal=16, sink=True)
    tangents = dict(tq=randn(*case.q.shape, seed=8), tk=None, tv=None, tbias=None)
    natural = [launch.forward(call), ops.run_pass("forward_jvp", call, tangents)]
    with config.TUNING.override(exp2_dtypes=(DOUBLE,)):
        assert launch.Plan(call, config.TUNING().interpreted).switches.EXP2
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
    tuned(config.TUNING, tensor_descriptors=True)
    described = every_derivative(case.ours, case.primals, 30)
    assert taken and all(taken)
    for key, value in pointers.items():
        assert torch.equal(described[key], value), key
