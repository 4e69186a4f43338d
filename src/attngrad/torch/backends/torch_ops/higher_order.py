"""Forward-mode and second-order attention, tiled like `first_order`: O(L) extra memory.

Three kernels, each a loop over the same query blocks as the first-order passes, each
recomputing P = exp(S - m) / l (and the dropout factor Z) from the kept row statistics:

    attention_jvp             the tangent O' of the output along (Q', K', V', bias')
    attention_backward_jvp    the tangent of the backward's (dQ, dK, dV, dbias) along
                              (Q', K', V', bias', dO'): forward-mode over reverse-mode
    attention_double_backward the gradient of <(gQ, gK, gV, gbias), backward(...)> with
                              respect to (Q, K, V, bias, dO): reverse-mode over reverse-mode

Shape legend and the forward as in `first_order`; per block of R rows every Lq x Lk quantity
below is an (B, H, R, Lk') tile, rowsum keeps its axis, and K~, V~ repeat over GQA groups.
The lines, derived in docs/derivation.md ("Forward mode and second order"):

    S' = scale (Q' K~^T + Q K~'^T) + bias'         the tangent of the scores
    P' = P * (S' - rowsum(P * S'))                 the softmax's Jacobian applied to S'
    O' = (P' * Z) V~ + (P * Z) V~'

    dP = (dO V~^T) * Z,  D = rowsum(dO * O) = rowsum(P * dP),  dS = P * (dP - D)
  tangent of the backward:
    dP~ = (dO' V~^T + dO V~'^T) * Z,  D~ = rowsum(P' * dP + P * dP~)
    dS~ = P' * (dP - D) + P * (dP~ - D~)
    dV~~ = (P' * Z)^T dO + (P * Z)^T dO'
    dQ~ = scale (dS~ K~ + dS K~'),  dK~~ = scale (dS~^T Q + dS^T Q'),  dbias~ = dS~
  double backward, for cotangents (gQ, gK~, gV~, gbias) of (dQ, dK~, dV~, dbias):
    T    = scale (gQ K~^T + Q gK~^T) + gbias       (the S' form, fed with cotangents)
    t    = rowsum(P * T)
    g_dP = P * (T - t)                             -> g_dO = (g_dP * Z) V~ + (P * Z) gV~
                                                      g_V~ = (g_dP * Z)^T dO
    g_P  = (dP - D) * (T - t) + (dO gV~^T) * Z      (the exact (dP - D) T - t dP + ..., less
                                                    t D, a per-row constant the softmax ignores)
    g_S  = P * (g_P - rowsum(P * g_P))
    g_Q  = scale (g_S K~ + dS gK~),  g_K~ = scale (g_S^T Q + dS^T gQ),  g_bias = g_S
With a soft cap (S = c tanh(A / c) + bias, A = scale Q K~^T) the scores' tangent and T take
the cap's slope, and the step back to Q and K~ also its curve (`_Softcap`; derivation 11.6).
Each row sum runs over a whole row of keys, which every block holds (a block's keys are
those any of its rows may see: a prefix, or with key bounds the band between them). Masked entries and
empty rows have P = 0, so every term above is 0 there: no NaN.
The double backward is the transpose of the backward's tangent map: the tests check both
against PyTorch and against each other (<g, J t> = <J^T g, t>).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple, Optional

import torch
from torch import Tensor

from ...op.call import AttentionCall, PassInputs
from ...op.dropout import keep_scale_into
from ...op.key_constant_bias import sink_share
from .first_order import (
    KeyGradient,
    ScoreTiles,
    add_block_to_bias,
    blocks,
    excludes_keys,
    operands,
    row_slice,
    scores_into,
    single_key_rows,
    with_column,
)
from .tiling import TILING

if TYPE_CHECKING:  # typing's from Python 3.11; the annotations are never evaluated
    from typing_extensions import Unpack


def _repeat(t: Optional[Tensor], groups: int, work: torch.dtype) -> Optional[Tensor]:
    """A key/value-side tangent or cotangent, repeated over GQA groups like K and V."""
    if t is None:
        return None
    return (t.repeat_interleave(groups, dim=1) if groups > 1 else t).to(work)


def _to(t: Optional[Tensor], work: torch.dtype, factor: float = 1.0) -> Optional[Tensor]:
    if t is None:
        return None
    t = t.to(work)
    return t * factor if factor != 1.0 else t


class _ScoreForm:
    """A (B, H, R, Lk') tile of the form  A_q K~^T + Q B_k^T + C, with any term absent.

    This is S' for tangents (A_q = scale Q', B_k = K~', C = bias') and T for cotangents
    (A_q = scale gQ, B_k = gK~, C = gbias). The two products share one GEMM: [A_q | Q] is
    multiplied by [K~ | B_k]^T, width 2d.
    """

    def __init__(self, q_scaled: Tensor, k_rep: Tensor, a_q: Optional[Tensor], b_k: Optional[Tensor], c: Optional[Tensor]):
        lefts, rights = [], []
        if a_q is not None:
            lefts.append(a_q)
            rights.append(k_rep)
        if b_k is not None:
            lefts.append(q_scaled)
            rights.append(b_k)
        self.left = torch.cat(lefts, dim=-1) if lefts else None  # (B, H, Lq, d or 2d)
        self.right = torch.cat(rights, dim=-1) if rights else None  # (B, H, Lk, d or 2d)
        self.c = c

    def tile_into(self, out: Tensor, start: int, stop: int, cols: slice, softcap: Optional[_Softcap] = None) -> Tensor:
        """The rows start:stop and keys `cols` of the form, written into `out`. With `softcap`,
        whose scores are c tanh(A / c) + bias, the products' part goes through the cap's
        slope first: (1 - tanh^2) (A_q K~^T + Q B_k^T) + C, after `softcap.met` saw them."""
        if self.left is None:
            out.zero_()
            if softcap is not None:  # no products: the curve meets zeros
                softcap.curve.zero_()
        else:
            torch.matmul(self.left[:, :, start:stop], self.right[..., cols, :].transpose(-1, -2), out=out)
            if softcap is not None:
                softcap.met(out)
                out.mul_(softcap.slope)
        c = row_slice(self.c, start, stop, cols.stop, cols.start)
        if c is not None:
            out.add_(c)
        return out


class _Softcap:
    """A block's derivatives of S = c tanh(A / c) in A: slope = 1 - tanh^2 (the first) and
    curve = -2 tanh (1 - tanh^2) / c (the second); `met(X)` multiplies the curve by X, the
    raw score-form tile (A' or the cotangents' T) that the second derivative meets."""

    def __init__(self, capped: Tensor, slope: Tensor, softcap: float) -> None:
        self.slope = torch.mul(capped, capped, out=slope).neg_().add_(1.0)
        self.curve = capped.mul_(self.slope).mul_(-2.0 / softcap)  # in tanh's buffer

    def met(self, raw: Tensor) -> None:
        self.curve.mul_(raw)


class _Gradients(NamedTuple):
    """A second-order pass's sums in the compute dtype: shaped like Q, for K~ and V~, and
    like the bias (None unless asked)."""

    q: Tensor
    k: KeyGradient
    v: KeyGradient
    bias: Optional[Tensor]


class _Recompute:
    """Per block: P = exp(S - m) / l and Z = keep / (1 - p), as the first-order passes had
    them from the call and the inputs' row statistics, in reused score-sized buffers (fresh
    16 MiB tiles would cost more in page faults than the arithmetic on them)."""

    def __init__(self, call: AttentionCall, inputs: PassInputs, buffers: int) -> None:
        self.batch, self.heads, self.len_q, _ = call.q.shape
        self.len_k = call.k.shape[-2]
        ops = operands(call)
        self.work, self.groups, self.q_scaled, self.k_rep, self.v_rep = ops.work, ops.groups, ops.q_scaled, ops.k_rep, ops.v_rep
        self.masks = ops.masks
        row_max = inputs["row_max"]
        self.row_max, self.inv_sum = row_max, inputs["inv_sum"]
        # [scale Q | -m] [K~ | 1]^T = S - m in one GEMM (see kernels.with_column)
        self.q_shifted, self.k_ones = with_column(self.q_scaled, -row_max[..., None]), with_column(self.k_rep, 1.0)
        self.q_scaled, self.k_rep = self.q_shifted[..., :-1], self.k_ones[..., :-1]  # views: no second copy kept
        self.scale, self.dropout_p = call.scale, call.dropout_p
        self.placement = call.placement  # once: it reads the seed tensor
        self.masked = excludes_keys(self.masks)
        # Long sequences get taller blocks than the first-order passes: these do 2.5-6
        # forwards' worth of GEMMs per tile, and 16-row GEMMs are thin (JVP at L=16384:
        # 10.6 s with 32-row blocks, 7.7 s with 128), for some more memory (128 rows x L
        # keys x B H per tile).
        self.plan = blocks(self.batch, self.heads, self.len_q, self.len_k, call.causal, TILING().higher_min_rows,
                           call.bounds)
        # after the pass's own: Z with dropout, then tanh(A / c) and the slope with softcap
        self.z_index, self.softcap_index = buffers, buffers + (self.dropout_p > 0.0)
        count = self.softcap_index + (2 if self.masks.softcap else 0)
        self.tiles = ScoreTiles(count, self.plan, self.batch, self.heads, self.work, call.q.device)
        self.capped: Optional[_Softcap] = None  # the current block's

    def tile(self, index: int, start: int, stop: int, cols: slice) -> Tensor:
        """Scratch buffer `index` shaped as this block's (B, H, R, keys) tile, for keys `cols`."""
        return self.tiles.get(index, (self.batch, self.heads, stop - start, cols.stop - cols.start))

    def probs(self, start: int, stop: int, cols: slice) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """(P, Z or None, the single-key rows or None) for one block and keys `cols`, P and Z
        (B, H, R, keys) in buffers 0 and z_index; P is exactly 1 on a single-key row's key
        (`first_order.single_key_rows`), and the caller sets such a row's dS to 0. With a
        softcap, `capped` holds the block's derivatives of the cap."""
        softcap = self.masks.softcap
        if softcap:  # the cap comes before the shift: S - m = c tanh(A / c) + bias - m
            capped = self.tile(self.softcap_index, start, stop, cols)
            s = scores_into(self.tile(0, start, stop, cols), self.q_scaled[:, :, start:stop], self.k_rep, self.masks,
                            start, stop, cols.start, capped)
            s.sub_(self.row_max[:, :, start:stop, None])
            self.capped = _Softcap(capped, self.tile(self.softcap_index + 1, start, stop, cols), softcap)
        else:
            s = scores_into(self.tile(0, start, stop, cols), self.q_shifted[:, :, start:stop], self.k_ones, self.masks,
                            start, stop, cols.start)  # S - m
        e = s.exp_()
        inv = self.inv_sum[:, :, start:stop, None]
        single = single_key_rows(e, self.masked, inv)
        p = e.mul_(inv)
        z = None
        if self.dropout_p > 0.0:
            z = keep_scale_into(self.tile(self.z_index, start, stop, cols), self.placement, start, self.dropout_p,
                                cols.start)
        return p, z, single

    def each_block(self) -> Iterator[tuple[int, int, slice, Tensor, Optional[Tensor], Optional[Tensor]]]:
        """(start, stop, cols, P, Z or None, single-key rows or None) for every block that
        sees a key, `cols` the slice of keys it sees; rows that see none keep their zero
        tangents and gradients."""
        for start, stop, first, keys in self.plan:
            if keys > first:
                cols = slice(first, keys)
                yield (start, stop, cols, *self.probs(start, stop, cols))

    def score_form(self, a_q: Optional[Tensor], b_k: Optional[Tensor], c: Optional[Tensor]) -> _ScoreForm:
        """The S'/T form for query-side `a_q` (B, H, Lq, d), key-side `b_k` (B, Hkv, Lk, d)
        and a bias-shaped `c`, in the compute dtype."""
        return _ScoreForm(self.q_scaled, self.k_rep, _to(a_q, self.work, self.scale),
                          _repeat(b_k, self.groups, self.work), _to(c, self.work))

    def values_with_ones(self) -> Tensor:
        """[V~ | 1] (B, H, Lk, dv + 1), so that [dO | -D] [V~ | 1]^T = dP - D is one GEMM;
        V~ becomes a view of it."""
        v_ones = with_column(self.v_rep, 1.0)
        self.v_rep = v_ones[..., :-1]
        return v_ones

    def gradient_accumulators(self, bias_grad: bool) -> _Gradients:
        """Zeros shaped like Q (contiguous, whatever the inputs' strides), sums for K~ and V~,
        and, when asked, zeros shaped like the bias, in the compute dtype."""
        dq = torch.zeros_like(self.q_scaled, memory_format=torch.contiguous_format)
        dk = KeyGradient(self.k_rep, self.k_rep.shape[-1])
        dv = KeyGradient(self.v_rep, self.v_rep.shape[-1])
        bias = torch.zeros(self.masks.bias.shape, dtype=self.work, device=self.q_scaled.device) if bias_grad else None
        return _Gradients(dq, dk, dv, bias)

    def back_through_scores(self, x: Tensor, ds: Tensor, key_side: Optional[Tensor], query_side: Optional[Tensor],
                            into: _Gradients, rows: slice, cols: slice, x_bias: Optional[Tensor] = None) -> None:
        """How both second-order passes end, for the block of `rows` and keys `cols`. A
        score-shaped tile X (dS~ or g_S) goes back through S = scale Q K~^T + bias, and
        dS = P * (dP - D) meets the key-side and query-side tangents or cotangents (K~', Q' or
        gK~, gQ) of dQ = scale dS K~, dK~ = scale dS^T Q, summed `into` q, k and bias (where
        not None):
            dq[rows] = scale (X K~ + dS key_side),  dk += X^T (scale Q) + dS^T query_side,  dbias += X
        (query_side carries the scale already). With a softcap, X and dS are taken in A (dA~
        or g_A, and dA), and the bias, added after the cap, gets `x_bias` (dS~ or g_S) instead."""
        into.q[:, :, rows] = _sum_of_products(
            (x, self.k_rep[..., cols, :], self.scale),
            None if key_side is None else (ds, key_side[..., cols, :], self.scale),
        )
        into.k.add(x, self.q_scaled[:, :, rows], cols.start)
        if query_side is not None:
            into.k.add(ds, query_side[:, :, rows], cols.start)
        if into.bias is not None:
            add_block_to_bias(into.bias, x if x_bias is None else x_bias, rows.start, rows.stop, cols.stop, cols.start)


