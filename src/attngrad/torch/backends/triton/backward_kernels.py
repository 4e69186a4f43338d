"""The backward-type kernels: `row_dot` (D), `row_sums` (the whole rows' sums of the
backward's JVP and the double backward), `query_side`, `key_side` (fused with dQ's ordered
adds, `dq_rank`, `add_in_order`, where the walks are contiguous runs), `key_side_light` and
`bias_side`. How their arguments are packed: `kernels`."""

from __future__ import annotations

import triton
import triton.language as tl

from .tile_ops import (
    SUMS,
    base_exp,
    dot_nt,
    in_base,
    keep_scale,
    load_floats,
    load_row_sums,
    load_rows,
    load_score_like,
    load_tile,
    mm,
    operand,
    score_form,
    scores,
    segment,
    tile_of,
    tile_terms,
    to_base,
    walk_list,
    whole,
)


@triton.jit
def _row_block(H, BM: tl.constexpr):
    """The (b, h) and the query rows of a program that owns a block of rows."""
    bh = tl.program_id(1)
    return (bh // H).to(tl.int64), (bh % H).to(tl.int64), tl.program_id(0) * BM + tl.arange(0, BM)


@triton.jit
def _rowsum_of_product(X, sx, Y, sy, b, h, offs_m, Lq, DV, BDV: tl.constexpr, ACC: tl.constexpr):
    """rowsum(X * Y) in ACC over the rows offs_m of two (B, H, Lq, DV) tensors at (b, h)."""
    offs_dv = tl.arange(0, BDV)
    x = load_tile(X + b * sx[0] + h * sx[1], sx[2], sx[3], offs_m, offs_dv, Lq, DV).to(ACC)
    y = load_tile(Y + b * sy[0] + h * sy[1], sy[2], sy[3], offs_m, offs_dv, Lq, DV).to(ACC)
    return tl.sum(x * y, 1)


@triton.jit
def row_dot(DO, O, DELTA, sd, so, H, Lq, DV, BM: tl.constexpr, BDV: tl.constexpr, ACC: tl.constexpr):
    """D = rowsum(dO * O) in ACC, per block of rows: (B, H, Lq) contiguous."""
    b, h, offs_m = _row_block(H, BM)
    tl.store(DELTA + (b * H + h) * Lq + offs_m, _rowsum_of_product(DO, sd, O, so, b, h, offs_m, Lq, DV, BDV, ACC),
             mask=offs_m < Lq)


@triton.jit
def given_row_sums(tensors, sd, so, sot, forward_sums, ROW_SUMS, H, Lq, DV, HAS_DO2: tl.constexpr, BM: tl.constexpr,
                   BDV: tl.constexpr, ACC: tl.constexpr):
    """ROW_SUMS (B, H, tile_ops.SUMS, Lq) of a backward's JVP from the forward's JVP along the
    same tangents (`forward_jvp` with SUMS), per block of rows, with no walk over the keys:
    x = t - c, c and the peak's index as `forward_sums` ((B, H, Lq) each) hold them, c2 = 0,
    and y = D~ = rowsum(dO * O') + rowsum(dO2 * O), which is `row_sums`' D~ summed by rows
    instead of by keys (O' = (P (S' - t) Z) V + (P Z) V2). dO2 shares dO's strides."""
    DO, O, OT, DO2 = tensors
    b, h, offs_m = _row_block(H, BM)
    y = _rowsum_of_product(DO, sd, OT, sot, b, h, offs_m, Lq, DV, BDV, ACC)
    if HAS_DO2:
        y += _rowsum_of_product(DO2, sd, O, so, b, h, offs_m, Lq, DV, BDV, ACC)
    t_less, centre, peak = forward_sums
    rows = (b * H + h) * Lq + offs_m
    inside = offs_m < Lq
    out = ROW_SUMS + (b * H + h) * SUMS * Lq + offs_m
    tl.store(out, tl.load(t_less + rows, mask=inside), mask=inside)
    tl.store(out + Lq, y, mask=inside)
    tl.store(out + 2 * Lq, tl.load(centre + rows, mask=inside), mask=inside)
    tl.store(out + 3 * Lq, tl.zeros((BM,), ACC), mask=inside)
    tl.store(out + 4 * Lq, tl.load(peak + rows, mask=inside).to(ACC), mask=inside)


@triton.jit
def _peak_of_tile(s, offs_n, top):
    """Per row: whether this tile holds a score above `top` (the peak so far), the tile's
    largest score, and the first key that has it (as a row mask over the tile's keys)."""
    tile_top = tl.max(s, 1)
    at = tl.min(tl.where(s == tile_top[:, None], offs_n[None, :], 2147483647), 1)
    return tile_top > top, tile_top, offs_n[None, :] == at[:, None]


@triton.jit
def _at(values, where):
    """values at the one key per row that `where` marks (exact: the other terms are 0)."""
    return tl.sum(tl.where(where, values, 0.0), 1)


@triton.jit
def row_sums(tensors, strides, cbias, sc, masks, meta, fmeta, walks, sizes, MODE: tl.constexpr,
             HAS_Q2: tl.constexpr, HAS_K2: tl.constexpr, HAS_V2: tl.constexpr, HAS_DO2: tl.constexpr,
             HAS_C: tl.constexpr, SW: tl.constexpr, CENTRE: tl.constexpr = False, SINK: tl.constexpr = False):
    """The whole-row sums a backward-type pass needs before its walks, for the form F (S' or
    T, `tile_ops.score_form`), into ROW_SUMS (B, H, tile_ops.SUMS, Lq): x = t - c, y, c, c2 and the
    peak key's index (`tile_ops.load_row_sums`), with t = rowsum(P F) and
        BACKWARD_JVP     y = D~ = rowsum(P (F - t) dP + P dP~),  dP~ = (dO2 V^T + dO V2^T) Z
        DOUBLE_BACKWARD  y = u - c2,  u = rowsum(P g_P) + t D P_sink,
                         g_P = b (F - t) + E,  b = dP - D (0 on a row of one key),  E = (dO V2^T) Z

    CENTRE (float32 and float64, as `jvp`): c is F at the row's most probable entry and c2
    g_P there, so that each sum's term at the peak is 0 exactly; uncentred, c = c2 = 0 and
    the peak is -1. On a peaked row t is nearly F at the peak, and F - t there would cancel
    t's rounding. The peak is found as the walk goes: where a tile holds a more probable
    key, the sums so far move to the new centre (as `jvp` does). A sink is an entry of score
    0, F = 0, dP = 0 and E = 0 (so b = -D and g_P = t D), and the first peak of a row."""
    Q, K, V, DO, Q2, K2, V2, DO2, M, INV, DELTA, ROW_SUMS = tensors
    sq, sk, sv, sd = strides
    H, G, Lq, Lk, D, DV, causal = sizes
    BM: tl.constexpr = SW.BM
    BN: tl.constexpr = SW.BN
    BD: tl.constexpr = SW.BD
    BDV: tl.constexpr = SW.BDV
    SD: tl.constexpr = SW.SD
    SDV: tl.constexpr = SW.SDV
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
    q = operand(Q + b * sq[0] + h * sq[1], sq[2], sq[3], offs_m, Lq, D, BD, SD)
    do = operand(DO + b * sd[0] + h * sd[1], sd[2], sd[3], offs_m, Lq, DV, BDV, SDV)
    q2 = None
    if HAS_Q2:
        q2 = operand(Q2 + b * sq[0] + h * sq[1], sq[2], sq[3], offs_m, Lq, D, BD, SD)
    do2 = None
    if HAS_DO2:
        do2 = operand(DO2 + b * sd[0] + h * sd[1], sd[2], sd[3], offs_m, Lq, DV, BDV, SDV)
    rows = (b * H + h) * Lq
    m_row = load_rows(M + rows, offs_m, Lq)
    inv = load_rows(INV + rows, offs_m, Lq)
    d_row = load_rows(DELTA + rows, offs_m, Lq)
    single = inv == 1.0  # a row of one key alone: b = 0 there (`tile_ops.tile_terms`)
    top = tl.full((BM,), float("-inf"), ACC)  # the peak's score
    if SINK:
        top = tl.zeros((BM,), ACC)
    peak = tl.full((BM,), -1, tl.int32)
    c = tl.zeros((BM,), ACC)  # F at the peak
    x = tl.zeros((BM,), ACC)  # rowsum(P (F - c))
    p_sum = tl.zeros((BM,), ACC)  # rowsum(P)
    # BACKWARD_JVP: y1 = rowsum(P (F - c) dP), pd = rowsum(P dP), y2 = rowsum(P dP~)
    # DOUBLE_BACKWARD: y1 = rowsum(P (a - a*)), a = b (F - c) + E; y2 = rowsum(P (b - b*)); pd = rowsum(P b)
    y1 = tl.zeros((BM,), ACC)
    y2 = tl.zeros((BM,), ACC)
    pd = tl.zeros((BM,), ACC)
    a_top = tl.zeros((BM,), ACC)  # a* = E at the peak (its F - c is 0)
    b_top = tl.zeros((BM,), ACC)  # b* = b at the peak
    if CENTRE and SINK:
        b_top = -d_row
    order, n_in, n_all = walk_list(walks, b, h, qb)
    for part in tl.static_range(0 if SW.SPLIT else 1, 2):  # the tiles that need no masking, then the others
        lo, hi = segment(0, n_in, n_all, part == 1, SW.SPLIT)
        for i in range(lo, hi):
            kb = tl.load(order + i)
            offs_n = kb * BN + tl.arange(0, BN)
            k = operand(K + b * sk[0] + hk * sk[1], sk[2], sk[3], offs_n, Lk, D, BD, SD)
            v = operand(V + b * sv[0] + hk * sv[1], sv[2], sv[3], offs_n, Lk, DV, BDV, SDV)
            qk = dot_nt(q, k, tl.zeros((BM, BN), ACC), BD, SD, IP)
            s, th = scores(qk, b, h, offs_m, offs_n, sizes, floats, masks, SW, part == 1)
            p = tl.exp(s - m_row[:, None]) * inv[:, None]
            k2 = None
            if HAS_K2:
                k2 = operand(K2 + b * sk[0] + hk * sk[1], sk[2], sk[3], offs_n, Lk, D, BD, SD)
            c_tile = None
            if HAS_C:
                c_tile = load_score_like(cbias, sc, b, h, offs_m, offs_n, Lq, Lk, ACC)
            form, _ = score_form(q, k, q2, k2, th, c_tile, scale, SW.SOFTCAP, BD, SD, IP, ACC)
            dp = dot_nt(do, v, tl.zeros((BM, BN), ACC), BDV, SDV, IP)
            extra = tl.zeros((BM, BN), ACC)
            if HAS_DO2:
                extra = dot_nt(do2, v, extra, BDV, SDV, IP)
            if HAS_V2:
                v2 = operand(V2 + b * sv[0] + hk * sv[1], sv[2], sv[3], offs_n, Lk, DV, BDV, SDV)
                extra = dot_nt(do, v2, extra, BDV, SDV, IP)
            if SW.DROPOUT:
                z = keep_scale(meta, b, h, offs_m, offs_n, keep_value)
                dp = dp * z
                extra = extra * z
            if MODE == 2:
                dp = tl.where(single[:, None], 0.0, dp - d_row[:, None])  # b
            if CENTRE:  # a more probable key in this tile: the centres move to it, and the sums with them
                moved, tile_top, where = _peak_of_tile(s, offs_n, top)
                new_c = tl.where(moved, _at(form, where), c)
                x += (c - new_c) * p_sum
                if MODE == 1:
                    y1 += (c - new_c) * pd
                else:
                    new_a = tl.where(moved, _at(extra, where), a_top)
                    new_b = tl.where(moved, _at(dp, where), b_top)
                    y1 -= (new_c - c) * pd + (new_a - a_top) * p_sum
                    y2 -= (new_b - b_top) * p_sum
                    a_top = new_a
                    b_top = new_b
                peak = tl.where(moved, tl.max(tl.where(where, offs_n[None, :], -1), 1), peak)
                top = tl.where(moved, tile_top, top)
                c = new_c
            fc = p * (form - c[:, None])
            x += tl.sum(fc, 1)
            p_sum += tl.sum(p, 1)
            pd += tl.sum(p * dp, 1)
            if MODE == 1:
                y1 += tl.sum(fc * dp, 1)
                y2 += tl.sum(p * extra, 1)
            else:
                y1 += tl.sum(fc * dp + p * (extra - a_top[:, None]), 1)
                y2 += tl.sum(p * (dp - b_top[:, None]), 1)
    # t - c = x - c P_sink: rowsum(P) = 1 - P_sink, and the sink's F is 0
    p_sink = tl.zeros((BM,), ACC)
    if SINK:
        seen = inv != 0
        p_sink = tl.where(seen, tl.exp(tl.log(tl.where(seen, inv, 1.0)) - m_row), 0.0)  # exp(-m) / l
    x_less = x - c * p_sink
    c2 = tl.zeros((BM,), ACC)
    if MODE == 1:
        y = y1 - x_less * pd + y2  # rowsum(P (F - t) dP) + rowsum(P dP~)
    else:
        # g_P - c2 = (a - a*) - (t - c)(b - b*), c2 = a* - (t - c) b*; the sink's a = D c, b = -D
        y = y1 - x_less * y2 + p_sink * ((d_row * c - a_top) + x_less * (d_row + b_top))
        c2 = a_top - x_less * b_top
    out = ROW_SUMS + rows * SUMS + offs_m
    inside = offs_m < Lq
    tl.store(out, x_less, mask=inside)
    tl.store(out + Lq, y, mask=inside)
    tl.store(out + 2 * Lq, c, mask=inside)
    tl.store(out + 3 * Lq, c2, mask=inside)
    tl.store(out + 4 * Lq, peak.to(ACC), mask=inside)


@triton.jit
def query_side(tensors, OUT_Q, OUT_DO, DBIAS, strides, sg, cbias, sc, masks, meta, fmeta, walks, sizes,
               MODE: tl.constexpr, HAS_Q2: tl.constexpr, HAS_K2: tl.constexpr, HAS_V2: tl.constexpr,
               HAS_DO2: tl.constexpr, HAS_C: tl.constexpr, DOUT_GRAD: tl.constexpr, BIAS_DIRECT: tl.constexpr,
               SW: tl.constexpr, CENTRE: tl.constexpr = False, descriptors=None, TMA: tl.constexpr = False):
    """Per query block: OUT_Q = scale (A2 K + A K2) (dQ, its tangent, or g_Q; `tile_ops.tile_terms`);
    with DOUT_GRAD, OUT_DO = W V + (P Z) V2 (the double backward's g_dO); with BIAS_DIRECT,
    each tile's term to the bias stored into DBIAS, a zeroed tensor of the scores' own shape.
    OUT_Q and OUT_DO are contiguous."""
    Q, K, V, DO, Q2, K2, V2, DO2, M, INV, DELTA, ROW_SUMS = tensors
    sq, sk, sv, sd = strides
    H, G, Lq, Lk, D, DV, causal = sizes
    BM: tl.constexpr = SW.BM
    BN: tl.constexpr = SW.BN
    BD: tl.constexpr = SW.BD
    BDV: tl.constexpr = SW.BDV
    SD: tl.constexpr = SW.SD
    SDV: tl.constexpr = SW.SDV
    IP: tl.constexpr = SW.IP
    ACC: tl.constexpr = SW.ACC
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // G
    floats = load_floats(fmeta, ACC)  # (scale, cap, 1 / cap, 1 / (1 - p))
    scale, inv_cap, keep_value = floats[0], floats[2], floats[3]
    offs_m = qb * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    q = operand(Q + b * sq[0] + h * sq[1], sq[2], sq[3], offs_m, Lq, D, BD, SD)
    do = operand(DO + b * sd[0] + h * sd[1], sd[2], sd[3], offs_m, Lq, DV, BDV, SDV)
    q2 = None
    if HAS_Q2:
        q2 = operand(Q2 + b * sq[0] + h * sq[1], sq[2], sq[3], offs_m, Lq, D, BD, SD)
    do2 = None
    if HAS_DO2:
        do2 = operand(DO2 + b * sd[0] + h * sd[1], sd[2], sd[3], offs_m, Lq, DV, BDV, SDV)
    rows = (b * H + h) * Lq
    m_row = load_rows(M + rows, offs_m, Lq)
    inv = load_rows(INV + rows, offs_m, Lq)
    d_row = load_rows(DELTA + rows, offs_m, Lq)
    sums = None
    if MODE != 0:
        sums = load_row_sums(ROW_SUMS + rows * SUMS, offs_m, Lq, CENTRE)
    acc_q = tl.zeros((BM, BD), ACC)
    acc_do = tl.zeros((BM, BDV), ACC)
    order, n_in, n_all = walk_list(walks, b, h, qb)
    for part in tl.static_range(0 if SW.SPLIT else 1, 2):  # the tiles that need no masking, then the others
        lo, hi = segment(0, n_in, n_all, part == 1, SW.SPLIT)
        for i in range(lo, hi):
            kb = tl.load(order + i)
            offs_n = kb * BN + tl.arange(0, BN)
            if TMA:
                k = tile_of(descriptors[0], b, hk, kb * BN, BN, BD)
                v = tile_of(descriptors[1], b, hk, kb * BN, BN, BDV)
            else:
                k = operand(K + b * sk[0] + hk * sk[1], sk[2], sk[3], offs_n, Lk, D, BD, SD)
                v = operand(V + b * sv[0] + hk * sv[1], sv[2], sv[3], offs_n, Lk, DV, BDV, SDV)
            qk = dot_nt(q, k, tl.zeros((BM, BN), ACC), BD, SD, IP)
            s, th = scores(qk, b, h, offs_m, offs_n, sizes, in_base(floats, SW.EXP2), masks, SW, part == 1)
            p = base_exp(s - to_base(m_row, SW.EXP2)[:, None], SW.EXP2) * inv[:, None]
            z = None
            if SW.DROPOUT:
                z = keep_scale(meta, b, h, offs_m, offs_n, keep_value)
            k2 = None
            if HAS_K2:
                k2 = operand(K2 + b * sk[0] + hk * sk[1], sk[2], sk[3], offs_n, Lk, D, BD, SD)
            v2 = None
            if HAS_V2:
                v2 = operand(V2 + b * sv[0] + hk * sv[1], sv[2], sv[3], offs_n, Lk, DV, BDV, SDV)
            c_tile = None
            if HAS_C:
                c_tile = load_score_like(cbias, sc, b, h, offs_m, offs_n, Lq, Lk, ACC)
            pz, w, to_bias, da, da2 = tile_terms(MODE, q, k, v, do, q2, k2, v2, do2, c_tile, p, z, th, d_row, inv,
                                                 sums, offs_n, scale, inv_cap, SW.SOFTCAP, SW.DROPOUT, CENTRE, BD,
                                                 SD, BDV, SDV, IP, ACC)
            # the products out to the head width take whole tiles, loaded only now
            acc_q += mm(da2.to(K.dtype.element_ty), whole(k, BD, SD), IP, ACC)
            if MODE != 0:
                if HAS_K2:
                    acc_q += mm(da.to(K2.dtype.element_ty), whole(k2, BD, SD), IP, ACC)
            if DOUT_GRAD:
                acc_do += mm(w.to(V.dtype.element_ty), whole(v, BDV, SDV), IP, ACC)
                if HAS_V2:
                    acc_do += mm(pz.to(V2.dtype.element_ty), whole(v2, BDV, SDV), IP, ACC)
            if BIAS_DIRECT:
                target = DBIAS + b * sg[0] + h * sg[1] + offs_m[:, None] * sg[2] + offs_n[None, :] * sg[3]
                tl.store(target, to_bias.to(DBIAS.dtype.element_ty),
                         mask=(offs_m[:, None] < Lq) & (offs_n[None, :] < Lk))
    out_rows = (b * H + h) * Lq + offs_m
    tl.store(OUT_Q + out_rows[:, None] * D + offs_d[None, :], (acc_q * scale).to(OUT_Q.dtype.element_ty),
             mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D))
    if DOUT_GRAD:
        tl.store(OUT_DO + out_rows[:, None] * DV + offs_dv[None, :], acc_do.to(OUT_DO.dtype.element_ty),
                 mask=(offs_m[:, None] < Lq) & (offs_dv[None, :] < DV))


