// attngrad's compiled tiles: the passes on query blocks of whole rows, the double
// backward, the JVP and the backward's JVP (see tiles.h for the design).
#include "whole_rows.h"

namespace attngrad_tiles {


// The double backward, for cotangents gQ, gK, gV, gbias (each may be null: zero) of the
// backward's dQ, dK, dV, dbias; per query block of whole rows (for_each_row_block), since
// two row sums run over all of a row's keys; Z the dropout keep-scale (1 without):
//   T = scale (gQ K^T + Q gK^T) + gbias,  t = rowsum(P * T),  X = (dO gV^T) Z
//   dP~ = (dO V^T) Z,  g_P = (dP~ - D) * (T - t) + X,  u = rowsum(P * g_P)
//   g_dP = P * (T - t)    -> g_V += (g_dP Z)^T dO,  g_dO = (g_dP Z) V + (P Z) gV (when asked)
//   g_S = P * (g_P - u),  dS = P * (dP~ - D)
//   g_Q = scale (g_S K + dS gK),  g_K += scale (g_S^T Q + dS^T gQ),  g_bias += g_S
// A work item adds into its own parts of g_K and g_V (gk_parts, gv_parts: one per chunk)
// and of g_bias (BiasGradient).
template <typename T>
void double_backward(const Pass<T>& pass) {
    const T *dout = pass[buf_dout], *q = pass[buf_q], *k = pass[buf_k], *v = pass[buf_v], *out = pass[buf_out];
    const T *row_max = pass[buf_row_max], *inv_sum = pass[buf_inv_sum];
    const T *gq = pass[buf_gq], *gk = pass[buf_gk], *gv = pass[buf_gv];
    T *delta = pass[buf_delta], *g_dout = pass[buf_g_dout], *g_q = pass[buf_g_q];
    T *gk_parts = pass[buf_gk_parts], *gv_parts = pass[buf_gv_parts];
    T* sink_rows = pass[buf_sink_rows];  // where given: each row's P_sink (u - t D), the sink logit's share
    const BiasGradient<T> g_bias(pass, buf_g_bias_parts, 2);
    const Shape& s = pass.s;
    const DropoutDraw& drop = pass.drop;
    const T scale = pass.scale;
    const ScoreMask<T> gbias{nullptr, Broadcast4(), pass[buf_gbias], Broadcast4(pass.call.bias_sizes)};
    row_dots(dout, out, delta, s.batch * s.heads * s.len_q, s.dim_v);  // D = rowsum(dO * O)
    const SingleKeyRows<T> single_key(pass.masks, pass.causal, s, inv_sum);
    const KvItems items(s, pass.call.chunks, g_bias.shares_batch(s), g_bias.shares_kv_heads(s));
    enum { K, GK, V, GV };  // the key side: inputs K, gK, V, gV; gradients g_K, g_V
    const KeySide<T> key_side(pass, {{k, s.dim}, {gk, s.dim}, {v, s.dim_v}, {gv, s.dim_v}},
                              {{gk_parts, s.dim}, {gv_parts, s.dim_v}});
    // scratch: P, then P Z; T, then g_dP Z; dP~ - D, then dS; X, then g_P, then g_S; with a
    // softcap its slope, and its curve (times the raw T)
    for_each_row_block(pass, items, 4 + CapRows<T>::tiles(pass.cap, true), key_side,
                       [&](const RowBlock& blk, T* scratch, typename KeySide<T>::Local& side) {
        const index_t rows = blk.rows, keys = blk.keys, first = blk.first, tile = row_block_tile(pass);
        if (sink_rows) std::fill(sink_rows + first, sink_rows + first + rows, T(0));
        if (keys == 0) {  // rows that see no key: nothing flows back through them
            std::fill(g_q + first * s.dim, g_q + (first + rows) * s.dim, T(0));
            if (g_dout) std::fill(g_dout + first * s.dim_v, g_dout + (first + rows) * s.dim_v, T(0));
            return;
        }
        const T* k_head = blk.head(k, s.dim);
        const T* v_head = blk.head(v, s.dim_v);
        const T* gk_head = blk.head(gk, s.dim);
        const T* gv_head = blk.head(gv, s.dim_v);
        const KeyGradient<T> g_k = side.gradient(0, blk), g_v = side.gradient(1, blk);  // key_side's order
        T* g_bias_part = g_bias.part(blk.chunk);
        const T* q_blk = blk.block(q, s.dim);
        const T* do_blk = blk.block(dout, s.dim_v);
        const T* gq_blk = blk.block(gq, s.dim);
        T *p = scratch, *t = scratch + tile, *dp = scratch + 2 * tile, *x = scratch + 3 * tile;
        const CapRows<T> cap_rows(pass.cap, scratch, tile, 4, true);
        // S = scale Q K^T;  T = scale (gQ K^T + Q gK^T) (+ gbias by row);  dP = dO V^T;  X = dO gV^T (Z by row)
        side.times_keys(pass, blk, s.dim, scale, q_blk, K, p);
        side.times_keys(pass, blk, s.dim, scale, gq_blk, K, q_blk, GK, t);
        side.times_keys(pass, blk, s.dim_v, T(1), do_blk, V, dp);
        side.times_keys(pass, blk, s.dim_v, T(1), do_blk, GV, x);
        for (index_t i = 0; i < rows; ++i) {
            T *pi = p + i * keys, *ti = t + i * keys, *dpi = dp + i * keys, *xi = x + i * keys;
            const index_t row = blk.r0 + i, seen = pass.causal.visible(row, blk.key0, keys);
            const T m = row_max[first + i], inv = inv_sum[first + i];
            const auto [sli, cvi] = cap_rows.row(i, keys);
            // S = c tanh(A / c) + bias, T = slope T_raw + gbias
            pass.score_row(pi, blk.b, blk.h, row, blk.key0, seen, sli, cvi, ti, &gbias);
            if (drop.on) {  // dP~ = (dO V^T) Z,  X = (dO gV^T) Z
                drop.scale_row(dpi, blk.b, blk.h, row, blk.key0, seen);
                drop.scale_row(xi, blk.b, blk.h, row, blk.key0, seen);
            }
            T d_row = delta[first + i];
            const bool single = single_key(blk.bh, row);
            row_probs(pi, ti, seen, m, inv, single);  // P
            if (single) {  // the row's one key: P = 1, so t = T, D = dP~ exactly
                d_row = T(0);
                for (index_t j = 0; j < seen; ++j) d_row += pi[j] * dpi[j];
            }
            const T p_sink = sink_probability(pass.call.sink, m, inv);
            // centred on the row's peak (centre_on_peak): T - c, t - c; then g_P - c', u - c'
            const auto [c, t_less] = centre_on_peak(pi, ti, seen, p_sink);
            const T t_sum = c + t_less;  // t = rowsum(P * T)
            second_order_terms(pi, ti, dpi, xi, seen, t_less, d_row);
            // with a sink, rowsum(P) = 1 - P_sink: the per-row t D that g_P leaves out (the softmax
            // ignores it only when P sums to 1) comes back as t D P_sink, P_sink = exp(-m) / l: the
            // sink is an entry of value t D (0 where p_sink is: no sink, or a row that sees no key)
            const auto [c_g, u_less] = centre_on_peak(pi, xi, seen, p_sink, t_sum * d_row);
            const T u_sum = c_g + u_less;  // u = rowsum(P * g_P) + t D P_sink
            centre_and_scale(pi, xi, seen, u_less);  // g_S = P ((g_P - c') - (u - c'))
            if (drop.on) {  // g_dP Z and P Z, for g_V and g_dO
                drop.scale_row(ti, blk.b, blk.h, row, blk.key0, seen);
                drop.scale_row(pi, blk.b, blk.h, row, blk.key0, seen);
            }
            for (T* r : {pi, ti, dpi, xi}) std::fill(r + seen, r + keys, T(0));
            // g_bias += g_S; a bias constant along the keys takes the row's sum in closed form,
            // rowsum(g_S) = rowsum(P g_P) - u rowsum(P) = P_sink (u - t D), where summing g_S cancels
            if (sink_rows) sink_rows[first + i] = p_sink * (u_sum - t_sum * d_row);
            if (g_bias_part && g_bias.key_constant()) {
                g_bias.add_value(g_bias_part, p_sink * (u_sum - t_sum * d_row), blk.b, blk.h, row);
            } else if (g_bias_part) {
                g_bias.add_row(g_bias_part, xi, blk.b, blk.h, row, blk.key0, seen);
            }
            // through dA = slope dS and S = c tanh(A / c): g_A = slope g_S + (curve T_raw) dS
            if (sli) Softcap<T>::back_to_raw(xi, dpi, sli, cvi, seen);
        }
        // backward: dV = (P Z)^T dO  ->  g_V += (g_dP Z)^T dO
        add_keys_product(pass, rows, keys, s.dim_v, T(1), t, do_blk, g_v);
        // backward: dP~ = (dO V^T) Z, dV = (P Z)^T dO  ->  g_dO = (g_dP Z) V + (P Z) gV
        if (g_dout) {
            T* g_do = g_dout + first * s.dim_v;
            pass.gemm(false, false, rows, s.dim_v, keys, T(1), t, keys, v_head, s.dim_v, T(0), g_do, s.dim_v);
            if (gv_head) {
                pass.gemm(false, false, rows, s.dim_v, keys, T(1), p, keys, gv_head, s.dim_v, T(1), g_do, s.dim_v);
            }
        }
        // backward: dQ = scale dS K, dK = scale dS^T Q  ->  g_Q = scale (g_S K + dS gK),
        // g_K += scale (g_S^T Q + dS^T gQ)
        T* g_q_blk = g_q + first * s.dim;
        pass.gemm(false, false, rows, s.dim, keys, scale, x, keys, k_head, s.dim, T(0), g_q_blk, s.dim);
        if (gk_head) pass.gemm(false, false, rows, s.dim, keys, scale, dp, keys, gk_head, s.dim, T(1), g_q_blk, s.dim);
        add_keys_product(pass, rows, keys, s.dim, scale, x, q_blk, g_k);
        add_keys_product(pass, rows, keys, s.dim, scale, dp, gq_blk, g_k);
    });
    g_bias.finish();  // the wide sums, where there are any
}

// The JVP: the output's tangent O' for tangents tQ, tK, tV, tbias (each may be null:
// zero), from the forward's statistics, per query block of whole rows (t below sums over
// all of a row's keys). Each block owns its rows of O'.
//   P = exp(S - m) / l,  T = S' = scale (tQ K^T + Q tK^T) + tbias,  t = rowsum(P * T)
//   P' = P (T - t),  O' = (P' Z) V + (P Z) tV
// Given an `out` buffer (the forward with its JVP), the pass is the forward too: a block
// holds whole rows, so it takes m and l from the row itself, with no statistics read, and
// writes O = (P Z) V beside O' (6 products where the forward and the JVP take 2 + 5), and
// the statistics as the forward writes them (0 and 0 for a row that sees no key, NaN 1/l for
// one that a NaN reached):
//   m = max S,  l = rowsum exp(S - m) (+ exp(-m): a sink's term),  O = (P Z) V
// Given a `centre` buffer, each row's t goes there (the tangent of its log-sum-exp, which
// backward_jvp_given_sums takes).
template <typename T>
void jvp(const Pass<T>& pass) {
    const T *q = pass[buf_q], *k = pass[buf_k], *v = pass[buf_v];
    T *row_max = pass[buf_row_max], *inv_sum = pass[buf_inv_sum];  // written with the forward, else read
    const T *tq = pass[buf_tq], *tk = pass[buf_tk], *tv = pass[buf_tv];
    T *out_t = pass[buf_tout], *out = pass[buf_out];
    T* centre = pass[buf_centre];  // where given: each row's t (0 for a row that sees no key),
    T* peak = pass[buf_peak];      // or with peak given, t - c and c (centre_on_peak)
    const bool with_forward = out != nullptr;
    const Shape& s = pass.s;
    const DropoutDraw& drop = pass.drop;
    const T scale = pass.scale;
    const T neg_inf = -std::numeric_limits<T>::infinity();
    const ScoreMask<T> tbias{nullptr, Broadcast4(), pass[buf_tbias], Broadcast4(pass.call.bias_sizes)};
    const SingleKeyRows<T> single_key(pass.masks, pass.causal, s, with_forward ? nullptr : inv_sum);  // asked only
                                                                                                        // when read
    const index_t value_slice = pass.call.value_slice;
    enum { K, TK };  // the key side: inputs K, tK
    const KeySide<T> key_side(pass, {{k, s.dim}, {tk, s.dim}}, {});
    // scratch: P; T, then P'
    for_each_row_block(pass, KvItems(s, pass.call.chunks, false, false), 2 + CapRows<T>::tiles(pass.cap, false),
                       key_side, [&](const RowBlock& blk, T* scratch, typename KeySide<T>::Local& side) {
        const index_t rows = blk.rows, keys = blk.keys, first = blk.first, tile = row_block_tile(pass);
        T* o_t = out_t + first * s.dim_v;
        T* o = with_forward ? out + first * s.dim_v : nullptr;
        if (with_forward) {  // a row that sees no key keeps statistics 0 (set below for the others)
            std::fill(row_max + first, row_max + first + rows, T(0));
            std::fill(inv_sum + first, inv_sum + first + rows, T(0));
        }
        if (centre) std::fill(centre + first, centre + first + rows, T(0));
        if (peak) std::fill(peak + first, peak + first + rows, T(0));
        if (keys == 0) {  // rows that see no key: output 0, tangent 0
            std::fill(o_t, o_t + rows * s.dim_v, T(0));
            if (o) std::fill(o, o + rows * s.dim_v, T(0));
            return;
        }
        const T* q_blk = blk.block(q, s.dim);
        const T* tq_blk = blk.block(tq, s.dim);
        const T* v_head = blk.head(v, s.dim_v);
        const T* tv_head = blk.head(tv, s.dim_v);
        T *p = scratch, *t = scratch + tile;
        const CapRows<T> cap_rows(pass.cap, scratch, tile, 2, false);
        // forward: S = scale Q K^T + bias  ->  S' = scale (tQ K^T + Q tK^T) + tbias
        side.times_keys(pass, blk, s.dim, scale, q_blk, K, p);
        side.times_keys(pass, blk, s.dim, scale, tq_blk, K, q_blk, TK, t);
        for (index_t i = 0; i < rows; ++i) {
            T *pi = p + i * keys, *ti = t + i * keys;
            const index_t row = blk.r0 + i, seen = pass.causal.visible(row, blk.key0, keys);
            T* sli = cap_rows.row(i, keys).first;
            pass.score_row(pi, blk.b, blk.h, row, blk.key0, seen, sli, nullptr, ti, &tbias);  // S' = slope A' + tbias
            // forward: P = softmax(S)  ->  P' = P (S' - rowsum(P S')); a row's one key: P' = 0
            // (1/l = 1: with a sink, the one key shares the row and P < 1)
            if (with_forward) {
                T top = max_of(pi, seen);  // -inf past a NaN too: has_nan tells the two apart
                if (top == neg_inf && has_nan(pi, seen)) top = std::numeric_limits<T>::quiet_NaN();
                if (top == neg_inf) {  // a row that sees no key: P = 0, so O = O' = 0
                    std::fill(pi, pi + keys, T(0));
                    std::fill(ti, ti + keys, T(0));
                    continue;
                }
                wide_t<T> sum = exp_and_sum(pi, seen, top);  // E = exp(S - m)
                if (pass.call.sink) sum += std::exp(-top);  // the sink's exp(0 - m); 1 / inf = 0
                // P = E / l, t; a row's one key has E = exp(0) = 1 = l: P = 1 exactly, unlike a
                // recomputed score's (SingleKeyRows)
                const T inv = static_cast<T>(1 / sum);
                row_max[first + i] = top, inv_sum[first + i] = inv;
                scale_and_dot(pi, ti, seen, inv);  // P (its sum with T comes centred below)
            } else {
                row_probs(pi, ti, seen, row_max[first + i], inv_sum[first + i], single_key(blk.bh, row));  // P
            }
            const T m = row_max[first + i], inv = inv_sum[first + i];
            const T p_sink = sink_probability(pass.call.sink, m, inv);
            const auto [c, t_less] = centre_on_peak(pi, ti, seen, p_sink);  // T - c, and t - c
            if (centre) centre[first + i] = peak ? t_less : c + t_less;
            if (peak) peak[first + i] = c;
            centre_and_scale(pi, ti, seen, t_less);  // P' = P ((T - c) - (t - c))
            if (drop.on) {  // P Z and P' Z
                drop.scale_row(pi, blk.b, blk.h, row, blk.key0, seen);
                drop.scale_row(ti, blk.b, blk.h, row, blk.key0, seen);
            }
            std::fill(pi + seen, pi + keys, T(0));
            std::fill(ti + seen, ti + keys, T(0));
        }
        // forward: O = (P Z) V  ->  O' = (P' Z) V + (P Z) tV
        pass.gemm(false, false, rows, s.dim_v, keys, T(1), t, keys, v_head, s.dim_v, T(0), o_t, s.dim_v);
        if (tv_head) pass.gemm(false, false, rows, s.dim_v, keys, T(1), p, keys, tv_head, s.dim_v, T(1), o_t, s.dim_v);
        // O = (P Z) V over slices of about `value_slice` keys, as the forward sums it
        for (index_t j0 = 0, n; o && j0 < keys; j0 += n) {
            n = value_slice_keys(j0, keys, value_slice);
            pass.gemm(false, false, rows, s.dim_v, n, T(1), p + j0, keys,
                      v_head + j0 * s.dim_v, s.dim_v, T(j0 > 0), o, s.dim_v);
        }
    });
}

// The backward's JVP (forward over reverse: Hessian-vector products), the tangents of dQ,
// dK, dV and dbias for tangents tdO, tQ, tK, tV, tbias (each may be null: zero); per query
// block of whole rows like the double backward (t and D' sum over all of a row's keys):
//   P = exp(S - m) / l,  T = S' = scale (tQ K^T + Q tK^T) + tbias,  t = rowsum(P * T)
//   P' = P (T - t),  dP~ = (dO V^T) Z,  dP~' = (tdO V^T + dO tV^T) Z
//   D = rowsum(dO * O),  D' = rowsum(P' * dP~ + P * dP~')
//   dS = P (dP~ - D),  dS' = P' (dP~ - D) + P (dP~' - D')
//   dV' += (P' Z)^T dO + (P Z)^T tdO,  dQ' = scale (dS' K + dS tK),
//   dK' += scale (dS'^T Q + dS^T tQ),  dbias' = dS' summed over the bias's broadcast axes
// A work item adds into its own parts of dK', dV' (one per chunk) and dbias' (BiasGradient).
// Given a dq buffer, the pass is the backward too (13 products where the two take 5 + 10),
// from the same P and dS:  dV += (P Z)^T dO,  dQ = scale dS K,  dK += scale dS^T Q,  dbias = dS.
template <typename T>
void backward_jvp(const Pass<T>& pass) {
    const T *dout = pass[buf_dout], *q = pass[buf_q], *k = pass[buf_k], *v = pass[buf_v], *out = pass[buf_out];
    const T *row_max = pass[buf_row_max], *inv_sum = pass[buf_inv_sum];
    const T *tdout = pass[buf_tdout], *tq = pass[buf_tq], *tk = pass[buf_tk], *tv = pass[buf_tv];
    T *delta = pass[buf_delta], *tdq = pass[buf_tdq];
    T *tdk_parts = pass[buf_tdk_parts], *tdv_parts = pass[buf_tdv_parts];
    T *dq = pass[buf_dq], *dk_parts = pass[buf_dk_parts], *dv_parts = pass[buf_dv_parts];
    T* sink_rows = pass[buf_sink_rows];  // where given: each row's P_sink (D' - t D), the sink logit's share
    const bool with_backward = dq != nullptr;
    const BiasGradient<T> tdbias(pass, buf_tdbias_parts, 2), dbias(pass, buf_dbias_row_parts, 2);
    const Shape& s = pass.s;
    const DropoutDraw& drop = pass.drop;
    const T scale = pass.scale;
    const ScoreMask<T> tbias{nullptr, Broadcast4(), pass[buf_tbias], Broadcast4(pass.call.bias_sizes)};
    row_dots(dout, out, delta, s.batch * s.heads * s.len_q, s.dim_v);  // D = rowsum(dO * O)
    const SingleKeyRows<T> single_key(pass.masks, pass.causal, s, inv_sum);
    const KvItems items(s, pass.call.chunks, tdbias.shares_batch(s), tdbias.shares_kv_heads(s));
    // scratch: P; T, then P'; dP~, then dS; dP~', then dS'; with a softcap its slope, and its
    // curve (times A')
    enum { K, TK, V, TV };  // the key side: inputs K, tK, V, tV; gradients dK', dV' (and dK, dV)
    std::vector<typename KeySide<T>::Gradient> key_grads = {{tdk_parts, s.dim}, {tdv_parts, s.dim_v}};
    if (with_backward) key_grads.insert(key_grads.end(), {{dk_parts, s.dim}, {dv_parts, s.dim_v}});
    const KeySide<T> key_side(pass, {{k, s.dim}, {tk, s.dim}, {v, s.dim_v}, {tv, s.dim_v}}, key_grads);
    for_each_row_block(pass, items, 4 + CapRows<T>::tiles(pass.cap, true), key_side,
                       [&](const RowBlock& blk, T* scratch, typename KeySide<T>::Local& side) {
        const index_t rows = blk.rows, keys = blk.keys, first = blk.first, tile = row_block_tile(pass);
        T* dq_t = tdq + first * s.dim;
        T* dq_blk = with_backward ? dq + first * s.dim : nullptr;
        if (sink_rows) std::fill(sink_rows + first, sink_rows + first + rows, T(0));
        if (keys == 0) {  // rows that see no key: nothing flows back through them
            std::fill(dq_t, dq_t + rows * s.dim, T(0));
            if (dq_blk) std::fill(dq_blk, dq_blk + rows * s.dim, T(0));
            return;
        }
        const T* k_head = blk.head(k, s.dim);
        const T* tk_head = blk.head(tk, s.dim);
        const KeyGradient<T> dk_t = side.gradient(0, blk), dv_t = side.gradient(1, blk);  // key_side's order
        T* dbias_t = tdbias.part(blk.chunk);
        KeyGradient<T> dk_g, dv_g;
        T* dbias_part = nullptr;
        if (with_backward) dk_g = side.gradient(2, blk), dv_g = side.gradient(3, blk), dbias_part = dbias.part(blk.chunk);
        const T* q_blk = blk.block(q, s.dim);
        const T* tq_blk = blk.block(tq, s.dim);
        const T* do_blk = blk.block(dout, s.dim_v);
        const T* tdo_blk = blk.block(tdout, s.dim_v);
        T *p = scratch, *t = scratch + tile, *dp = scratch + 2 * tile, *x = scratch + 3 * tile;
        const CapRows<T> cap_rows(pass.cap, scratch, tile, 4, true);
        // forward: S = scale Q K^T + bias  ->  S' = scale (tQ K^T + Q tK^T) + tbias
        side.times_keys(pass, blk, s.dim, scale, q_blk, K, p);
        side.times_keys(pass, blk, s.dim, scale, tq_blk, K, q_blk, TK, t);
        // backward: dP = dO V^T  ->  dP' = tdO V^T + dO tV^T
        side.times_keys(pass, blk, s.dim_v, T(1), do_blk, V, dp);
        side.times_keys(pass, blk, s.dim_v, T(1), tdo_blk, V, do_blk, TV, x);
        for (index_t i = 0; i < rows; ++i) {
            T *pi = p + i * keys, *ti = t + i * keys, *dpi = dp + i * keys, *xi = x + i * keys;
            const index_t row = blk.r0 + i, seen = pass.causal.visible(row, blk.key0, keys);
            const auto [sli, cvi] = cap_rows.row(i, keys);
            pass.score_row(pi, blk.b, blk.h, row, blk.key0, seen, sli, cvi, ti, &tbias);  // S' = slope A' + tbias, curve A'
            const bool single = single_key(blk.bh, row);  // then P' = 0 and dS = dS' = 0
            const T m = row_max[first + i], inv = inv_sum[first + i];
            row_probs(pi, ti, seen, m, inv, single);  // P
            const T p_sink = sink_probability(pass.call.sink, m, inv);
            const auto [c, t_less] = centre_on_peak(pi, ti, seen, p_sink);  // T - c, and t - c
            const T t_sum = c + t_less;  // t = rowsum(P * T)
            centre_and_scale(pi, ti, seen, t_less);  // P' = P ((T - c) - (t - c))
            T d_t = T(0);
            if (drop.on) {  // dP~ = dP Z, dP~' = dP' Z
                drop.scale_row(dpi, blk.b, blk.h, row, blk.key0, seen);
                drop.scale_row(xi, blk.b, blk.h, row, blk.key0, seen);
            }
            if (single) {
                std::fill(dpi, dpi + seen, T(0));
                std::fill(xi, xi + seen, T(0));
            } else {
                d_t = tangent_delta(pi, ti, dpi, xi, seen);  // D'
                score_grad_tangents(pi, ti, dpi, xi, seen, delta[first + i], d_t);  // dS, dS'
            }
            if (drop.on) {  // P Z and P' Z, for dV'
                drop.scale_row(pi, blk.b, blk.h, row, blk.key0, seen);
                drop.scale_row(ti, blk.b, blk.h, row, blk.key0, seen);
            }
            for (T* r : {pi, ti, dpi, xi}) std::fill(r + seen, r + keys, T(0));
            // dbias' = dS'; a bias constant along the keys takes the row's sum in closed form, the
            // tangent of D P_sink: P_sink (D' - t D), where the sum of dS' would cancel
            if (sink_rows) sink_rows[first + i] = p_sink * (d_t - t_sum * delta[first + i]);
            if (dbias_t && tdbias.key_constant()) {
                tdbias.add_value(dbias_t, p_sink * (d_t - t_sum * delta[first + i]), blk.b, blk.h, row);
            } else if (dbias_t) {
                tdbias.add_row(dbias_t, xi, blk.b, blk.h, row, blk.key0, seen);
            }
            if (dbias_part) dbias.add_row(dbias_part, dpi, blk.b, blk.h, row, blk.key0, seen);  // dbias = dS
            // backward: dA = slope dS  ->  dA' = slope dS' + (curve A') dS
            if (sli) Softcap<T>::back_to_raw(xi, dpi, sli, cvi, seen);
        }
        // backward: dV = (P Z)^T dO  ->  dV' += (P' Z)^T dO + (P Z)^T tdO
        add_keys_product(pass, rows, keys, s.dim_v, T(1), t, do_blk, dv_t);
        add_keys_product(pass, rows, keys, s.dim_v, T(1), p, tdo_blk, dv_t);
        // backward: dQ = scale dS K, dK = scale dS^T Q  ->  dQ' = scale (dS' K + dS tK),
        // dK' += scale (dS'^T Q + dS^T tQ)
        pass.gemm(false, false, rows, s.dim, keys, scale, x, keys, k_head, s.dim, T(0), dq_t, s.dim);
        if (tk_head) pass.gemm(false, false, rows, s.dim, keys, scale, dp, keys, tk_head, s.dim, T(1), dq_t, s.dim);
        add_keys_product(pass, rows, keys, s.dim, scale, x, q_blk, dk_t);
        add_keys_product(pass, rows, keys, s.dim, scale, dp, tq_blk, dk_t);
        if (with_backward) {  // dV += (P Z)^T dO,  dQ = scale dS K,  dK += scale dS^T Q
            add_keys_product(pass, rows, keys, s.dim_v, T(1), p, do_blk, dv_g);
            pass.gemm(false, false, rows, s.dim, keys, scale, dp, keys, k_head, s.dim, T(0), dq_blk, s.dim);
            add_keys_product(pass, rows, keys, s.dim, scale, dp, q_blk, dk_g);
        }
    });
    tdbias.finish();  // the wide sums, where there are any
    dbias.finish();
}

template void double_backward<float>(const Pass<float>&);
template void double_backward<double>(const Pass<double>&);
template void jvp<float>(const Pass<float>&);
template void jvp<double>(const Pass<double>&);
template void backward_jvp<float>(const Pass<float>&);
template void backward_jvp<double>(const Pass<double>&);

}  // namespace attngrad_tiles
