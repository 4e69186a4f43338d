"""What every Triton kernel does to one (BM queries, BN keys) score tile: the scores and
which of them take part, the dropout factor, the tangent or cotangent score form, and the
per-tile terms of every backward-type pass. The kernels (`kernels`) differ only in which
tiles they walk and what they accumulate.

Tile legend: rows = queries offs_m (BM,), columns = keys offs_n (BN,); q (BM, BD), k (BN, BD),
v (BN, BDV), do (BM, BDV); row statistics (BM,). ACC is the compute dtype (float64 for
float64 inputs, else float32); the GEMMs take the inputs' own dtype and sum in ACC.

The products over the head width (S = Q K^T, dP = dO V^T and the tangent or cotangent
forms) take their operands SD (or SDV) columns at a time (`operand`): an FMA product (IEEE
float32, float64) holds a whole inner row of each operand per thread, so a pass with many of
them spills unless the width is cut into slices.

A call's sizes and its constexprs reach the kernels as one tuple argument each (`Sizes`,
`Switches`), read by name; `kernels` says how the rest of their arguments are packed.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

# the pass a backward-type kernel runs (a constexpr)
BACKWARD, BACKWARD_JVP, DOUBLE_BACKWARD = 0, 1, 2
# the row sums a backward-type pass reads, (B, H, SUMS, Lq) (`kernels.row_sums`)
SUMS = tl.constexpr(5)


class Sizes(NamedTuple):
    """A call's sizes, one kernel argument: the query heads, the GQA group (query heads per
    key/value head), the lengths, the head widths and the causal diagonal's offset."""

    H: int
    G: int
    Lq: int
    Lk: int
    D: int
    DV: int
    causal: int


class Switches(NamedTuple):
    """A call's constexprs at one tile size, one kernel argument (`SW`, a tuple of constexprs
    read by name): what takes part in the scores (`scores`), the mask kept per block's block
    (MR rows x MK keys), dropout, whether the walks take the tiles that need no masking in a
    loop of their own (SPLIT, `segment`), whether the scores are in base 2 (EXP2,
    `in_base`), the tile (BM x BN), the padded head widths and the columns their products
    take at a time, the products' precision and the compute dtype."""

    HAS_BIAS: bool
    HAS_MASK: bool
    HAS_BLOCKS: bool
    MR: int
    MK: int
    HAS_BOUNDS: bool
    CAUSAL: bool
    SOFTCAP: bool
    DROPOUT: bool
    SPLIT: bool
    EXP2: bool
    BM: int
    BN: int
    BD: int
    BDV: int
    SD: int
    SDV: int
    IP: str
    ACC: tl.dtype


# Triton 3.9's interpreter multiplies bfloat16 tiles wrongly in tl.dot (float16 is right):
# there, bfloat16 operands are widened to float32 first, which keeps every product exact.
# Compiled kernels multiply bfloat16 on the tensor cores.
WIDEN_BFLOAT16 = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def load_floats(fmeta, ACC: tl.constexpr):
    """A call's float scalars in ACC: (scale, cap, 1 / cap, 1 / (1 - p))."""
    return (tl.load(fmeta).to(ACC), tl.load(fmeta + 1).to(ACC), tl.load(fmeta + 2).to(ACC),
            tl.load(fmeta + 3).to(ACC))


@triton.jit
def mm(a, b, IP: tl.constexpr, ACC: tl.constexpr):
    """a @ b summed in ACC, the products in the operands' dtype (float32 in TF32 if IP says so)."""
    if WIDEN_BFLOAT16 and a.dtype == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee", out_dtype=ACC)
    return tl.dot(a, b, input_precision=IP, out_dtype=ACC)


@triton.jit
def mm_into(a, b, acc, IP: tl.constexpr):
    """acc + a @ b, the products in the operands' dtype, summed into acc's."""
    if WIDEN_BFLOAT16 and a.dtype == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee", out_dtype=acc.dtype)
    # out_dtype stated: Triton before 3.9 takes float32 for it even where acc is float64
    return tl.dot(a, b, acc, input_precision=IP, out_dtype=acc.dtype)


