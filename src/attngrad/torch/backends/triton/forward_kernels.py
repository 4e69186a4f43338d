"""The kernels that walk each query block's keys with the rows' statistics made as they go
or read: `forward` (online softmax: O, m and 1/l), `jvp` (O' from the forward's m and 1/l)
and `forward_jvp` (the two in one walk). How their arguments are packed: `kernels`."""

from __future__ import annotations

import triton
import triton.language as tl

from .tile_ops import (
    base_exp,
    dot_nt,
    from_base,
    in_base,
    keep_scale,
    load_floats,
    load_rows,
    load_score_like,
    load_tile,
    mm,
    operand,
    score_form,
    scores,
    segment,
    tile_of,
    walk_list,
)


@triton.jit
def _recentre(s, tile_top, sp, offs_n, top, centre, peak, x, weight, acc_s, acc_o):
    """Where a row's tile holds a key more probable than `top` (its peak so far), the centre c
    becomes that key's S' (of tied keys, the largest S', then the first key), the peak that
    key's index, and the sums centred on c move with it: x by (c_old - c) `weight` (the
    probability summed so far), acc_s by (c_old - c) acc_o. (c, top, peak, x, acc_s) after
    the tile; a NaN S' names no key."""
    tied = s == tile_top[:, None]
    sp_top = tl.max(tl.where(tied, sp, float("-inf")), 1)
    at = tl.min(tl.where(tied & (sp == sp_top[:, None]), offs_n[None, :], 2147483647), 1)
    moved = tile_top > top
    new_centre = tl.where(moved, sp_top, centre)
    new_peak = tl.where(moved, tl.where(at == 2147483647, -1, at), peak)
    move = tl.where(moved, centre - new_centre, 0.0)
    return new_centre, tl.where(moved, tile_top, top), new_peak, x + move * weight, acc_s + move[:, None] * acc_o


@triton.jit
def forward(tensors, strides, masks, meta, fmeta, walks, sizes, descriptors, SW: tl.constexpr,
            TMA: tl.constexpr = False):
    """With TMA, K's and V's tiles come through `descriptors` (tensor descriptors of the
    (B, Hkv, Lk, d) tensors, blocks of (1, 1, BN, BD), zero outside: `launch._descriptors`)."""
    Q, K, V, O, M, INV = tensors
    sq, sk, sv, so = strides
    H, G, Lq, Lk, D, DV, causal = sizes
    BM: tl.constexpr = SW.BM
    BN: tl.constexpr = SW.BN
    BD: tl.constexpr = SW.BD
    BDV: tl.constexpr = SW.BDV
    SD: tl.constexpr = SW.SD
    IP: tl.constexpr = SW.IP
    ACC: tl.constexpr = SW.ACC
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // G
    floats = load_floats(fmeta, ACC)  # (scale, cap, 1 / cap, 1 / (1 - p))
    keep_value = floats[3]
    score_floats = in_base(floats, SW.EXP2)  # the scores, the shift and m in base 2 where EXP2
    offs_m = qb * BM + tl.arange(0, BM)
    offs_dv = tl.arange(0, BDV)
    q = operand(Q + b * sq[0] + h * sq[1], sq[2], sq[3], offs_m, Lq, D, BD, SD)
    m_i = tl.full((BM,), float("-inf"), ACC)
    l_i = tl.zeros((BM,), ACC)
    acc = tl.zeros((BM, BDV), ACC)
    order, n_in, n_all = walk_list(walks, b, h, qb)
    for part in tl.static_range(0 if SW.SPLIT else 1, 2):  # the tiles that need no masking, then the others
        lo, hi = segment(0, n_in, n_all, part == 1, SW.SPLIT)
        for i in range(lo, hi):
            kb = tl.load(order + i)
            offs_n = kb * BN + tl.arange(0, BN)
            if TMA:
                k = tile_of(descriptors[0], b, hk, kb * BN, BN, BD)
            else:
                k = operand(K + b * sk[0] + hk * sk[1], sk[2], sk[3], offs_n, Lk, D, BD, SD)
            qk = dot_nt(q, k, tl.zeros((BM, BN), ACC), BD, SD, IP)
            s, _ = scores(qk, b, h, offs_m, offs_n, sizes, score_floats, masks, SW, part == 1)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: any finite shift
            alpha = base_exp(m_i - shift, SW.EXP2)
            e = base_exp(s - shift[:, None], SW.EXP2)
            l_i = l_i * alpha + tl.sum(e, 1)
            if SW.DROPOUT:
                e = e * keep_scale(meta, b, h, offs_m, offs_n, keep_value)
            if TMA:
                v = tile_of(descriptors[1], b, hk, kb * BN, BN, BDV)
            else:
                v = load_tile(V + b * sv[0] + hk * sv[1], sv[2], sv[3], offs_n, offs_dv, Lk, DV)
            acc = acc * alpha[:, None] + mm(e.to(v.dtype), v, IP, ACC)
            m_i = m_new
    # l = 0 only where a row saw no key (its O 0, even where 0 x NaN left NaN in acc); a row
    # that a NaN or Inf reached has l NaN, and keeps 1/l and O NaN
    empty = l_i == 0
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))  # no 1 / 0 computed, even masked away
    rows = (b * H + h) * Lq + offs_m
    tl.store(M + rows, tl.where(m_i == float("-inf"), 0.0, from_base(m_i, SW.EXP2)), mask=offs_m < Lq)
    tl.store(INV + rows, inv, mask=offs_m < Lq)
    out = O + b * so[0] + h * so[1] + offs_m[:, None] * so[2] + offs_dv[None, :] * so[3]
    tl.store(out, tl.where(empty[:, None], 0.0, acc * inv[:, None]).to(O.dtype.element_ty),
             mask=(offs_m[:, None] < Lq) & (offs_dv[None, :] < DV))


