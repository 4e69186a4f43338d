"""NaN and Inf propagate (issue 58, item 4): a NaN or Inf that reaches a row's scores leaves
that row NaN, in every backend and every pass, where a row that sees no key by its masks
gives 0. The reference is float64 autograd of the plain softmax definition: the NaN
positions of each result must be the same as its, and every other entry the same to 1e-12.

A row whose softmax sum is NaN once looked to the compiled tiles like a row that saw no key
(`!(l > 0)`), and came out 0: a silent 0 that hides a diverged run from every NaN check.
"""

import math

import pytest

torch = pytest.importorskip("torch")

from attngrad.check.torch_backend import every_derivative  # noqa: E402
from attngrad.torch import attention  # noqa: E402
from attngrad.torch.op.dropout import Placement  # noqa: E402

from ...conftest import EXACT, rel_err  # noqa: E402
from ..conftest import make_call  # noqa: E402

B, H, HKV, LQ, LK, D, DV = 2, 2, 1, 7, 9, 5, 4


@pytest.fixture(autouse=True)
def _small_tiles(many_blocks):
    """Every case crosses many blocks, in each backend (`every_backend`: Triton's too)."""


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def definition(q, k, v, bias=None, *, allowed=None, causal=False):
    """softmax(scale Q K^T + bias, masked entries -inf) V in PyTorch operators, GQA by
    repeating K and V; a row that sees no key gives 0 (its scores are set to 0 before the
    softmax and its P to 0 after, so that no NaN of the all -inf row reaches autograd)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    if causal:
        allowed = torch.ones(s.shape[-2:], dtype=torch.bool).tril() & (True if allowed is None else allowed)
    if allowed is None:
        return torch.softmax(s, -1) @ v
    seen = allowed.any(-1, keepdim=True)
    s = torch.where(seen, s.masked_fill(~allowed, float("-inf")), 0.0)
    return torch.where(seen, torch.softmax(s, -1), 0.0) @ v


def derivatives(fn, primals):
    """every_derivative's results: out, the gradients, the JVP, the double backward and the
    forward-over-reverse HVP (the backward's JVP), from the same dO and tangents each time."""
    return every_derivative(fn, tuple(primals), seed=58)


def assert_same_nans(ours: dict, ref: dict, names=None) -> None:
    """NaN where the reference has NaN, and nowhere else; equal to 1e-12 elsewhere."""
    for name in names or ref:
        a, r = ours[name].detach(), ref[name].detach()
        assert torch.equal(a.isnan(), r.isnan()), (
            f"{name}: NaN at {a.isnan().nonzero().tolist()}, the definition's at {r.isnan().nonzero().tolist()}")
        finite = ~r.isnan()
        assert torch.equal(a[finite].isinf(), r[finite].isinf()), name
        kept = finite & r.isfinite()
        assert rel_err(a[kept], r[kept]) <= EXACT, f"{name}: {rel_err(a[kept], r[kept]):.2g}"


def primals(bias=False):
    q, k, v = randn(B, H, LQ, D, seed=1), randn(B, HKV, LK, D, seed=2), randn(B, HKV, LK, DV, seed=3)
    return [q, k, v] + ([randn(B, H, LQ, LK, seed=4)] if bias else [])


# (input, index, value): one entry of q (a row), of k or v (a key), or of the bias (a score)
POISONS = {
    "nan-in-q-row": (0, (1, 0, 3, 2), math.nan),
    "inf-in-q-row": (0, (0, 1, 4, 0), math.inf),  # scores +-inf: exp(inf - inf) = NaN in the softmax
    "nan-in-k-key": (1, (0, 0, 5, 1), math.nan),
    "nan-in-v-key": (2, (1, 0, 2, 3), math.nan),
    "nan-in-bias": (3, (0, 1, 6, 4), math.nan),
}


# Triton's interpreter runs its kernels in NumPy, which warns at inf - inf (the point here)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("poison", list(POISONS))
def test_nan_reaches_what_the_definition_says_in_every_pass(every_backend, poison):
    """Without masks every row sees every key: a NaN in q's row i (or Inf: scores +-inf),
    in a key's k or v, or in a bias entry, gives NaN exactly where float64 autograd of the
    definition does, in the output, the gradients, the JVP, the double backward and the HVP;
    the rest to 1e-12. A NaN in one key spreads to every row of its batch entry (both heads:
    GQA), one in a row of q to that row's output and dQ and to all of dK and dV."""
    where, index, value = POISONS[poison]
    inputs = primals(bias=where == 3)
    inputs[where][index] = value
    ref = derivatives(lambda q, k, v, *b: definition(q, k, v, *b), inputs)
    ours = derivatives(lambda q, k, v, *b: attention(q, k, v, attn_bias=b[0] if b else None, enable_gqa=True),
                       inputs)
    assert ref["out"].isnan().any()  # the case tests something
    assert_same_nans(ours, ref)


def test_a_nan_row_stays_nan_and_a_masked_row_zero_under_masks(every_backend):
    """Causal and a boolean mask, under which row 2 of batch entry 1 sees no key, and a NaN in
    row 5 of q there: row 5 is NaN in the output, the JVP and dQ, and so is every dK and dV
    row of the keys it sees; row 2 is exactly 0, its dQ and dQ's tangent too; every other
    entry of the output, dQ and the JVP equals the definition's to 1e-12. (The definition's
    own dK and dV are NaN at every key of the head, past the mask: softmax of a NaN row is
    NaN at its -inf entries too. A backend that multiplies those entries' P = 0 by the NaN
    may give NaN there; it must give it at the keys the row sees.)"""
    allowed = randn(B, 1, LQ, LK, seed=5) > -0.7
    allowed[..., 0] = True
    allowed[1, :, 2] = False
    q, k, v = primals()
    q[1, 0, 5, 1] = math.nan
    ref = derivatives(lambda q, k, v: definition(q, k, v, allowed=allowed, causal=True), [q, k, v])
    ours = derivatives(lambda q, k, v: attention(q, k, v, attn_mask=allowed, is_causal=True, enable_gqa=True),
                       [q, k, v])
    assert_same_nans(ours, ref, ["out", "dq", "jvp"])
    for name in ("out", "dq", "jvp", "hvp_q", "gg_q", "gg_dout"):
        assert torch.equal(ours[name][1, :, 2], torch.zeros_like(ours[name][1, :, 2])), name
    sees = (allowed[1, 0, 5] & (torch.arange(LK) <= 5))  # the keys row 5 sees
    for name in ("dk", "dv"):
        assert ours[name][1, 0, sees].isnan().all(), name
        assert_same_nans({name: ours[name][0]}, {name: ref[name][0]})  # batch entry 0: no NaN


def test_a_nan_key_reaches_the_rows_that_see_it_under_the_causal_mask(every_backend):
    """A NaN in k at key 3: rows 3 on (which see it) are NaN in the output and the JVP, rows
    0 to 2 (which do not) give the definition's output to 1e-12, and row 2 of batch entry 1,
    which sees no key, gives 0. The JVP of rows 0 to 2 may be NaN: their tangent scores hold
    the NaN at the masked key, and a backend that sums P' = P (S' - rowsum(P S')) over the
    masked entries (P = 0) multiplies 0 by it, as PyTorch's math path does; where it is not
    NaN it is the definition's."""
    allowed = torch.ones(B, 1, LQ, LK, dtype=torch.bool)
    allowed[1, :, 2] = False
    q, k, v = primals()
    k[1, 0, 3, 0] = math.nan
    tangents = tuple(randn(*t.shape, seed=9 + i) for i, t in enumerate((q, k, v)))
    fn = lambda q, k, v: attention(q, k, v, attn_mask=allowed, is_causal=True, enable_gqa=True)  # noqa: E731
    out, out_t = torch.func.jvp(fn, (q, k, v), tangents)
    ref, ref_t = torch.func.jvp(lambda q, k, v: definition(q, k, v, allowed=allowed, causal=True), (q, k, v),
                                tangents)
    assert_same_nans({"out": out}, {"out": ref})
    assert out[1, :, 3:].isnan().all() and not out[1, :, :3].isnan().any()
    assert torch.equal(out[1, :, 2], torch.zeros_like(out[1, :, 2]))
    assert out_t[1, :, 3:].isnan().all()
    # a NaN value: row 2 still gives 0, though its zero weights times the NaN (0 x NaN) are NaN
    v_nan = v.clone()
    v_nan[1, 0, 0, 1] = math.nan  # key 0, which every row but row 2 sees
    out_v = fn(q, k.nan_to_num(), v_nan)
    assert torch.equal(out_v[1, :, 2], torch.zeros_like(out_v[1, :, 2]))
    others = torch.arange(LQ) != 2
    assert out_v[1, :, others, 1].isnan().all() and not out_v[0].isnan().any()  # O = P V: column 1
    assert torch.equal(ref_t[1, :, 2], torch.zeros_like(ref_t[1, :, 2]))
    finite = ~out_t.isnan()
    assert torch.equal(finite[0], torch.ones_like(finite[0])), "batch entry 0 has no NaN"
    assert rel_err(out_t[finite], ref_t[finite]) <= EXACT


@pytest.mark.parametrize("where,index", [(0, (1, 0, 3, 2)), (1, (0, 0, 5, 1))], ids=["nan-in-q-row", "nan-in-k-key"])
def test_given_sums_pass_and_its_ring_parts_keep_nan(where, index):
    """The compiled tiles' backward JVP given the rows' sums (a ring step's), on the whole
    keys and on two parts of them: NaN in the HVP exactly where float64 autograd of the
    definition has it, the rest to 1e-12, from the tiles' own forward statistics (a NaN row's
    1/l NaN) and the torch-ops kernels' sums."""
    native = pytest.importorskip("attngrad.torch.backends.cpu_tiles.native")
    if native.library() is None:
        pytest.skip(f"no compiled tiles: {native.build_info.reason}")
    from attngrad.torch.backends.torch_ops import higher_order
    inputs = primals()
    inputs[where][index] = math.nan
    q, k, v = inputs
    dout, tdout = randn(B, H, LQ, DV, seed=6), randn(B, H, LQ, DV, seed=7)
    tq, tk, tv = (randn(*t.shape, seed=8 + i) for i, t in enumerate(inputs))
    scale = D ** -0.5
    k_rep, v_rep, tk_rep, tv_rep = (t.repeat_interleave(H // HKV, 1) for t in (k, v, tk, tv))  # the kernels' GQA
    out, row_max, inv_sum = native.attention_forward(make_call(q, k_rep, v_rep, scale=scale))
    assert inv_sum[1, 0, 3].isnan() if where == 0 else inv_sum[0].isnan().all()  # the rows it reached
    call = make_call(q, k_rep, v_rep, scale=scale)
    jvp_inputs = dict(row_max=row_max, inv_sum=inv_sum, tq=tq, tk=tk_rep, tv=tv_rep, tbias=None)
    centre = torch.zeros(B, H, LQ, 1, dtype=torch.float64)
    higher_order.attention_jvp(call, **jvp_inputs, row_sums=dict(centre=torch.zeros_like(centre),
                                                                   centre_sums=centre))
    delta_t = (dout * higher_order.attention_jvp(call, **jvp_inputs)).sum(-1, keepdim=True) + \
        (tdout * out).sum(-1, keepdim=True)
    inputs = dict(dout=dout, out=out, row_max=row_max, inv_sum=inv_sum, tdout=tdout, tq=tq,
                  row_sums=dict(centre=centre, delta_t=delta_t))
    whole = native.attention_backward_jvp_given_sums(call, dict(inputs, tk=tk_rep, tv=tv_rep))
    parts = [native.attention_backward_jvp_given_sums(
        make_call(q, k_rep[:, :, lo:hi], v_rep[:, :, lo:hi], scale=scale, seed=Placement(0, 0, lo, 0, 1).tensor()),
        dict(inputs, tk=tk_rep[:, :, lo:hi], tv=tv_rep[:, :, lo:hi])) for lo, hi in ((0, 4), (4, LK))]
    joined = (parts[0][0] + parts[1][0], torch.cat([parts[0][1], parts[1][1]], 2),
              torch.cat([parts[0][2], parts[1][2]], 2))
    vjp = lambda q, k, v, do: torch.func.vjp(definition, q, k, v)[1](do)  # noqa: E731
    _, hvp = torch.func.jvp(vjp, (q, k_rep, v_rep, dout), (tq, tk_rep, tv_rep, tdout))
    ref = dict(zip(("dq_t", "dk_t", "dv_t"), hvp))
    assert ref["dq_t"].isnan().any()
    for results in (whole, joined):
        assert_same_nans(dict(zip(("dq_t", "dk_t", "dv_t"), results)), ref)
