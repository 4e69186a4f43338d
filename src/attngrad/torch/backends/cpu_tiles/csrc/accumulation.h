// How work items add up what they share without atomics and with the same bits on any
// thread count: rows a work item zeroes as it reaches them, the bias gradient's parts
// (BiasGradient) and the items that share a broadcast bias (KvItems), streaming stores,
// and the rows' sums D = rowsum(dO * O).
#pragma once

#include "pass.h"

namespace attngrad_tiles {

// Rows [0, end) of a row-major accumulator (`width` numbers a row) that a work item alone
// adds into, zeroed up to a mark as its products first reach them (`reach`), the rest at
// its end (`finish`): the zeros are still in cache when the products add into them.
template <typename T>
class ZeroedRows {
   public:
    ZeroedRows(T* rows, index_t width, index_t end) : rows_(rows), width_(width), end_(end) {}
    void reach(index_t hi) {  // rows [0, hi) zeroed (or added into since)
        if (hi <= hi_) return;
        std::fill(rows_ + hi_ * width_, rows_ + hi * width_, T(0));
        hi_ = hi;
    }
    void finish() { reach(end_); }

   private:
    T* rows_;
    index_t width_, end_, hi_ = 0;
};

// The bias gradient: dS summed over the axes the bias broadcasts along. The batch entries
// and key/value heads a broadcast bias shares are visited by one work item (KvItems), in
// order; chunks of one (b, key/value head) would still add into the same entries where the
// bias broadcasts along the chunked axis (`chunked_axis`: 3, keys, in the backward; 2,
// query rows, in the backward's JVP), so there each chunk owns a part, and the caller adds
// the parts in order. No entry is written by two threads, and no atomics.
// A float32 bias that broadcasts along the query rows sums Lq terms or more into each entry
// (B H Lq for a (1, Lk) mask), one after another: there the sums run in double (BiasGradient's
// wide sums), as PyTorch's own reduction runs blocked; its gradient was 2.3-6.5x less accurate
// than PyTorch's with float32 sums (issue 58, benchmarks/float32_mask_grads.py).
inline int64_t bias_grad_parts(const AttngradCall& c, int chunked_axis) {
    return c.bias_sizes[chunked_axis] == 1 ? c.chunks : 1;
}

// dst[0, n) = src[0, n), past the caches where the CPU has streaming stores: a gradient the
// size of the scores is written once and not read again by this pass, and a cached write
// would first read each line (and evict the tiles' operands).
template <typename T>
void stream_copy(T* dst, const T* src, index_t n) {
#if defined(__AVX512F__)
    index_t j = 0;
    constexpr index_t lanes = 64 / sizeof(T);
    for (; j < n && reinterpret_cast<uintptr_t>(dst + j) % 64 != 0; ++j) dst[j] = src[j];
    for (; j + lanes <= n; j += lanes) {
        if constexpr (std::is_same_v<T, float>) {
            _mm512_stream_ps(dst + j, _mm512_loadu_ps(src + j));
        } else {
            _mm512_stream_pd(dst + j, _mm512_loadu_pd(src + j));
        }
    }
    for (; j < n; ++j) dst[j] = src[j];
#else
    std::memcpy(dst, src, n * sizeof(T));
#endif
}

// dst[0, n) = 0, past the caches where the CPU has streaming stores (as stream_copy)
template <typename T>
void stream_zero(T* dst, index_t n) {
#if defined(__AVX512F__)
    index_t j = 0;
    constexpr index_t lanes = 64 / sizeof(T);
    for (; j < n && reinterpret_cast<uintptr_t>(dst + j) % 64 != 0; ++j) dst[j] = T(0);
    for (; j + lanes <= n; j += lanes) {
        if constexpr (std::is_same_v<T, float>) {
            _mm512_stream_ps(dst + j, _mm512_setzero_ps());
        } else {
            _mm512_stream_pd(dst + j, _mm512_setzero_pd());
        }
    }
    for (; j < n; ++j) dst[j] = T(0);
#else
    std::fill(dst, dst + n, T(0));
#endif
}

// Orders a worker's streaming stores before whatever it does next (its end: the join that
// hands the results to the caller)
inline void store_fence() {
#if defined(__AVX512F__)
    _mm_sfence();
#endif
}

template <typename T>
class BiasGradient {
   public:
    BiasGradient(const Pass<T>& p, AttngradBuffer parts, int chunked_axis)
        : parts_(p[parts]), bb_(p.call.bias_sizes),
          part_numel_(p.call.bias_sizes[0] * p.call.bias_sizes[1] * p.call.bias_sizes[2] * p.call.bias_sizes[3]),
          chunks_(bias_grad_parts(p.call, chunked_axis)) {
        // a part without a row axis: B H Lk numbers at most, so its double copy is small
        if (std::is_same_v<T, float> && parts_ && p.call.bias_sizes[2] == 1 && p.s.len_q > 1) {
            wide_.assign(part_numel_ * chunks_, wide_t<T>(0));
        }
    }
    BiasGradient(const BiasGradient&) = delete;
    BiasGradient& operator=(const BiasGradient&) = delete;

