// attngrad's compiled tiles: the backward's JVP on the backward's own tiles, given the two
// sums over each row's keys that the whole-row pass (backward_jvp, passes_higher.cpp) makes
// itself (see tiles.h for the design).
#include "whole_rows.h"  // times_keys

namespace attngrad_tiles {

// The backward's JVP for tangents tdO, tQ, tK, tV, tbias (each may be null: zero), given per
// row the centre t = rowsum(P * S') (the forward's JVP makes it) and D' = rowsum(dO' * O +
// dO * O'). With them no tile needs a whole row, so the pass runs as the backward does: work
// items (chunk of key blocks, b, key/value head), query blocks inside, tiles that stay in
// cache; and on a part of each row's keys too (a ring step), whose sums are the whole row's.
// Per tile:
//   P = exp(S - m) / l,  S' = scale (tQ K^T + Q tK^T) + tbias,  P' = P (S' - t)
//   dP~ = (dO V^T) Z,  dP~' = (tdO V^T + dO tV^T) Z
//   dS = P (dP~ - D),  dS' = P' (dP~ - D) + P (dP~' - D')
//   dV' += (P' Z)^T dO + (P Z)^T tdO,  dQ' += scale (dS' K + dS tK),  dK' += scale (dS'^T Q + dS^T tQ)
// (with a soft cap, dS and dS' are taken back to the raw scores first, as the whole-row
// pass does). Given dq_parts, the pass is the backward too, from the same P and dS:
//   dV += (P Z)^T dO,  dQ += scale dS K,  dK += scale dS^T Q.
// dQ' (and dQ) sum into one part per chunk (tdq_parts, dq_parts), dK', dV' (and dK, dV) into
// the item's own rows; the caller zeroes them all. No bias gradient: the whole-row pass
// takes those calls.
template <typename T>
void backward_jvp_given_sums(const Pass<T>& pass) {
    const T *dout = pass[buf_dout], *q = pass[buf_q], *k = pass[buf_k], *v = pass[buf_v], *out = pass[buf_out];
    const T *row_max = pass[buf_row_max], *inv_sum = pass[buf_inv_sum];
    const T *tdout = pass[buf_tdout], *tq = pass[buf_tq], *tk = pass[buf_tk], *tv = pass[buf_tv];
    const T *centre = pass[buf_centre], *delta_t = pass[buf_delta_t];
    const T* peak = pass[buf_peak];  // where given, centre is t - c, c = S' at the row's peak
    T *delta = pass[buf_delta], *tdq_parts = pass[buf_tdq_parts], *tdk = pass[buf_tdk], *tdv = pass[buf_tdv];
    T *dq_parts = pass[buf_dq_parts], *dk = pass[buf_dk], *dv = pass[buf_dv];  // null: the tangents alone
    const Shape& s = pass.s;
    const Causal causal = pass.causal;
    const ScoreMask<T>& masks = pass.masks;
    const DropoutDraw& drop = pass.drop;
    const T scale = pass.scale;
    const ScoreMask<T> tbias{nullptr, Broadcast4(), pass[buf_tbias], Broadcast4(pass.call.bias_sizes)};
    const index_t block_rows = pass.call.block_rows, block_keys = pass.call.block_keys, chunks = pass.call.chunks;
    const index_t group = s.heads / s.kv_heads;
    const index_t rows_total = s.batch * s.heads * s.len_q;
    const index_t key_blocks = (s.len_k + block_keys - 1) / block_keys;
    row_dots(dout, out, delta, rows_total, s.dim_v);  // D = rowsum(dO * O)
    const SingleKeyRows<T> single_key(masks, causal, s, inv_sum);
    const TileMap tile_map(pass.call);
    const KeyRanges ranges(pass.call);
    const KvItems items(s, chunks, false, false);
    const index_t tile = std::min(block_rows, s.len_q) * std::min(block_keys, s.len_k);
    parallel_items(items.count(), [&](const ItemSource& source) {
        // P, then P Z; S', then P' Z; dP~, then dS; dP~', then dS'; with a cap its slope and curve
        std::vector<T> scratch((4 + CapRows<T>::tiles(pass.cap, true)) * tile);
        std::vector<T> keep(drop.on ? std::min(block_keys, s.len_k) : 0);  // a row's dropout multipliers Z
        for (index_t item; (item = source.next()) >= 0;) {
          items.visit(item, [&](const KvItem& it) {
            const index_t chunk = it.chunk, bhk = it.bhk, b = it.b, hk = it.hk;
            const T* k_head = k + bhk * s.len_k * s.dim;
            const T* v_head = v + bhk * s.len_k * s.dim_v;
            const T* tk_head = tk ? tk + bhk * s.len_k * s.dim : nullptr;
            const T* tv_head = tv ? tv + bhk * s.len_k * s.dim_v : nullptr;
            T* tdk_head = tdk + bhk * s.len_k * s.dim;
            T* tdv_head = tdv + bhk * s.len_k * s.dim_v;
            T* tdq = tdq_parts + chunk * rows_total * s.dim;
            T* dk_head = dq_parts ? dk + bhk * s.len_k * s.dim : nullptr;
            T* dv_head = dq_parts ? dv + bhk * s.len_k * s.dim_v : nullptr;
            T* dq = dq_parts ? dq_parts + chunk * rows_total * s.dim : nullptr;
            index_t computed = 0;
            for (index_t kb = chunk * key_blocks / chunks; kb < (chunk + 1) * key_blocks / chunks; ++kb) {
                const index_t kb0 = kb * block_keys, block_cols = std::min(block_keys, s.len_k - kb0);
                for (index_t h = hk * group; h < (hk + 1) * group; ++h) {
                    const index_t bh = b * s.heads + h;
                    for (index_t r0 = 0; r0 < s.len_q; r0 += block_rows) {
                        const auto [key0, keys] = ranges(b, r0 / block_rows);  // block_map.key_ranges
                        const TileMap::Kind kind = tile_map(b, h, r0 / block_rows, kb);
                        if (keys == 0 || kb0 >= key0 + keys || kb0 + block_cols <= key0 || kind == TileMap::skipped) {
                            continue;
                        }
                        const ScoreMask<T>& tile_masks = kind == TileMap::unmasked ? pass.structure : masks;
                        ++computed;
                        const index_t rows = std::min(block_rows, s.len_q - r0), first = bh * s.len_q + r0;
                        const index_t c0 = std::max(kb0, key0), width = std::min(kb0 + block_cols, key0 + keys) - c0;
                        const T* k_blk = k_head + c0 * s.dim;
                        const T* v_blk = v_head + c0 * s.dim_v;
                        const T* tk_blk = tk_head ? tk_head + c0 * s.dim : nullptr;
                        const T* tv_blk = tv_head ? tv_head + c0 * s.dim_v : nullptr;
                        const T* q_blk = q + first * s.dim;
                        const T* tq_blk = tq ? tq + first * s.dim : nullptr;
                        const T* do_blk = dout + first * s.dim_v;
                        const T* tdo_blk = tdout ? tdout + first * s.dim_v : nullptr;
                        const index_t n = rows * width;
                        T *p = scratch.data(), *t = p + n, *dp = t + n, *x = dp + n;
                        const CapRows<T> cap_rows(pass.cap, scratch.data(), n, 4, true);
                        const bool fetch = kind == TileMap::computed;  // the mask and bias rows ahead of use
                        if (fetch) masks.prefetch(b, h, r0, std::min(kFetchAhead, rows), c0, width);
                        // forward: S = scale Q K^T  ->  S' = scale (tQ K^T + Q tK^T)
                        pass.gemm(false, true, rows, width, s.dim, scale, q_blk, s.dim, k_blk, s.dim, T(0), p, width);
                        times_keys<T>(pass, rows, width, s.dim, scale, tq_blk, KeyOperand<T>{tq_blk ? k_blk : nullptr, s.dim},
                                      tk_blk ? q_blk : nullptr, KeyOperand<T>{tk_blk, s.dim}, t);
                        // backward: dP = dO V^T  ->  dP' = tdO V^T + dO tV^T
                        pass.gemm(false, true, rows, width, s.dim_v, T(1), do_blk, s.dim_v, v_blk, s.dim_v, T(0), dp,
                                  width);
                        times_keys<T>(pass, rows, width, s.dim_v, T(1), tdo_blk,
                                      KeyOperand<T>{tdo_blk ? v_blk : nullptr, s.dim_v}, tv_blk ? do_blk : nullptr,
                                      KeyOperand<T>{tv_blk, s.dim_v}, x);
                        for (index_t i = 0; i < rows; ++i) {
                            T *pi = p + i * width, *ti = t + i * width, *dpi = dp + i * width, *xi = x + i * width;
                            const index_t row = r0 + i, seen = causal.visible(row, c0, width);
                            const auto [sli, cvi] = cap_rows.row(i, width);
                            // S = c tanh(A / c) + bias, S' = slope A' + tbias (and the curve, times A')
                            pass.score_row(tile_masks, pi, b, h, row, c0, seen, sli, cvi, ti, &tbias);
                            if (fetch && i + kFetchAhead < rows) masks.prefetch(b, h, row + kFetchAhead, 1, c0, width);
                            if (drop.on) {  // Z drawn once for the row; dP~ = dP Z, dP~' = dP' Z
                                std::fill(keep.begin(), keep.begin() + seen, T(1));
                                drop.scale_row(keep.data(), b, h, row, c0, seen);
                                for (index_t j = 0; j < seen; ++j) dpi[j] *= keep[j], xi[j] *= keep[j];
                            }
                            // P (and rowsum(P * S') over the tile's keys, not read: centred below)
                            probs_and_dot(pi, ti, seen, row_max[first + i], inv_sum[first + i]);
                            if (single_key(bh, row)) {  // the row's one key: P = 1, P' = 0, dS = dS' = 0
                                for (index_t j = 0; j < seen; ++j) pi[j] = pi[j] > T(0) ? T(1) : T(0);
                                std::fill(ti, ti + seen, T(0));
                                std::fill(dpi, dpi + seen, T(0));
                                std::fill(xi, xi + seen, T(0));
                            } else {
                                // a tile that holds all of the row's keys sums t and D' itself, as
                                // the whole-row pass does (their rounding then cancels there)
                                const index_t row_end = std::min(causal.visible(row, 0, s.len_k), key0 + keys);
                                const bool whole = !pass.call.partial_rows && c0 <= key0 && row_end <= c0 + width;
                                // P' = P ((S' - c) - (t - c)), centred on the row's peak
                                // (centre_on_peak): here, or by the forward's JVP, with 0 for
                                // a ring step's sums
                                T t_less = centre[first + i];
                                if (whole) {
                                    const T m = row_max[first + i], inv = inv_sum[first + i];
                                    const T p_sink = sink_probability(pass.call.sink, m, inv);
                                    t_less = centre_on_peak(pi, ti, seen, p_sink).second;
                                } else if (peak) {
                                    shift_row(ti, seen, peak[first + i]);
                                }
                                centre_and_scale(pi, ti, seen, t_less);
                                const T d_t = whole ? tangent_delta(pi, ti, dpi, xi, seen) : delta_t[first + i];
                                score_grad_tangents(pi, ti, dpi, xi, seen, delta[first + i], d_t);  // dS, dS'
                            }
                            if (drop.on) for (index_t j = 0; j < seen; ++j) pi[j] *= keep[j], ti[j] *= keep[j];
                            for (T* r : {pi, ti, dpi, xi}) std::fill(r + seen, r + width, T(0));
                            // backward: dA = slope dS  ->  dA' = slope dS' + (curve A') dS
                            if (sli) Softcap<T>::back_to_raw(xi, dpi, sli, cvi, seen);
                        }
                        // backward: dV = (P Z)^T dO  ->  dV' += (P' Z)^T dO + (P Z)^T tdO
                        pass.gemm(true, false, width, s.dim_v, rows, T(1), t, width, do_blk, s.dim_v, T(1),
                                  tdv_head + c0 * s.dim_v, s.dim_v);
                        if (tdo_blk) {
                            pass.gemm(true, false, width, s.dim_v, rows, T(1), p, width, tdo_blk, s.dim_v, T(1),
                                      tdv_head + c0 * s.dim_v, s.dim_v);
                        }
                        // backward: dQ = scale dS K, dK = scale dS^T Q  ->  dQ' += scale (dS' K + dS tK),
                        // dK' += scale (dS'^T Q + dS^T tQ)
                        pass.gemm(false, false, rows, s.dim, width, scale, x, width, k_blk, s.dim, T(1), tdq + first * s.dim,
                                  s.dim);
                        if (tk_blk) {
                            pass.gemm(false, false, rows, s.dim, width, scale, dp, width, tk_blk, s.dim, T(1),
                                      tdq + first * s.dim, s.dim);
                        }
                        pass.gemm(true, false, width, s.dim, rows, scale, x, width, q_blk, s.dim, T(1),
                                  tdk_head + c0 * s.dim, s.dim);
                        if (tq_blk) {
                            pass.gemm(true, false, width, s.dim, rows, scale, dp, width, tq_blk, s.dim, T(1),
                                      tdk_head + c0 * s.dim, s.dim);
                        }
                        if (dq) {  // the backward: dV += (P Z)^T dO,  dQ += scale dS K,  dK += scale dS^T Q
                            pass.gemm(true, false, width, s.dim_v, rows, T(1), p, width, do_blk, s.dim_v, T(1),
                                      dv_head + c0 * s.dim_v, s.dim_v);
                            pass.gemm(false, false, rows, s.dim, width, scale, dp, width, k_blk, s.dim, T(1),
                                      dq + first * s.dim, s.dim);
                            pass.gemm(true, false, width, s.dim, rows, scale, dp, width, q_blk, s.dim, T(1),
                                      dk_head + c0 * s.dim, s.dim);
                        }
                    }
                }
            }
            tiles_computed.fetch_add(computed, std::memory_order_relaxed);
          });
        }
    });
}

template void backward_jvp_given_sums<float>(const Pass<float>&);
template void backward_jvp_given_sums<double>(const Pass<double>&);

}  // namespace attngrad_tiles