@triton.jit
def jvp(tensors, strides, tbias, stb, masks, meta, fmeta, walks, sizes, HAS_TQ: tl.constexpr,
        HAS_TK: tl.constexpr, HAS_TV: tl.constexpr, HAS_TBIAS: tl.constexpr, SW: tl.constexpr,
        CENTRE: tl.constexpr = False, SINK: tl.constexpr = False):
    """O' = (P' Z) V + (P Z) V' with P' = P (S' - t), t = rowsum(P S'), in one walk. With
    CENTRE, centred on each row's peak as the tiles are (`centre_on_peak`): with c S' at the most probable key
    so far, it sums x = rowsum(P (S' - c)) and (P Z (S' - c)) V, and where a later key is
    more probable, moves both to the new c (by (c_old - c) times what it has summed of P
    and of (P Z) V, whose weight is off the row's peak, so small where the row is peaked).
    A sink is an entry of score 0 and S' 0, so c starts there.
    Then t - c = x - c P_sink (rowsum(P) = 1 - P_sink; SINK: 1/l holds a sink's term) and
    O' = sum (P Z (S' - c)) V - (t - c) sum (P Z) V + (P Z) V'; without it c = 0 (the half
    and TF32 kernels, whose products' rounding is far above what centring saves, and which
    it would make spill). The tangents share q's (TQ), k's (TK) and v's (TV) strides; 1/l
    and m are the forward's."""
    Q, K, V, TQ, TK, TV, OT, M, INV = tensors
    sq, sk, sv, so = strides
    H, G, Lq, Lk, D, DV, causal = sizes
    BM: tl.constexpr = SW.BM
    BN: tl.constexpr = SW.BN
    BD: tl.constexpr = SW.BD
    BDV: tl.constexpr = SW.BDV
    SD: tl.constexpr = SW.SD
    IP: tl.constexpr = SW.IP
    ACC: tl.constexpr = SW.ACC
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // G
    floats = load_floats(fmeta, ACC)  # (scale, cap, 1 / cap, 1 / (1 - p))
    scale, keep_value = floats[0], floats[3]
    offs_m = qb * BM + tl.arange(0, BM)
    offs_dv = tl.arange(0, BDV)
    q = operand(Q + b * sq[0] + h * sq[1], sq[2], sq[3], offs_m, Lq, D, BD, SD)
    tq = None
    if HAS_TQ:
        tq = operand(TQ + b * sq[0] + h * sq[1], sq[2], sq[3], offs_m, Lq, D, BD, SD)
    rows = (b * H + h) * Lq
    m_row = load_rows(M + rows, offs_m, Lq)
    inv = load_rows(INV + rows, offs_m, Lq)
    centre = tl.zeros((BM,), ACC)  # c: S' at the most probable key so far
    top = tl.full((BM,), float("-inf"), ACC)  # that key's score
    if SINK:  # the sink is an entry of score 0 (its logit is in the bias) and S' 0: c = 0 until a key outweighs it
        top = tl.zeros((BM,), ACC)
    peak = tl.full((BM,), -1, tl.int32)  # that key's index (unused here: `forward_jvp` stores it)
    x = tl.zeros((BM,), ACC)  # rowsum(P (S' - c))
    p_sum = tl.zeros((BM,), ACC)  # rowsum(P), what x moves by per unit of c
    acc_o = tl.zeros((BM, BDV), ACC)
    acc_s = tl.zeros((BM, BDV), ACC)
    order, n_in, n_all = walk_list(walks, b, h, qb)
    for part in tl.static_range(0 if SW.SPLIT else 1, 2):  # the tiles that need no masking, then the others
        lo, hi = segment(0, n_in, n_all, part == 1, SW.SPLIT)
        for i in range(lo, hi):
            kb = tl.load(order + i)
            offs_n = kb * BN + tl.arange(0, BN)
            k = operand(K + b * sk[0] + hk * sk[1], sk[2], sk[3], offs_n, Lk, D, BD, SD)
            qk = dot_nt(q, k, tl.zeros((BM, BN), ACC), BD, SD, IP)
            s, th = scores(qk, b, h, offs_m, offs_n, sizes, floats, masks, SW, part == 1)
            p = tl.exp(s - m_row[:, None]) * inv[:, None]
            tk = None
            if HAS_TK:
                tk = operand(TK + b * sk[0] + hk * sk[1], sk[2], sk[3], offs_n, Lk, D, BD, SD)
            t_bias = None
            if HAS_TBIAS:
                t_bias = load_score_like(tbias, stb, b, h, offs_m, offs_n, Lq, Lk, ACC)
            sp, _ = score_form(q, k, tq, tk, th, t_bias, scale, SW.SOFTCAP, BD, SD, IP, ACC)
            sp_less = sp
            if CENTRE:  # a more probable key in this tile: c becomes its S', and the sums move with it
                centre, top, peak, x, acc_s = _recentre(s, tl.max(s, 1), sp, offs_n, top, centre, peak, x, p_sum,
                                                        acc_s, acc_o)
                sp_less = sp - centre[:, None]
                p_sum += tl.sum(p, 1)
            x += tl.sum(p * sp_less, 1)
            if SW.DROPOUT:
                p = p * keep_scale(meta, b, h, offs_m, offs_n, keep_value)
            v = load_tile(V + b * sv[0] + hk * sv[1], sv[2], sv[3], offs_n, offs_dv, Lk, DV)
            acc_o += mm(p.to(v.dtype), v, IP, ACC)
            acc_s += mm((p * sp_less).to(v.dtype), v, IP, ACC)
            if HAS_TV:
                tv = load_tile(TV + b * sv[0] + hk * sv[1], sv[2], sv[3], offs_n, offs_dv, Lk, DV)
                acc_s += mm(p.to(tv.dtype), tv, IP, ACC)
    t_less = x  # t - c
    if CENTRE and SINK:  # rowsum(P) = 1 - P_sink: t - c = x - c P_sink, P_sink = exp(-m) / l (0 on a row that sees no key)
        seen = inv != 0
        p_sink = tl.where(seen, tl.exp(tl.log(tl.where(seen, inv, 1.0)) - m_row), 0.0)
        t_less = x - centre * p_sink
    out = OT + b * so[0] + h * so[1] + offs_m[:, None] * so[2] + offs_dv[None, :] * so[3]
    tl.store(out, (acc_s - t_less[:, None] * acc_o).to(OT.dtype.element_ty),
             mask=(offs_m[:, None] < Lq) & (offs_dv[None, :] < DV))


