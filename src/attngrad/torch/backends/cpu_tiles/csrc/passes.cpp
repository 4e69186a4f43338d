// attngrad's compiled tiles: the forward and the backward (see tiles.h for the design).
#include "tiles.h"

namespace attngrad_tiles {

template <typename T>
void forward(const Pass<T>& pass) {
    const T *q = pass[buf_q], *k = pass[buf_k], *v = pass[buf_v];
    T *out = pass[buf_out], *row_max = pass[buf_row_max], *inv_sum = pass[buf_inv_sum];
    const Shape& s = pass.s;
    const Causal causal = pass.causal;
    const ScoreMask<T>& masks = pass.masks;
    const DropoutDraw& drop = pass.drop;
    const T scale = pass.scale;
    const index_t block_rows = pass.call.block_rows, block_keys = pass.call.block_keys;
    const index_t value_slice = pass.call.value_slice;
    const index_t group = s.heads / s.kv_heads;
    const index_t query_blocks = (s.len_q + block_rows - 1) / block_rows;
    const index_t bh_count = s.batch * s.heads;
    const T neg_inf = -std::numeric_limits<T>::infinity();
    const TileMap tile_map(pass.call);
    const KeyRanges ranges(pass.call);
    // a tile's scratch is no larger than the call: a decode step's is one row, not 128
    const index_t tile_rows = std::min(block_rows, s.len_q), tile_keys = std::min(block_keys, s.len_k);
    // A work item is a run of query blocks of one head: one block, or with the call's
    // transposed_keys (a narrow band) a run of blocks (band_run_blocks), which copy the keys
    // they see transposed once and take S = Q (K^T) from the copy (BandKeys)
    const index_t run_blocks = pass.call.transposed_keys ? band_run_blocks(query_blocks, bh_count) : 1;
    const index_t runs = (query_blocks + run_blocks - 1) / run_blocks;
    // the last query blocks first: a causal pass's heaviest work is scheduled first
    parallel_items(runs * bh_count, [&](const ItemSource& source) {
        std::vector<T> scores(tile_rows * tile_keys), acc(tile_rows * s.dim_v), m(tile_rows);
        std::vector<wide_t<T>> l(tile_rows);  // the softmax sums, wide (exp_and_sum)
        RoundedTile scores_bf16(pass.call.bf16_products, tile_rows * tile_keys);  // E, for E V
        BandKeys<T> keys_t(pass.call.transposed_keys);
        index_t computed = 0;  // counted once per worker: a shared atomic per block cost 1% of a window's forward
        for (index_t item; (item = source.next()) >= 0;) {
          const index_t run = runs - 1 - item / bh_count, bh = item % bh_count;
          const index_t b = bh / s.heads, h = bh % s.heads;
          const T* k_head = k + (b * s.kv_heads + h / group) * s.len_k * s.dim;
          const T* v_head = v + (b * s.kv_heads + h / group) * s.len_k * s.dim_v;
          const index_t qb0 = run * run_blocks, qb1 = std::min(query_blocks, qb0 + run_blocks);
          if (keys_t.on()) {  // the keys any block of the run sees
              index_t lo = s.len_k, hi = 0;
              for (index_t qb = qb0; qb < qb1; ++qb) {
                  const auto [key0, n] = ranges(b, qb);
                  if (n > 0) lo = std::min(lo, key0), hi = std::max(hi, key0 + n);
              }
              keys_t.copy(k_head, s.dim, std::min(lo, hi), hi);
          }
          for (index_t qb = qb0; qb < qb1; ++qb) {
            const index_t r0 = qb * block_rows, rows = std::min(block_rows, s.len_q - r0);
            const T* q_blk = q + (bh * s.len_q + r0) * s.dim;
            const auto [key0, key_count] = ranges(b, qb);  // block_map.key_ranges
            const index_t keys = key0 + key_count;
            std::fill(m.begin(), m.end(), neg_inf);
            std::fill(l.begin(), l.end(), wide_t<T>(0));
            std::fill(acc.begin(), acc.end(), T(0));
            // a block whose rows see no key (key_count 0, key0 anywhere) computes no tile, whatever
            // the tile map says of its tiles
            for (index_t kb0 = key0 / block_keys * block_keys; key_count > 0 && kb0 < keys; kb0 += block_keys) {
                const TileMap::Kind kind = tile_map(b, h, qb, kb0 / block_keys);
                if (kind == TileMap::skipped) continue;  // every score of the tile excluded
                const ScoreMask<T>& tile_masks = kind == TileMap::unmasked ? pass.structure : masks;
                ++computed;
                // the tile: the key block's keys within the query block's range, which need not
                // start at a block's edge (a sliding window's band)
                const index_t c0 = std::max(kb0, key0), cols = std::min(kb0 + block_keys, keys) - c0;
                const bool fetch = kind == TileMap::computed;  // the mask and bias rows ahead of use
                if (fetch) masks.prefetch(b, h, r0, std::min(kFetchAhead, rows), c0, cols);
                // forward: S = scale Q_blk K_blk^T
                keys_t.scores(pass, rows, cols, s.dim, scale, q_blk, k_head, c0, scores.data());
                for (index_t i = 0; i < rows; ++i) {
                    T* row = scores.data() + i * cols;
                    const index_t seen = causal.visible(r0 + i, c0, cols);
                    pass.score_row(tile_masks, row, b, h, r0 + i, c0, seen);  // S = c tanh(S / c) + bias, excluded -inf
                    if (fetch && i + kFetchAhead < rows) masks.prefetch(b, h, r0 + i + kFetchAhead, 1, c0, cols);
                    const index_t start = tile_masks.before_bounds(b, r0 + i, c0, seen);  // E = 0 before it
                    T top = max_of(row + start, seen - start);  // -inf past a NaN, as for no key
                    if (top == neg_inf && m[i] == neg_inf && has_nan(row + start, seen - start)) {
                        top = std::numeric_limits<T>::quiet_NaN();  // a NaN arrived: m, l, O are NaN
                    }
                    const T m_new = max_keeping_nan(m[i], top);
                    // E = exp(S - m'); a row that has seen no key so far keeps E = 0
                    const wide_t<T> sum = m_new != neg_inf ? exp_and_sum(row + start, seen - start, m_new) : 0;
                    std::fill(row, row + (m_new != neg_inf ? start : cols), T(0));
                    std::fill(row + seen, row + cols, T(0));  // the row's future
                    if (m_new != m[i]) {  // rescale what earlier key blocks summed
                        const T correction = m[i] == neg_inf ? T(0) : m_new != m_new ? m_new : exp_score(m[i] - m_new);
                        l[i] *= correction;
                        T* acc_row = acc.data() + i * s.dim_v;
                        for (index_t c = 0; c < s.dim_v; ++c) acc_row[c] *= correction;
                        m[i] = m_new;
                    }
                    l[i] += sum;
                    if (drop.on) drop.scale_row(row, b, h, r0 + i, c0, seen);  // E Z: l keeps E alone
                    scores_bf16.round(row, i * cols, cols);
                }
                // forward: acc += E V_blk, over slices of about `value_slice` keys
                for (index_t j0 = 0, n; j0 < cols; j0 += n) {
                    n = value_slice_keys(j0, cols, value_slice);
                    pass.gemm(false, false, rows, s.dim_v, n, T(1), scores.data() + j0,
                            cols, v_head + (c0 + j0) * s.dim_v, s.dim_v, T(1), acc.data(), s.dim_v,
                            scores_bf16.at(j0));
                }
            }
            for (index_t i = 0; i < rows; ++i) {
                const index_t r = bh * s.len_q + r0 + i;
                // l = 0 only for a row that saw no key (else its largest term is exp(0) = 1): out 0,
                // statistics 0, whatever 0 x NaN left in acc. A row that a NaN or Inf reached has
                // l NaN, and keeps NaN statistics and output, as every later pass then does
                const bool empty = l[i] == 0;
                const T inv = empty ? T(0) : static_cast<T>(1 / l[i]);
                row_max[r] = empty ? T(0) : m[i];
                inv_sum[r] = inv;
                const T* acc_row = acc.data() + i * s.dim_v;
                T* out_row = out + r * s.dim_v;
                if (empty) {
                    std::fill(out_row, out_row + s.dim_v, T(0));
                } else {
                    for (index_t c = 0; c < s.dim_v; ++c) out_row[c] = acc_row[c] * inv;
                }
            }
          }
        }
        tiles_computed.fetch_add(computed, std::memory_order_relaxed);
    });
}

template <typename T>
void backward(const Pass<T>& pass) {
    const T *dout = pass[buf_dout], *q = pass[buf_q], *k = pass[buf_k], *v = pass[buf_v], *out = pass[buf_out];
    const T *row_max = pass[buf_row_max], *inv_sum = pass[buf_inv_sum];
    T *delta = pass[buf_delta], *dq_parts = pass[buf_dq_parts], *dk = pass[buf_dk], *dv = pass[buf_dv];
    const BiasGradient<T> dbias(pass, buf_dbias_parts, 3);
    const Shape& s = pass.s;
    const Causal causal = pass.causal;
    const ScoreMask<T>& masks = pass.masks;
    const DropoutDraw& drop = pass.drop;
    const T scale = pass.scale;
    const index_t block_rows = pass.call.block_rows, block_keys = pass.call.block_keys, chunks = pass.call.chunks;
    const index_t group = s.heads / s.kv_heads;
    const index_t rows_total = s.batch * s.heads * s.len_q;
    const index_t key_blocks = (s.len_k + block_keys - 1) / block_keys;
    const SingleKeyRows<T> single_key(masks, causal, s, inv_sum);
    const TileMap tile_map(pass.call);
    const KeyRanges ranges(pass.call);
    // D = rowsum(dO * O), read only by rows whose keys span more than one block (below)
    if (pass.call.partial_rows) {
        row_dots(dout, out, delta, rows_total, s.dim_v);
    } else if (key_blocks > 1) {
        row_dots_of_spanning_blocks(dout, out, delta, s, ranges, block_rows, block_keys);
    }
    const KvItems items(s, chunks, dbias.shares_batch(s), dbias.shares_kv_heads(s));
    const bool dbias_direct = dbias.direct(s);  // written entry by entry; else added into zeros
    if (dbias.part(0) && !dbias_direct) dbias.zero_all();
    const index_t tile = std::min(block_rows, s.len_q) * std::min(block_keys, s.len_k);  // no larger than the call
    // bfloat16 products on brgemm: each key block's dK and dV summed transposed
    std::optional<TransposedKeyGrads> keys_t_grads;
    if constexpr (std::is_same_v<T, float>) {
        if (pass.rounded.vnni() && s.dim % 2 == 0 && s.dim_v % 2 == 0) {
            keys_t_grads.emplace(q, dout, s.batch * s.heads, s.len_q, s.dim, s.dim_v, block_rows, block_keys);
        }
    }
    parallel_items(items.count(), [&](const ItemSource& source) {
        std::vector<T> probs(tile), dscores(tile);
        RoundedTile probs_bf16(pass.call.bf16_products, tile), dscores_bf16(pass.call.bf16_products, tile);
        TransposedKeyGrads::Scratch key_sums;  // keys_t_grads's
        // the cap's slope at a row's scores, made and used within the row's own sweep
        std::vector<T> slope_row(pass.cap.c ? std::min(block_keys, s.len_k) : 0);
        std::vector<T> keep(drop.on ? std::min(block_keys, s.len_k) : 0);  // a row's dropout multipliers Z
        BandKeys<T> keys_t(pass.call.transposed_keys), values_t(pass.call.transposed_keys);
        std::vector<ZeroedRows<T>> dq_zeroed;  // the dQ rows of an item's heads
        for (index_t item; (item = source.next()) >= 0;) {
          items.visit(item, [&](const KvItem& it) {
            const index_t chunk = it.chunk, bhk = it.bhk, b = it.b, hk = it.hk;
            const T* k_head = k + bhk * s.len_k * s.dim;
            const T* v_head = v + bhk * s.len_k * s.dim_v;
            T* dk_head = dk + bhk * s.len_k * s.dim;
            T* dv_head = dv + bhk * s.len_k * s.dim_v;
            T* dq = dq_parts + chunk * rows_total * s.dim;
            T* dbias_part = dbias.part(chunk);
            // The item zeroes what it alone sums into, its chunk's dQ rows of its heads and
            // each key block's dK and dV rows, as its products first reach them (ZeroedRows):
            // the caller's buffers come unzeroed, and the zeros land in this core's cache
            dq_zeroed.clear();
            for (index_t h = hk * group; h < (hk + 1) * group; ++h) {
                dq_zeroed.emplace_back(dq + (b * s.heads + h) * s.len_q * s.dim, s.dim, s.len_q);
            }
            index_t computed = 0;
            for (index_t kb = chunk * key_blocks / chunks; kb < (chunk + 1) * key_blocks / chunks; ++kb) {
                const index_t kb0 = kb * block_keys, block_cols = std::min(block_keys, s.len_k - kb0);
                ZeroedRows<T> dk_zeroed(dk_head + kb0 * s.dim, s.dim, block_cols);
                ZeroedRows<T> dv_zeroed(dv_head + kb0 * s.dim_v, s.dim_v, block_cols);
                if (keys_t_grads) keys_t_grads->start(key_sums);
                if (keys_t.on()) {  // K and V over the block's keys that any query block sees, transposed
                    index_t lo = kb0 + block_cols, hi = kb0;
                    for (index_t qb = 0; qb * block_rows < s.len_q; ++qb) {
                        const auto [key0, keys] = ranges(b, qb);
                        if (keys == 0 || key0 >= kb0 + block_cols || key0 + keys <= kb0) continue;
                        lo = std::min(lo, std::max(key0, kb0));
                        hi = std::max(hi, std::min(key0 + keys, kb0 + block_cols));
                    }
                    keys_t.copy(k_head, s.dim, std::min(lo, hi), hi);
                    values_t.copy(v_head, s.dim_v, std::min(lo, hi), hi);
                }
                for (index_t h = hk * group; h < (hk + 1) * group; ++h) {
                    const index_t bh = b * s.heads + h;
                    for (index_t r0 = 0; r0 < s.len_q; r0 += block_rows) {
                        // the query blocks whose key range (block_map.key_ranges) misses these keys
                        const auto [key0, keys] = ranges(b, r0 / block_rows);
                        const index_t rows = std::min(block_rows, s.len_q - r0), first = bh * s.len_q + r0;
                        // skipped: beyond the block's keys, or every score of the tile excluded
                        const TileMap::Kind kind = tile_map(b, h, r0 / block_rows, kb);
                        if (keys == 0 || kb0 >= key0 + keys || kb0 + block_cols <= key0 || kind == TileMap::skipped) {
                            if (dbias_direct) dbias.zero_tile(dbias_part, b, h, r0, rows, kb0, block_cols);
                            continue;
                        }
                        const ScoreMask<T>& tile_masks = kind == TileMap::unmasked ? pass.structure : masks;
                        ++computed;
                        // the forward's tile of these rows starts and ends where their block's
                        // keys do: the same GEMM, so the same scores, bit for bit, as the forward's
                        const index_t c0 = std::max(kb0, key0), width = std::min(kb0 + block_cols, key0 + keys) - c0;
                        if (dbias_direct) {
                            if (c0 > kb0) dbias.zero_tile(dbias_part, b, h, r0, rows, kb0, c0 - kb0);
                            const index_t end = kb0 + block_cols;
                            if (c0 + width < end) dbias.zero_tile(dbias_part, b, h, r0, rows, c0 + width, end - c0 - width);
                        }
                        const T* k_blk = k_head + c0 * s.dim;
                        const bool fetch = kind == TileMap::computed;  // the mask and bias rows ahead of use
                        if (fetch) masks.prefetch(b, h, r0, std::min(kFetchAhead, rows), c0, width);
                        // forward: S = scale Q K_blk^T;  backward: dP = dO V_blk^T
                        keys_t.scores(pass, rows, width, s.dim, scale, q + first * s.dim, k_head, c0, probs.data());
                        values_t.scores(pass, rows, width, s.dim_v, T(1), dout + first * s.dim_v, v_head, c0,
                                        dscores.data());
                        for (index_t i = 0; i < rows; ++i) {
                            T* p = probs.data() + i * width;
                            T* ds = dscores.data() + i * width;
                            const index_t seen = causal.visible(r0 + i, c0, width);
                            const T m = row_max[first + i], inv = inv_sum[first + i];
                            T* slope = pass.cap.c ? slope_row.data() : nullptr;
                            pass.score_row(tile_masks, p, b, h, r0 + i, c0, seen, slope);  // S = c tanh(A / c) + bias
                            if (fetch && i + kFetchAhead < rows) {
                                masks.prefetch(b, h, r0 + i + kFetchAhead, 1, c0, width);
                            }
                            if (drop.on) {  // Z drawn once for the row; dP = (dO V^T) Z
                                std::fill(keep.begin(), keep.begin() + seen, T(1));
                                drop.scale_row(keep.data(), b, h, r0 + i, c0, seen);
                                for (index_t j = 0; j < seen; ++j) ds[j] *= keep[j];
                            }
                            // P = dS = 0 before the row's bounds, and the sweeps start past them
                            const index_t start = tile_masks.before_bounds(b, r0 + i, c0, seen);
                            std::fill(p, p + start, T(0));
                            std::fill(ds, ds + start, T(0));
                            const index_t row_end = std::min(causal.visible(r0 + i, 0, s.len_k), key0 + keys);
                            if (!pass.call.partial_rows && c0 <= key0 && row_end <= c0 + width) {
                                // every key of the row is in this block: D = rowsum(P dP) from
                                // the very dP it is subtracted from, whose rounding then cancels
                                // (rowsum(dO O) carries O's; few-key rows showed it in float32)
                                const T d_row = probs_and_dot(p + start, ds + start, seen - start, m, inv);
                                centre_and_scale(p + start, ds + start, seen - start, d_row);
                            } else {
                                probs_and_score_grad(p + start, ds + start, seen - start, m, inv, delta[first + i]);
                            }
                            // the row's one key, if in this block: P = 1, dS = 0 (with l = 1: a ring
                            // step's row may have more keys than this call's, each with weight)
                            if (single_key(bh, r0 + i)) {
                                for (index_t j = 0; j < seen; ++j) {
                                    p[j] = p[j] > T(0) ? T(1) : T(0);
                                    ds[j] = T(0);
                                }
                            }
                            if (drop.on) for (index_t j = 0; j < seen; ++j) p[j] *= keep[j];  // P Z, for dV
                            std::fill(p + seen, p + width, T(0));
                            std::fill(ds + seen, ds + width, T(0));
                            // forward: S = scale Q K^T + bias  ->  dbias = dS, summed over its broadcast axes
                            if (dbias_direct) {
                                dbias.write_row(dbias_part, ds, b, h, r0 + i, c0, width);
                            } else if (dbias_part) {
                                dbias.add_row(dbias_part, ds, b, h, r0 + i, c0, seen);
                            }
                            // forward: S = c tanh(A / c) + bias  ->  dA = dS (1 - tanh^2)
                            if (slope) for (index_t j = 0; j < seen; ++j) ds[j] *= slope[j];
                            probs_bf16.round(p, i * width, width);
                            dscores_bf16.round(ds, i * width, width);
                        }
                        dq_zeroed[h - hk * group].reach(r0 + rows);
                        if (keys_t_grads) {  // dV_blk^T += dO^T (P Z), dK_blk^T += Q^T dS (scale at the end)
                            if constexpr (std::is_same_v<T, float>) {
                                keys_t_grads->add(key_sums, bh, r0, rows, c0 - kb0, width, probs.data(), dscores.data(),
                                                  probs_bf16.at(0), dscores_bf16.at(0), q, dout, pass.rounded);
                            }
                        } else {
                            dv_zeroed.reach(c0 + width - kb0);
                            dk_zeroed.reach(c0 + width - kb0);
                            // forward: O = (P Z) V  ->  dV_blk += (P Z)^T dO
                            pass.gemm(true, false, width, s.dim_v, rows, T(1), probs.data(), width,
                                      dout + first * s.dim_v, s.dim_v, T(1), dv_head + c0 * s.dim_v, s.dim_v,
                                      probs_bf16.at(0));
                            // forward: S = scale Q K^T  ->  dK_blk += scale dS^T Q
                            pass.gemm(true, false, width, s.dim, rows, scale, dscores.data(), width, q + first * s.dim,
                                      s.dim, T(1), dk_head + c0 * s.dim, s.dim, dscores_bf16.at(0));
                        }
                        // forward: S = scale Q K^T  ->  dQ += scale dS K_blk
                        pass.gemm(false, false, rows, s.dim, width, scale, dscores.data(), width, k_blk, s.dim, T(1),
                                dq + first * s.dim, s.dim, dscores_bf16.at(0));
                    }
                }
                if constexpr (std::is_same_v<T, float>) {
                    if (keys_t_grads) {
                        keys_t_grads->finish(key_sums, block_cols, scale, dk_head + kb0 * s.dim,
                                             dv_head + kb0 * s.dim_v);
                        continue;
                    }
                }
                dk_zeroed.finish();
                dv_zeroed.finish();
            }
            for (ZeroedRows<T>& rows : dq_zeroed) rows.finish();
            tiles_computed.fetch_add(computed, std::memory_order_relaxed);
          });
        }
        store_fence();  // the bias gradient's streamed rows
    });
    dbias.finish();  // the wide sums, where there are any
}

template void forward<float>(const Pass<float>&);
template void forward<double>(const Pass<double>&);
template void backward<float>(const Pass<float>&);
template void backward<double>(const Pass<double>&);

}  // namespace attngrad_tiles
