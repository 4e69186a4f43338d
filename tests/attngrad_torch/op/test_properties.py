"""One property test: Hypothesis draws the shapes and every feature of `attngrad.torch.attention`
together, and every derivative of every backend is held to float64 autograd of the definition.

Drawn: B 1-2; Hkv 1-2 and H a multiple of it (GQA); Lq, Lk 1-40; E and Ev 1-20, odd or
even; a boolean mask of any broadcast shape, some rows of it empty; a float bias of any
broadcast shape ((Lq, Lk), (1, H, Lq, Lk), (B, 1, Lq, 1), (1, 1, 1, 1), ...), learned; the
causal mask with any diagonal (True, "top_left", "bottom_right", ints that empty rows or
pass the ends); a window (left, right), either side open; key padding as a mask or as
lengths; a soft cap 0.5 to 4 times the scores' spread; sinks; the scale. Dropout is left
to its own tests (dropout_p = 0).

The definition (`by_definition`): S = c tanh(scale Q K^T / c) + bias, -inf where a mask
excludes a key, softmax over [S | s_h] with the sink's column dropped, times V; a row that
sees no key gives 0. Checked (`every_derivative`, random tangents and upstream gradients):
the output, the gradients of q, k, v, the bias and the sinks, the JVP, the double backward,
the backward's JVP (forward over reverse) and the gradient through the JVP (reverse over
forward), each tensor at EXACT relative to its largest reference entry, or to
FLOOR_FRACTION of its group's largest tensor where that is more. A tensor that is 0 in
exact arithmetic (a bias constant along the keys without sinks; q's and k's derivatives
where no row weighs two logits) is measured against the largest tensor of its group. On a
row that sees no key, the output, its JVP and q's derivatives must be 0 exactly.

KNOWN_OPEN lists the draws that the float64 definition cannot judge at EXACT (a peaked
row, where its own autograd cancels: mpmath checked); those are held to a looser bar. A
tensor that a draw makes ill-conditioned is judged against the definition's own change
with the inputs moved in their last bits (`judge`).

ATTNGRAD_PROPERTY_EXAMPLES (200) and ATTNGRAD_PROPERTY_TRITON_EXAMPLES (4) set the number
of draws; the draws are derandomized, so a run repeats.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional, Union

import pytest

torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, example, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attngrad.check.compare import error_figure  # noqa: E402
from attngrad.check.torch_backend import every_derivative  # noqa: E402
from attngrad.torch import attention, use_backend  # noqa: E402
from attngrad.torch.backends.cpu_tiles import native  # noqa: E402
from attngrad.torch.op import dispatch  # noqa: E402

from ...conftest import EXACT  # noqa: E402

DOUBLE = torch.float64
EXAMPLES = int(os.environ.get("ATTNGRAD_PROPERTY_EXAMPLES", "200"))
TRITON_EXAMPLES = int(os.environ.get("ATTNGRAD_PROPERTY_TRITON_EXAMPLES", "4"))
LOCAL = ("tiles", "torch-ops")
# A tensor far smaller than the largest of its group is the result of cancellation (a row
# that puts nearly all its weight on one logit, a saturated cap), which the definition
# itself computes only to ~1e-16 of the terms that cancel: it is measured against this
# fraction of the group's largest entry, as conftest's `assert_all_close` does for the other
# property tests.
FLOOR_FRACTION = 1e-3


@dataclass(frozen=True)
class Draw:
    """One call: sizes, options, and the seed of its random tensors."""

    batch: int
    heads: int
    heads_kv: int
    len_q: int
    len_k: int
    e: int
    ev: int
    mask: Optional[tuple]  # the boolean mask's shape, or None
    mask_density: float
    empty_rows: bool  # some of the mask's rows see no key at all
    bias: Optional[tuple]  # the bias's shape, or None
    causal: Union[bool, str, int]
    window: Optional[tuple]
    key_padding: Optional[str]  # "mask" or "lengths"
    softcap: Optional[float]
    sinks: bool
    scale: Optional[float]
    spread: float  # the scores' size: larger makes peaked rows
    seed: int


def broadcast_shape(draw, full: tuple) -> tuple:
    """A shape that broadcasts to `full` = (B, H, Lq, Lk): the last 2 to 4 of its dimensions,
    each kept or 1."""
    rank = draw(st.integers(2, 4))
    return tuple(n if draw(st.booleans()) else 1 for n in full[4 - rank:])


@st.composite
def draws(draw, max_len=40, max_e=20, max_batch=2) -> Draw:
    batch, heads_kv = draw(st.integers(1, max_batch)), draw(st.integers(1, 2))
    heads = heads_kv * draw(st.integers(1, 3))
    len_q, len_k = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    full = (batch, heads, len_q, len_k)
    mask = broadcast_shape(draw, full) if draw(st.booleans()) else None
    bias = broadcast_shape(draw, full) if draw(st.booleans()) else None
    causal = draw(st.one_of(st.just(False), st.sampled_from([True, "top_left", "bottom_right"]),
                            st.integers(-len_q - 3, len_k + 3)))
    side = st.one_of(st.none(), st.integers(0, 12))
    window = draw(st.one_of(st.none(), st.tuples(side, side)))
    e, scale, spread = draw(st.integers(1, max_e)), draw(st.one_of(st.none(), st.floats(0.05, 2.5))), \
        draw(st.sampled_from([0.5, 1.0, 2.0]))
    # the cap from 0.5 to 4 times the scores' spread: a cap far below them flattens every
    # score's slope 1 - tanh^2 to cancellation, in the definition as much as in attngrad
    spread_of_scores = (e ** -0.5 if scale is None else scale) * spread ** 2 * e ** 0.5
    softcap = draw(st.one_of(st.none(), st.floats(0.5, 4.0).map(lambda f: f * spread_of_scores)))
    return Draw(
        batch=batch, heads=heads, heads_kv=heads_kv, len_q=len_q, len_k=len_k,
        e=e, ev=draw(st.integers(1, max_e)),
        mask=mask, mask_density=draw(st.sampled_from([0.3, 0.7, 0.95])), empty_rows=draw(st.booleans()),
        bias=bias, causal=causal, window=window,
        key_padding=draw(st.sampled_from([None, None, "mask", "lengths"])),
        softcap=softcap, sinks=draw(st.booleans()), scale=scale, spread=spread,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def randn(*shape, generator, spread=1.0):
    return torch.randn(*shape, generator=generator, dtype=DOUBLE) * spread


class Call:
    """The drawn call's tensors, and the two functions of its primals: attngrad's and the
    definition's. The primals are q, k, v and, when there is a bias or sinks, one flat
    "extra" holding the bias then the sinks (every_derivative takes one extra)."""

    def __init__(self, d: Draw):
        self.d = d
        g = torch.Generator().manual_seed(d.seed)
        b, h, hkv, lq, lk = d.batch, d.heads, d.heads_kv, d.len_q, d.len_k
        self.q = randn(b, h, lq, d.e, generator=g, spread=d.spread)
        self.k = randn(b, hkv, lk, d.e, generator=g, spread=d.spread)
        self.v = randn(b, hkv, lk, d.ev, generator=g)
        self.mask = None
        if d.mask is not None:
            self.mask = torch.rand(*d.mask, generator=g, dtype=DOUBLE) < d.mask_density
            if d.empty_rows and self.mask.shape[-2] == lq > 1:
                self.mask[..., torch.randperm(lq, generator=g)[: lq // 3 + 1], :] = False
        self.key_padding = None
        if d.key_padding == "mask":
            self.key_padding = torch.rand(b, lk, generator=g) < 0.3  # True = padding
        elif d.key_padding == "lengths":
            self.key_padding = torch.randint(0, lk + 1, (b,), generator=g)
        bias = randn(*d.bias, generator=g, spread=2.0) if d.bias is not None else torch.zeros(0, dtype=DOUBLE)
        sinks = randn(h, generator=g, spread=2.0) if d.sinks else torch.zeros(0, dtype=DOUBLE)
        self.primals = (self.q, self.k, self.v) + ((torch.cat([bias.flatten(), sinks]),) if d.bias or d.sinks else ())
        self.scale = d.scale if d.scale is not None else d.e ** -0.5
        self.allowed = self.dense_allowed()

    def split(self, extra):
        """(bias, sinks) from the flat extra primal."""
        n = 0 if self.d.bias is None else torch.Size(self.d.bias).numel()
        bias = extra[:n].reshape(self.d.bias) if self.d.bias is not None else None
        return bias, (extra[n:] if self.d.sinks else None)

    def dense_allowed(self):
        """(B, H, Lq, Lk) boolean, from the definitions: which keys each query sees."""
        d = self.d
        i, j = torch.arange(d.len_q)[:, None], torch.arange(d.len_k)[None, :]
        keep = torch.ones(d.batch, d.heads, d.len_q, d.len_k, dtype=torch.bool)
        offset = {False: None, True: 0, "top_left": 0, "bottom_right": d.len_k - d.len_q}.get(d.causal, d.causal) \
            if isinstance(d.causal, (bool, str)) else d.causal
        if offset is not None:
            keep = keep & (j <= i + offset)
        if d.window is not None:
            left, right, c = *d.window, offset or 0
            if left is not None:
                keep = keep & (j >= i + c - left)
            if right is not None:
                keep = keep & (j <= i + c + right)
        if self.mask is not None:
            keep = keep & self.mask
        if self.key_padding is not None:
            if self.key_padding.dtype == torch.bool:
                keep = keep & ~self.key_padding[:, None, None, :]
            else:
                keep = keep & (j < self.key_padding[:, None, None, None])
        return keep

    def ours(self, q, k, v, extra=None):
        bias, sinks = self.split(extra) if extra is not None else (None, None)
        d = self.d
        return attention(q, k, v, attn_mask=self.mask, attn_bias=bias, is_causal=d.causal,
                         key_padding=self.key_padding, window=d.window, softcap=d.softcap, sinks=sinks,
                         scale=d.scale, enable_gqa=d.heads != d.heads_kv)

    def by_definition(self, q, k, v, extra=None):
        """softmax([S | s_h]) without its last column, times V; S = c tanh(scale Q K^T / c) + bias,
        -inf where the masks exclude a key; 0 on a row that sees no key."""
        bias, sinks = self.split(extra) if extra is not None else (None, None)
        groups = q.shape[1] // k.shape[1]
        p = torch.softmax(self.logits(q, k, bias, sinks), dim=-1)  # (B, H, Lq, Lk [+ 1])
        seen = self.allowed.any(-1, keepdim=True)  # (B, H, Lq, 1)
        return (p[..., : self.d.len_k] * seen) @ v.repeat_interleave(groups, dim=1)  # (B, H, Lq, Ev)

    def logits(self, q, k, bias, sinks):
        """[S | s_h]: S = c tanh(scale Q K^T / c) + bias, -inf where the masks exclude a key,
        and any finite numbers on a row that sees no key (its weights are dropped).

        With sinks, a bias constant along the keys is written as the same shift of the sink's
        logit the other way, [S | s_h - bias] (softmax is blind to a shift of a whole row):
        added to every score, its derivatives would be sums of the scores' that cancel down
        to the sink's, 2.5e-12 off in float64 on a draw (autograd's, the definition's own)."""
        s = q @ k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(-1, -2) * self.scale  # (B, H, Lq, Lk)
        if self.d.softcap is not None:
            s = self.d.softcap * torch.tanh(s / self.d.softcap)
        on_the_sink = bias is not None and sinks is not None and bias.shape[-1] == 1
        if bias is not None and not on_the_sink:
            s = s + bias
        seen = self.allowed.any(-1, keepdim=True)
        s = s.masked_fill(~self.allowed, float("-inf")).masked_fill(~seen, 0.0)
        if sinks is None:
            return s
        sink = sinks[:, None, None] - bias if on_the_sink else sinks[:, None, None]
        return torch.cat([s, sink.expand(*s.shape[:-1], 1)], dim=-1)

    def named(self, results: dict) -> dict:
        """every_derivative's results with the extra split into bias and sinks."""
        out = {}
        for name, t in results.items():
            if name.endswith("extra"):
                bias, sinks = self.split(t)
                stem = name[: -len("extra")]
                if bias is not None:
                    out[stem + "bias"] = bias
                if sinks is not None:
                    out[stem + "sinks"] = sinks
            else:
                out[name] = t
        return out

    def exact_zeros(self) -> set:
        """The tensors that are 0 in exact arithmetic."""
        d, zeros = self.d, set()
        if d.sinks:
            return zeros
        if d.bias is not None and d.bias[-1] == 1:  # softmax is blind to a shift along the keys
            zeros |= {"dbias", "gg_bias", "hvp_bias", "rof_bias", "rof_tbias"}
        if self.weighs_one_logit():  # every row's weights are 0 or 1: S has no effect
            zeros |= {"dq", "dk", "gg_q", "gg_k", "gg_v", "hvp_q", "hvp_k", "rof_q", "rof_k", "rof_v", "rof_tq",
                      "rof_tk", "gg_bias", "hvp_bias", "rof_bias", "rof_tbias", "dbias"}
        return zeros

    def least_spread(self) -> float:
        """min over the rows that weigh two logits or more (a sink is one) of 1 - max_j P_ij:
        near 0 where a row's softmax is peaked."""
        bias, sinks = self.split(self.primals[3]) if len(self.primals) > 3 else (None, None)
        with torch.no_grad():
            p = torch.softmax(self.logits(self.q, self.k, bias, sinks), dim=-1)
        several = self.allowed.any(-1) & (self.allowed.sum(-1) + (sinks is not None) >= 2)
        rest = (1 - p.amax(-1))[several]
        return float(rest.min()) if rest.numel() else 1.0

    def weighs_one_logit(self) -> bool:
        """No row sees two keys (and there is no sink)."""
        return not self.d.sinks and int(self.allowed.sum(-1).max()) <= 1