@triton.jit
def forward_jvp(tensors, strides, tbias, stb, masks, meta, fmeta, walks, sizes, descriptors, HAS_TQ: tl.constexpr,
                HAS_TK: tl.constexpr, HAS_TV: tl.constexpr, HAS_TBIAS: tl.constexpr, SW: tl.constexpr,
                CENTRE: tl.constexpr = False, SINK: tl.constexpr = False, TMA: tl.constexpr = False,
                row_sums=None, SUMS: tl.constexpr = False):
    """The forward and its JVP in one walk, 6 products per tile where `forward` and `jvp` take
    2 + 6: the online softmax of `forward` (shift m, l = rowsum(e), e = exp(S - m)) carries
    beside (e Z) V the sums x = rowsum(e (S' - c)) and (e Z (S' - c)) V + (e Z) V', all
    rescaled together when m moves. With CENTRE, c is S' at the most probable key so far (as
    `jvp` centres), and moving it adds (c_old - c) times l to x and times (e Z) V to the other.
    A sink (SINK) is an entry of score 0, S' 0 and value 0: it adds exp(-m) to l and starts c
    at 0. Then 1/l, O = (e Z) V / l, t - c = x / l - c P_sink and
    O' = ((e Z (S' - c)) V + (e Z) V' - (t - c) (e Z) V) / l. Row statistics as `forward`
    leaves them with `ops.add_sink` applied; O and O' share strides (so). With TMA, K, V and
    their tangents come through `descriptors`, as in `forward`. With SUMS, each row's t - c,
    c and the peak key's index (-1: none, or the sink) also go to `row_sums`, three
    contiguous (B, H, Lq) tensors: what a backward's JVP along the same tangents takes
    instead of `row_sums`' walk (`launch.given_row_sums`)."""
    Q, K, V, TQ, TK, TV, O, OT, M, INV = tensors
    sq, sk, sv, so = strides
    H, G, Lq, Lk, D, DV, causal = sizes
    BM: tl.constexpr = SW.BM
    BN: tl.constexpr = SW.BN
    BD: tl.constexpr = SW.BD
    BDV: tl.constexpr = SW.BDV
    SD: tl.constexpr = SW.SD
    IP: tl.constexpr = SW.IP
    ACC: tl.constexpr = SW.ACC
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // G
    floats = load_floats(fmeta, ACC)  # (scale, cap, 1 / cap, 1 / (1 - p))
    scale, keep_value = floats[0], floats[3]
    score_floats = in_base(floats, SW.EXP2)  # the scores, the shift and m in base 2 where EXP2 (S' is not)
    offs_m = qb * BM + tl.arange(0, BM)
    offs_dv = tl.arange(0, BDV)
    q = operand(Q + b * sq[0] + h * sq[1], sq[2], sq[3], offs_m, Lq, D, BD, SD)
    tq = None
    if HAS_TQ:
        tq = operand(TQ + b * sq[0] + h * sq[1], sq[2], sq[3], offs_m, Lq, D, BD, SD)
    m_i = tl.full((BM,), float("-inf"), ACC)
    l_i = tl.zeros((BM,), ACC)
    x = tl.zeros((BM,), ACC)  # rowsum(e (S' - c))
    acc_o = tl.zeros((BM, BDV), ACC)  # (e Z) V
    acc_s = tl.zeros((BM, BDV), ACC)  # (e Z (S' - c)) V + (e Z) V'
    centre = tl.zeros((BM,), ACC)  # c: S' at the most probable key so far
    top = tl.full((BM,), float("-inf"), ACC)  # that key's score (a sink's 0 to start with)
    if SINK:
        top = tl.zeros((BM,), ACC)
    peak = tl.full((BM,), -1, tl.int32)  # that key's index (-1: the sink's, or none)
    order, n_in, n_all = walk_list(walks, b, h, qb)
    for part in tl.static_range(0 if SW.SPLIT else 1, 2):  # the tiles that need no masking, then the others
        lo, hi = segment(0, n_in, n_all, part == 1, SW.SPLIT)
        for i in range(lo, hi):
            kb = tl.load(order + i)
            offs_n = kb * BN + tl.arange(0, BN)
            if TMA:
                k = tile_of(descriptors[0], b, hk, kb * BN, BN, BD)
            else:
                k = operand(K + b * sk[0] + hk * sk[1], sk[2], sk[3], offs_n, Lk, D, BD, SD)
            qk = dot_nt(q, k, tl.zeros((BM, BN), ACC), BD, SD, IP)
            s, th = scores(qk, b, h, offs_m, offs_n, sizes, score_floats, masks, SW, part == 1)
            tile_top = tl.max(s, 1)
            m_new = tl.maximum(m_i, tile_top)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: any finite shift
            alpha = base_exp(m_i - shift, SW.EXP2)
            e = base_exp(s - shift[:, None], SW.EXP2)
            tk = None
            if HAS_TK:
                if TMA:
                    tk = tile_of(descriptors[2], b, hk, kb * BN, BN, BD)
                else:
                    tk = operand(TK + b * sk[0] + hk * sk[1], sk[2], sk[3], offs_n, Lk, D, BD, SD)
            t_bias = None
            if HAS_TBIAS:
                t_bias = load_score_like(tbias, stb, b, h, offs_m, offs_n, Lq, Lk, ACC)
            sp, _ = score_form(q, k, tq, tk, th, t_bias, scale, SW.SOFTCAP, BD, SD, IP, ACC)
            l_i = l_i * alpha
            x = x * alpha
            acc_o = acc_o * alpha[:, None]
            acc_s = acc_s * alpha[:, None]
            sp_less = sp
            if CENTRE:  # a more probable key in this tile: c becomes its S', and the sums move with it
                centre, top, peak, x, acc_s = _recentre(s, tile_top, sp, offs_n, top, centre, peak, x, l_i, acc_s,
                                                        acc_o)
                sp_less = sp - centre[:, None]
            l_i += tl.sum(e, 1)
            x += tl.sum(e * sp_less, 1)
            if SW.DROPOUT:
                e = e * keep_scale(meta, b, h, offs_m, offs_n, keep_value)
            if TMA:
                v = tile_of(descriptors[1], b, hk, kb * BN, BN, BDV)
            else:
                v = load_tile(V + b * sv[0] + hk * sv[1], sv[2], sv[3], offs_n, offs_dv, Lk, DV)
            acc_o += mm(e.to(v.dtype), v, IP, ACC)
            acc_s += mm((e * sp_less).to(v.dtype), v, IP, ACC)
            if HAS_TV:
                if TMA:
                    tv = tile_of(descriptors[3], b, hk, kb * BN, BN, BDV)
                else:
                    tv = load_tile(TV + b * sv[0] + hk * sv[1], sv[2], sv[3], offs_n, offs_dv, Lk, DV)
                acc_s += mm(e.to(tv.dtype), tv, IP, ACC)
            m_i = m_new
    # l = 0 only where a row saw no key (O and O' 0); a row that a NaN or Inf reached has l
    # NaN, and keeps 1/l, O and O' NaN. A sink's weight is exp(-m) / (l + exp(-m)) =
    # 1 / (1 + l exp(m)), which stays finite where exp(-m) overflows (then 1/l and O are 0)
    empty = l_i == 0
    if SINK:
        seen_m = tl.where(empty, 0.0, m_i)
        inv = tl.where(empty, 0.0, 1.0 / (l_i + base_exp(-seen_m, SW.EXP2)))
    else:
        inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))  # no 1 / 0 computed, even masked away
    t_less = x * inv  # t - c, less c P_sink where a sink holds a share of the row
    if CENTRE and SINK:
        t_less -= centre / (1.0 + l_i * base_exp(seen_m, SW.EXP2))
    rows = (b * H + h) * Lq + offs_m
    tl.store(M + rows, tl.where(m_i == float("-inf"), 0.0, from_base(m_i, SW.EXP2)), mask=offs_m < Lq)
    tl.store(INV + rows, inv, mask=offs_m < Lq)
    at = offs_m[:, None] * so[2] + offs_dv[None, :] * so[3]
    inside = (offs_m[:, None] < Lq) & (offs_dv[None, :] < DV)
    out = acc_o * inv[:, None]
    tl.store(O + b * so[0] + h * so[1] + at, tl.where(empty[:, None], 0.0, out).to(O.dtype.element_ty), mask=inside)
    out_t = (acc_s - t_less[:, None] * acc_o) * inv[:, None]
    tl.store(OT + b * so[0] + h * so[1] + at, tl.where(empty[:, None], 0.0, out_t).to(OT.dtype.element_ty),
             mask=inside)
    if SUMS:
        t_less_out, centre_out, peak_out = row_sums
        tl.store(t_less_out + rows, t_less, mask=offs_m < Lq)
        tl.store(centre_out + rows, centre, mask=offs_m < Lq)
        tl.store(peak_out + rows, peak, mask=offs_m < Lq)