    // The part that chunk `chunk` adds into, or null without a bias gradient
    T* part(index_t chunk) const { return parts_ ? parts_ + (chunks_ > 1 ? chunk : 0) * part_numel_ : nullptr; }

    // Which of the batch and key/value head axes work items must share (KvItems): those the
    // bias broadcasts along, when there is a gradient
    bool shares_batch(const Shape& s) const { return parts_ && bb_.sb == 0 && s.batch > 1; }
    bool shares_kv_heads(const Shape& s) const { return parts_ && bb_.sh == 0 && s.kv_heads > 1; }

    // Whether the bias has the scores' own sizes, so that each entry of its gradient is one
    // score's dS: then the backward writes every entry once (the tiles it skips as 0), and
    // the buffer is neither zeroed first nor read back (a (8, 4096, 4096) gradient is 512 MiB)
    bool direct(const Shape& s) const {
        // each size is 1 or the scores' own (ops.cpp), so equal counts mean equal sizes
        return parts_ && chunks_ == 1 && part_numel_ == s.batch * s.heads * s.len_q * s.len_k;
    }

    // The whole buffer zeroed, where the pass adds into it (not `direct`); the wide sums start at 0
    void zero_all() const {
        parallel_range(part_numel_ * chunks_, 1 << 16, [&](index_t begin, index_t end) {
            std::fill(parts_ + begin, parts_ + end, T(0));
        });
    }

    // part = x for keys c0..c0 + n of row i of head (b, h): a `direct` gradient's row
    void write_row(T* part, const T* x, index_t b, index_t h, index_t i, index_t c0, index_t n) const {
        stream_copy(part + bb_.row(b, h, i) + c0 * bb_.sj, x, n);
    }

    // part = 0 for keys c0..c0 + n of rows r0..r0 + rows of head (b, h): a `direct` gradient's
    // skipped tile
    void zero_tile(T* part, index_t b, index_t h, index_t r0, index_t rows, index_t c0, index_t n) const {
        for (index_t i = r0; i < r0 + rows; ++i) stream_zero(part + bb_.row(b, h, i) + c0 * bb_.sj, n);
    }

    // Whether the bias is constant along the keys (a sink's): then a row adds one number
    bool key_constant() const { return parts_ && bb_.sj == 0; }

    // part += value for row i of head (b, h) of a key_constant bias: a row's whole sum of its
    // scores' gradients, given in closed form where summing them would cancel
    void add_value(T* part, T value, index_t b, index_t h, index_t i) const {
        const index_t at = bb_.row(b, h, i);
        if (wide_.empty()) {
            part[at] += value;
        } else {
            wide(part)[at] += value;
        }
    }

    // part += dS for keys c0..c0 + n of row i of head (b, h)
    void add_row(T* part, const T* ds, index_t b, index_t h, index_t i, index_t c0, index_t n) const {
        const index_t at = bb_.row(b, h, i) + c0 * bb_.sj;
        if (wide_.empty()) {
            add_to(part + at, ds, n);
        } else {
            add_to(wide(part) + at, ds, n);
        }
    }

    // The wide sums rounded into the parts, where there are any: once, after every work item
    // of the pass is done
    void finish() const {
        if (wide_.empty()) return;
        parallel_range(part_numel_ * chunks_, 1 << 16, [&](index_t begin, index_t end) {
            for (index_t e = begin; e < end; ++e) parts_[e] = static_cast<T>(wide_[e]);
        });
    }

   private:
    // The wide sums of `part`, at the same offsets (each item writes apart, as into the parts)
    wide_t<T>* wide(T* part) const { return wide_.data() + (part - parts_); }