@triton.jit
def operand(ptr, s_row, s_col, offs, n, width, BW: tl.constexpr, S: tl.constexpr):
    """Rows `offs` (R,) of a strided (n, width) matrix as a product over the head width
    (padded to BW) takes them S columns at a time: the whole (R, BW) tile, loaded now, where
    S = BW; else a view (the rows' pointers and which exist (R, 1), the column stride, the
    width) whose slices `columns` loads where each is multiplied."""
    if S == BW:
        return load_tile(ptr, s_row, s_col, offs, tl.arange(0, BW), n, width)
    else:
        return ptr + offs[:, None] * s_row, offs[:, None] < n, s_col, width


@triton.jit
def columns(view, c, S: tl.constexpr):
    """Columns [c, c + S) of an `operand` view, 0 outside the matrix."""
    ptrs, inside, s_col, width = view
    cols = c + tl.arange(0, S)
    return tl.load(ptrs + cols[None, :] * s_col, mask=inside & (cols[None, :] < width), other=0.0)


@triton.jit
def whole(op, BW: tl.constexpr, S: tl.constexpr):
    """An `operand`'s whole (R, BW) tile, for the products out to the head width."""
    if S == BW:
        return op
    else:
        return columns(op, 0, BW)


@triton.jit
def dot_nt(a, b, acc, BW: tl.constexpr, S: tl.constexpr, IP: tl.constexpr):
    """acc + A B^T over the head width for `operand`s A (R, BW) and B (C, BW): at once where
    S = BW, else S columns at a time up to the true width, summed in order into acc. The
    loop runs to the width given at run time, so the compiler cannot unroll it and hoist
    every slice's loads: one slice of each operand is live at a time."""
    if S == BW:
        acc = mm_into(a, tl.trans(b), acc, IP)
    else:
        width = a[3]
        for c in range(0, width, S):
            acc = mm_into(columns(a, c, S), tl.trans(columns(b, c, S)), acc, IP)
    return acc


@triton.jit
def mix64(z):
    """SplitMix64's output function on uint64 lanes (`attngrad.torch.op.dropout`)."""
    z = z ^ (z >> 30)
    z = z * 0xBF58476D1CE4E5B9
    z = z ^ (z >> 27)
    z = z * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def keep_scale(meta, b, h, offs_m, offs_n, keep_value):
    """Z (BM, BN): 1 / (1 - p) where score (b, h, i, j) is kept, else 0, from the seed and the
    coordinates in the whole call alone (the same bits as `dropout.keep_scale_torch` and the
    compiled tiles). meta: int64 [seed, row offset, key offset, head offset, threshold]."""
    seed = tl.load(meta).to(tl.uint64, bitcast=True)
    row_offset = tl.load(meta + 1)
    key_offset = tl.load(meta + 2)
    head = (h + tl.load(meta + 3)).to(tl.uint64)
    threshold = tl.load(meta + 4).to(tl.uint64)
    key = mix64(seed + 0x9E3779B97F4A7C15 * ((b.to(tl.uint64) << 32) + head + 1))
    rows = (offs_m + row_offset).to(tl.uint64)
    cols = (offs_n + key_offset).to(tl.uint64)
    z = mix64(key + 0x9E3779B97F4A7C15 * ((rows[:, None] << 32) + cols[None, :] + 1))
    return tl.where((z >> 32) >= threshold, keep_value, 0.0)