def group(name: str) -> str:
    for prefix in ("gg_", "hvp_", "rof_"):
        if name.startswith(prefix):
            return prefix
    return "jvp" if name == "jvp" else "first"


# Where the float64 definition cannot judge at EXACT: (what, the bar a call's affected tensors
# are held to (EXACT where the call does not have it), which tensors it affects).
KNOWN_OPEN = [
    # a row with a peaked softmax. attngrad centres each row on its most probable entry (issue
    # 58 item 3); the definition's own autograd does not: dS = P (dP - rowsum(P dP)) with P
    # near 1 cancels there. On the draws 2,000 runs found past EXACT, mpmath (50 digits) put
    # the tiles and torch-ops at 1e-19 and the definition at 3.2e-16 (gg_v, 1 - max P =
    # 1.2e-4, Lq = 1, Lk = 2, E = 2). Until the reference is one that centres too (or exact),
    # such rows are held to 3e-14 / (1 - max P), within [EXACT, 1e-9]; the output and dv,
    # which cancel nothing, to EXACT. Triton's backward-type passes do not centre (docs/design.md)
    ("a peaked row: the definition's autograd cancels", lambda call: min(1e-9, max(EXACT, 3e-14 / max(call.least_spread(), 1e-9))),
     lambda name: name not in ("out", "dv")),
]


