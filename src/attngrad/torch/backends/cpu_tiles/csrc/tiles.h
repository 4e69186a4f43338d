// attngrad's compiled tiles: every pass of exact attention (forward, backward, JVP, the
// backward's JVP, double backward) with the causal diagonal, a boolean mask, a float bias
// and its gradient, per-row key bounds (structured masks: padding lengths, sliding windows,
// packed documents), a soft cap, dropout and GQA, in the manner of FlashAttention-2 (Dao,
// 2023) on per-thread tiles small enough to stay in a core's cache; and the dropout
// keep-masks of the counter-based generator in `dropout.py`.
//
// The sources: tiles_math.h (SIMD exp and tanh, the row loops), this header (masks, dropout,
// work items, the GEMM and thread-pool interface every pass uses), runtime.cpp (the GEMM and
// the work loop on PyTorch's thread pool), row_products.h (the GEMM of a one-row tile),
// passes.cpp (forward, backward), passes_higher.cpp
// (double backward, JVP, the backward's JVP), passes_given_sums.cpp (the backward's JVP on the
// backward's tiles, given each row's sums) and ops.cpp (the TORCH_LIBRARY ops
// attngrad_tiles::*, which check every tensor against the others before a pass runs).
//
// Shape legend (row-major, contiguous)
//   q (B, H, Lq, d), k (B, Hkv, Lk, d), v (B, Hkv, Lk, dv), out and dout (B, H, Lq, dv),
//   row_max and inv_sum (B, H, Lq). G = H / Hkv query heads share one key/value head.
//   R rows of a query block, C keys of a key block.
//
// forward, per (b, h, query block), over key blocks with an online softmax:
//   S = scale Q_blk K_blk^T                                    (R, C)
//   m' = max(m, rowmax S),  E = exp(S - m'),  l = l exp(m - m') + rowsum E
//   acc = acc exp(m - m') + E V_blk                            (R, dv)
//   out = acc / l;  row_max = m, inv_sum = 1 / l              (the statistics attngrad keeps)
// backward, per (b, key/value head, chunk of key blocks), over query blocks:
//   P  = exp(S - m) / l,  dP = dO V_blk^T,  dS = P (dP - D)    D = rowsum(dO * O), or
//   rowsum(P * dP) where the block holds all of the row's keys (the same in exact arithmetic)
//   dV_blk += P^T dO,  dK_blk += scale dS^T Q,  dQ += scale dS K_blk,  dbias += dS
// jvp, backward_jvp, double_backward: see each in passes_higher.cpp; they take query blocks
// of whole rows. backward_jvp_given_sums (passes_given_sums.cpp) takes the backward's tiles.
// A work item owns its dK and dV rows, and its own copy of dQ when the keys are split into
// chunks (the double backward and the backward's JVP: their dQ-shaped rows, and their own
// dK, dV-shaped sums when the query blocks are split; a bias gradient: the batch entries
// and heads sharing a broadcast bias form one item (KvItems), and chunks adding into the
// same entries own parts): nothing is written by two threads, and the parts are added in a
// fixed order, so the bits do not depend on the schedule. The items run on PyTorch's own
// thread pool (at::parallel_for), one worker per thread, each taking the next item from an
// atomic counter (parallel_items): dynamic load balancing, with the GEMMs single-threaded
// inside a worker.
// The causal mask is a diagonal: row i sees keys j <= i + c (c = 0 top-left, Lk - Lq
// bottom-right). Key bounds leave row i of batch entry b the keys [lo, hi): tiles outside
// every row's bounds are skipped, and the whole-row passes hold only the keys between them.
// A row that sees no key has output 0 and sends back 0; a row that sees one key has P = 1
// there exactly and dS = 0 (a recomputed score can round apart from the forward's maximum).
// A row that a NaN or Inf reached (a NaN score, or +inf: exp(inf - inf)) has l NaN, and keeps
// 1/l NaN, so its output and all it sends back are NaN: "no key" is l = 0 (its maximum -inf
// with no NaN among the scores, has_nan), never !(l > 0), in every pass.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "tiles_math.h"

