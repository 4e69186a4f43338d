// The call of a pass and what every pass works with: the buffers a call may name and the
// call's sizes, options and pointers (AttngradCall, filled by checked_call.cpp), the GEMM
// and transpose on the calling thread, the work items on PyTorch's thread pool, the dropout
// draw and the causal diagonal. The passes' overview is in tiles.h.
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

}  // namespace attngrad_tiles