# how far past the definition's own rounding spread (`judge`) a result may lie
ROUNDING_SPREAD = 16.0


def judge(call: Call, ours: dict, theirs: dict, backend: str, spread: dict) -> list[str]:
    """Every tensor's error against the definition's; the failures, described.

    A draw can make a tensor a sum whose terms cancel far below their size (one query row and
    a value width of 1 made the JVP 2e4 times smaller than its terms): no float64 sum, the
    definition's included (3e-11 off, against mpmath), meets EXACT relative to its own size
    there. Such a problem is ill-conditioned, not our algorithm unstable, and a change of the
    inputs by their last bits shows it: `spread` is each tensor's largest change, in the
    definition, with every primal moved by 2^-50 of itself. A tensor within ROUNDING_SPREAD
    times that is as exact as float64 allows; an unstable algorithm (an uncentred peaked row,
    a sum that cancels in our passes alone) stays far past it."""
    zeros, failures = call.exact_zeros(), []
    unseen = ~call.allowed.any(-1)  # (B, H, Lq): rows that see no key give 0, exactly
    for name in ("out", "jvp", "dq", "gg_q", "hvp_q", "rof_q", "rof_tq"):
        if bool(ours[name][unseen].any()):
            failures.append(f"{backend} {name}: not 0 on a row that sees no key ({int(unseen.sum())} such rows)")
    open_here = [(what, affected, bar) for what, bar_for, affected in KNOWN_OPEN if (bar := bar_for(call)) > EXACT]
    scales: dict[str, float] = {}
    for name, ref in theirs.items():
        if ref.numel():
            scales[group(name)] = max(scales.get(group(name), 0.0), float(ref.abs().max()))
    for name, ref in theirs.items():
        bar, why = EXACT, "EXACT"
        for what, affected, looser in open_here:
            if affected(name):
                bar, why = max(bar, looser), what
        floor = scales.get(group(name), 0.0) * (1.0 if name in zeros else FLOOR_FRACTION)
        figure = error_figure(ours[name].detach().numpy(), ref.detach().numpy(), floor=floor)
        if not figure.rel <= bar and not figure.max_abs <= ROUNDING_SPREAD * spread[name]:
            failures.append(f"{backend} {name}: rel {figure.rel:.3g} (max_abs {figure.max_abs:.3g}) over {bar:g} "
                            f"({why}{', judged as an exact zero' if name in zeros else ''})")
    return failures