@triton.jit
def tanh(x):
    """tanh from one exp: Triton's core language has none the interpreter also runs."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def load_tile(ptr, s_row, s_col, offs_r, offs_c, n_r, n_c):
    """A (rows, cols) tile of a strided matrix, 0 outside [0, n_r) x [0, n_c)."""
    inside = (offs_r[:, None] < n_r) & (offs_c[None, :] < n_c)
    return tl.load(ptr + offs_r[:, None] * s_row + offs_c[None, :] * s_col, mask=inside, other=0.0)


@triton.jit
def tile_of(descriptor, b, h, row, R: tl.constexpr, C: tl.constexpr):
    """Rows [row, row + R) of head (b, h) of a (B, H, L, width) tensor descriptor with blocks of
    (1, 1, R, C): an (R, C) tile, 0 outside the tensor (the descriptor's padding)."""
    return descriptor.load([b.to(tl.int32), h.to(tl.int32), row, 0]).reshape(R, C)


@triton.jit
def load_rows(ptr, offs_m, Lq):
    """A (BM,) row statistic of a contiguous (B, H, Lq) tensor, at the (b, h) of `ptr`."""
    return tl.load(ptr + offs_m, mask=offs_m < Lq, other=0.0)


@triton.jit
def load_row_sums(ptr, offs_m, Lq, CENTRE: tl.constexpr):
    """The (BM,) row sums of a backward-type pass from a contiguous (B, H, SUMS, Lq) tensor
    at the (b, h) of `ptr` (`kernels.row_sums`): (x, y), and where the pass is CENTREd
    (x, y, c, c2, peak) with the centres and the peak key's index (-1: none)."""
    inside = offs_m < Lq
    x = tl.load(ptr + offs_m, mask=inside, other=0.0)
    y = tl.load(ptr + Lq + offs_m, mask=inside, other=0.0)
    if CENTRE:
        c = tl.load(ptr + 2 * Lq + offs_m, mask=inside, other=0.0)
        c2 = tl.load(ptr + 3 * Lq + offs_m, mask=inside, other=0.0)
        peak = tl.load(ptr + 4 * Lq + offs_m, mask=inside, other=-1.0).to(tl.int32)
        sums = (x, y, c, c2, peak)
    else:
        sums = (x, y)
    return sums


@triton.jit
def off_peak(values, centre, at_peak):
    """values - c per row, and exactly 0 at the row's peak key (`at_peak`, the key its sums
    are centred on, `kernels.row_sums`): by its index, not by subtracting, since another
    kernel's S' there need not have the row sums' bits."""
    return tl.where(at_peak, 0.0, values - centre[:, None])


LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def in_base(floats, EXP2: tl.constexpr):
    """The floats `scores` takes, with log2(e) folded into the scale where EXP2: the scores
    (of a call without bias or cap) then come in base 2, and exp(S - m) is exp2(S2 - m2),
    one multiply per score fewer than `tl.exp`'s own (ex2 of x log2(e))."""
    if EXP2:
        return floats[0] * LOG2E, floats[1], floats[2], floats[3]
    else:
        return floats


@triton.jit
def base_exp(x, EXP2: tl.constexpr):
    """exp of a difference of scores in their base (`in_base`)."""
    if EXP2:
        return tl.exp2(x)
    else:
        return tl.exp(x)


@triton.jit
def to_base(m, EXP2: tl.constexpr):
    """Row maxima (stored in natural units) in the scores' base."""
    if EXP2:
        return m * LOG2E
    else:
        return m


@triton.jit
def from_base(m, EXP2: tl.constexpr):
    """Row maxima in the scores' base, in natural units (as stored)."""
    if EXP2:
        return m * LN2
    else:
        return m


@triton.jit
def walk_list(lists, b, h, own):
    """The walk of block `own` of head (b, h) from its list (`launch._walk_lists`): (a pointer to
    its first block, how many need no masking, how many in all)."""
    walks, sl = lists
    base = walks + b * sl[0] + h * sl[1] + own * sl[2]
    return base + 2, tl.load(base), tl.load(base + 1)


@triton.jit
def segment(start, n_interior, n_all, MASKED: tl.constexpr, SPLIT: tl.constexpr):
    """The positions [lo, hi) of a walk's list that its loop over the tiles needing no
    masking (MASKED off; the kernels run it only with SPLIT) or over the others takes:
    [start, n_interior), then [n_interior, n_all); without SPLIT the masked loop takes the
    whole list, [start, n_all)."""
    if not MASKED:
        return start, n_interior
    elif SPLIT:
        return n_interior, n_all
    else:
        return start, n_all


@triton.jit
def scores(qk, b, h, offs_m, offs_n, sizes, floats, masks, SW: tl.constexpr, MASKED: tl.constexpr):
    """(S, tanh(A / c)) for the product qk = Q K^T of a tile: S = scale qk (capped: c tanh(A / c)),
    plus the bias, at -inf where the key does not take part (outside the call, past the causal
    diagonal j <= i + causal, outside the row's key bounds [lo, hi), masked out, or left out by
    the mask kept per block: entry (i, j) is btiles[blocks[b, h, i // MR, j // MK], i % MR, j % MK],
    `mask_blocks`). Without MASKED the tile is one every entry of which takes part
    (`block_map.unmasked_tiles`): none of that is read or applied. Without a cap the second
    result is A itself, unused. sizes: `Sizes`; floats: (scale, cap, 1 / cap, ...); masks:
    the score masks as the kernels take them (`kernels`)."""
    scale, cap, inv_cap = floats[0], floats[1], floats[2]
    bias, sb, mask, sm, bounds, sob, blocks, sx, btiles = masks
    Lq, Lk = sizes.Lq, sizes.Lk
    a = qk * scale
    if SW.SOFTCAP:
        th = tanh(a * inv_cap)
        s = cap * th
    else:
        th = a
        s = a
    inside = (offs_m[:, None] < Lq) & (offs_n[None, :] < Lk)
    if SW.HAS_BIAS:
        at = bias + b * sb[0] + h * sb[1] + offs_m[:, None] * sb[2] + offs_n[None, :] * sb[3]
        if MASKED:
            s += tl.load(at, mask=inside, other=0.0).to(s.dtype)
        else:
            s += tl.load(at).to(s.dtype)
    if MASKED:
        keep = inside
        if SW.CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + sizes.causal)
        if SW.HAS_BOUNDS:
            row = bounds + b * sob[0] + offs_m * sob[1]
            lo = tl.load(row, mask=offs_m < Lq, other=0)
            hi = tl.load(row + 1, mask=offs_m < Lq, other=0)
            keep = keep & (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])
        if SW.HAS_MASK:
            allowed = tl.load(mask + b * sm[0] + h * sm[1] + offs_m[:, None] * sm[2] + offs_n[None, :] * sm[3],
                              mask=inside, other=0)
            keep = keep & (allowed != 0)
        if SW.HAS_BLOCKS:
            # 32-bit offsets, as everywhere here: the backend refuses tensors of 2^31 elements or more
            tile = tl.load(blocks + b * sx[0] + h * sx[1] + (offs_m // SW.MR)[:, None] * sx[2]
                           + (offs_n // SW.MK)[None, :], mask=inside, other=0)
            entry = tile * (SW.MR * SW.MK) + ((offs_m % SW.MR) * SW.MK)[:, None] + (offs_n % SW.MK)[None, :]
            keep = keep & (tl.load(btiles + entry, mask=inside, other=0) != 0)
        s = tl.where(keep, s, float("-inf"))
    return s, th


@triton.jit
def score_form(q, k, q2, k2, th, c_tile, scale, SOFTCAP: tl.constexpr, BD: tl.constexpr, SD: tl.constexpr,
               IP: tl.constexpr, ACC: tl.constexpr):
    """(F, F_raw) of the form F = slope * scale (q2 K^T + Q k2^T) + C: S' for tangents (q2 = Q',
    k2 = K', C = bias'), T for cotangents (gQ, gK, gbias); F_raw is the products' part before
    the cap's slope 1 - tanh^2 (its curve meets it). q, k, q2, k2 are `operand`s; an
    absent term is None."""
    raw = tl.zeros(th.shape, ACC)
    if q2 is not None:
        raw = dot_nt(q2, k, raw, BD, SD, IP)
    if k2 is not None:
        raw = dot_nt(q, k2, raw, BD, SD, IP)
    raw = raw * scale
    form = raw
    if SOFTCAP:
        form = raw * (1.0 - th * th)
    if c_tile is not None:
        form += c_tile
    return form, raw


@triton.jit
def load_score_like(ptr, s, b, h, offs_m, offs_n, Lq, Lk, ACC: tl.constexpr):
    """A (BM, BN) tile of a bias-shaped tensor (a bias tangent or cotangent) of strides s, 0 outside."""
    inside = (offs_m[:, None] < Lq) & (offs_n[None, :] < Lk)
    return tl.load(ptr + b * s[0] + h * s[1] + offs_m[:, None] * s[2] + offs_n[None, :] * s[3], mask=inside,
                   other=0.0).to(ACC)


@triton.jit
def tile_terms(MODE: tl.constexpr, q, k, v, do, q2, k2, v2, do2, c_tile, p, z, th, m_d, inv, sums, offs_n,
               scale, inv_cap, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, CENTRE: tl.constexpr, BD: tl.constexpr,
               SD: tl.constexpr, BDV: tl.constexpr, SDV: tl.constexpr, IP: tl.constexpr, ACC: tl.constexpr):
    """The score-shaped terms of one tile for a backward-type pass, from P (BM, BN), Z (or
    None without dropout), the rows' D = rowsum(dO * O) (`m_d`), 1/l and the pass's row sums
    (`load_row_sums`; None for the backward); q, k, v, do and the second inputs are `operand`s:

      BACKWARD        dP = (dO V^T) Z,  dS = P (dP - D)
      BACKWARD_JVP    S' (q2 = Q', k2 = K', c = bias'), P' = P (S' - t), t = rowsum(P S'),
                      dP~ = (dO' V^T + dO V'^T) Z, D~ = rowsum(P' dP + P dP~),
                      dS~ = P' (dP - D) + P (dP~ - D~)
      DOUBLE_BACKWARD T (q2 = gQ, k2 = gK, c = gbias), t = rowsum(P T),
                      g_dP = P (T - t), X = (dO gV^T) Z, g_P = (dP - D)(T - t) + X,
                      u = rowsum(P g_P) (+ t D P_sink), g_S = P (g_P - u)

    CENTREd, as the row sums are: S' - t (or T - t) is taken as (S' - c) - (t - c), c its value
    at the row's peak key, and g_P - u as (g_P - c2) - (u - c2), each 0 at the peak by its
    index (`off_peak`); the sums hold x = t - c and y = D~ or u - c2. Uncentred (half, TF32),
    the sums are (t, D~ or u) alone: c = c2 = 0 and no peak.

    Returns (P Z, W, to the bias, to Q and K, to Q and K with the second inputs): W = P Z, P' Z
    or g_dP Z (what goes to V's side), "to the bias" dS, dS~ or g_S, and "to Q and K" the
    score-side term taken back through the cap (dA = slope dS; its partner dA~ or g_A, which
    also holds the cap's curve times S'_raw or T_raw). A row with 1/l = 1 had one key
    alone (exp(0) = 1, the others 0 to rounding): its dP - D is rounding, and set to 0."""
    dp = dot_nt(do, v, tl.zeros(p.shape, ACC), BDV, SDV, IP)
    if DROPOUT:
        dp = dp * z
        pz = p * z
    else:
        pz = p
    dpd = tl.where(inv[:, None] == 1.0, 0.0, dp - m_d[:, None])
    ds = p * dpd
    slope = 1.0
    if SOFTCAP:
        slope = 1.0 - th * th
        curve = -2.0 * th * slope * inv_cap
    da = ds * slope
    if MODE == 0:
        w = pz
        to_bias = ds
        da2 = da
    elif MODE == 1:
        x_row, y_row = sums[0], sums[1]
        form, raw = score_form(q, k, q2, k2, th, c_tile, scale, SOFTCAP, BD, SD, IP, ACC)
        if CENTRE:
            form = off_peak(form, sums[2], offs_n[None, :] == sums[4][:, None])
        pt = p * (form - x_row[:, None])
        dpt = tl.zeros(dp.shape, ACC)
        if do2 is not None:
            dpt = dot_nt(do2, v, dpt, BDV, SDV, IP)
        if v2 is not None:
            dpt = dot_nt(do, v2, dpt, BDV, SDV, IP)
        if DROPOUT:
            dpt = dpt * z
            w = pt * z
        else:
            w = pt
        to_bias = pt * dpd + p * (dpt - y_row[:, None])
        da2 = to_bias
        if SOFTCAP:
            da2 = slope * to_bias + curve * raw * ds
    else:
        x_row, y_row = sums[0], sums[1]
        form, raw = score_form(q, k, q2, k2, th, c_tile, scale, SOFTCAP, BD, SD, IP, ACC)
        if CENTRE:
            at_peak = offs_n[None, :] == sums[4][:, None]
            form = off_peak(form, sums[2], at_peak)
        centred = form - x_row[:, None]
        g_dp = p * centred
        g_p = dpd * centred
        if v2 is not None:
            x = dot_nt(do, v2, tl.zeros(p.shape, ACC), BDV, SDV, IP)
            if DROPOUT:
                x = x * z
            g_p += x
        if DROPOUT:
            w = g_dp * z
        else:
            w = g_dp
        if CENTRE:
            g_p = off_peak(g_p, sums[3], at_peak)
        to_bias = p * (g_p - y_row[:, None])
        da2 = to_bias
        if SOFTCAP:
            da2 = slope * to_bias + curve * raw * ds
    return pz, w, to_bias, da, da2