    // sum[0, n) += ds[0, n) along the keys, or sum[0] += the row's sum where the bias is constant along them
    template <typename S>
    void add_to(S* sum, const T* ds, index_t n) const {
        if (bb_.sj) {
            for (index_t j = 0; j < n; ++j) sum[j] += ds[j];
        } else {
            wide_t<T> row = 0;
            for (index_t j = 0; j < n; ++j) row += ds[j];
            sum[0] += static_cast<S>(row);
        }
    }

    T* parts_;
    Broadcast4 bb_;
    index_t part_numel_, chunks_;
    // with a float32 bias broadcast along the query rows, the sums in double, in the parts'
    // layout (mutable: the work items add into it as into the parts)
    mutable std::vector<wide_t<T>> wide_;
};

// The work of the backward passes: chunk `chunk` of key/value head bhk = b Hkv + hk.
struct KvItem {
    index_t chunk, bhk, b, hk;
};

// The work items of the backward passes, in chunk-major order (in the backward's causal
// pass the first key chunks, seen by the most rows, are the heaviest and so go first): one
// per (chunk, b, hk), except that the batch entries or key/value heads a bias gradient sums
// over are one item, visited in order, so that no two items add into the same entries.
class KvItems {
   public:
    KvItems(const Shape& s, index_t chunks, bool share_batch, bool share_kv_heads)
        : batch_(s.batch), kv_heads_(s.kv_heads), chunks_(chunks), b_items_(share_batch ? 1 : s.batch),
          hk_items_(share_kv_heads ? 1 : s.kv_heads) {}

    index_t count() const { return chunks_ * b_items_ * hk_items_; }

    // fn(KvItem) for each (chunk, b, hk) of item `item`, in order
    template <typename F>
    void visit(index_t item, F&& fn) const {
        const index_t groups = b_items_ * hk_items_, chunk = item / groups;
        const index_t b0 = item % groups / hk_items_, hk0 = item % hk_items_;
        for (index_t b = b0; b < (b_items_ == 1 ? batch_ : b0 + 1); ++b) {
            for (index_t hk = hk0; hk < (hk_items_ == 1 ? kv_heads_ : hk0 + 1); ++hk) {
                fn(KvItem{chunk, b * kv_heads_ + hk, b, hk});
            }
        }
    }

   private:
    index_t batch_, kv_heads_, chunks_, b_items_, hk_items_;
};

// delta_r = rowsum(a_r * b_r) for `rows` rows of width `width`, summed in double (wide_dot):
// D enters every dS = P (dP - D) of its row, and a float32 sum of d products would carry d
// roundings into all of them
template <typename T>
void row_dots(const T* a, const T* b, T* delta, index_t rows, index_t width) {
    parallel_range(rows, 256, [&](index_t begin, index_t end) {
        for (index_t r = begin; r < end; ++r) delta[r] = static_cast<T>(wide_dot(a + r * width, b + r * width, width));
    });
}

// delta (as row_dots) for the rows of the query blocks whose key range spans two key blocks
// or more: the only rows the backward reads it for (a row whose keys all lie in one block
// sums its own D there), none of a narrow band's blocks but those that meet a block's edge
template <typename T>
void row_dots_of_spanning_blocks(const T* a, const T* b, T* delta, const Shape& s, const KeyRanges& ranges,
                                 index_t block_rows, index_t block_keys) {
    const index_t query_blocks = (s.len_q + block_rows - 1) / block_rows;
    parallel_range(s.batch * s.heads * query_blocks, 1, [&](index_t begin, index_t end) {
        for (index_t item = begin; item < end; ++item) {
            const index_t bh = item / query_blocks, qb = item % query_blocks;
            const auto [key0, keys] = ranges(bh / s.heads, qb);
            if (keys == 0 || key0 / block_keys == (key0 + keys - 1) / block_keys) continue;
            const index_t r0 = bh * s.len_q + qb * block_rows;
            const index_t r1 = bh * s.len_q + std::min(s.len_q, (qb + 1) * block_rows);
            for (index_t r = r0; r < r1; ++r) {
                delta[r] = static_cast<T>(wide_dot(a + r * s.dim_v, b + r * s.dim_v, s.dim_v));
            }
        }
    });
}

}  // namespace attngrad_tiles