namespace attngrad_tiles {

// The buffers a call of a pass may name; ops.cpp fills them from the op's tensors after
// checking every size, dtype and layout, and a pass reads only those its op takes.
#define ATTNGRAD_BUFFERS(X) \
    X(q) X(k) X(v) X(mask) X(bias) X(out) X(row_max) X(inv_sum) X(dout) X(delta) X(dq_parts) X(dk) X(dv) \
    X(dbias_parts) X(gq) X(gk) X(gv) X(g_dout) X(g_q) X(gk_parts) X(gv_parts) X(tq) X(tk) X(tv) X(tbias) X(tout) \
    X(tdout) X(tdq) X(tdk_parts) X(tdv_parts) X(tdbias_parts) X(gbias) X(g_bias_parts) X(key_bounds) X(tile_map) \
    X(key_ranges) X(mask_blocks) X(mask_tiles) X(dq) X(dk_parts) X(dv_parts) X(dbias_row_parts) X(centre) \
    X(delta_t) X(tdq_parts) X(tdk) X(tdv) X(peak) X(sink_rows)

enum AttngradBuffer : int {
#define ATTNGRAD_ENUM(name) buf_##name,
    ATTNGRAD_BUFFERS(ATTNGRAD_ENUM)
#undef ATTNGRAD_ENUM
    kBufferCount
};

// One call of a pass: the sizes, the options and the buffers (null where absent), filled
// by ops.cpp from the op's arguments.
struct AttngradCall {
    int64_t batch = 0, heads = 0, kv_heads = 0, len_q = 0, len_k = 0, dim = 0, dim_v = 0;
    int64_t mask_sizes[4] = {1, 1, 1, 1}, bias_sizes[4] = {1, 1, 1, 1};  // (b, h, i, j), each 1 or the scores' own
    bool double_precision = false;         // the element type of every float buffer
    bool causal = false;
    int64_t causal_offset = 0;             // with causal, row i sees keys j <= i + causal_offset
    int64_t tile_map_sizes[2] = {1, 1};    // tile_map (1 or B, 1 or H, query blocks, key blocks)
    int64_t key_ranges_batch = 1;          // key_ranges (1 or B, query blocks, 2)
    int64_t bounds_batch = 1;              // key_bounds (bounds_batch, Lq, 2): row i of batch b sees keys
                                           // [lo, hi) only; bounds_batch 1 (shared) or B
    int64_t mask_blocks_sizes[4] = {1, 1, 1, 1};  // mask_blocks (1 or B, 1 or H, Lq / R, Lk / K) int32, each
    int64_t mask_tile_rows = 1, mask_tile_keys = 1;  // block's tile in mask_tiles (T, R, K): `mask_blocks.py`
    double scale = 1;
    double softcap = 0;  // c > 0: scores c tanh(scale q.k / c) + bias; 0: none
    bool dropout = false;
    uint64_t seed = 0, threshold = 0;  // keep where the draw's high 32 bits >= threshold = ceil(p 2^32)
    double keep_value = 1;             // 1 / (1 - p)
    int64_t dropout_row_offset = 0, dropout_key_offset = 0, dropout_head_offset = 0;  // where this call's
                                         // rows, keys and heads sit in the whole: the draws' coordinates
    bool partial_rows = false;  // the keys are a part of each row's (a ring step): no whole-row sums
    bool sink = false;          // each row's softmax has one more term, exp(0), of a key with value 0
    bool transposed_keys = false;  // the whole-row passes copy key-side heads transposed (whole_rows.h, KeySide)
    bool bf16_products = false;  // float32 buffers of bfloat16 inputs: every GEMM multiplies its operands rounded
                                 // to bfloat16 (gemm_bf16), as the inputs' own type, with float32 sums
    // which pass reads K and V, so which of their layouts RoundedInputs keeps for brgemm:
    // the forward's K^T (S) and V (E V), the backward's K^T, V^T (dP) and K (dS K), or any
    enum class KeyReaders : int8_t { any, forward, backward } key_readers = KeyReaders::any;
    int64_t block_rows = 1, block_keys = 1, value_slice = 1;  // query rows and keys of a tile; keys per E V product
    int64_t chunks = 1;                                       // work items per (b, key/value head)
    void* data[kBufferCount] = {};
};

// C (m x n, row-major, ldc) = alpha op(A) op(B) + beta C, op(A) m x k, op(B) k x n, on the
// calling thread alone (runtime.cpp: the BLAS inside PyTorch, or ATen's mm where there is none).
void gemm(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, float alpha, const float* a, index_t lda,
          const float* b, index_t ldb, float beta, float* c, index_t ldc);
void gemm(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, double alpha, const double* a, index_t lda,
          const double* b, index_t ldb, double beta, double* c, index_t ldc);

template <typename T>
inline void gemm(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, T alpha, const T* a, index_t lda,
                 const T* b, index_t ldb, T beta, T* c, index_t ldc) {
    gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// b (cols x rows, leading dimension ldb) = a^T for a (rows x cols, lda), row-major
void transpose(index_t rows, index_t cols, const float* a, index_t lda, float* b, index_t ldb);
void transpose(index_t rows, index_t cols, const double* a, index_t lda, double* b, index_t ldb);

#include "bf16_products.h"  // bfloat16's products: RoundedInputs, gemm_bf16, RoundedTile

// Hands out work items 0, 1, ..., count - 1, each once, in that order, to whichever worker
// asks first; -1 when none is left.
class ItemSource {
   public:
    explicit ItemSource(index_t count) : count_(count) {}
    index_t next() const;

   private:
    index_t count_;
    mutable std::atomic<index_t> next_{0};
};

// worker(items) on each of up to min(count, at::get_num_threads()) workers of PyTorch's
// thread pool, each drawing items until none is left; the BLAS single-threaded inside.
void parallel_items(index_t count, const std::function<void(const ItemSource&)>& worker);

// fn(begin, end) over [0, count) split across PyTorch's thread pool (for loops whose
// iterations write apart and cost alike).
void parallel_range(index_t count, index_t grain, const std::function<void(index_t, index_t)>& fn);

// The threads of PyTorch's pool (parallel_items's workers at most)
index_t pool_threads();

struct Shape {
    index_t batch, heads, kv_heads, len_q, len_k, dim, dim_v;
};

// The dropout keep-mask generator of `dropout.py`, bit for bit: SplitMix64's output
// function on a counter made of the seed and the score's coordinates (b, h, i, j), so the
// backward regenerates the forward's mask, whatever the tiling.
constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;

using u64v = uint64_t __attribute__((vector_size(8 * sizeof(uint64_t))));
using i64v = int64_t __attribute__((vector_size(8 * sizeof(int64_t))));

// One body for one counter and eight (u64v)
template <typename U>
inline U mix64(U z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// x[0, 8) <- x value where `kept` (all ones), +0 where not (0), as whole vectors: the kept
// lanes' bits pass an AND, then one multiply
inline void keep_scale8(float* x, i64v kept, float value) {
    using i32x8 = int32_t __attribute__((vector_size(8 * sizeof(int32_t))));
    using f32x8 = float __attribute__((vector_size(8 * sizeof(float))));
    i32x8 bits;
    std::memcpy(&bits, x, sizeof bits);
    bits &= __builtin_convertvector(kept, i32x8);
    f32x8 v;
    std::memcpy(&v, &bits, sizeof v);
    v *= value;
    std::memcpy(x, &v, sizeof v);
}

inline void keep_scale8(double* x, i64v kept, double value) {
    using f64x8 = double __attribute__((vector_size(8 * sizeof(double))));
    i64v bits;
    std::memcpy(&bits, x, sizeof bits);
    bits &= kept;
    f64x8 v;
    std::memcpy(&v, &bits, sizeof v);
    v *= value;
    std::memcpy(x, &v, sizeof v);
}

struct DropoutDraw {
    bool on = false;
    uint64_t seed = 0, threshold = 0;  // keep where the draw's high 32 bits >= ceil(p 2^32)
    double value = 0;                  // 1 / (1 - p), 0 for p = 1
    index_t row_offset = 0, key_offset = 0, head_offset = 0;  // the call's within the whole

    // x[0, n) *= Z for keys c0..c0 + n of row i of head (b, h): x value where kept, else 0;
    // and y[0, n) *= the same Z, where y is given (the backward's dP and P share one draw).
    // Eight draws at a time in 64-bit vector lanes (GCC's vector extensions: AVX-512's
    // 64-bit multiplies where the CPU has them, plain integer arithmetic elsewhere, the same
    // bits either way), the last n mod 8 one by one.
    template <typename T>
    void scale_row(T* x, index_t b, index_t h, index_t i, index_t c0, index_t n, T* y = nullptr) const {
        const uint64_t key_bh =
            mix64(seed + kGamma * ((static_cast<uint64_t>(b) << 32) + static_cast<uint64_t>(h + head_offset) + 1));
        const uint64_t row_counter = key_bh + kGamma * (static_cast<uint64_t>(i + row_offset) << 32);
        // the counter of key c0 + j: row_counter + kGamma (c0 + j + 1), modulo 2^64
        const uint64_t first = row_counter + kGamma * (static_cast<uint64_t>(c0 + key_offset) + 1);
        const T keep_value = static_cast<T>(value);
        index_t j = 0;
        u64v counter = first + kGamma * u64v{0, 1, 2, 3, 4, 5, 6, 7};
        for (; j + 8 <= n; j += 8, counter += kGamma * 8) {
            const i64v kept = (mix64(counter) >> 32) >= threshold;  // all ones where kept, 0 where dropped
            keep_scale8(x + j, kept, keep_value);
            if (y) keep_scale8(y + j, kept, keep_value);
        }
        for (; j < n; ++j) {
            const bool kept = (mix64(first + kGamma * static_cast<uint64_t>(j)) >> 32) >= threshold;
            x[j] = kept ? x[j] * keep_value : T(0);
            if (y) y[j] = kept ? y[j] * keep_value : T(0);
        }
    }
};

// The causal diagonal: with `on`, row i sees keys j <= i + offset.
struct Causal {
    bool on;
    index_t offset;
    // Keys of block [c0, c0 + cols) that row `row` may see: all, or up to the diagonal.
    index_t visible(index_t row, index_t c0, index_t cols) const {
        return on ? std::clamp<index_t>(row + offset - c0 + 1, 0, cols) : cols;
    }
};

// The cache lines of bytes [p, p + bytes) fetched into the L2 cache ahead of use. On x86-64
// an asm statement: GCC deletes a C++ loop of __builtin_prefetch alone (a loop without side
// effects may be assumed to end, and then removed).
inline void fetch_lines(const void* p, index_t bytes) {
    const char* at = static_cast<const char*>(p);
    for (index_t offset = 0; offset < bytes; offset += 64) {
#if defined(__x86_64__)
        asm volatile("prefetcht1 %0" : : "m"(at[offset]));
#else
        __builtin_prefetch(at + offset, 0, 2);
#endif
    }
}

// Rows a pass fetches its mask and bias ahead of use (ScoreMask::prefetch): far enough for
// memory's latency, near enough that the lines are still in the cache (3 and 12 did no better).
constexpr index_t kFetchAhead = 6;

// A (b, h, i, j) tensor, contiguous in its own sizes, each of which is 1 or the scores' own
// (B, H, Lq, Lk): element strides, 0 along the axes it broadcasts along.
struct Broadcast4 {
    index_t sb = 0, sh = 0, si = 0, sj = 0;
    explicit Broadcast4(const int64_t* sizes = nullptr) {
        if (!sizes) return;
        const index_t sj1 = 1, si1 = sizes[3], sh1 = sizes[2] * si1, sb1 = sizes[1] * sh1;
        sb = sizes[0] == 1 ? 0 : sb1;
        sh = sizes[1] == 1 ? 0 : sh1;
        si = sizes[2] == 1 ? 0 : si1;
        sj = sizes[3] == 1 ? 0 : sj1;
    }
    index_t row(index_t b, index_t h, index_t i) const { return b * sb + h * sh + i * si; }
};

// A boolean mask (nonzero = take part), an additive float bias and per-row key bounds, each
// optional, as the torch-ops kernels' `scores_into` applies them: S = scale Q K^T + bias,
// excluded entries -inf. The bounds are what a structured mask (padding lengths, a sliding
// window, packed documents) leaves of a row: keys [lo, hi), per batch entry or shared.
template <typename T>
struct ScoreMask {
    const uint8_t* mask = nullptr;
    Broadcast4 m;
    const T* bias = nullptr;
    Broadcast4 bb;
    const int64_t* bounds = nullptr;  // (1 or B, Lq, 2)
    index_t bounds_sb = 0;            // 0 (shared) or 2 Lq
    // A mask kept per block (`mask_blocks.py`): entry (i, j) of head (b, h) is
    // tiles[index[b, h, i / R, j / K]][i % R][j % K]; tile 0 keeps none, tile 1 all (ops.cpp
    // checks both and every index before a pass runs)
    const int32_t* block_index = nullptr;
    const uint8_t* block_tiles = nullptr;
    index_t block_sb = 0, block_sh = 0, key_blocks = 0, tile_rows = 1, tile_keys = 1;

    bool any() const { return mask || bias || bounds || block_index; }

    // Row i's entries of head (b, h) at keys c0..c0 + n by the mask kept per block: f(j, kept)
    // for each run of keys within one block, kept null where that block keeps every key
    // (tile 1) and pointing at the row's entries for key c0 + j otherwise
    template <typename F>
    void block_runs(index_t b, index_t h, index_t i, index_t c0, index_t n, F&& f) const {
        const int32_t* row = block_index + b * block_sb + h * block_sh + (i / tile_rows) * key_blocks;
        const uint8_t* tile_row = block_tiles + (i % tile_rows) * tile_keys;
        for (index_t j = 0; j < n;) {
            const index_t key = c0 + j, kb = key / tile_keys, stop = std::min(n, (kb + 1) * tile_keys - c0);
            const index_t t = row[kb];
            f(j, stop, t == 1 ? nullptr : tile_row + t * tile_rows * tile_keys + (key - kb * tile_keys));
            j = stop;
        }
    }

    // The keys [lo, hi) row i of batch entry b may see by its bounds (all n without them)
    std::pair<index_t, index_t> range(index_t b, index_t i, index_t n) const {
        if (!bounds) return {0, n};
        const int64_t* row = bounds + b * bounds_sb + 2 * i;
        return {row[0], row[1]};
    }

    // Keys of [c0, c0 + n) before row i's bounds (excluded by them, -inf once applied): the
    // keys a row sweep can start past (a sliding window's tile begins with up to R - 1 of them)
    index_t before_bounds(index_t b, index_t i, index_t c0, index_t n) const {
        if (!bounds) return 0;
        return std::clamp<index_t>(range(b, i, 0).first - c0, 0, n);
    }

    // Rows i0..i0 + count's bias and mask entries of head (b, h) at keys c0..c0 + n fetched
    // into the L2 cache ahead of use: a bias of the scores' size is read once per pass, from
    // memory, in rows a tile's width long, and the hardware does not fetch ahead across rows.
    // The passes fetch the first kFetchAhead rows of a tile before its GEMMs, and row
    // i + kFetchAhead while they work on row i.
    void prefetch(index_t b, index_t h, index_t i0, index_t count, index_t c0, index_t n) const {
        // a row that all rows share (a padding mask's) once
        for (index_t i = i0; i < i0 + (bb.si ? count : 1); ++i) {
            if (bias && bb.sj == 1) fetch_lines(bias + bb.row(b, h, i) + c0, n * sizeof(T));
        }
        for (index_t i = i0; i < i0 + (m.si ? count : 1); ++i) {
            if (mask && m.sj == 1) fetch_lines(mask + m.row(b, h, i) + c0, n);
        }
    }

    // Scores s[0, n) of row i of head (b, h), keys c0..c0 + n
    void apply(T* s, index_t b, index_t h, index_t i, index_t c0, index_t n) const {
        constexpr T neg_inf = -std::numeric_limits<T>::infinity();
        if (bias) {
            const T* row = bias + bb.row(b, h, i) + c0 * bb.sj;
            if (bb.sj == 1) {  // a column per key: a loop the compiler vectorises
                for (index_t j = 0; j < n; ++j) s[j] += row[j];
            } else {
                for (index_t j = 0; j < n; ++j) s[j] += row[0];
            }
        }
        if (mask) {
            const uint8_t* row = mask + m.row(b, h, i) + c0 * m.sj;
            if (m.sj == 1) {
                for (index_t j = 0; j < n; ++j) s[j] = row[j] ? s[j] : neg_inf;
            } else if (!row[0]) {
                std::fill(s, s + n, neg_inf);
            }
        }
        if (bounds) {
            const auto [lo, hi] = range(b, i, 0);
            const index_t first = std::clamp<index_t>(lo - c0, 0, n), stop = std::clamp<index_t>(hi - c0, first, n);
            std::fill(s, s + first, neg_inf);
            std::fill(s + stop, s + n, neg_inf);
        }
        if (block_index) {
            block_runs(b, h, i, c0, n, [&](index_t j0, index_t j1, const uint8_t* kept) {
                if (!kept) return;
                for (index_t j = j0; j < j1; ++j) s[j] = kept[j - j0] ? s[j] : neg_inf;
            });
        }
    }

    // How many of keys 0..n of row i of head (b, h) take part: read within the row's bounds only
    index_t count(index_t b, index_t h, index_t i, index_t n) const {
        auto [lo, hi] = range(b, i, n);
        hi = std::min(hi, n);
        if (!mask && !bias && !block_index) return std::max<index_t>(0, hi - lo);
        const uint8_t* mrow = mask ? mask + m.row(b, h, i) : nullptr;
        const T* brow = bias ? bias + bb.row(b, h, i) : nullptr;
        const auto takes_part = [&](index_t j) {
            return (!mrow || mrow[j * m.sj]) && (!brow || brow[j * bb.sj] != -std::numeric_limits<T>::infinity());
        };
        index_t total = 0;
        if (!block_index) {
            for (index_t j = lo; j < hi; ++j) total += takes_part(j);
            return total;
        }
        if (lo >= hi) return 0;
        block_runs(b, h, i, lo, hi - lo, [&](index_t j0, index_t j1, const uint8_t* kept) {
            for (index_t j = j0; j < j1; ++j) total += (!kept || kept[j - j0]) && takes_part(lo + j);
        });
        return total;
    }
};

// The rows that see exactly one key, where a pass sets P = 1 exactly (a recomputed score can
// round apart from the forward's maximum). Only a row whose forward sum l came out exactly 1
// can be one, so only those rows' keys are counted (within their bounds): rows with l = 1 are
// rare outside one-key rows, and the scan no longer reads the whole mask or bias per pass.
template <typename T>
class SingleKeyRows {
   public:
    // inv_sum null (a pass that makes its own statistics): nothing to ask
    SingleKeyRows(const ScoreMask<T>& masks, Causal causal, const Shape& s, const T* inv_sum)
        : causal_(causal), len_k_(s.len_k), len_q_(s.len_q), inv_sum_(inv_sum) {
        if (!masks.any() || inv_sum == nullptr) return;
        single_.resize(s.batch * s.heads * s.len_q);
        parallel_range(s.batch * s.heads * s.len_q, 256, [&](index_t begin, index_t end) {
            for (index_t r = begin; r < end; ++r) {
                const index_t bh = r / s.len_q, i = r % s.len_q;
                single_[r] = inv_sum[r] == T(1) &&
                             masks.count(bh / s.heads, bh % s.heads, i, causal.visible(i, 0, s.len_k)) == 1;
            }
        });
    }
    // Whether row i of flat head bh (b H + h) sees exactly one key (and so l = 1)
    bool operator()(index_t bh, index_t i) const {
        const index_t r = bh * len_q_ + i;
        if (!single_.empty()) return single_[r] != 0;
        return inv_sum_[r] == T(1) && causal_.visible(i, 0, len_k_) == 1;
    }

   private:
    Causal causal_;
    index_t len_k_, len_q_;
    const T* inv_sum_;
    std::vector<uint8_t> single_;
};

// What the forward and the backward do with each (query block, key block) tile: the map
// `block_map.tile_map` computes once per call from the causal diagonal, the key bounds, the
// mask and the bias, (1 or B, 1 or H, query blocks, key blocks), checked against the call's
// sizes and blocks (and its values) by ops.cpp. Skipped: no score of the tile takes part
// (padding: a quarter of the keys excluded is a quarter of the work saved). Unmasked: the
// mask keeps all of it and the bias is 0 there, so neither is read (a padding mask written
// as a float mask costs what a boolean one does). Computed: the entries are masked one by
// one (ScoreMask::apply). None given: every tile computed. The passes derive nothing.
class TileMap {
   public:
    enum Kind : uint8_t { computed = 0, skipped = 1, unmasked = 2 };  // block_map's COMPUTED, SKIPPED, UNMASKED

    explicit TileMap(const AttngradCall& c)
        : kinds_(static_cast<const uint8_t*>(c.data[buf_tile_map])),
          key_blocks_((c.len_k + c.block_keys - 1) / c.block_keys) {
        const index_t query_blocks = (c.len_q + c.block_rows - 1) / c.block_rows;
        sh_ = c.tile_map_sizes[1] == 1 ? 0 : query_blocks * key_blocks_;
        sb_ = c.tile_map_sizes[0] == 1 ? 0 : c.tile_map_sizes[1] * query_blocks * key_blocks_;
    }

    // What to do with tile (qb, kb) of head (b, h)
    Kind operator()(index_t b, index_t h, index_t qb, index_t kb) const {
        return kinds_ ? static_cast<Kind>(kinds_[b * sb_ + h * sh_ + qb * key_blocks_ + kb]) : computed;
    }

   private:
    const uint8_t* kinds_;
    index_t key_blocks_, sb_ = 0, sh_ = 0;
};

// The keys each query block (of the call's block_rows) may see: the map
// `block_map.key_ranges` computes once per call from the causal diagonal and the key bounds,
// (1 or B, query blocks, 2) int64 of [key0, key0 + keys), checked by ops.cpp. None given:
// every key, for every block. The passes read their key ranges here and derive none; the
// entries within them are masked one by one (Causal::visible, ScoreMask::apply).
class KeyRanges {
   public:
    explicit KeyRanges(const AttngradCall& c)
        : ranges_(static_cast<const int64_t*>(c.data[buf_key_ranges])), len_k_(c.len_k),
          sb_(c.key_ranges_batch == 1 ? 0 : 2 * ((c.len_q + c.block_rows - 1) / c.block_rows)) {}

    // (key0, keys) of query block qb of batch entry b
    std::pair<index_t, index_t> operator()(index_t b, index_t qb) const {
        if (!ranges_) return {0, len_k_};
        const int64_t* r = ranges_ + b * sb_ + 2 * qb;
        return {r[0], r[1]};
    }

   private:
    const int64_t* ranges_;
    index_t len_k_, sb_;
};

// Score tiles the forward and the backward have computed in this process (tiles_computed
// op): the tests count the tiles the block map lets them skip.
extern std::atomic<int64_t> tiles_computed;

template <typename T>
ScoreMask<T> score_mask(const AttngradCall& c) {
    ScoreMask<T> masks;
    if (c.data[buf_mask]) {
        masks.mask = static_cast<const uint8_t*>(c.data[buf_mask]);
        masks.m = Broadcast4(c.mask_sizes);
    }
    if (c.data[buf_bias]) {
        masks.bias = static_cast<const T*>(c.data[buf_bias]);
        masks.bb = Broadcast4(c.bias_sizes);
    }
    if (c.data[buf_key_bounds]) {
        masks.bounds = static_cast<const int64_t*>(c.data[buf_key_bounds]);
        masks.bounds_sb = c.bounds_batch == 1 ? 0 : 2 * c.len_q;
    }
    if (c.data[buf_mask_blocks]) {
        masks.block_index = static_cast<const int32_t*>(c.data[buf_mask_blocks]);
        masks.block_tiles = static_cast<const uint8_t*>(c.data[buf_mask_tiles]);
        const int64_t* sizes = c.mask_blocks_sizes;
        masks.key_blocks = sizes[3];
        masks.block_sh = sizes[1] == 1 ? 0 : sizes[2] * sizes[3];
        masks.block_sb = sizes[0] == 1 ? 0 : sizes[1] * sizes[2] * sizes[3];
        masks.tile_rows = c.mask_tile_rows, masks.tile_keys = c.mask_tile_keys;
    }
    return masks;
}

// The soft cap of the scores (Gemma 2): S = c tanh(A / c) for A = scale Q K^T, before the
// bias and the masks. Its slope 1 - tanh^2 takes every derivative from S back to A; its
// curve, the slope's own derivative -2 tanh (1 - tanh^2) / c, enters the second order.
// float32 computes tanh 16 lanes at a time (tanh_cap), float64 with the C library's.
template <typename T>
struct Softcap {
    T c = 0;    // 0: no cap
    T inv = 0;  // 1 / c: a multiply where a division per score cost a tenth of the causal pass

    explicit Softcap(T cap = 0) : c(cap), inv(cap != T(0) ? T(1) / cap : T(0)) {}

    // a[0, n) <- c tanh(a / c); where given, slope and curve [0, n) at those scores
    void apply(T* a, index_t n, T* slope = nullptr, T* curve = nullptr) const {
        index_t j = 0;
        if constexpr (std::is_same_v<T, float>) {
            for (; j + kLanes <= n; j += kLanes) {
                const floatv t = tanh_cap(load(a + j) * inv);
                store(a + j, t * c);
                if (slope) store(slope + j, 1.0f - t * t);
                if (curve) store(curve + j, (t * -2.0f) * (1.0f - t * t) * inv);
            }
            if (j < n) {  // the row's last n mod 16 as one vector too (tanh(0) in the lanes past them)
                const index_t rest = n - j;
                const floatv t = tanh_cap(load_tail(a + j, rest, 0.0f) * inv);
                store_tail(a + j, rest, t * c);
                if (slope) store_tail(slope + j, rest, 1.0f - t * t);
                if (curve) store_tail(curve + j, rest, (t * -2.0f) * (1.0f - t * t) * inv);
                j = n;
            }
        }
        for (; j < n; ++j) {  // float64
            const T t = tanh_cap(a[j] * inv);
            a[j] = c * t;
            if (slope) slope[j] = T(1) - t * t;
            if (curve) curve[j] = T(-2) * t * (T(1) - t * t) * inv;
        }
    }

    // The same, and a tangent or cotangent form x[0, n) of the raw scores (A' or T_raw)
    // taken through the cap: x <- slope x, and where given curve <- curve x, the slope's own
    // change along x (the second-order passes need it)
    void apply_with_form(T* a, T* x, index_t n, T* slope, T* curve = nullptr) const {
        apply(a, n, slope, curve);
        for (index_t j = 0; j < n; ++j) {
            if (curve) curve[j] *= x[j];
            x[j] *= slope[j];
        }
    }

    // A score-shaped pair taken from S back to A: second <- slope second and, by the product
    // rule, first <- slope first + (curve x) second (dS~, dS in the backward's JVP; g_S, dS
    // in the double backward)
    static void back_to_raw(T* first, T* second, const T* slope, const T* curve, index_t n) {
        for (index_t j = 0; j < n; ++j) {
            first[j] = slope[j] * first[j] + curve[j] * second[j];
            second[j] *= slope[j];
        }
    }
};

// Where a whole-row pass keeps the cap's slope and (with `curved`) its curve: the tiles
// after its own `own` ones in its scratch, or nulls without a cap.
template <typename T>
struct CapRows {
    T *slope = nullptr, *curve = nullptr;

    static int tiles(const Softcap<T>& cap, bool curved) { return cap.c != T(0) ? 1 + curved : 0; }
    CapRows(const Softcap<T>& cap, T* scratch, index_t tile, int own, bool curved) {
        if (cap.c == T(0)) return;
        slope = scratch + own * tile;
        if (curved) curve = scratch + (own + 1) * tile;
    }
    // Row i of each, rows `keys` long
    std::pair<T*, T*> row(index_t i, index_t keys) const {
        return {slope ? slope + i * keys : nullptr, curve ? curve + i * keys : nullptr};
    }
};

// A call with its buffers typed: what every pass below takes.
template <typename T>
struct Pass {
    const AttngradCall& call;
    Shape s;
    Causal causal;
    ScoreMask<T> masks;
    DropoutDraw drop;
    T scale;
    Softcap<T> cap;
    ScoreMask<T> structure;  // masks without the mask and bias: a tile the tile map leaves unmasked
    RoundedInputs rounded;   // with bf16_products

    explicit Pass(const AttngradCall& c)
        : call(c),
          s{c.batch, c.heads, c.kv_heads, c.len_q, c.len_k, c.dim, c.dim_v},
          causal{c.causal != 0, c.causal_offset},
          masks(score_mask<T>(c)),
          drop{c.dropout != 0, c.seed, c.threshold, c.keep_value, c.dropout_row_offset, c.dropout_key_offset,
               c.dropout_head_offset},
          scale(static_cast<T>(c.scale)),
          cap(static_cast<T>(c.softcap)),
          structure(masks),
          rounded(std::is_same_v<T, float> && c.bf16_products ? RoundedInputs(c) : RoundedInputs()) {
        structure.mask = nullptr, structure.bias = nullptr;
    }

    T* operator[](AttngradBuffer b) const { return static_cast<T*>(call.data[b]); }

    // Every GEMM of a pass: in T, or with bfloat16 products for bfloat16 inputs (A from
    // `a_rounded`, where given: a RoundedTile's copy of `a`)
    void gemm(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, T alpha, const T* a, index_t lda,
              const T* b, index_t ldb, T beta, T* c, index_t ldc, const uint16_t* a_rounded = nullptr) const {
        if constexpr (std::is_same_v<T, float>) {
            if (call.bf16_products) {
                gemm_bf16(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, rounded, a_rounded);
                return;
            }
        }
        attngrad_tiles::gemm<T>(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    }

    // The one row routine of every pass: the scores s[0, n) of row i of head (b, h), keys
    // c0..c0 + n, from the raw A = scale Q K^T: the soft cap (its slope and curve where
    // asked, and a tangent or cotangent `form` of the raw scores taken through it), then the
    // bias, the mask and the key bounds (-inf where excluded); and the form's own bias term
    // (tbias, gbias), where given.
    void score_row(T* s, index_t b, index_t h, index_t i, index_t c0, index_t n, T* slope = nullptr,
                   T* curve = nullptr, T* form = nullptr, const ScoreMask<T>* form_bias = nullptr) const {
        score_row(masks, s, b, h, i, c0, n, slope, curve, form, form_bias);
    }
    // The same with the tile's own masks: `masks`, or `structure` on a tile the map leaves unmasked
    void score_row(const ScoreMask<T>& tile_masks, T* s, index_t b, index_t h, index_t i, index_t c0, index_t n,
                   T* slope = nullptr, T* curve = nullptr, T* form = nullptr,
                   const ScoreMask<T>* form_bias = nullptr) const {
        if (cap.c != T(0)) {
            if (form) {
                cap.apply_with_form(s, form, n, slope, curve);
            } else {
                cap.apply(s, n, slope, curve);
            }
        }
        if (tile_masks.any()) tile_masks.apply(s, b, h, i, c0, n);
        if (form && form_bias && form_bias->any()) form_bias->apply(form, b, h, i, c0, n);
    }
};

// Keys of the E V product's slice that starts at key j0 of a tile of `cols` keys: `slice`
// keys (a float32 sum's rounding grows with its length, and blocked sums keep each part
// short), or all the rest where less than half a slice would follow: a window's 287-key
// tile as 128 + 159 keys, not 128 + 128 + 31 (its forward 1.7% faster).
inline index_t value_slice_keys(index_t j0, index_t cols, index_t slice) {
    const index_t n = std::min(slice, cols - j0);
    return cols - j0 - n < slice / 2 ? cols - j0 : n;
}

// Query blocks per work item of the forward on a narrow band (the call's transposed_keys):
// a run of n blocks shares one transposed copy of the keys its blocks see (BandKeys), about
// n R + band keys, against R + band for each block alone. The longest run, kBandRunMax,
// halved down to kBandRunMin while the pool's threads would draw fewer than
// kBandItemsPerThread runs each (the load balance of a few heads). Causal window 256 at
// L=4096, H=8, 32-row blocks: 64 blocks ran the forward 3.7% faster than 16, 128 no faster.
constexpr index_t kBandRunMax = 64, kBandRunMin = 16, kBandItemsPerThread = 4;
inline index_t band_run_blocks(index_t query_blocks, index_t heads) {
    index_t run = kBandRunMax;
    while (run > kBandRunMin && (query_blocks + run - 1) / run * heads < kBandItemsPerThread * pool_threads()) {
        run /= 2;
    }
    return run;
}

// One operand of the score-sized products S = scale Q K^T and dP = dO V^T: the key-side head
// (keys x width) as it is, or, with the call's transposed_keys (a narrow band), a copy of
// its keys [lo, hi) transposed, made once for the tiles of a run of query blocks (forward)
// or of a key block (backward). MKL's NT product repacks K at every call: on a band's
// 32 x 287 x 64 tiles it ran at 118 GFLOP/s, against 167 for the NN product from a copy
// (one core, Intel Xeon). Forward and backward take S from the same NN product (of the same
// sizes), so the backward still recomputes the forward's scores bit for bit: MKL's results
// did not depend on the copy's leading dimension or offset (3000 random shapes, depth to 256).
template <typename T>
class BandKeys {
   public:
    explicit BandKeys(bool on) : on_(on) {}
    bool on() const { return on_; }

    // Copies keys [lo, hi) of `head` (keys x width) transposed (width x (hi - lo))
    void copy(const T* head, index_t width, index_t lo, index_t hi) {
        lo_ = lo;
        // rows of the copy a whole number of cache lines apart, and not a multiple of 4 KiB
        // apart: a key block's 2048 keys would put the product's 64 rows in one L1 set
        constexpr index_t line = 64 / sizeof(T), page = 4096 / sizeof(T);
        ld_ = (hi - lo + line - 1) / line * line;
        if (ld_ % page == 0) ld_ += line;
        copy_.resize(width * ld_);
        transpose(hi - lo, width, head + lo * width, width, copy_.data(), ld_);
    }

    // out (rows x cols) = alpha a K^T over keys [c0, c0 + cols) of `head`, for a (rows x
    // width): from the copy when on (its keys must hold those), else from the head
    void scores(const Pass<T>& pass, index_t rows, index_t cols, index_t width, T alpha, const T* a, const T* head,
                index_t c0, T* out) const {
        if (on_) {
            pass.gemm(false, false, rows, cols, width, alpha, a, width, copy_.data() + (c0 - lo_), ld_, T(0), out,
                      cols);
        } else {
            pass.gemm(false, true, rows, cols, width, alpha, a, width, head + c0 * width, width, T(0), out, cols);
        }
    }

   private:
    bool on_;
    std::vector<T> copy_;
    index_t lo_ = 0, ld_ = 0;
};

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

// The passes (passes.cpp, passes_higher.cpp), for float and double.
template <typename T> void forward(const Pass<T>& pass);
template <typename T> void backward(const Pass<T>& pass);
template <typename T> void double_backward(const Pass<T>& pass);
template <typename T> void jvp(const Pass<T>& pass);
template <typename T> void backward_jvp(const Pass<T>& pass);
template <typename T> void backward_jvp_given_sums(const Pass<T>& pass);

}  // namespace attngrad_tiles