def _add_matmul(acc: Tensor, a: Tensor, b: Tensor, *, alpha: float = 1.0) -> None:
    """acc += alpha a b over the leading (B, H) axes, in place, as one batched GEMM. acc is
    (B, H, X, Y), contiguous in its last two axes."""
    bh = a.shape[0] * a.shape[1]
    acc.view(bh, *acc.shape[2:]).baddbmm_(a.reshape(bh, *a.shape[2:]), b.reshape(bh, *b.shape[2:]), alpha=alpha)


def _sum_of_products(*terms: Optional[tuple[Tensor, Tensor, float]]) -> Tensor:
    """sum of alpha a b over the present (a, b, alpha) terms, as a new contiguous (B, H, R, .)
    block (accumulating in a strided row slice of a (B, H, L, .) tensor would be slower)."""
    present = [t for t in terms if t is not None]
    a, b, alpha = present[0]
    out = torch.matmul(a, b)
    if alpha != 1.0:
        out.mul_(alpha)
    for a, b, alpha in present[1:]:
        _add_matmul(out, a, b, alpha=alpha)
    return out


def _times(t: Tensor, z: Optional[Tensor], out: Tensor) -> Tensor:
    """t * Z into `out`; t itself without dropout (callers only read the result)."""
    return torch.mul(t, z, out=out) if z is not None else t