def check(d: Draw, backends: tuple) -> None:
    note(repr(d))
    call = Call(d)
    note(f"rows that see no key: {int((~call.allowed.any(-1)).sum())} of {call.allowed[..., 0].numel()}; "
         f"least 1 - max P of a row: {call.least_spread():.3g}; exact zeros: {sorted(call.exact_zeros())}")
    theirs = call.named(every_derivative(call.by_definition, call.primals, d.seed % 1000))
    spread = dict.fromkeys(theirs, 0.0)  # made only where a tensor misses EXACT (it costs a third evaluation)
    failures = []
    for backend in backends:
        before = dict(dispatch.ran)
        with use_backend(backend):
            ours = call.named(every_derivative(call.ours, call.primals, d.seed % 1000))
        ran = {name for key, count in dispatch.ran.items() if count > before.get(key, 0) for name in key[1:]}
        assert ran <= {backend}, f"{backend}: passes ran on {ran}"
        missed = judge(call, ours, theirs, backend, spread)
        if missed and not any(spread.values()):
            spread = definition_spread(call, theirs)
            missed = judge(call, ours, theirs, backend, spread)
        failures += missed
    assert not failures, "\n".join(failures)


def definition_spread(call: Call, theirs: dict) -> dict:
    """Each tensor's largest change, in the definition, with every primal moved by 2^-50 of
    itself (`judge`)."""
    signs = torch.Generator().manual_seed(call.d.seed + 1)
    nudged = tuple(p * (1 + 2.0**-50 * (2 * torch.randint(0, 2, p.shape, generator=signs, dtype=DOUBLE) - 1))
                   for p in call.primals)
    moved = call.named(every_derivative(call.by_definition, nudged, call.d.seed % 1000))
    return {name: float((theirs[name] - moved[name]).abs().max()) if theirs[name].numel() else 0.0 for name in theirs}