@triton.jit
def dq_rank(kb, qb, step, n_q, n_k, stop, ROTATE: tl.constexpr):
    """How many key blocks add their part of dQ into query block qb before key block kb does,
    which reaches it at `step` of its walk; the order is fixed, so the sum's bits are.
    ROTATE (every key block walks every query block, from query block kb on, cyclically): the
    parts go in by (step, key block), which keeps the key blocks in step with one another. Else
    (each key block walks a contiguous run upwards, and the contributors to qb are the key blocks
    below `stop`, its walk's end): from the highest key block down, the causal diagonal first."""
    if ROTATE:
        # key block j reaches qb at step (qb - j) mod n_q; count those earlier, per residue
        quo = n_k // n_q
        rem = n_k % n_q
        window = (tl.maximum(0, tl.minimum(qb + 1, rem) - tl.maximum(qb - step + 1, 0))
                  + tl.maximum(0, rem - (n_q - tl.maximum(step - qb - 1, 0))))
        return step * quo + window + kb // n_q
    else:
        return stop - 1 - kb


@triton.jit
def add_in_order(DQ, LOCKS, part, rows, offs_m, offs_d, Lq, D, lock, rank, WAIT: tl.constexpr):
    """DQ[rows + offs_m] += part once the `rank` parts before it are in (LOCKS[lock] counts
    them), then lets the next one in. WAIT off (the interpreter, whose programs run one after
    another) adds in the programs' order. The spin is bounded so that a wrong rank costs an
    order, never a hung GPU."""
    if WAIT:
        seen = tl.atomic_add(LOCKS + lock, 0, sem="acquire")
        tries = 0
        while (seen != rank) & (tries < 4_000_000):
            seen = tl.atomic_add(LOCKS + lock, 0, sem="acquire")
            tries += 1
    ptrs = DQ + (rows + offs_m)[:, None] * D + offs_d[None, :]
    inside = (offs_m[:, None] < Lq) & (offs_d[None, :] < D)
    total = tl.load(ptrs, mask=inside, other=0.0, cache_modifier=".cg") + part
    tl.store(ptrs, total, mask=inside, cache_modifier=".cg")
    if WAIT:
        tl.debug_barrier()  # every thread's part stored before the next key block may read it
        tl.atomic_xchg(LOCKS + lock, rank + 1, sem="release")