def _softmax_jacobian_times(p: Tensor, x: Tensor, out: Tensor, row: Optional[Tensor] = None,
                            sums: Optional[Tensor] = None) -> Tensor:
    """P * (X - rowsum(P * X)) into `out` (not x's buffer): the softmax's Jacobian, which is
    symmetric, times X row by row. It is S' -> P' in forward mode and g_P -> g_S in reverse.
    (PyTorch's fused softmax-backward kernel computes this in one pass, but its bits change
    with the thread count for rows of most lengths, torch 2.13: three passes instead.)

    A call on a part of each row's keys (a ring step) cannot sum the whole row: it is given
    the whole row's sum as `row` (B, H, R, 1), and adds its own part of it into `sums`."""
    if row is None or sums is not None:
        computed = torch.mul(p, x, out=out).sum(dim=-1, keepdim=True)
        if sums is not None:
            sums += computed
        row = computed if row is None else row
    return torch.sub(x, row, out=out).mul_(p)


def _centre_on_the_peak(p: Tensor, x: Tensor, scratch: Tensor, share: Optional[Tensor],
                        x_sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Centre x on each row's most probable entry: x - c in place, c = x there, and returns
    (c, t - c) (B, H, R, 1), t = rowsum(P * x) + P_sink x_sink the row's centre.

    On a peaked row t is nearly x at the peak, and x - t there cancels the rounding of t's
    sum (about |x| eps): float64 backward JVPs erred up to 2e-10 so. Centred, the peak's term
    of the sum is 0 exactly and the rest are small. A sink (`share` = P_sink, else None) is
    an entry of the row too, of value `x_sink` (None: 0, as for S' and T; t D for g_P): where
    it is the most probable, c = x_sink (a row that gave the sink 0.9997 of its weight erred
    2.4e-12 centred on its one key). rowsum(P) = 1 - P_sink, so t - c = rowsum(P (x - c)) +
    P_sink (x_sink - c)."""
    top, at = p.max(dim=-1, keepdim=True)
    c = x.gather(-1, at)
    if share is not None:
        sink_value = torch.zeros_like(c) if x_sink is None else x_sink.to(c.dtype)
        c = torch.where(share > top, sink_value, c)
    x.sub_(c)
    t_c = torch.mul(p, x, out=scratch).sum(dim=-1, keepdim=True)
    if share is not None:
        t_c += share * ((0.0 if x_sink is None else x_sink) - c)
    return c, t_c


def _rows(t: Optional[Tensor], start: int, stop: int) -> Optional[Tensor]:
    """Rows start:stop of a (B, H, Lq, 1) row quantity, or None."""
    return None if t is None else t[:, :, start:stop]


def attention_jvp(call: AttentionCall, **inputs: Unpack[PassInputs]) -> Tensor:
    """O' (B, H, Lq, dv) in q's dtype; an absent tangent is zero.

    For a part of each row's keys (`row_sums`: `centre` and `centre_sums`, see
    `_softmax_jacobian_times`): with `centre` = 0, the result is this part of
    (P * S' * Z) V~ + (P * Z) V~', and this part of rowsum(P * S') is added into
    `centre_sums` (B, H, Lq, 1, compute dtype); the whole O' is then the parts' sum less
    rowsum(P * S') O."""
    sums = inputs.get("row_sums") or {}
    centre, centre_sums = sums.get("centre"), sums.get("centre_sums")
    r = _Recompute(call, inputs, buffers=3)
    form = r.score_form(inputs["tq"], inputs["tk"], inputs["tbias"])
    tv_rep = _repeat(inputs["tv"], r.groups, r.work)
    out_t = torch.zeros(r.batch, r.heads, r.len_q, call.v.shape[-1], dtype=r.work, device=call.q.device)
    for start, stop, cols, p, z, _single in r.each_block():  # a single-key row's P' is 0 exactly
        s_t = form.tile_into(r.tile(1, start, stop, cols), start, stop, cols, r.capped)  # S'
        if centre is None and centre_sums is None:  # whole rows: P' = P ((S' - c) - (t - c))
            _, t_c = _centre_on_the_peak(p, s_t, r.tile(2, start, stop, cols), _sink_share(r, slice(start, stop), r.work)
                                         if call.sink else None)
            p_t = torch.sub(s_t, t_c, out=r.tile(2, start, stop, cols)).mul_(p)
        else:
            p_t = _softmax_jacobian_times(p, s_t, r.tile(2, start, stop, cols), _rows(centre, start, stop),
                                          _rows(centre_sums, start, stop))  # P'
        scratch = s_t  # S' is spent
        # forward: O = (P * Z) V~  ->  O' = (P' * Z) V~ + (P * Z) V~'
        out_t[:, :, start:stop] = _sum_of_products(
            (p_t.mul_(z) if z is not None else p_t, r.v_rep[..., cols, :], 1.0),
            None if tv_rep is None else (_times(p, z, scratch), tv_rep[..., cols, :], 1.0),
        )
    return out_t.to(call.q.dtype)


def _sink_share(r: _Recompute, rows: slice, dtype: torch.dtype) -> Tensor:
    """(B, H, R, 1) the sink's P, exp(0 - m) / l, on rows that see a key, 0 elsewhere
    (`key_constant_bias.sink_share`), in `dtype`."""
    return sink_share(r.row_max[:, :, rows], r.inv_sum[:, :, rows])[..., None].to(dtype)


def _rows_give_the_bias(bias_grad: bool, bias: Optional[Tensor], centre: Optional[Tensor]) -> bool:
    """Whether the second-order passes add a bias's gradient per row in closed form: a bias
    constant along the keys, on whole rows (no `centre` given: a ring step's rows are parts,
    whose sums do not simplify)."""
    return bias_grad and bias is not None and bias.shape[-1] == 1 and centre is None


def _check_sink_rows(sink_rows: Optional[Tensor], sink: bool, centre: Optional[Tensor]) -> None:
    """`sink_rows` needs a sink and whole rows; it starts at 0 (a row no block visits sees no key)."""
    if sink_rows is None:
        return
    if not sink or centre is not None:
        raise ValueError("attngrad kernels: sink_rows needs a sink, on whole rows")
    sink_rows.zero_()


def _delta(dout: Tensor, out: Tensor, work: torch.dtype) -> Tensor:
    """D = rowsum(dO * O), (B, H, Lq, 1)."""
    return (dout.to(work) * out.to(work)).sum(dim=-1, keepdim=True)


def attention_backward_jvp(call: AttentionCall,
                           **inputs: Unpack[PassInputs]) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Tangents of (dq, dk, dv, dbias or None), each in its input's dtype and shape.

    For a part of each row's keys, the whole rows' sums are given (`row_sums`, B, H, Lq, 1,
    compute dtype): `centre` = rowsum(P * S') and `delta_t` = D~ = rowsum(dO' * O + dO * O');
    with `peak` c (S' at each row's most probable key), `centre` is t - c (the tiles' forward
    JVP leaves them so).

    A bias constant along the keys gets each whole row's sum of dS~ in closed form, the
    tangent of D P_sink (`key_constant_bias`): P_sink (D~ - t D), and 0 without the call's
    sink; `sink_rows` (B, H, Lq), where given, takes that term of every row (`sink_logits`)."""
    sums = inputs.get("row_sums") or {}
    centre, delta_t, peak = sums.get("centre"), sums.get("delta_t"), sums.get("peak")
    dout, bias_grad, sink, sink_rows = inputs["dout"], inputs["bias_grad"], call.sink, inputs.get("sink_rows")
    _check_sink_rows(sink_rows, sink, centre)
    r = _Recompute(call, inputs, buffers=5)
    work = r.work
    tq, tk = inputs["tq"], inputs["tk"]
    form = r.score_form(tq, tk, inputs["tbias"])
    tq_s, tk_rep, tv_rep = _to(tq, work, call.scale), _repeat(tk, r.groups, work), _repeat(inputs["tv"], r.groups, work)
    do_w, tdo_w = dout.to(work), _to(inputs["tdout"], work)
    delta = _delta(dout, inputs["out"], work)
    grads = r.gradient_accumulators(bias_grad)
    row_constant = _rows_give_the_bias(bias_grad, call.bias, centre)
    # the sums each block's tiles go into: not a bias constant along the keys (its closed form, below)
    through_scores = grads._replace(bias=None) if row_constant else grads
    for start, stop, cols, p, z, single in r.each_block():
        rows = slice(start, stop)
        do_blk, v_blk = do_w[:, :, rows], r.v_rep[..., cols, :]
        s_t = form.tile_into(r.tile(1, start, stop, cols), start, stop, cols, r.capped)  # S'
        if centre is None:  # whole rows: P' = P ((S' - c) - (t - c)), and t for the bias's closed form below
            c, t_c = _centre_on_the_peak(p, s_t, r.tile(4, start, stop, cols),
                                         _sink_share(r, rows, r.work) if sink else None)
            t_row = c + t_c
            p_t = torch.sub(s_t, t_c, out=r.tile(4, start, stop, cols)).mul_(p)
        else:
            t_row = _rows(centre, start, stop)
            if peak is not None:  # t - c given: S' - c first
                s_t.sub_(peak[:, :, rows])
            p_t = _softmax_jacobian_times(p, s_t, r.tile(4, start, stop, cols), t_row)  # P'
            if peak is not None:
                t_row = t_row + peak[:, :, rows]
        scratch = s_t  # S' is spent
        # backward: dP = (dO V~^T) * Z, and its tangent dP~ = (dO' V~^T + dO V~'^T) * Z
        dp = torch.matmul(do_blk, v_blk.transpose(-1, -2), out=r.tile(2, start, stop, cols))
        dp_t = r.tile(3, start, stop, cols).zero_()
        if tdo_w is not None:
            _add_matmul(dp_t, tdo_w[:, :, rows], v_blk.transpose(-1, -2))
        if tv_rep is not None:
            _add_matmul(dp_t, do_blk, tv_rep[..., cols, :].transpose(-1, -2))
        if z is not None:
            dp.mul_(z)
            dp_t.mul_(z)
        # backward: dS = P * (dP - D)  ->  dS~ = P' * (dP - D) + P * (dP~ - D~)
        if delta_t is not None:
            delta_t_blk = delta_t[:, :, rows]
        else:
            delta_t_blk = torch.mul(p_t, dp, out=scratch).sum(dim=-1, keepdim=True)
            delta_t_blk += torch.mul(p, dp_t, out=scratch).sum(dim=-1, keepdim=True)
        # backward: dV~ = (P * Z)^T dO  ->  dV~~ = (P' * Z)^T dO + (P * Z)^T dO'
        grads.v.add(_times(p_t, z, scratch), do_blk, cols.start)
        if tdo_w is not None:
            grads.v.add(_times(p, z, scratch), tdo_w[:, :, rows], cols.start)
        dp.sub_(delta[:, :, rows])  # dP - D
        if single is not None:  # D = dP exactly there, and dS = 0 (as in `first_order`)
            dp.masked_fill_(single, 0.0)
        ds_t = p_t.mul_(dp).add_(dp_t.sub_(delta_t_blk).mul_(p))  # dS~, in P''s buffer
        ds = p.mul_(dp)  # dS, in P's buffer
        ds_bias = None
        if r.capped is not None:  # backward: dA = slope dS  ->  dA~ = slope dS~ + (curve A') dS
            ds_bias, cap = ds_t, r.capped
            ds_t = cap.curve.mul_(ds).addcmul_(cap.slope, ds_t)
            ds = cap.slope.mul_(ds)
        # backward: dQ = scale dS K~, dK~ = scale dS^T Q, dbias = dS  ->  product rule on each
        r.back_through_scores(ds_t, ds, tk_rep, tq_s, through_scores, rows, cols, ds_bias)
        if (row_constant or sink_rows is not None) and sink:  # rowsum(dS~) = the tangent of D P_sink
            share = _sink_share(r, rows, delta_t_blk.dtype)
            per_row = share * (delta_t_blk - t_row * delta[:, :, rows])  # P_sink (D~ - t D)
            if row_constant:
                add_block_to_bias(grads.bias, per_row, start, stop, 1)
            if sink_rows is not None:
                sink_rows[:, :, rows] = per_row[..., 0]
    return (
        grads.q.to(call.q.dtype),
        grads.k.total(r.groups).to(call.k.dtype),
        grads.v.total(r.groups).to(call.v.dtype),
        None if grads.bias is None else grads.bias.to(call.bias.dtype),
    )


def attention_double_backward(
    call: AttentionCall, **inputs: Unpack[PassInputs]
) -> tuple[Optional[Tensor], Tensor, Tensor, Tensor, Optional[Tensor]]:
    """(g_dout or None, g_q, g_k, g_v, g_bias or None): the gradients, with respect to the
    backward's inputs, of <gq, dq> + <gk, dk> + <gv, dv> + <gbias, dbias>; an absent cotangent
    is zero. g_dout only with `dout_grad`: a gradient penalty's dO is a constant, and g_dout
    takes two of the twelve score-sized products per block.

    For a part of each row's keys, the whole rows' sums are given (`row_sums`, B, H, Lq, 1,
    compute dtype; `double_backward_row_sums`): `centre` = t = rowsum(P * T) and `g_centre` =
    rowsum(P * g_P).

    With the call's sink (`ops.add_sink`) P sums to 1 - P_sink on a row, and the per-row t D
    left out of g_P returns as t D P_sink in rowsum(P * g_P), P_sink = exp(-m) / l. A bias
    constant along the keys gets each whole row's sum of g_S in closed form, P_sink (u - t D)
    with u that row sum, and 0 without a sink: summing g_S would cancel down to it.
    `sink_rows` (B, H, Lq), where given, takes that term of every row (`sink_logits`)."""
    sums = inputs.get("row_sums") or {}
    centre, g_centre = sums.get("centre"), sums.get("g_centre")
    dout, bias_grad, sink, sink_rows = inputs["dout"], inputs["bias_grad"], call.sink, inputs.get("sink_rows")
    _check_sink_rows(sink_rows, sink, centre)
    r = _Recompute(call, inputs, buffers=5)
    work = r.work
    gq, gk = inputs["gq"], inputs["gk"]
    form = r.score_form(gq, gk, inputs["gbias"] if bias_grad else None)  # T
    gq_s, gk_rep, gv_rep = _to(gq, work, call.scale), _repeat(gk, r.groups, work), _repeat(inputs["gv"], r.groups, work)
    width_v = call.v.shape[-1]
    # [dO | -D] [V~ | 1]^T = dP - D in one GEMM without dropout (see kernels.with_column)
    do_w, delta = dout.to(work), _delta(dout, inputs["out"], work)
    v_ones = r.values_with_ones() if call.dropout_p == 0.0 else None
    g_do = torch.zeros(*dout.shape, dtype=work, device=dout.device) if inputs["dout_grad"] else None
    grads = r.gradient_accumulators(bias_grad)
    row_constant = _rows_give_the_bias(bias_grad, call.bias, centre)
    # the sums each block's tiles go into: not a bias constant along the keys (its closed form, below)
    through_scores = grads._replace(bias=None) if row_constant else grads
    for start, stop, cols, p, z, single in r.each_block():
        rows = slice(start, stop)
        do_rows, v_blk = with_column(do_w[:, :, rows], -delta[:, :, rows]), r.v_rep[..., cols, :]  # [dO | -D]
        do_blk = do_rows[..., :width_v]
        scratch = r.tile(3, start, stop, cols)
        t_form = form.tile_into(r.tile(1, start, stop, cols), start, stop, cols, r.capped)  # T
        share = _sink_share(r, rows, work) if sink else None
        if centre is not None:  # t = rowsum(P * T), given
            t_row, t_less = centre[:, :, rows], centre[:, :, rows]
        else:  # centred on the peak: T - c in T's buffer, and t - c
            c, t_less = _centre_on_the_peak(p, t_form, scratch, share)
            t_row = c + t_less
        dp_out = r.tile(2, start, stop, cols)
        if z is None:
            dp = torch.matmul(do_rows, v_ones[..., cols, :].transpose(-1, -2), out=dp_out)  # dP - D
        else:
            dp = torch.matmul(do_blk, v_blk.transpose(-1, -2), out=dp_out).mul_(z).add_(do_rows[..., width_v:])
        if single is not None:  # D = dP exactly there, and dS = 0 (as in `first_order`)
            dp.masked_fill_(single, 0.0)
        # through dS = P * (dP - D), D = rowsum(P * dP): to dP, then to P
        t_form.sub_(t_less)  # T - t
        g_dp = torch.mul(p, t_form, out=scratch)
        # through dP = (dO V~^T) * Z
        g_dp_z = g_dp.mul_(z) if z is not None else g_dp
        grads.v.add(g_dp_z, do_blk, cols.start)
        g_p = t_form.mul_(dp)  # (dP - D) * (T - t), in T's buffer
        # through dV~ = (P * Z)^T dO, with dP's path to dO beside it
        if g_do is not None:
            g_do[:, :, rows] = _sum_of_products(
                (g_dp_z, v_blk, 1.0),
                None if gv_rep is None else (_times(p, z, r.tile(4, start, stop, cols)), gv_rep[..., cols, :], 1.0),
            )
        if gv_rep is not None:
            if z is None:
                _add_matmul(g_p, do_blk, gv_rep[..., cols, :].transpose(-1, -2))
            else:
                g_p.addcmul_(torch.matmul(do_blk, gv_rep[..., cols, :].transpose(-1, -2), out=scratch), z)
        # through P = softmax(S), then S = scale Q K~^T + bias; dQ, dK~ also hold K~, Q directly
        if g_centre is not None:  # u = rowsum(P * g_P), given
            u_row = g_centre[:, :, rows]
            g_s = _softmax_jacobian_times(p, g_p, scratch, u_row)  # g_S = P * (g_P - u)
        else:  # centred as T is; the t D that g_P leaves out returns through a sink as t D P_sink
            c, u_less = _centre_on_the_peak(p, g_p, scratch, share, t_row * delta[:, :, rows] if sink else None)
            u_row = c + u_less
            g_s = torch.sub(g_p, u_less, out=scratch).mul_(p)  # g_S = P * (g_P - u)
        ds = p.mul_(dp)  # dS = P * (dP - D), in P's buffer
        g_s_bias = None
        if r.capped is not None:  # through dA = slope dS, and S = c tanh(A / c): g_A = slope g_S + (curve T_raw) dS
            g_s_bias, cap = g_s, r.capped
            g_s = cap.curve.mul_(ds).addcmul_(cap.slope, g_s)
            ds = cap.slope.mul_(ds)
        r.back_through_scores(g_s, ds, gk_rep, gq_s, through_scores, rows, cols, g_s_bias)
        if (row_constant or sink_rows is not None) and sink:  # rowsum(g_S) = rowsum(P * g_P) - u rowsum(P)
            per_row = share * (u_row - t_row * delta[:, :, rows])  # = P_sink (u - t D)
            if row_constant:
                add_block_to_bias(grads.bias, per_row, start, stop, 1)
            if sink_rows is not None:
                sink_rows[:, :, rows] = per_row[..., 0]
    return (
        None if g_do is None else g_do.to(dout.dtype),
        grads.q.to(call.q.dtype),
        grads.k.total(r.groups).to(call.k.dtype),
        grads.v.total(r.groups).to(call.v.dtype),
        None if grads.bias is None else grads.bias.to(call.bias.dtype),
    )


def double_backward_row_sums(call: AttentionCall, **inputs: Unpack[PassInputs]) -> tuple[Tensor, Tensor]:
    """This call's keys' part of the double backward's two row sums, for a ring step
    (B, H, Lq, 1 each, compute dtype): rowsum(P * T), and rowsum(P * (dP * T + (dO gV~^T) * Z)).
    Its `row_sums` come empty: given only so that a backend that takes rows' sums runs it.

    Over a whole row, with t = rowsum(P * T), D = rowsum(P * dP) and rowsum(P) = 1 (or P = 0),
        rowsum(P * g_P) = rowsum(P * ((dP - D) (T - t) + (dO gV~^T) Z))
                        = rowsum(P * (dP T + (dO gV~^T) Z)) - t D,
    so one pass over the keys gives both, for `attention_double_backward`'s centre and g_centre."""
    r = _Recompute(call, inputs, buffers=3)
    form = r.score_form(inputs["gq"], inputs["gk"], inputs["gbias"] if inputs["bias_grad"] else None)  # T
    gv_rep = _repeat(inputs["gv"], r.groups, r.work)
    do_w = inputs["dout"].to(r.work)
    t_sum = torch.zeros(r.batch, r.heads, r.len_q, 1, dtype=r.work, device=call.q.device)
    u_sum = torch.zeros_like(t_sum)
    for start, stop, cols, p, z, _single in r.each_block():
        rows = slice(start, stop)
        t_form = form.tile_into(r.tile(1, start, stop, cols), start, stop, cols, r.capped)  # T
        dp = torch.matmul(do_w[:, :, rows], r.v_rep[..., cols, :].transpose(-1, -2), out=r.tile(2, start, stop, cols))
        if gv_rep is not None:  # (dO gV~^T) Z is not multiplied by T: its own row sum
            x = torch.matmul(do_w[:, :, rows], gv_rep[..., cols, :].transpose(-1, -2))
            u_sum[:, :, rows] += (x.mul_(z) if z is not None else x).mul_(p).sum(dim=-1, keepdim=True)
        if z is not None:
            dp.mul_(z)
        pt = t_form.mul_(p)  # P * T
        t_sum[:, :, rows] += pt.sum(dim=-1, keepdim=True)
        u_sum[:, :, rows] += pt.mul_(dp).sum(dim=-1, keepdim=True)
    return t_sum, u_sum