@pytest.fixture
def small_tiles(many_blocks, monkeypatch, tuned):
    """Narrow key blocks too, so that 40 keys cross several, and whole tiles are skipped. One
    thread: these calls are far too small to share, and on a busy machine threads that wait
    for each other made the test several times slower."""
    tuned(native.TILING, block_keys=8, narrow_block_keys=4, narrow_band=6, double_tile=24)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def available(name: str) -> bool:
    return {b.name: b for b in dispatch.list_backends()}[name].available


# the fixture only sets module constants, the same for every draw
PROPERTY = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


# a row that gives the sink 0.9997 of its weight: centred on its one key, the double
# backward's t = c (1 - P_sink) cancelled (gg_sinks 2.4e-12 off); the sink is its peak
SINK_PEAK = Draw(batch=1, heads=2, heads_kv=2, len_q=24, len_k=1, e=9, ev=10, mask=None, mask_density=0.3,
                 empty_rows=False, bias=None, causal="bottom_right", window=None, key_padding=None, softcap=None,
                 sinks=True, scale=None, spread=2.0, seed=0)


@settings(max_examples=EXAMPLES, **PROPERTY)
@given(draws())
@example(d=SINK_PEAK)
@example(d=dataclasses.replace(SINK_PEAK, len_q=1, len_k=20, e=20, ev=1, causal=False, sinks=False, scale=1.90234375,
                               spread=0.5))  # a JVP 2e4 times smaller than its terms: ill-conditioned (`judge`)
@example(d=dataclasses.replace(SINK_PEAK, heads=2, heads_kv=1, len_q=6, len_k=16, e=1, ev=1, bias=(1, 1), causal=False,
                               seed=6))  # sinks beside one number of bias: the definition's derivatives in the sink's
def test_every_derivative_of_every_feature_together(small_tiles, d):
    """tiles and torch-ops, one definition's derivatives for both."""
    check(d, tuple(b for b in LOCAL if available(b)))


@pytest.mark.skipif(not available("triton"), reason="Triton runs here only in its interpreter (TRITON_INTERPRET=1)")
@settings(max_examples=TRITON_EXAMPLES, **PROPERTY)
@given(draws(max_len=12, max_e=6, max_batch=1))
def test_every_derivative_of_every_feature_together_on_triton(d):
    """The same on Triton's interpreter: fewer and smaller draws, it is slow."""
    check(d, ("triton",))