@triton.jit
def key_side(tensors, OUT_K, OUT_V, strides, cbias, sc, masks, meta, fmeta, walks, sizes, MODE: tl.constexpr,
             HAS_Q2: tl.constexpr, HAS_K2: tl.constexpr, HAS_V2: tl.constexpr, HAS_DO2: tl.constexpr,
             HAS_C: tl.constexpr, SW: tl.constexpr, DQ=None, LOCKS=None, key_walks=None, query_ranges=None,
             FUSED: tl.constexpr = False, ROTATE: tl.constexpr = False, WAIT: tl.constexpr = False,
             CENTRE: tl.constexpr = False, descriptors=None, TMA: tl.constexpr = False):
    """Per key block of one key/value head, over the G query heads of its group in order:
    OUT_K = scale (A2^T Q + A^T Q2) and OUT_V = W^T dO + (P Z)^T dO2 (dK and dV, their
    tangents, or g_K and g_V; `tile_ops.tile_terms`). walks: each key block's query blocks,
    as lists. OUT_K and OUT_V are contiguous (B, Hkv, Lk, .).

    FUSED (the backward of a call whose walks are contiguous runs): also adds each tile's
    dS K into DQ, a zeroed (B, H, Lq, D) buffer in ACC, in the fixed order of `dq_rank`
    (LOCKS: one counter per query block, zeroed; key_walks and query_ranges: each query block's
    key blocks and each key block's query blocks, as ranges, every tile masked), so
    that no query-side walk recomputes S and dP: 5 products per tile instead of 7. Without
    ROTATE the programs take the key blocks from the last down, so that each waits only on
    programs launched before it."""
    Q, K, V, DO, Q2, K2, V2, DO2, M, INV, DELTA, ROW_SUMS = tensors
    sq, sk, sv, sd = strides
    H, G, Lq, Lk, D, DV, causal = sizes
    BM: tl.constexpr = SW.BM
    BN: tl.constexpr = SW.BN
    BD: tl.constexpr = SW.BD
    BDV: tl.constexpr = SW.BDV
    SD: tl.constexpr = SW.SD
    SDV: tl.constexpr = SW.SDV
    IP: tl.constexpr = SW.IP
    ACC: tl.constexpr = SW.ACC
    kb = tl.program_id(0)
    if FUSED and not ROTATE:
        kb = tl.num_programs(0) - 1 - kb
    bhk = tl.program_id(1)
    hkv = H // G
    b = (bhk // hkv).to(tl.int64)
    hk = (bhk % hkv).to(tl.int64)
    floats = load_floats(fmeta, ACC)  # (scale, cap, 1 / cap, 1 / (1 - p))
    scale, inv_cap, keep_value = floats[0], floats[2], floats[3]
    offs_n = kb * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    k = operand(K + b * sk[0] + hk * sk[1], sk[2], sk[3], offs_n, Lk, D, BD, SD)
    v = operand(V + b * sv[0] + hk * sv[1], sv[2], sv[3], offs_n, Lk, DV, BDV, SDV)
    k2 = None
    if HAS_K2:
        k2 = operand(K2 + b * sk[0] + hk * sk[1], sk[2], sk[3], offs_n, Lk, D, BD, SD)
    v2 = None
    if HAS_V2:
        v2 = operand(V2 + b * sv[0] + hk * sv[1], sv[2], sv[3], offs_n, Lk, DV, BDV, SDV)
    acc_k = tl.zeros((BN, BD), ACC)
    acc_v = tl.zeros((BN, BDV), ACC)
    for g in range(G):
        h = hk * G + g
        rows = (b * H + h) * Lq
        if FUSED:  # a contiguous run of query blocks, every tile in the masked loop
            qrng, sr = query_ranges
            order = qrng + b * sr[0] + h * sr[1] + kb * sr[2]
            first = tl.load(order)
            n_in = first
            n_all = tl.load(order + 1)
        else:
            first = 0
            order, n_in, n_all = walk_list(walks, b, h, kb)
        for part in tl.static_range(0 if SW.SPLIT else 1, 2):  # the tiles that need no masking, then the others
            lo, hi = segment(first, n_in, n_all, part == 1, SW.SPLIT)
            for i in range(lo, hi):
                if FUSED:
                    qb = i
                    if ROTATE:
                        qb = (kb + i) % tl.cdiv(Lq, BM)
                else:
                    qb = tl.load(order + i)
                offs_m = qb * BM + tl.arange(0, BM)
                if TMA:
                    q = tile_of(descriptors[0], b, h, qb * BM, BM, BD)
                    do = tile_of(descriptors[1], b, h, qb * BM, BM, BDV)
                else:
                    q = operand(Q + b * sq[0] + h * sq[1], sq[2], sq[3], offs_m, Lq, D, BD, SD)
                    do = operand(DO + b * sd[0] + h * sd[1], sd[2], sd[3], offs_m, Lq, DV, BDV, SDV)
                m_row = load_rows(M + rows, offs_m, Lq)
                inv = load_rows(INV + rows, offs_m, Lq)
                d_row = load_rows(DELTA + rows, offs_m, Lq)
                sums = None
                if MODE != 0:
                    sums = load_row_sums(ROW_SUMS + rows * SUMS, offs_m, Lq, CENTRE)
                qk = dot_nt(q, k, tl.zeros((BM, BN), ACC), BD, SD, IP)
                s, th = scores(qk, b, h, offs_m, offs_n, sizes, in_base(floats, SW.EXP2), masks, SW, part == 1)
                p = base_exp(s - to_base(m_row, SW.EXP2)[:, None], SW.EXP2) * inv[:, None]
                z = None
                if SW.DROPOUT:
                    z = keep_scale(meta, b, h, offs_m, offs_n, keep_value)
                q2 = None
                if HAS_Q2:
                    q2 = operand(Q2 + b * sq[0] + h * sq[1], sq[2], sq[3], offs_m, Lq, D, BD, SD)
                do2 = None
                if HAS_DO2:
                    do2 = operand(DO2 + b * sd[0] + h * sd[1], sd[2], sd[3], offs_m, Lq, DV, BDV, SDV)
                c_tile = None
                if HAS_C:
                    c_tile = load_score_like(cbias, sc, b, h, offs_m, offs_n, Lq, Lk, ACC)
                pz, w, to_bias, da, da2 = tile_terms(MODE, q, k, v, do, q2, k2, v2, do2, c_tile, p, z, th, d_row, inv,
                                                     sums, offs_n, scale, inv_cap, SW.SOFTCAP, SW.DROPOUT, CENTRE,
                                                     BD, SD, BDV, SDV, IP, ACC)
                # the products out to the head width take whole tiles, loaded only now
                acc_k += mm(tl.trans(da2).to(Q.dtype.element_ty), whole(q, BD, SD), IP, ACC)
                if MODE != 0:
                    if HAS_Q2:
                        acc_k += mm(tl.trans(da).to(Q2.dtype.element_ty), whole(q2, BD, SD), IP, ACC)
                acc_v += mm(tl.trans(w).to(DO.dtype.element_ty), whole(do, BDV, SDV), IP, ACC)
                if MODE == 1:
                    if HAS_DO2:
                        acc_v += mm(tl.trans(pz).to(DO2.dtype.element_ty), whole(do2, BDV, SDV), IP, ACC)
                if FUSED:
                    dq_part = mm(da2.to(K.dtype.element_ty), whole(k, BD, SD), IP, ACC)
                    n_q = tl.cdiv(Lq, BM)
                    stop = 0
                    if not ROTATE:
                        krng, skr = key_walks
                        stop = tl.load(krng + b * skr[0] + h * skr[1] + qb * skr[2] + 1)
                    rank = dq_rank(kb, qb, i - first, n_q, tl.num_programs(0), stop, ROTATE)
                    add_in_order(DQ, LOCKS, dq_part, rows, offs_m, offs_d, Lq, D, (b * H + h) * n_q + qb, rank, WAIT)
    out_rows = (b * hkv + hk) * Lk + offs_n
    tl.store(OUT_K + out_rows[:, None] * D + offs_d[None, :], (acc_k * scale).to(OUT_K.dtype.element_ty),
             mask=(offs_n[:, None] < Lk) & (offs_d[None, :] < D))
    tl.store(OUT_V + out_rows[:, None] * DV + offs_dv[None, :], acc_v.to(OUT_V.dtype.element_ty),
             mask=(offs_n[:, None] < Lk) & (offs_dv[None, :] < DV))


@triton.jit
def key_side_light(tensors, OUT_K, OUT_V, strides, key_bounds, fmeta, walks, sizes, SW: tl.constexpr):
    """key_side's backward (dK, dV) for a light call (`config.is_light`) whose walks are
    contiguous, in the keys' orientation, as FlashAttention-2's dK/dV loop: S^T = K Q^T and
    dP^T = V dO^T come out as the left operands of dV += P^T dO and dK += dS^T Q, where
    key_side transposes P and dS in registers for them (a trip through shared memory each;
    on an H200 at d = 64, key_side took 1.65x query_side's time per product)."""
    Q, K, V, DO = tensors[:4]
    M, INV, DELTA = tensors[8:11]
    sq, sk, sv, sd = strides
    bounds, sob = key_bounds
    qrng, sr = walks
    H, G, Lq, Lk, D, DV, causal = sizes
    BM: tl.constexpr = SW.BM
    BN: tl.constexpr = SW.BN
    BD: tl.constexpr = SW.BD
    BDV: tl.constexpr = SW.BDV
    IP: tl.constexpr = SW.IP
    ACC: tl.constexpr = SW.ACC
    kb = tl.program_id(0)
    bhk = tl.program_id(1)
    hkv = H // G
    b = (bhk // hkv).to(tl.int64)
    hk = (bhk % hkv).to(tl.int64)
    scale = tl.load(fmeta).to(ACC)
    score_scale = in_base((scale, 0.0, 0.0, 0.0), SW.EXP2)[0]
    offs_n = kb * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    k = load_tile(K + b * sk[0] + hk * sk[1], sk[2], sk[3], offs_n, offs_d, Lk, D)  # (BN, BD)
    v = load_tile(V + b * sv[0] + hk * sv[1], sv[2], sv[3], offs_n, offs_dv, Lk, DV)  # (BN, BDV)
    acc_k = tl.zeros((BN, BD), ACC)
    acc_v = tl.zeros((BN, BDV), ACC)
    for g in range(G):
        h = hk * G + g
        walk = qrng + b * sr[0] + h * sr[1] + kb * sr[2]
        rows = (b * H + h) * Lq
        for qb in range(tl.load(walk), tl.load(walk + 1)):
            offs_m = qb * BM + tl.arange(0, BM)
            q = load_tile(Q + b * sq[0] + h * sq[1], sq[2], sq[3], offs_m, offs_d, Lq, D)  # (BM, BD)
            do = load_tile(DO + b * sd[0] + h * sd[1], sd[2], sd[3], offs_m, offs_dv, Lq, DV)  # (BM, BDV)
            m_row = load_rows(M + rows, offs_m, Lq)
            inv = load_rows(INV + rows, offs_m, Lq)
            d_row = load_rows(DELTA + rows, offs_m, Lq)
            st = mm(k, tl.trans(q), IP, ACC) * score_scale  # (BN, BM), in base 2 where EXP2
            keep = (offs_n[:, None] < Lk) & (offs_m[None, :] < Lq)
            if SW.CAUSAL:
                keep = keep & (offs_n[:, None] <= offs_m[None, :] + causal)
            if SW.HAS_BOUNDS:
                row = bounds + b * sob[0] + offs_m * sob[1]
                lo = tl.load(row, mask=offs_m < Lq, other=0)
                hi = tl.load(row + 1, mask=offs_m < Lq, other=0)
                keep = keep & (offs_n[:, None] >= lo[None, :]) & (offs_n[:, None] < hi[None, :])
            pt = base_exp(tl.where(keep, st, float("-inf")) - to_base(m_row, SW.EXP2)[None, :], SW.EXP2) * inv[None, :]
            dpt = mm(v, tl.trans(do), IP, ACC)  # (BN, BM)
            # a row with 1/l = 1 had one key alone: its dP - D is rounding, and set to 0 (`tile_terms`)
            dst = pt * tl.where(inv[None, :] == 1.0, 0.0, dpt - d_row[None, :])
            acc_v += mm(pt.to(DO.dtype.element_ty), do, IP, ACC)
            acc_k += mm(dst.to(Q.dtype.element_ty), q, IP, ACC)
    out_rows = (b * hkv + hk) * Lk + offs_n
    tl.store(OUT_K + out_rows[:, None] * D + offs_d[None, :], (acc_k * scale).to(OUT_K.dtype.element_ty),
             mask=(offs_n[:, None] < Lk) & (offs_d[None, :] < D))
    tl.store(OUT_V + out_rows[:, None] * DV + offs_dv[None, :], acc_v.to(OUT_V.dtype.element_ty),
             mask=(offs_n[:, None] < Lk) & (offs_dv[None, :] < DV))


@triton.jit
def bias_side(tensors, DBIAS, strides, sg, cbias, sc, masks, meta, fmeta, tile_map, walks, B, sizes, BIAS_H,
              MODE: tl.constexpr, HAS_Q2: tl.constexpr, HAS_K2: tl.constexpr, HAS_V2: tl.constexpr,
              HAS_DO2: tl.constexpr, HAS_C: tl.constexpr, BATCH_BROADCAST: tl.constexpr, HEADS_BROADCAST: tl.constexpr,
              ROWS_BROADCAST: tl.constexpr, KEYS_BROADCAST: tl.constexpr, SW: tl.constexpr,
              CENTRE: tl.constexpr = False):
    """Per block of the bias's own (1 or B, BIAS_H = 1 or H, 1 or Lq, 1 or Lk) shape: the sum of the
    tiles' terms to the bias (dS, dS~ or g_S) over the batch entries, heads, rows and keys
    that the block's entries broadcast to, in a fixed order (no atomics). DBIAS is
    contiguous in the bias's 4-D shape."""
    Q, K, V, DO, Q2, K2, V2, DO2, M, INV, DELTA, ROW_SUMS = tensors
    sq, sk, sv, sd = strides
    tmap, st = tile_map
    krng, skr = walks
    H, G, Lq, Lk, D, DV, causal = sizes
    BM: tl.constexpr = SW.BM
    BN: tl.constexpr = SW.BN
    BD: tl.constexpr = SW.BD
    BDV: tl.constexpr = SW.BDV
    SD: tl.constexpr = SW.SD
    SDV: tl.constexpr = SW.SDV
    IP: tl.constexpr = SW.IP
    ACC: tl.constexpr = SW.ACC
    rb = tl.program_id(0)
    kb_own = tl.program_id(1)
    entry = tl.program_id(2)
    b_own = entry // BIAS_H
    h_own = entry % BIAS_H
    floats = load_floats(fmeta, ACC)  # (scale, cap, 1 / cap, 1 / (1 - p))
    scale, inv_cap, keep_value = floats[0], floats[2], floats[3]
    acc = tl.zeros((BM, BN), ACC)
    b_first = b_own
    b_count = 1
    if BATCH_BROADCAST:
        b_first = 0
        b_count = B
    h_first = h_own
    h_count = 1
    if HEADS_BROADCAST:
        h_first = 0
        h_count = H
    for b_step in range(b_count):
        b = (b_first + b_step).to(tl.int64)
        for h_step in range(h_count):
            h = (h_first + h_step).to(tl.int64)
            hk = h // G
            rows = (b * H + h) * Lq
            n_q = tl.cdiv(Lq, BM)
            q_first = rb
            q_count = 1
            if ROWS_BROADCAST:
                q_first = 0
                q_count = n_q
            for q_step in range(q_count):
                qb = q_first + q_step
                walk = krng + b * skr[0] + h * skr[1] + qb * skr[2]
                if KEYS_BROADCAST:
                    k_first = tl.load(walk).to(tl.int32)
                    k_count = (tl.load(walk + 1) - tl.load(walk)).to(tl.int32)
                else:
                    k_first = kb_own
                    k_count = 1
                for k_step in range(k_count):
                    kb = k_first + k_step
                    # kb_own may lie off the walk
                    if tl.load(tmap + b * st[0] + h * st[1] + qb * st[2] + kb * st[3]) == 0:
                        offs_m = qb * BM + tl.arange(0, BM)
                        offs_n = kb * BN + tl.arange(0, BN)
                        q = operand(Q + b * sq[0] + h * sq[1], sq[2], sq[3], offs_m, Lq, D, BD, SD)
                        do = operand(DO + b * sd[0] + h * sd[1], sd[2], sd[3], offs_m, Lq, DV, BDV, SDV)
                        k = operand(K + b * sk[0] + hk * sk[1], sk[2], sk[3], offs_n, Lk, D, BD, SD)
                        v = operand(V + b * sv[0] + hk * sv[1], sv[2], sv[3], offs_n, Lk, DV, BDV, SDV)
                        m_row = load_rows(M + rows, offs_m, Lq)
                        inv = load_rows(INV + rows, offs_m, Lq)
                        d_row = load_rows(DELTA + rows, offs_m, Lq)
                        sums = None
                        if MODE != 0:
                            sums = load_row_sums(ROW_SUMS + rows * SUMS, offs_m, Lq, CENTRE)
                        qk = dot_nt(q, k, tl.zeros((BM, BN), ACC), BD, SD, IP)
                        s, th = scores(qk, b, h, offs_m, offs_n, sizes, floats, masks, SW, True)
                        p = tl.exp(s - m_row[:, None]) * inv[:, None]
                        z = None
                        if SW.DROPOUT:
                            z = keep_scale(meta, b, h, offs_m, offs_n, keep_value)
                        q2 = None
                        if HAS_Q2:
                            q2 = operand(Q2 + b * sq[0] + h * sq[1], sq[2], sq[3], offs_m, Lq, D, BD, SD)
                        k2 = None
                        if HAS_K2:
                            k2 = operand(K2 + b * sk[0] + hk * sk[1], sk[2], sk[3], offs_n, Lk, D, BD, SD)
                        v2 = None
                        if HAS_V2:
                            v2 = operand(V2 + b * sv[0] + hk * sv[1], sv[2], sv[3], offs_n, Lk, DV, BDV, SDV)
                        do2 = None
                        if HAS_DO2:
                            do2 = operand(DO2 + b * sd[0] + h * sd[1], sd[2], sd[3], offs_m, Lq, DV, BDV, SDV)
                        c_tile = None
                        if HAS_C:
                            c_tile = load_score_like(cbias, sc, b, h, offs_m, offs_n, Lq, Lk, ACC)
                        _, _, to_bias, _, _ = tile_terms(MODE, q, k, v, do, q2, k2, v2, do2, c_tile, p, z, th, d_row,
                                                         inv, sums, offs_n, scale, inv_cap, SW.SOFTCAP, SW.DROPOUT,
                                                         CENTRE, BD, SD, BDV, SDV, IP, ACC)
                        acc += to_bias
    out = DBIAS + b_own * sg[0] + h_own * sg[1]
    offs_r = rb * BM + tl.arange(0, BM)
    offs_c = kb_own * BN + tl.arange(0, BN)
    if ROWS_BROADCAST:
        if KEYS_BROADCAST:
            tl.store(out, tl.sum(tl.sum(acc, 1), 0).to(DBIAS.dtype.element_ty))
        else:
            tl.store(out + offs_c * sg[3], tl.sum(acc, 0).to(DBIAS.dtype.element_ty), mask=offs_c < Lk)
    else:
        if KEYS_BROADCAST:
            tl.store(out + offs_r * sg[2], tl.sum(acc, 1).to(DBIAS.dtype.element_ty), mask=offs_r < Lq)
        else:
            tl.store(out + offs_r[:, None] * sg[2] + offs_c[None, :] * sg[3], acc.to(DBIAS.dtype.element_ty),
                     mask=(offs_r[:, None] < Lq) & (offs_c[None, :] < Lk))
