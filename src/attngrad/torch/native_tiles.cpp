// attngrad's compiled tiles: every pass of exact attention (forward, backward, JVP, the
// backward's JVP, double backward) with the causal diagonal, a boolean mask, a float bias
// and its gradient, per-row key bounds (structured masks: padding lengths, sliding windows,
// packed documents), a soft cap, dropout and GQA, in the manner of FlashAttention-2 (Dao,
// 2023) on per-thread tiles small enough to stay in a core's cache; and the dropout
// keep-masks of the counter-based generator in `dropout.py`.
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
// jvp, backward_jvp, double_backward: see each below; they take query blocks of whole rows.
// A work item owns its dK and dV rows, and its own copy of dQ when the keys are split into
// chunks (the double backward and the backward's JVP: their dQ-shaped rows, and their own
// dK, dV-shaped sums when the query blocks are split; a bias gradient: the batch entries
// and heads sharing a broadcast bias form one item (KvItems), and chunks adding into the
// same entries own parts): nothing is written by two threads, and the parts are added in a
// fixed order, so the bits do not depend on the schedule.
// The causal mask is a diagonal: row i sees keys j <= i + c (c = 0 top-left, Lk - Lq
// bottom-right). Key bounds leave row i of batch entry b the keys [lo, hi): tiles outside
// every row's bounds are skipped, and the whole-row passes hold only the keys between them. A row that sees no key has output 0 and sends back 0; a row that sees one
// key has P = 1 there exactly and dS = 0 (a recomputed score can round apart from the
// forward's maximum).
//
// Every entry point takes one AttngradCall (sizes, options, named buffers), checks its
// sizes and the element count of every buffer against them, and returns nonzero
// (attngrad_error() says why) before touching memory otherwise.
//
// The GEMMs are the BLAS's Fortran sgemm/dgemm, handed over by pointer at load time (the
// MKL inside PyTorch), called single-threaded inside the OpenMP work loop.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>
#include <cstddef>
#include <initializer_list>

#include <omp.h>

// One call of a pass, as `native.AttentionCall` describes it on the Python side (which
// checks its own layout against attngrad_call_layout() when it loads the library). Every
// entry point takes one; a buffer the pass does not use is null.
#define ATTNGRAD_BUFFERS(X) \
    X(q) X(k) X(v) X(mask) X(bias) X(out) X(row_max) X(inv_sum) X(dout) X(delta) X(dq_parts) X(dk) X(dv) \
    X(dbias_parts) X(gq) X(gk) X(gv) X(g_dout) X(g_q) X(gk_parts) X(gv_parts) X(tq) X(tk) X(tv) X(tbias) X(tout) \
    X(tdout) X(tdq) X(tdk_parts) X(tdv_parts) X(tdbias_parts) X(gbias) X(g_bias_parts) X(key_bounds)

enum AttngradBuffer : int {
#define ATTNGRAD_ENUM(name) buf_##name,
    ATTNGRAD_BUFFERS(ATTNGRAD_ENUM)
#undef ATTNGRAD_ENUM
    kBufferCount
};

struct AttngradCall {
    int64_t batch, heads, kv_heads, len_q, len_k, dim, dim_v;
    int64_t mask_sizes[4], bias_sizes[4];  // (b, h, i, j), each 1 or the scores' own (B, H, Lq, Lk)
    int64_t double_precision;              // the element type of every float buffer
    int64_t causal, causal_offset;         // with causal, row i sees keys j <= i + causal_offset
    int64_t bounds_batch;                  // key_bounds (bounds_batch, Lq, 2): row i of batch b sees keys
                                           // [lo, hi) only; bounds_batch 1 (shared) or B
    double scale;
    double softcap;  // c > 0: scores c tanh(scale q.k / c) + bias; 0: none
    int64_t dropout;
    uint64_t seed, threshold;  // keep where the draw's high 32 bits >= threshold = ceil(p 2^32)
    double keep_value;         // 1 / (1 - p)
    int64_t dropout_row_offset, dropout_key_offset, dropout_head_offset;  // where this call's rows,
                                         // keys and heads sit in the whole: the draws' coordinates
    int64_t partial_rows;  // 1: the keys are a part of each row's (a ring step): no whole-row sums
    int64_t sink;          // 1: each row's softmax has one more term, exp(0), of a key with value 0
    int64_t threads;
    int64_t block_rows, block_keys, value_slice;  // query rows and keys of a tile; keys per E V product
    int64_t chunks;                               // work items per (b, key/value head)
    void* data[kBufferCount];
    int64_t numel[kBufferCount];  // element counts, 0 for a null buffer
};

#define ATTNGRAD_FIELDS(X)                                                                                          \
    X(batch) X(heads) X(kv_heads) X(len_q) X(len_k) X(dim) X(dim_v) X(mask_sizes) X(bias_sizes) X(double_precision) \
    X(causal) X(causal_offset) X(bounds_batch) X(scale) X(softcap) X(dropout) X(seed) X(threshold) X(keep_value) \
    X(dropout_row_offset) X(dropout_key_offset) X(dropout_head_offset) X(partial_rows) X(sink) X(threads) X(block_rows)   \
    X(block_keys) X(value_slice) X(chunks) X(data) X(numel)

namespace {

using index_t = int64_t;

using sgemm_fn = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                          const int*, const float*, const int*, const float*, float*, const int*);
using dgemm_fn = void (*)(const char*, const char*, const int*, const int*, const int*, const double*, const double*,
                          const int*, const double*, const int*, const double*, double*, const int*);
using local_threads_fn = int (*)(int);

sgemm_fn blas_sgemm = nullptr;
dgemm_fn blas_dgemm = nullptr;
local_threads_fn blas_local_threads = nullptr;  // MKL_Set_Num_Threads_Local, if there is one

void fortran_gemm(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
                  const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                  const int* ldc) {
    blas_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void fortran_gemm(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
                  const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
                  const int* ldc) {
    blas_dgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// C (m x n, row-major, ldc) = alpha op(A) op(B) + beta C, op(A) m x k, op(B) k x n.
// A row-major matrix is its transpose in column-major, so the Fortran call computes
// C^T = op(B)^T op(A)^T with the operands swapped.
template <typename T>
void gemm(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, T alpha, const T* a, index_t lda, const T* b,
          index_t ldb, T beta, T* c, index_t ldc) {
    const int mi = static_cast<int>(n), ni = static_cast<int>(m), ki = static_cast<int>(k);
    const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
    fortran_gemm(trans_b ? "T" : "N", trans_a ? "T" : "N", &mi, &ni, &ki, &alpha, b, &la, a, &lb, &beta, c, &lc);
}

// exp for x <= 0 (a score minus its row maximum): exp(x) = 2^n exp(r), n = round(x / ln 2),
// |r| <= ln(2) / 2, and exp(r) by its degree-7 Taylor polynomial (truncation 5e-9 relative,
// below float32's 6e-8 rounding). Below -87.3 (2^-126, where float32 turns subnormal), and
// at -inf, 0. Written once over a generic element type so that the same lines serve one
// float and a 16-float vector (GCC's vector extensions: the loops below are explicit SIMD,
// where the auto-vectoriser gave up on the reductions).
template <typename F, typename I>
inline F exp_score_any(F x) {
    const F lowest = F{} - 87.3f;
    const F highest = F{} + 88.0f;  // x is <= 0 up to rounding; the clamp keeps 2^n finite
    const F xc = x < lowest ? lowest : (x > highest ? highest : x);
    const F n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23)
    const F r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 in two parts (Cody and Waite)
    F p = F{} + 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    I bits;
    if constexpr (sizeof(F) == sizeof(float)) {
        bits = (static_cast<I>(n) + 127) << 23;  // 2^n, n in [-126, 127]
    } else {
        bits = (__builtin_convertvector(n, I) + 127) << 23;
    }
    F two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    const F zero{};
    return x < lowest ? zero : p * two_n;
}

constexpr int kLanes = 16;
using floatv = float __attribute__((vector_size(kLanes * sizeof(float))));
using intv = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline float exp_score(float x) { return exp_score_any<float, int32_t>(x); }
inline floatv exp_score(floatv x) { return exp_score_any<floatv, intv>(x); }
// float64 is the exactness path: the C library's exp, within an ulp
inline double exp_score(double x) { return std::exp(x); }

inline floatv load(const float* p) {
    floatv v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline void store(float* p, floatv v) { std::memcpy(p, &v, sizeof v); }

// tanh in float32, for the soft cap: below |x| = 0.625 the odd minimax polynomial of Cephes'
// tanhf (x + x^3 p(x^2), about 2 ulp), above it (1 - e) / (1 + e) with e = exp(-2 |x|) from
// exp_score (e <= 0.29 there: no cancellation), signed. One body for a float and a 16-float
// vector, like exp_score_any; float64 keeps the C library's tanh.
template <typename F, typename I>
inline F tanh_any(F x) {
    const F zero{}, one = F{} + 1.0f, cut = F{} + 0.625f;
    const F ax = x < zero ? -x : x;
    const F z = x * x;
    F p = F{} - 5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const F e = exp_score_any<F, I>(ax * -2.0f);
    const F large = (one - e) / (one + e);
    return ax < cut ? p * z * x + x : (x < zero ? -large : large);
}

inline float tanh_cap(float x) { return tanh_any<float, int32_t>(x); }
inline floatv tanh_cap(floatv x) { return tanh_any<floatv, intv>(x); }
inline double tanh_cap(double x) { return std::tanh(x); }

// Each row operation below has a loop over elements, which float32 also runs on a row's
// last n mod 16 entries, and a float32 version over 16-float vectors.

// max_j x_j (-inf for n = 0)
template <typename T>
T max_of_each(const T* x, index_t n) {
    T top = -std::numeric_limits<T>::infinity();
    for (index_t j = 0; j < n; ++j) top = x[j] > top ? x[j] : top;
    return top;
}

template <typename T>
T max_of(const T* x, index_t n) {
    return max_of_each(x, n);
}

template <>
float max_of(const float* x, index_t n) {
    floatv lanes = floatv{} - std::numeric_limits<float>::infinity();
    index_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
        const floatv v = load(x + j);
        lanes = v > lanes ? v : lanes;
    }
    float top = max_of_each(x + j, n - j);
    for (int t = 0; t < kLanes; ++t) top = lanes[t] > top ? lanes[t] : top;
    return top;
}

// x_j <- exp(x_j - shift); returns the sum of the new x_j
template <typename T>
T exp_and_sum_each(T* x, index_t n, T shift) {
    T sum = 0;
    for (index_t j = 0; j < n; ++j) {
        x[j] = exp_score(x[j] - shift);
        sum += x[j];
    }
    return sum;
}

template <typename T>
T exp_and_sum(T* x, index_t n, T shift) {
    return exp_and_sum_each(x, n, shift);
}

template <>
float exp_and_sum(float* x, index_t n, float shift) {
    floatv lanes{};
    index_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
        const floatv e = exp_score(load(x + j) - shift);
        store(x + j, e);
        lanes += e;
    }
    float sum = exp_and_sum_each(x + j, n - j, shift);
    for (int t = 0; t < kLanes; ++t) sum += lanes[t];
    return sum;
}

// forward: P = exp(S - m) / l  ->  dS = P (dP - D); p holds S and becomes P, ds holds dP
// and becomes dS
template <typename T>
void probs_and_score_grad_each(T* p, T* ds, index_t n, T m, T inv, T d) {
    for (index_t j = 0; j < n; ++j) {
        const T pj = exp_score(p[j] - m) * inv;
        p[j] = pj;
        ds[j] = pj * (ds[j] - d);
    }
}

template <typename T>
void probs_and_score_grad(T* p, T* ds, index_t n, T m, T inv, T d) {
    probs_and_score_grad_each(p, ds, n, m, inv, d);
}

template <>
void probs_and_score_grad(float* p, float* ds, index_t n, float m, float inv, float d) {
    index_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
        const floatv pj = exp_score(load(p + j) - m) * inv;
        store(p + j, pj);
        store(ds + j, pj * (load(ds + j) - d));
    }
    probs_and_score_grad_each(p + j, ds + j, n - j, m, inv, d);
}

// The double backward's row work, in three sweeps over one row (in the manner of the row
// operations above: a loop for any type, 16-float vectors for float32).
// p <- P = exp(S - m) / l; returns t = rowsum(P * T)
template <typename T>
T probs_and_dot_each(T* p, const T* t, index_t n, T m, T inv) {
    T sum = 0;
    for (index_t j = 0; j < n; ++j) {
        p[j] = exp_score(p[j] - m) * inv;
        sum += p[j] * t[j];
    }
    return sum;
}

template <typename T>
T probs_and_dot(T* p, const T* t, index_t n, T m, T inv) {
    return probs_and_dot_each(p, t, n, m, inv);
}

template <>
float probs_and_dot(float* p, const float* t, index_t n, float m, float inv) {
    floatv lanes{};
    index_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
        const floatv pj = exp_score(load(p + j) - m) * inv;
        store(p + j, pj);
        lanes += pj * load(t + j);
    }
    float sum = probs_and_dot_each(p + j, t + j, n - j, m, inv);
    for (int i = 0; i < kLanes; ++i) sum += lanes[i];
    return sum;
}

// x <- g_P = (dP - D) (T - t) + X,  t <- g_dP = P (T - t),  dp <- dS = P (dP - D);
// returns u = rowsum(P * g_P)
template <typename T>
T second_order_terms_each(const T* p, T* t, T* dp, T* x, index_t n, T t_sum, T d_row) {
    T sum = 0;
    for (index_t j = 0; j < n; ++j) {
        const T t_centred = t[j] - t_sum, dp_centred = dp[j] - d_row;
        const T g_p = dp_centred * t_centred + x[j];
        sum += p[j] * g_p;
        x[j] = g_p;
        t[j] = p[j] * t_centred;
        dp[j] = p[j] * dp_centred;
    }
    return sum;
}

template <typename T>
T second_order_terms(const T* p, T* t, T* dp, T* x, index_t n, T t_sum, T d_row) {
    return second_order_terms_each(p, t, dp, x, n, t_sum, d_row);
}

template <>
float second_order_terms(const float* p, float* t, float* dp, float* x, index_t n, float t_sum, float d_row) {
    floatv lanes{};
    index_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
        const floatv pj = load(p + j), t_centred = load(t + j) - t_sum, dp_centred = load(dp + j) - d_row;
        const floatv g_p = dp_centred * t_centred + load(x + j);
        lanes += pj * g_p;
        store(x + j, g_p);
        store(t + j, pj * t_centred);
        store(dp + j, pj * dp_centred);
    }
    float sum = second_order_terms_each(p + j, t + j, dp + j, x + j, n - j, t_sum, d_row);
    for (int i = 0; i < kLanes; ++i) sum += lanes[i];
    return sum;
}

// x <- P (x - u)
template <typename T>
void centre_and_scale_each(const T* p, T* x, index_t n, T u) {
    for (index_t j = 0; j < n; ++j) x[j] = p[j] * (x[j] - u);
}

template <typename T>
void centre_and_scale(const T* p, T* x, index_t n, T u) {
    centre_and_scale_each(p, x, n, u);
}

template <>
void centre_and_scale(const float* p, float* x, index_t n, float u) {
    index_t j = 0;
    for (; j + kLanes <= n; j += kLanes) store(x + j, load(p + j) * (load(x + j) - u));
    centre_and_scale_each(p + j, x + j, n - j, u);
}

// The backward's JVP row work (after P, P' = P (T - t), dP~ = dP Z, dP~' = dP' Z are in
// place): returns D' = rowsum(P' * dP~ + P * dP~'), in one sweep over a row
template <typename T>
T tangent_delta_each(const T* p, const T* p_t, const T* dp, const T* dp_t, index_t n) {
    T sum = 0;
    for (index_t j = 0; j < n; ++j) sum += p_t[j] * dp[j] + p[j] * dp_t[j];
    return sum;
}

template <typename T>
T tangent_delta(const T* p, const T* p_t, const T* dp, const T* dp_t, index_t n) {
    return tangent_delta_each(p, p_t, dp, dp_t, n);
}

template <>
float tangent_delta(const float* p, const float* p_t, const float* dp, const float* dp_t, index_t n) {
    floatv lanes{};
    index_t j = 0;
    for (; j + kLanes <= n; j += kLanes) lanes += load(p_t + j) * load(dp + j) + load(p + j) * load(dp_t + j);
    float sum = tangent_delta_each(p + j, p_t + j, dp + j, dp_t + j, n - j);
    for (int i = 0; i < kLanes; ++i) sum += lanes[i];
    return sum;
}

// dp_t <- dS' = P' (dP~ - D) + P (dP~' - D'),  dp <- dS = P (dP~ - D)
template <typename T>
void score_grad_tangents_each(const T* p, const T* p_t, T* dp, T* dp_t, index_t n, T d, T d_t) {
    for (index_t j = 0; j < n; ++j) {
        const T centred = dp[j] - d;
        dp_t[j] = p_t[j] * centred + p[j] * (dp_t[j] - d_t);
        dp[j] = p[j] * centred;
    }
}

template <typename T>
void score_grad_tangents(const T* p, const T* p_t, T* dp, T* dp_t, index_t n, T d, T d_t) {
    score_grad_tangents_each(p, p_t, dp, dp_t, n, d, d_t);
}

template <>
void score_grad_tangents(const float* p, const float* p_t, float* dp, float* dp_t, index_t n, float d, float d_t) {
    index_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
        const floatv pj = load(p + j), centred = load(dp + j) - d;
        store(dp_t + j, load(p_t + j) * centred + pj * (load(dp_t + j) - d_t));
        store(dp + j, pj * centred);
    }
    score_grad_tangents_each(p + j, p_t + j, dp + j, dp_t + j, n - j, d, d_t);
}

// While it lives, the BLAS runs on the calling thread alone: the tiles are the parallel axis.
class SingleThreadedBlas {
   public:
    SingleThreadedBlas() : previous_(blas_local_threads ? blas_local_threads(1) : 0) {}
    ~SingleThreadedBlas() {
        if (blas_local_threads) blas_local_threads(previous_);
    }

   private:
    int previous_;
};

struct Shape {
    index_t batch, heads, kv_heads, len_q, len_k, dim, dim_v;
};

// The dropout keep-mask generator of `dropout.py`, bit for bit: SplitMix64's output
// function on a counter made of the seed and the score's coordinates (b, h, i, j), so the
// backward regenerates the forward's mask, whatever the tiling.
constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;

inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

struct DropoutDraw {
    bool on = false;
    uint64_t seed = 0, threshold = 0;  // keep where the draw's high 32 bits >= ceil(p 2^32)
    double value = 0;                  // 1 / (1 - p), 0 for p = 1
    index_t row_offset = 0, key_offset = 0, head_offset = 0;  // the call's within the whole

    // x[0, n) *= Z for keys c0..c0 + n of row i of head (b, h): x value where kept, else 0
    template <typename T>
    void scale_row(T* x, index_t b, index_t h, index_t i, index_t c0, index_t n) const {
        const uint64_t key_bh =
            mix64(seed + kGamma * ((static_cast<uint64_t>(b) << 32) + static_cast<uint64_t>(h + head_offset) + 1));
        const uint64_t row_counter = key_bh + kGamma * (static_cast<uint64_t>(i + row_offset) << 32);
        c0 += key_offset;
        const T keep_value = static_cast<T>(value);
        for (index_t j = 0; j < n; ++j) {
            const uint64_t z = mix64(row_counter + kGamma * (static_cast<uint64_t>(c0 + j) + 1));
            x[j] = (z >> 32) >= threshold ? x[j] * keep_value : T(0);
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
    // How many keys (a prefix of len_k) rows ..stop - 1 may see.
    index_t keys_before(index_t stop, index_t len_k) const {
        return on ? std::clamp<index_t>(stop + offset, 0, len_k) : len_k;
    }
};

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

    bool any() const { return mask || bias || bounds; }

    // The keys [lo, hi) row i of batch entry b may see by its bounds (all n without them)
    std::pair<index_t, index_t> range(index_t b, index_t i, index_t n) const {
        if (!bounds) return {0, n};
        const int64_t* row = bounds + b * bounds_sb + 2 * i;
        return {row[0], row[1]};
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
    }

    // Whether key j of row i of head (b, h) takes part (a bias of -inf excludes it too)
    bool takes_part(index_t b, index_t h, index_t i, index_t j) const {
        const auto [lo, hi] = range(b, i, j + 1);
        return j >= lo && j < hi && (!mask || mask[m.row(b, h, i) + j * m.sj]) &&
               (!bias || bias[bb.row(b, h, i) + j * bb.sj] != -std::numeric_limits<T>::infinity());
    }

    // How many of keys 0..n of row i of head (b, h) take part: read within the row's bounds only
    index_t count(index_t b, index_t h, index_t i, index_t n) const {
        auto [lo, hi] = range(b, i, n);
        hi = std::min(hi, n);
        if (!mask && !bias) return std::max<index_t>(0, hi - lo);
        const uint8_t* mrow = mask ? mask + m.row(b, h, i) : nullptr;
        const T* brow = bias ? bias + bb.row(b, h, i) : nullptr;
        index_t total = 0;
        for (index_t j = lo; j < hi; ++j) {
            total += (!mrow || mrow[j * m.sj]) && (!brow || brow[j * bb.sj] != -std::numeric_limits<T>::infinity());
        }
        return total;
    }
};

// Keys each row (b, h, i) may see, for telling the rows that see exactly one: the causal
// diagonal alone gives it directly; with a mask or bias, a pass over them counts (B H Lq
// counts, O(B H Lq Lk) reads of the mask, once per backward pass).
template <typename T>
class RowKeys {
   public:
    RowKeys(const ScoreMask<T>& masks, Causal causal, const Shape& s, int threads) : causal_(causal), len_k_(s.len_k),
                                                                                   len_q_(s.len_q) {
        if (!masks.any()) return;
        counts_.resize(s.batch * s.heads * s.len_q);
#pragma omp parallel for num_threads(threads) schedule(static)
        for (index_t r = 0; r < s.batch * s.heads * s.len_q; ++r) {
            const index_t bh = r / s.len_q, i = r % s.len_q;
            counts_[r] = masks.count(bh / s.heads, bh % s.heads, i, causal.visible(i, 0, s.len_k));
        }
    }
    // Keys row i of flat head bh (b H + h) may see
    index_t operator()(index_t bh, index_t i) const {
        return counts_.empty() ? causal_.visible(i, 0, len_k_) : counts_[bh * len_q_ + i];
    }

   private:
    Causal causal_;
    index_t len_k_, len_q_;
    std::vector<index_t> counts_;
};

// Which (query block, key block) tiles a mask or bias excludes entirely, so that the passes
// skip them (padding: a quarter of the keys excluded is a quarter of the work saved). Kept
// per (b, h) only along the axes the mask or bias varies on; a scan that stops at the first
// key that takes part, so it reads a whole tile only where the tile is excluded.
template <typename T>
class BlockSkips {
   public:
    BlockSkips(const ScoreMask<T>& masks, const Shape& s, index_t block_rows, index_t block_keys, int threads)
        : query_blocks_((s.len_q + block_rows - 1) / block_rows), key_blocks_((s.len_k + block_keys - 1) / block_keys) {
        if (!masks.any()) return;
        per_b_ = (masks.mask && masks.m.sb) || (masks.bias && masks.bb.sb) || masks.bounds_sb;
        heads_ = (masks.mask && masks.m.sh) || (masks.bias && masks.bb.sh) ? s.heads : 1;
        const bool dense = masks.mask || masks.bias;
        const index_t tiles = (per_b_ ? s.batch : 1) * heads_ * query_blocks_ * key_blocks_;
        skip_.assign(tiles, 0);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (index_t tile = 0; tile < tiles; ++tile) {
            const index_t kb = tile % key_blocks_, qb = tile / key_blocks_ % query_blocks_;
            const index_t bh = tile / key_blocks_ / query_blocks_, b = bh / heads_, h = bh % heads_;
            const index_t r1 = std::min(s.len_q, (qb + 1) * block_rows), c1 = std::min(s.len_k, (kb + 1) * block_keys);
            bool excluded = true;
            for (index_t i = qb * block_rows; i < r1 && excluded; ++i) {
                // only the keys within the row's bounds can take part: a band's tile costs its rows
                const auto [lo, hi] = masks.range(b, i, s.len_k);
                const index_t j0 = std::max(kb * block_keys, lo), j1 = std::min(c1, hi);
                if (!dense) excluded = j0 >= j1;
                for (index_t j = j0; dense && j < j1 && excluded; ++j) excluded = !masks.takes_part(b, h, i, j);
            }
            skip_[tile] = excluded;
        }
    }

    // Whether tile (qb, kb) of head (b, h) is excluded entirely
    bool operator()(index_t b, index_t h, index_t qb, index_t kb) const {
        if (skip_.empty()) return false;
        const index_t bh = (per_b_ ? b : 0) * heads_ + (heads_ > 1 ? h : 0);
        return skip_[(bh * query_blocks_ + qb) * key_blocks_ + kb];
    }

   private:
    index_t query_blocks_, key_blocks_, heads_ = 1;
    bool per_b_ = false;
    std::vector<uint8_t> skip_;
};

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
    return masks;
}

// The soft cap of the scores (Gemma 2): S = c tanh(A / c) for A = scale Q K^T, before the
// bias and the masks. Its slope 1 - tanh^2 takes every derivative from S back to A; its
// curve, the slope's own derivative -2 tanh (1 - tanh^2) / c, enters the second order.
// float32 computes tanh 16 lanes at a time (tanh_cap), float64 with the C library's.
template <typename T>
struct Softcap {
    T c = 0;  // 0: no cap

    // a[0, n) <- c tanh(a / c); where given, slope and curve [0, n) at those scores
    void apply(T* a, index_t n, T* slope = nullptr, T* curve = nullptr) const {
        index_t j = 0;
        if constexpr (std::is_same_v<T, float>) {
            for (; j + kLanes <= n; j += kLanes) {
                const floatv t = tanh_cap(load(a + j) / c);
                store(a + j, t * c);
                if (slope) store(slope + j, 1.0f - t * t);
                if (curve) store(curve + j, (t * -2.0f) * (1.0f - t * t) / c);
            }
        }
        for (; j < n; ++j) {
            const T t = tanh_cap(a[j] / c);
            a[j] = c * t;
            if (slope) slope[j] = T(1) - t * t;
            if (curve) curve[j] = T(-2) * t * (T(1) - t * t) / c;
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
    int threads;

    explicit Pass(const AttngradCall& c)
        : call(c),
          s{c.batch, c.heads, c.kv_heads, c.len_q, c.len_k, c.dim, c.dim_v},
          causal{c.causal != 0, c.causal_offset},
          masks(score_mask<T>(c)),
          drop{c.dropout != 0, c.seed, c.threshold, c.keep_value, c.dropout_row_offset, c.dropout_key_offset,
               c.dropout_head_offset},
          scale(static_cast<T>(c.scale)),
          cap{static_cast<T>(c.softcap)},
          threads(static_cast<int>(c.threads)) {}

    T* operator[](AttngradBuffer b) const { return static_cast<T*>(call.data[b]); }
};

// The bias gradient: dS summed over the axes the bias broadcasts along. The batch entries
// and key/value heads a broadcast bias shares are visited by one work item (KvItems), in
// order; chunks of one (b, key/value head) would still add into the same entries where the
// bias broadcasts along the chunked axis (`chunked_axis`: 3, keys, in the backward; 2,
// query rows, in the backward's JVP), so there each chunk owns a part, and the caller adds
// the parts in order. No entry is written by two threads, and no atomics.
inline int64_t bias_grad_parts(const AttngradCall& c, int chunked_axis) {
    return c.bias_sizes[chunked_axis] == 1 ? c.chunks : 1;
}

template <typename T>
class BiasGradient {
   public:
    BiasGradient(const Pass<T>& p, AttngradBuffer parts, int chunked_axis)
        : parts_(p[parts]), bb_(p.call.bias_sizes),
          part_numel_(p.call.bias_sizes[0] * p.call.bias_sizes[1] * p.call.bias_sizes[2] * p.call.bias_sizes[3]),
          chunks_(bias_grad_parts(p.call, chunked_axis)) {}

    // The part that chunk `chunk` adds into, or null without a bias gradient
    T* part(index_t chunk) const { return parts_ ? parts_ + (chunks_ > 1 ? chunk : 0) * part_numel_ : nullptr; }

    // Which of the batch and key/value head axes work items must share (KvItems): those the
    // bias broadcasts along, when there is a gradient
    bool shares_batch(const Shape& s) const { return parts_ && bb_.sb == 0 && s.batch > 1; }
    bool shares_kv_heads(const Shape& s) const { return parts_ && bb_.sh == 0 && s.kv_heads > 1; }

    // part += dS for keys c0..c0 + n of row i of head (b, h)
    void add_row(T* part, const T* ds, index_t b, index_t h, index_t i, index_t c0, index_t n) const {
        T* row = part + bb_.row(b, h, i);
        if (bb_.sj) {
            row += c0;
            for (index_t j = 0; j < n; ++j) row[j] += ds[j];
        } else {
            T sum = 0;
            for (index_t j = 0; j < n; ++j) sum += ds[j];
            row[0] += sum;
        }
    }

   private:
    T* parts_;
    Broadcast4 bb_;
    index_t part_numel_, chunks_;
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

// out (rows x keys) = alpha (a1 b1^T + a2 b2^T), each factor `width` wide and row-major; a
// pair with a null factor is left out, and with neither out is 0. The tangents' and
// cotangents' score-sized products: scale (tQ K^T + Q tK^T), dO tV^T + tdO V^T, ...
template <typename T>
void products_nt(index_t rows, index_t keys, index_t width, T alpha, const T* a1, const T* b1, const T* a2,
                 const T* b2, T* out) {
    const bool first = a1 && b1, second = a2 && b2;
    if (first) gemm<T>(false, true, rows, keys, width, alpha, a1, width, b1, width, T(0), out, keys);
    if (second) gemm<T>(false, true, rows, keys, width, alpha, a2, width, b2, width, T(first ? 1 : 0), out, keys);
    if (!first && !second) std::fill(out, out + rows * keys, T(0));
}

// A row whose one key takes part: P = 1 there and 0 elsewhere, exactly (a recomputed score
// can round apart from the forward's maximum); returns rowsum(P * t) = t at that key.
template <typename T>
T single_key_probs(T* p, const T* t, index_t n) {
    T sum = 0;
    for (index_t j = 0; j < n; ++j) {
        p[j] = p[j] > T(0) ? T(1) : T(0);
        sum += p[j] * t[j];
    }
    return sum;
}

// A query block of whole rows, in the passes that hold them (JVP, the backward's JVP,
// double backward), within work item (chunk of query blocks, b, key/value head hk).
struct RowBlock {
    index_t chunk, b, hk, bhk;  // the work item; bhk = b Hkv + hk
    index_t h, bh;              // the query head, and bh = b H + h
    index_t r0, rows, first;    // rows r0..r0 + rows of the head; first = bh Lq + r0
    index_t keys;               // how many keys, from key0 on, any of the rows sees
    index_t len_k;
    index_t key0 = 0;           // the first of them: 0, or the smallest lower key bound of the rows

    // The item's head in a key-side (B, Hkv, Lk, width) tensor from key key0 on, the block's
    // rows in a query-side (B, H, Lq, width) one; null (an absent tangent) stays null.
    template <typename P>
    P* head(P* base, index_t width) const { return base ? base + head_offset(width) : nullptr; }
    template <typename P>
    P* block(P* base, index_t width) const { return base ? base + first * width : nullptr; }
    // The item's head in its own chunk's part of `parts` (chunks x (B, Hkv, Lk, width))
    template <typename P>
    P* part_head(P* parts, index_t kv_size, index_t width) const {
        return parts + chunk * kv_size * width + head_offset(width);
    }
    index_t head_offset(index_t width) const { return (bhk * len_k + key0) * width; }
};

// A block's keys narrowed to those between its rows' bounds: a band of a sliding window,
// not the whole prefix, so its row sums run over the keys that can take part alone.
template <typename T>
void narrow_to_bounds(RowBlock& blk, const ScoreMask<T>& masks) {
    index_t lo = blk.keys, hi = 0;
    for (index_t i = blk.r0; i < blk.r0 + blk.rows; ++i) {
        const auto [row_lo, row_hi] = masks.range(blk.b, i, blk.len_k);
        lo = std::min(lo, row_lo);
        hi = std::max(hi, row_hi);
    }
    const index_t stop = std::min(blk.keys, hi);
    blk.key0 = std::min(lo, stop);
    blk.keys = stop - blk.key0;
}

// body(block, scratch) for every query block of whole rows: the work `items` in parallel,
// each visiting, for its (chunk of query blocks, b, key/value head)s in order, its chunk of
// blocks for every query head of the group in order (so its sums into its own parts have a
// fixed order); `scratch` holds `tiles` tiles of block_rows x Lk per thread.
template <typename T, typename Body>
void for_each_row_block(const Pass<T>& pass, const KvItems& items, int tiles, Body&& body) {
    const Shape& s = pass.s;
    const index_t block_rows = pass.call.block_rows, chunks = pass.call.chunks;
    const index_t group = s.heads / s.kv_heads;
    const index_t query_blocks = (s.len_q + block_rows - 1) / block_rows;
#pragma omp parallel num_threads(pass.threads)
    {
        SingleThreadedBlas blas_guard;
        std::vector<T> scratch(tiles * block_rows * s.len_k);
#pragma omp for schedule(dynamic, 1)
        for (index_t item = 0; item < items.count(); ++item) {
            items.visit(item, [&](const KvItem& it) {
                for (index_t h = it.hk * group; h < (it.hk + 1) * group; ++h) {
                    for (index_t qb = it.chunk * query_blocks / chunks; qb < (it.chunk + 1) * query_blocks / chunks;
                         ++qb) {
                        RowBlock blk{it.chunk, it.b, it.hk, it.bhk, h, it.b * s.heads + h, qb * block_rows, 0, 0, 0,
                                     s.len_k};
                        blk.rows = std::min(block_rows, s.len_q - blk.r0);
                        blk.first = blk.bh * s.len_q + blk.r0;
                        blk.keys = pass.causal.keys_before(blk.r0 + blk.rows, s.len_k);
                        if (pass.masks.bounds) narrow_to_bounds(blk, pass.masks);
                        body(blk, scratch.data());
                    }
                }
            });
        }
    }
}

template <typename T>
void forward(const Pass<T>& pass) {
    const T *q = pass[buf_q], *k = pass[buf_k], *v = pass[buf_v];
    T *out = pass[buf_out], *row_max = pass[buf_row_max], *inv_sum = pass[buf_inv_sum];
    const Shape& s = pass.s;
    const Causal causal = pass.causal;
    const ScoreMask<T>& masks = pass.masks;
    const DropoutDraw& drop = pass.drop;
    const T scale = pass.scale;
    const int threads = pass.threads;
    const index_t block_rows = pass.call.block_rows, block_keys = pass.call.block_keys;
    const index_t value_slice = pass.call.value_slice;
    const index_t group = s.heads / s.kv_heads;
    const index_t query_blocks = (s.len_q + block_rows - 1) / block_rows;
    const index_t bh_count = s.batch * s.heads;
    const T neg_inf = -std::numeric_limits<T>::infinity();
    const BlockSkips<T> skips(masks, s, block_rows, block_keys, threads);
#pragma omp parallel num_threads(threads)
    {
        SingleThreadedBlas blas_guard;
        std::vector<T> scores(block_rows * block_keys), acc(block_rows * s.dim_v), m(block_rows), l(block_rows);
        // the last query blocks first: a causal pass's heaviest work is scheduled first
#pragma omp for schedule(dynamic, 1)
        for (index_t item = 0; item < query_blocks * bh_count; ++item) {
            const index_t qb = query_blocks - 1 - item / bh_count, bh = item % bh_count;
            const index_t b = bh / s.heads, h = bh % s.heads;
            const index_t r0 = qb * block_rows, rows = std::min(block_rows, s.len_q - r0);
            const T* q_blk = q + (bh * s.len_q + r0) * s.dim;
            const T* k_head = k + (b * s.kv_heads + h / group) * s.len_k * s.dim;
            const T* v_head = v + (b * s.kv_heads + h / group) * s.len_k * s.dim_v;
            const index_t keys = causal.keys_before(r0 + rows, s.len_k);
            std::fill(m.begin(), m.end(), neg_inf);
            std::fill(l.begin(), l.end(), T(0));
            std::fill(acc.begin(), acc.end(), T(0));
            for (index_t c0 = 0; c0 < keys; c0 += block_keys) {
                if (skips(b, h, qb, c0 / block_keys)) continue;  // every score of the tile excluded
                const index_t cols = std::min(block_keys, keys - c0);
                // forward: S = scale Q_blk K_blk^T
                gemm<T>(false, true, rows, cols, s.dim, scale, q_blk, s.dim, k_head + c0 * s.dim, s.dim, T(0),
                        scores.data(), cols);
                for (index_t i = 0; i < rows; ++i) {
                    T* row = scores.data() + i * cols;
                    const index_t seen = causal.visible(r0 + i, c0, cols);
                    if (pass.cap.c) pass.cap.apply(row, seen);                  // S = c tanh(S / c)
                    if (masks.any()) masks.apply(row, b, h, r0 + i, c0, seen);  // S += bias, excluded -inf
                    const T m_new = std::max(m[i], max_of(row, seen));
                    // E = exp(S - m'); a row that has seen no key so far keeps E = 0
                    const T sum = m_new != neg_inf ? exp_and_sum(row, seen, m_new) : T(0);
                    std::fill(row + (m_new != neg_inf ? seen : 0), row + cols, T(0));  // the row's future
                    if (m_new != m[i]) {  // rescale what earlier key blocks summed
                        const T correction = m[i] == neg_inf ? T(0) : exp_score(m[i] - m_new);
                        l[i] *= correction;
                        T* acc_row = acc.data() + i * s.dim_v;
                        for (index_t c = 0; c < s.dim_v; ++c) acc_row[c] *= correction;
                        m[i] = m_new;
                    }
                    l[i] += sum;
                    if (drop.on) drop.scale_row(row, b, h, r0 + i, c0, seen);  // E Z: l keeps E alone
                }
                // forward: acc += E V_blk, over slices of `value_slice` keys: a float32 sum's
                // rounding grows with its length, and blocked sums keep each part short
                for (index_t j0 = 0; j0 < cols; j0 += value_slice) {
                    gemm<T>(false, false, rows, s.dim_v, std::min(value_slice, cols - j0), T(1), scores.data() + j0,
                            cols, v_head + (c0 + j0) * s.dim_v, s.dim_v, T(1), acc.data(), s.dim_v);
                }
            }
            for (index_t i = 0; i < rows; ++i) {
                const index_t r = bh * s.len_q + r0 + i;
                const bool empty = !(l[i] > T(0));  // a row that saw no key: out 0, statistics 0
                const T inv = empty ? T(0) : T(1) / l[i];
                row_max[r] = empty ? T(0) : m[i];
                inv_sum[r] = inv;
                const T* acc_row = acc.data() + i * s.dim_v;
                T* out_row = out + r * s.dim_v;
                for (index_t c = 0; c < s.dim_v; ++c) out_row[c] = acc_row[c] * inv;
            }
        }
    }
}

// delta_r = rowsum(a_r * b_r) for `rows` rows of width `width`, summed in double: D enters
// every dS = P (dP - D) of its row, and a float32 sum of d products would carry d roundings
// into all of them (O(L d) work, so the wider sum costs nothing measurable)
template <typename T>
void row_dots(const T* a, const T* b, T* delta, index_t rows, index_t width, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (index_t r = 0; r < rows; ++r) {
        double sum = 0;
        for (index_t c = 0; c < width; ++c) sum += double(a[r * width + c]) * double(b[r * width + c]);
        delta[r] = static_cast<T>(sum);
    }
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
    const int threads = pass.threads;
    const index_t block_rows = pass.call.block_rows, block_keys = pass.call.block_keys, chunks = pass.call.chunks;
    const index_t group = s.heads / s.kv_heads;
    const index_t rows_total = s.batch * s.heads * s.len_q;
    row_dots(dout, out, delta, rows_total, s.dim_v, threads);  // D = rowsum(dO * O)
    const RowKeys<T> row_keys_of(masks, causal, s, threads);
    const BlockSkips<T> skips(masks, s, block_rows, block_keys, threads);
    const index_t key_blocks = (s.len_k + block_keys - 1) / block_keys;
    const KvItems items(s, chunks, dbias.shares_batch(s), dbias.shares_kv_heads(s));
#pragma omp parallel num_threads(threads)
    {
        SingleThreadedBlas blas_guard;
        std::vector<T> probs(block_rows * block_keys), dscores(block_rows * block_keys);
        std::vector<T> slopes(pass.cap.c ? block_rows * block_keys : 0);  // the cap's, per score
#pragma omp for schedule(dynamic, 1)
        for (index_t item = 0; item < items.count(); ++item) {
          items.visit(item, [&](const KvItem& it) {
            const index_t chunk = it.chunk, bhk = it.bhk, b = it.b, hk = it.hk;
            const T* k_head = k + bhk * s.len_k * s.dim;
            const T* v_head = v + bhk * s.len_k * s.dim_v;
            T* dk_head = dk + bhk * s.len_k * s.dim;
            T* dv_head = dv + bhk * s.len_k * s.dim_v;
            T* dq = dq_parts + chunk * rows_total * s.dim;
            T* dbias_part = dbias.part(chunk);
            for (index_t kb = chunk * key_blocks / chunks; kb < (chunk + 1) * key_blocks / chunks; ++kb) {
                const index_t c0 = kb * block_keys, cols = std::min(block_keys, s.len_k - c0);
                const T* k_blk = k_head + c0 * s.dim;
                const T* v_blk = v_head + c0 * s.dim_v;
                for (index_t h = hk * group; h < (hk + 1) * group; ++h) {
                    const index_t bh = b * s.heads + h;
                    // causal: rows before c0 - offset see none of these keys
                    const index_t first_row = causal.on ? std::max<index_t>(0, c0 - causal.offset) : 0;
                    for (index_t r0 = first_row / block_rows * block_rows; r0 < s.len_q; r0 += block_rows) {
                        if (skips(b, h, r0 / block_rows, kb)) continue;  // every score of the tile excluded
                        const index_t rows = std::min(block_rows, s.len_q - r0), first = bh * s.len_q + r0;
                        // forward: S = scale Q K_blk^T;  backward: dP = dO V_blk^T
                        gemm<T>(false, true, rows, cols, s.dim, scale, q + first * s.dim, s.dim, k_blk, s.dim, T(0),
                                probs.data(), cols);
                        gemm<T>(false, true, rows, cols, s.dim_v, T(1), dout + first * s.dim_v, s.dim_v, v_blk,
                                s.dim_v, T(0), dscores.data(), cols);
                        for (index_t i = 0; i < rows; ++i) {
                            T* p = probs.data() + i * cols;
                            T* ds = dscores.data() + i * cols;
                            const index_t seen = causal.visible(r0 + i, c0, cols);
                            const index_t row_keys = row_keys_of(bh, r0 + i);
                            const T m = row_max[first + i], inv = inv_sum[first + i];
                            T* slope = pass.cap.c ? slopes.data() + i * cols : nullptr;
                            if (slope) pass.cap.apply(p, seen, slope);  // S = c tanh(A / c)
                            if (masks.any()) masks.apply(p, b, h, r0 + i, c0, seen);
                            if (drop.on) drop.scale_row(ds, b, h, r0 + i, c0, seen);  // dP = (dO V^T) Z
                            if (!pass.call.partial_rows && c0 == 0 && causal.visible(r0 + i, 0, s.len_k) <= cols) {
                                // every key of the row is in this block: D = rowsum(P dP) from
                                // the very dP it is subtracted from, whose rounding then cancels
                                // (rowsum(dO O) carries O's; few-key rows showed it in float32)
                                const T d_row = probs_and_dot(p, ds, seen, m, inv);
                                centre_and_scale(p, ds, seen, d_row);
                            } else {
                                probs_and_score_grad(p, ds, seen, m, inv, delta[first + i]);
                            }
                            // the row's one key, if in this block: P = 1, dS = 0 (with l = 1: a ring
                            // step's row may have more keys than this call's, each with weight)
                            if (row_keys == 1 && inv == T(1)) {
                                for (index_t j = 0; j < seen; ++j) {
                                    p[j] = p[j] > T(0) ? T(1) : T(0);
                                    ds[j] = T(0);
                                }
                            }
                            if (drop.on) drop.scale_row(p, b, h, r0 + i, c0, seen);  // P Z, for dV
                            std::fill(p + seen, p + cols, T(0));
                            std::fill(ds + seen, ds + cols, T(0));
                            // forward: S = scale Q K^T + bias  ->  dbias = dS, summed over its broadcast axes
                            if (dbias_part) dbias.add_row(dbias_part, ds, b, h, r0 + i, c0, seen);
                            // forward: S = c tanh(A / c) + bias  ->  dA = dS (1 - tanh^2)
                            if (slope) for (index_t j = 0; j < seen; ++j) ds[j] *= slope[j];
                        }
                        // forward: O = (P Z) V  ->  dV_blk += (P Z)^T dO
                        gemm<T>(true, false, cols, s.dim_v, rows, T(1), probs.data(), cols, dout + first * s.dim_v,
                                s.dim_v, T(1), dv_head + c0 * s.dim_v, s.dim_v);
                        // forward: S = scale Q K^T  ->  dK_blk += scale dS^T Q,  dQ += scale dS K_blk
                        gemm<T>(true, false, cols, s.dim, rows, scale, dscores.data(), cols, q + first * s.dim, s.dim,
                                T(1), dk_head + c0 * s.dim, s.dim);
                        gemm<T>(false, false, rows, s.dim, cols, scale, dscores.data(), cols, k_blk, s.dim, T(1),
                                dq + first * s.dim, s.dim);
                    }
                }
            }
          });
        }
    }
}


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
    const BiasGradient<T> g_bias(pass, buf_g_bias_parts, 2);
    const Shape& s = pass.s;
    const DropoutDraw& drop = pass.drop;
    const T scale = pass.scale;
    const ScoreMask<T> gbias{nullptr, Broadcast4(), pass[buf_gbias], Broadcast4(pass.call.bias_sizes)};
    const index_t kv_size = s.batch * s.kv_heads * s.len_k;
    row_dots(dout, out, delta, s.batch * s.heads * s.len_q, s.dim_v, pass.threads);  // D = rowsum(dO * O)
    const RowKeys<T> row_keys_of(pass.masks, pass.causal, s, pass.threads);
    const KvItems items(s, pass.call.chunks, g_bias.shares_batch(s), g_bias.shares_kv_heads(s));
    // scratch: P, then P Z; T, then g_dP Z; dP~ - D, then dS; X, then g_P, then g_S; with a
    // softcap its slope, and its curve (times the raw T)
    for_each_row_block(pass, items, 4 + CapRows<T>::tiles(pass.cap, true), [&](const RowBlock& blk, T* scratch) {
        const index_t rows = blk.rows, keys = blk.keys, first = blk.first, tile = pass.call.block_rows * s.len_k;
        if (keys == 0) {  // rows that see no key: nothing flows back through them
            std::fill(g_q + first * s.dim, g_q + (first + rows) * s.dim, T(0));
            if (g_dout) std::fill(g_dout + first * s.dim_v, g_dout + (first + rows) * s.dim_v, T(0));
            return;
        }
        const T* k_head = blk.head(k, s.dim);
        const T* v_head = blk.head(v, s.dim_v);
        const T* gk_head = blk.head(gk, s.dim);
        const T* gv_head = blk.head(gv, s.dim_v);
        T* g_k = blk.part_head(gk_parts, kv_size, s.dim);
        T* g_v = blk.part_head(gv_parts, kv_size, s.dim_v);
        T* g_bias_part = g_bias.part(blk.chunk);
        const T* q_blk = blk.block(q, s.dim);
        const T* do_blk = blk.block(dout, s.dim_v);
        const T* gq_blk = blk.block(gq, s.dim);
        T *p = scratch, *t = scratch + tile, *dp = scratch + 2 * tile, *x = scratch + 3 * tile;
        const CapRows<T> cap_rows(pass.cap, scratch, tile, 4, true);
        // S = scale Q K^T;  T = scale (gQ K^T + Q gK^T) (+ gbias by row);  dP = dO V^T;  X = dO gV^T (Z by row)
        gemm<T>(false, true, rows, keys, s.dim, scale, q_blk, s.dim, k_head, s.dim, T(0), p, keys);
        products_nt(rows, keys, s.dim, scale, gq_blk, k_head, q_blk, gk_head, t);
        gemm<T>(false, true, rows, keys, s.dim_v, T(1), do_blk, s.dim_v, v_head, s.dim_v, T(0), dp, keys);
        products_nt<T>(rows, keys, s.dim_v, T(1), do_blk, gv_head, nullptr, nullptr, x);
        for (index_t i = 0; i < rows; ++i) {
            T *pi = p + i * keys, *ti = t + i * keys, *dpi = dp + i * keys, *xi = x + i * keys;
            const index_t row = blk.r0 + i, seen = pass.causal.visible(row, blk.key0, keys);
            const T m = row_max[first + i], inv = inv_sum[first + i];
            const auto [sli, cvi] = cap_rows.row(i, keys);
            if (sli) pass.cap.apply_with_form(pi, ti, seen, sli, cvi);  // S = c tanh(A / c), T = slope T_raw
            if (pass.masks.any()) pass.masks.apply(pi, blk.b, blk.h, row, blk.key0, seen);
            if (gbias.any()) gbias.apply(ti, blk.b, blk.h, row, blk.key0, seen);
            if (drop.on) {  // dP~ = (dO V^T) Z,  X = (dO gV^T) Z
                drop.scale_row(dpi, blk.b, blk.h, row, blk.key0, seen);
                drop.scale_row(xi, blk.b, blk.h, row, blk.key0, seen);
            }
            T d_row = delta[first + i];
            T t_sum = probs_and_dot(pi, ti, seen, m, inv);  // P, t = rowsum(P * T)
            if (row_keys_of(blk.bh, row) == 1 && inv == T(1)) {  // the row's one key: P = 1, so t = T, D = dP~ exactly
                t_sum = single_key_probs(pi, ti, seen);
                d_row = T(0);
                for (index_t j = 0; j < seen; ++j) d_row += pi[j] * dpi[j];
            }
            T u_sum = second_order_terms(pi, ti, dpi, xi, seen, t_sum, d_row);
            // with a sink, rowsum(P) = 1 - P_sink: the per-row t D that g_P leaves out (the softmax
            // ignores it only when P sums to 1) comes back as t D P_sink, P_sink = exp(-m) / l
            if (pass.call.sink && inv > T(0)) u_sum += t_sum * d_row * std::exp(std::log(inv) - m);
            centre_and_scale(pi, xi, seen, u_sum);  // g_S = P (g_P - u)
            if (drop.on) {  // g_dP Z and P Z, for g_V and g_dO
                drop.scale_row(ti, blk.b, blk.h, row, blk.key0, seen);
                drop.scale_row(pi, blk.b, blk.h, row, blk.key0, seen);
            }
            for (T* r : {pi, ti, dpi, xi}) std::fill(r + seen, r + keys, T(0));
            if (g_bias_part) g_bias.add_row(g_bias_part, xi, blk.b, blk.h, row, blk.key0, seen);  // g_bias += g_S
            // through dA = slope dS and S = c tanh(A / c): g_A = slope g_S + (curve T_raw) dS
            if (sli) Softcap<T>::back_to_raw(xi, dpi, sli, cvi, seen);
        }
        // backward: dV = (P Z)^T dO  ->  g_V += (g_dP Z)^T dO
        gemm<T>(true, false, keys, s.dim_v, rows, T(1), t, keys, do_blk, s.dim_v, T(1), g_v, s.dim_v);
        // backward: dP~ = (dO V^T) Z, dV = (P Z)^T dO  ->  g_dO = (g_dP Z) V + (P Z) gV
        if (g_dout) {
            T* g_do = g_dout + first * s.dim_v;
            gemm<T>(false, false, rows, s.dim_v, keys, T(1), t, keys, v_head, s.dim_v, T(0), g_do, s.dim_v);
            if (gv_head) {
                gemm<T>(false, false, rows, s.dim_v, keys, T(1), p, keys, gv_head, s.dim_v, T(1), g_do, s.dim_v);
            }
        }
        // backward: dQ = scale dS K, dK = scale dS^T Q  ->  g_Q = scale (g_S K + dS gK),
        // g_K += scale (g_S^T Q + dS^T gQ)
        T* g_q_blk = g_q + first * s.dim;
        gemm<T>(false, false, rows, s.dim, keys, scale, x, keys, k_head, s.dim, T(0), g_q_blk, s.dim);
        if (gk_head) gemm<T>(false, false, rows, s.dim, keys, scale, dp, keys, gk_head, s.dim, T(1), g_q_blk, s.dim);
        gemm<T>(true, false, keys, s.dim, rows, scale, x, keys, q_blk, s.dim, T(1), g_k, s.dim);
        if (gq_blk) gemm<T>(true, false, keys, s.dim, rows, scale, dp, keys, gq_blk, s.dim, T(1), g_k, s.dim);
    });
}

// The JVP: the output's tangent O' for tangents tQ, tK, tV, tbias (each may be null:
// zero), from the forward's statistics, per query block of whole rows (t below sums over
// all of a row's keys). Each block owns its rows of O'.
//   P = exp(S - m) / l,  T = S' = scale (tQ K^T + Q tK^T) + tbias,  t = rowsum(P * T)
//   P' = P (T - t),  O' = (P' Z) V + (P Z) tV
template <typename T>
void jvp(const Pass<T>& pass) {
    const T *q = pass[buf_q], *k = pass[buf_k], *v = pass[buf_v];
    const T *row_max = pass[buf_row_max], *inv_sum = pass[buf_inv_sum];
    const T *tq = pass[buf_tq], *tk = pass[buf_tk], *tv = pass[buf_tv];
    T* out_t = pass[buf_tout];
    const Shape& s = pass.s;
    const DropoutDraw& drop = pass.drop;
    const T scale = pass.scale;
    const ScoreMask<T> tbias{nullptr, Broadcast4(), pass[buf_tbias], Broadcast4(pass.call.bias_sizes)};
    const RowKeys<T> row_keys_of(pass.masks, pass.causal, s, pass.threads);
    // scratch: P; T, then P'
    for_each_row_block(pass, KvItems(s, pass.call.chunks, false, false), 2 + CapRows<T>::tiles(pass.cap, false),
                       [&](const RowBlock& blk, T* scratch) {
        const index_t rows = blk.rows, keys = blk.keys, first = blk.first, tile = pass.call.block_rows * s.len_k;
        T* o_t = out_t + first * s.dim_v;
        if (keys == 0) {  // rows that see no key: output 0, tangent 0
            std::fill(o_t, o_t + rows * s.dim_v, T(0));
            return;
        }
        const T* q_blk = blk.block(q, s.dim);
        const T* tq_blk = blk.block(tq, s.dim);
        const T* k_head = blk.head(k, s.dim);
        const T* tk_head = blk.head(tk, s.dim);
        const T* v_head = blk.head(v, s.dim_v);
        const T* tv_head = blk.head(tv, s.dim_v);
        T *p = scratch, *t = scratch + tile;
        const CapRows<T> cap_rows(pass.cap, scratch, tile, 2, false);
        // forward: S = scale Q K^T + bias  ->  S' = scale (tQ K^T + Q tK^T) + tbias
        gemm<T>(false, true, rows, keys, s.dim, scale, q_blk, s.dim, k_head, s.dim, T(0), p, keys);
        products_nt(rows, keys, s.dim, scale, tq_blk, k_head, q_blk, tk_head, t);
        for (index_t i = 0; i < rows; ++i) {
            T *pi = p + i * keys, *ti = t + i * keys;
            const index_t row = blk.r0 + i, seen = pass.causal.visible(row, blk.key0, keys);
            T* sli = cap_rows.row(i, keys).first;
            if (sli) pass.cap.apply_with_form(pi, ti, seen, sli);  // S' = slope A' + tbias
            if (pass.masks.any()) pass.masks.apply(pi, blk.b, blk.h, row, blk.key0, seen);
            if (tbias.any()) tbias.apply(ti, blk.b, blk.h, row, blk.key0, seen);
            // forward: P = softmax(S)  ->  P' = P (S' - rowsum(P S'))
            T t_sum = probs_and_dot(pi, ti, seen, row_max[first + i], inv_sum[first + i]);
            // (1/l = 1: with a sink, the one key shares the row and P < 1)
            if (row_keys_of(blk.bh, row) == 1 && inv_sum[first + i] == T(1)) t_sum = single_key_probs(pi, ti, seen);  // so P' = 0
            centre_and_scale(pi, ti, seen, t_sum);
            if (drop.on) {  // P Z and P' Z
                drop.scale_row(pi, blk.b, blk.h, row, blk.key0, seen);
                drop.scale_row(ti, blk.b, blk.h, row, blk.key0, seen);
            }
            std::fill(pi + seen, pi + keys, T(0));
            std::fill(ti + seen, ti + keys, T(0));
        }
        // forward: O = (P Z) V  ->  O' = (P' Z) V + (P Z) tV
        gemm<T>(false, false, rows, s.dim_v, keys, T(1), t, keys, v_head, s.dim_v, T(0), o_t, s.dim_v);
        if (tv_head) gemm<T>(false, false, rows, s.dim_v, keys, T(1), p, keys, tv_head, s.dim_v, T(1), o_t, s.dim_v);
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
template <typename T>
void backward_jvp(const Pass<T>& pass) {
    const T *dout = pass[buf_dout], *q = pass[buf_q], *k = pass[buf_k], *v = pass[buf_v], *out = pass[buf_out];
    const T *row_max = pass[buf_row_max], *inv_sum = pass[buf_inv_sum];
    const T *tdout = pass[buf_tdout], *tq = pass[buf_tq], *tk = pass[buf_tk], *tv = pass[buf_tv];
    T *delta = pass[buf_delta], *tdq = pass[buf_tdq];
    T *tdk_parts = pass[buf_tdk_parts], *tdv_parts = pass[buf_tdv_parts];
    const BiasGradient<T> tdbias(pass, buf_tdbias_parts, 2);
    const Shape& s = pass.s;
    const DropoutDraw& drop = pass.drop;
    const T scale = pass.scale;
    const ScoreMask<T> tbias{nullptr, Broadcast4(), pass[buf_tbias], Broadcast4(pass.call.bias_sizes)};
    const index_t kv_size = s.batch * s.kv_heads * s.len_k;
    row_dots(dout, out, delta, s.batch * s.heads * s.len_q, s.dim_v, pass.threads);  // D = rowsum(dO * O)
    const RowKeys<T> row_keys_of(pass.masks, pass.causal, s, pass.threads);
    const KvItems items(s, pass.call.chunks, tdbias.shares_batch(s), tdbias.shares_kv_heads(s));
    // scratch: P; T, then P'; dP~, then dS; dP~', then dS'; with a softcap its slope, and its
    // curve (times A')
    for_each_row_block(pass, items, 4 + CapRows<T>::tiles(pass.cap, true), [&](const RowBlock& blk, T* scratch) {
        const index_t rows = blk.rows, keys = blk.keys, first = blk.first, tile = pass.call.block_rows * s.len_k;
        T* dq_t = tdq + first * s.dim;
        if (keys == 0) {  // rows that see no key: nothing flows back through them
            std::fill(dq_t, dq_t + rows * s.dim, T(0));
            return;
        }
        const T* k_head = blk.head(k, s.dim);
        const T* v_head = blk.head(v, s.dim_v);
        const T* tk_head = blk.head(tk, s.dim);
        const T* tv_head = blk.head(tv, s.dim_v);
        T* dk_t = blk.part_head(tdk_parts, kv_size, s.dim);
        T* dv_t = blk.part_head(tdv_parts, kv_size, s.dim_v);
        T* dbias_t = tdbias.part(blk.chunk);
        const T* q_blk = blk.block(q, s.dim);
        const T* tq_blk = blk.block(tq, s.dim);
        const T* do_blk = blk.block(dout, s.dim_v);
        const T* tdo_blk = blk.block(tdout, s.dim_v);
        T *p = scratch, *t = scratch + tile, *dp = scratch + 2 * tile, *x = scratch + 3 * tile;
        const CapRows<T> cap_rows(pass.cap, scratch, tile, 4, true);
        // forward: S = scale Q K^T + bias  ->  S' = scale (tQ K^T + Q tK^T) + tbias
        gemm<T>(false, true, rows, keys, s.dim, scale, q_blk, s.dim, k_head, s.dim, T(0), p, keys);
        products_nt(rows, keys, s.dim, scale, tq_blk, k_head, q_blk, tk_head, t);
        // backward: dP = dO V^T  ->  dP' = tdO V^T + dO tV^T
        gemm<T>(false, true, rows, keys, s.dim_v, T(1), do_blk, s.dim_v, v_head, s.dim_v, T(0), dp, keys);
        products_nt(rows, keys, s.dim_v, T(1), tdo_blk, v_head, do_blk, tv_head, x);
        for (index_t i = 0; i < rows; ++i) {
            T *pi = p + i * keys, *ti = t + i * keys, *dpi = dp + i * keys, *xi = x + i * keys;
            const index_t row = blk.r0 + i, seen = pass.causal.visible(row, blk.key0, keys);
            const auto [sli, cvi] = cap_rows.row(i, keys);
            if (sli) pass.cap.apply_with_form(pi, ti, seen, sli, cvi);  // S' = slope A', curve A'
            if (pass.masks.any()) pass.masks.apply(pi, blk.b, blk.h, row, blk.key0, seen);
            if (tbias.any()) tbias.apply(ti, blk.b, blk.h, row, blk.key0, seen);
            T t_sum = probs_and_dot(pi, ti, seen, row_max[first + i], inv_sum[first + i]);  // P, t = rowsum(P * T)
            const bool single = row_keys_of(blk.bh, row) == 1 && inv_sum[first + i] == T(1);  // then P' = 0 and dS = dS' = 0
            if (single) t_sum = single_key_probs(pi, ti, seen);
            centre_and_scale(pi, ti, seen, t_sum);  // P' = P (T - t)
            if (drop.on) {  // dP~ = dP Z, dP~' = dP' Z
                drop.scale_row(dpi, blk.b, blk.h, row, blk.key0, seen);
                drop.scale_row(xi, blk.b, blk.h, row, blk.key0, seen);
            }
            if (single) {
                std::fill(dpi, dpi + seen, T(0));
                std::fill(xi, xi + seen, T(0));
            } else {
                const T d_t = tangent_delta(pi, ti, dpi, xi, seen);  // D'
                score_grad_tangents(pi, ti, dpi, xi, seen, delta[first + i], d_t);  // dS, dS'
            }
            if (drop.on) {  // P Z and P' Z, for dV'
                drop.scale_row(pi, blk.b, blk.h, row, blk.key0, seen);
                drop.scale_row(ti, blk.b, blk.h, row, blk.key0, seen);
            }
            for (T* r : {pi, ti, dpi, xi}) std::fill(r + seen, r + keys, T(0));
            if (dbias_t) tdbias.add_row(dbias_t, xi, blk.b, blk.h, row, blk.key0, seen);  // dbias' = dS'
            // backward: dA = slope dS  ->  dA' = slope dS' + (curve A') dS
            if (sli) Softcap<T>::back_to_raw(xi, dpi, sli, cvi, seen);
        }
        // backward: dV = (P Z)^T dO  ->  dV' += (P' Z)^T dO + (P Z)^T tdO
        gemm<T>(true, false, keys, s.dim_v, rows, T(1), t, keys, do_blk, s.dim_v, T(1), dv_t, s.dim_v);
        if (tdo_blk) gemm<T>(true, false, keys, s.dim_v, rows, T(1), p, keys, tdo_blk, s.dim_v, T(1), dv_t, s.dim_v);
        // backward: dQ = scale dS K, dK = scale dS^T Q  ->  dQ' = scale (dS' K + dS tK),
        // dK' += scale (dS'^T Q + dS^T tQ)
        gemm<T>(false, false, rows, s.dim, keys, scale, x, keys, k_head, s.dim, T(0), dq_t, s.dim);
        if (tk_head) gemm<T>(false, false, rows, s.dim, keys, scale, dp, keys, tk_head, s.dim, T(1), dq_t, s.dim);
        gemm<T>(true, false, keys, s.dim, rows, scale, x, keys, q_blk, s.dim, T(1), dk_t, s.dim);
        if (tq_blk) gemm<T>(true, false, keys, s.dim, rows, scale, dp, keys, tq_blk, s.dim, T(1), dk_t, s.dim);
    });
}

// out (B, H, R, keys) <- Z for rows row_start.. and keys 0..: 1 / (1 - p) where kept, else 0
template <typename T>
void dropout_keep_scale(T* out, index_t batch, index_t heads, index_t row_start, index_t rows, index_t key_start,
                        index_t keys, const DropoutDraw& draw, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (index_t row = 0; row < batch * heads * rows; ++row) {
        const index_t bh = row / rows;
        T* out_row = out + row * keys;
        std::fill(out_row, out_row + keys, T(1));
        draw.scale_row(out_row, bh / heads, bh % heads, row_start + row % rows, key_start, keys);
    }
}

// Entry-point checks: a message for attngrad_error() and a nonzero return on the first
// size that does not fit.
thread_local char error_message[512] = "";

bool fail(const char* what, const char* name, int64_t got, int64_t want) {
    std::snprintf(error_message, sizeof error_message, "%s: %s is %lld, expected %lld", what, name,
                  static_cast<long long>(got), static_cast<long long>(want));
    return false;
}

constexpr int64_t kIntMax = std::numeric_limits<int>::max();  // the BLAS takes 32-bit sizes

// a * b, or false where it would pass 2^62 (sizes that no buffer could have)
bool product(int64_t a, int64_t b, int64_t* out) {
    return !__builtin_mul_overflow(a, b, out) && *out <= (int64_t{1} << 62);
}

const char* const kBufferNames[kBufferCount] = {
#define ATTNGRAD_NAME(name) #name,
    ATTNGRAD_BUFFERS(ATTNGRAD_NAME)
#undef ATTNGRAD_NAME
};

// How a pass takes a buffer: not at all (it must be null), always, or where given.
enum class Use { none, required, optional };

// The element count buffer `b` must have in call `c`, or -1 where it overflows.
int64_t expected_numel(const AttngradCall& c, int b) {
    int64_t rows = 0, kv = 0, mask = 0, bias = 0, n = -1;
    if (!product(c.batch * c.heads, c.len_q, &rows) || !product(c.batch * c.kv_heads, c.len_k, &kv) ||
        !product(c.mask_sizes[0] * c.mask_sizes[1], c.mask_sizes[2] * c.mask_sizes[3], &mask) ||
        !product(c.bias_sizes[0] * c.bias_sizes[1], c.bias_sizes[2] * c.bias_sizes[3], &bias)) {
        return -1;
    }
    switch (b) {
        case buf_q: case buf_gq: case buf_g_q: case buf_tq: return product(rows, c.dim, &n) ? n : -1;
        case buf_k: case buf_dk: case buf_gk: case buf_tk: return product(kv, c.dim, &n) ? n : -1;
        case buf_v: case buf_dv: case buf_gv: case buf_tv: return product(kv, c.dim_v, &n) ? n : -1;
        case buf_out: case buf_dout: case buf_g_dout: case buf_tout: return product(rows, c.dim_v, &n) ? n : -1;
        case buf_row_max: case buf_inv_sum: case buf_delta: return rows;
        case buf_mask: return mask;
        case buf_bias: case buf_tbias: case buf_gbias: return bias;  // a bias's tangent has the bias's sizes
        case buf_dq_parts: return product(rows * c.dim, c.chunks, &n) ? n : -1;
        case buf_gk_parts: return product(kv * c.dim, c.chunks, &n) ? n : -1;
        case buf_gv_parts: return product(kv * c.dim_v, c.chunks, &n) ? n : -1;
        case buf_dbias_parts: return product(bias, bias_grad_parts(c, 3), &n) ? n : -1;
        case buf_tdbias_parts: case buf_g_bias_parts: return product(bias, bias_grad_parts(c, 2), &n) ? n : -1;
        case buf_tdout: return product(rows, c.dim_v, &n) ? n : -1;
        case buf_tdq: return product(rows, c.dim, &n) ? n : -1;
        case buf_tdk_parts: return product(kv * c.dim, c.chunks, &n) ? n : -1;
        case buf_tdv_parts: return product(kv * c.dim_v, c.chunks, &n) ? n : -1;
        case buf_key_bounds: return product(c.bounds_batch * c.len_q, 2, &n) ? n : -1;
        default: return -1;
    }
}

// A mask's or bias's (b, h, i, j) sizes: each 1 or the scores' own
bool check_broadcast(const char* what, const char* name, const AttngradCall& c, const int64_t* sizes) {
    const int64_t full[4] = {c.batch, c.heads, c.len_q, c.len_k};
    for (int d = 0; d < 4; ++d) {
        if (sizes[d] != 1 && sizes[d] != full[d]) return fail(what, name, sizes[d], full[d]);
    }
    return true;
}

// Key bounds, where given: bounds_batch 1 or B, and every [lo, hi) within 0..Lk (lo >= hi: no key)
bool check_bounds(const char* what, const AttngradCall& c) {
    if (!c.data[buf_key_bounds]) return true;
    if (c.bounds_batch != 1 && c.bounds_batch != c.batch) return fail(what, "bounds_batch", c.bounds_batch, c.batch);
    const int64_t* bounds = static_cast<const int64_t*>(c.data[buf_key_bounds]);
    for (int64_t r = 0; r < 2 * c.bounds_batch * c.len_q; ++r) {
        if (bounds[r] < 0 || bounds[r] > c.len_k) return fail(what, "a key bound", bounds[r], c.len_k);
    }
    return true;
}

// Every size, option and buffer of call `c` for a pass that takes q, k, v, optionally a
// mask and a bias, and the buffers `uses` (the others must be null): sizes in range, and
// each buffer's element count what the sizes say, before anything is read.
bool check_call(const char* what, const AttngradCall* call, std::initializer_list<std::pair<int, Use>> uses) {
    if (!call) return fail(what, "call", 0, 1);
    const AttngradCall& c = *call;
    const int64_t sizes[7] = {c.batch, c.heads, c.kv_heads, c.len_q, c.len_k, c.dim, c.dim_v};
    const char* const size_names[7] = {"batch", "heads", "kv_heads", "len_q", "len_k", "dim", "dim_v"};
    for (int i = 0; i < 7; ++i) {
        if (sizes[i] < 1 || sizes[i] > kIntMax) return fail(what, size_names[i], sizes[i], 1);
    }
    if (c.heads % c.kv_heads != 0) return fail(what, "heads mod kv_heads", c.heads % c.kv_heads, 0);
    const int64_t options[5] = {c.threads, c.block_rows, c.block_keys, c.value_slice, c.chunks};
    const char* const option_names[5] = {"threads", "block_rows", "block_keys", "value_slice", "chunks"};
    for (int i = 0; i < 5; ++i) {
        if (options[i] < 1 || options[i] > kIntMax) return fail(what, option_names[i], options[i], 1);
    }
    if (c.block_rows * c.len_k > (int64_t{1} << 40)) {
        return fail(what, "block_rows * len_k", c.block_rows * c.len_k, 1 << 30);
    }
    if (c.threshold > (uint64_t{1} << 32)) return fail(what, "threshold", static_cast<int64_t>(c.threshold), 1ll << 32);
    // the draws' row counter is 32 bits wide, their key counter (plus one) too
    if (c.dropout_row_offset < 0 || c.dropout_row_offset > kIntMax - c.len_q) {
        return fail(what, "dropout_row_offset", c.dropout_row_offset, 0);
    }
    if (c.dropout_key_offset < 0 || c.dropout_key_offset > kIntMax - c.len_k) {
        return fail(what, "dropout_key_offset", c.dropout_key_offset, 0);
    }
    if (c.dropout_head_offset < 0 || c.dropout_head_offset > kIntMax - c.heads) {
        return fail(what, "dropout_head_offset", c.dropout_head_offset, 0);
    }
    if (c.partial_rows != 0 && c.partial_rows != 1) return fail(what, "partial_rows", c.partial_rows, 1);
    if (c.sink != 0 && c.sink != 1) return fail(what, "sink", c.sink, 1);
    if (!check_broadcast(what, "mask_sizes", c, c.mask_sizes)) return false;
    if (!check_broadcast(what, "bias_sizes", c, c.bias_sizes)) return false;
    Use use[kBufferCount] = {};
    use[buf_q] = use[buf_k] = use[buf_v] = Use::required;
    use[buf_mask] = use[buf_bias] = use[buf_key_bounds] = Use::optional;
    for (const auto& [b, how] : uses) use[b] = how;
    for (int b = 0; b < kBufferCount; ++b) {
        if (!c.data[b]) {
            if (use[b] == Use::required) return fail(what, kBufferNames[b], 0, 1);
            if (c.numel[b] != 0) return fail(what, kBufferNames[b], c.numel[b], 0);
            continue;
        }
        if (use[b] == Use::none) return fail(what, kBufferNames[b], c.numel[b], 0);  // not this pass's
        const int64_t want = expected_numel(c, b);
        if (c.numel[b] != want) return fail(what, kBufferNames[b], c.numel[b], want);
    }
    return check_bounds(what, c);
}

// An entry point: check the call against the buffers its pass takes, then run the pass
// in the call's element type; 0, or 1 without touching a buffer.
template <typename Run>
int run_checked(const char* what, const AttngradCall* call, std::initializer_list<std::pair<int, Use>> uses,
                Run&& run) {
    if (!check_call(what, call, uses)) return 1;
    if (call->double_precision) {
        run(Pass<double>(*call));
    } else {
        run(Pass<float>(*call));
    }
    return 0;
}

// The call's layout, "name@offset ..." for every field, then its size and the buffers' names
std::string call_layout() {
    std::string text;
#define ATTNGRAD_OFFSET(name) text += #name "@" + std::to_string(offsetof(AttngradCall, name)) + " ";
    ATTNGRAD_FIELDS(ATTNGRAD_OFFSET)
#undef ATTNGRAD_OFFSET
    text += "size@" + std::to_string(sizeof(AttngradCall)) + " buffers:";
    for (int b = 0; b < kBufferCount; ++b) text += std::string(b ? "," : "") + kBufferNames[b];
    return text;
}

}  // namespace

extern "C" {

// Why the last call on this thread returned nonzero.
const char* attngrad_error() { return error_message; }

// The BLAS entry points; `local_threads` may be null. Call once before anything else.
void attngrad_set_blas(void* sgemm, void* dgemm, void* local_threads) {
    blas_sgemm = reinterpret_cast<sgemm_fn>(sgemm);
    blas_dgemm = reinterpret_cast<dgemm_fn>(dgemm);
    blas_local_threads = reinterpret_cast<local_threads_fn>(local_threads);
}

// The layout of AttngradCall, which the Python side compares with its own before any call.
const char* attngrad_call_layout() {
    static const std::string layout = call_layout();
    return layout.c_str();
}

// How many parts the backward's dbias_parts (whole_rows 0) or the whole-row passes'
// tdbias_parts and g_bias_parts (1) hold: 1, or `chunks` where the bias is constant along the chunked
// axis; each (b, h, i, j)-shaped (bias_sizes), zeroed by the caller, who adds them in order.
int64_t attngrad_bias_grad_parts(const AttngradCall* call, int whole_rows) {
    return call ? bias_grad_parts(*call, whole_rows ? 2 : 3) : 0;
}

// Each entry point checks the call (check_call: q, k, v, and optionally a mask and a bias,
// with the buffers listed) and returns 0, or nonzero without touching a buffer
// (attngrad_error() says why).

// out (B, H, Lq, dv), row_max and inv_sum (B, H, Lq) from q, k, v; mask (bytes, nonzero =
// take part) and bias optional; dropout in the output's E V.
int attngrad_forward(const AttngradCall* call) {
    return run_checked("attngrad_forward", call,
                       {{buf_out, Use::required}, {buf_row_max, Use::required}, {buf_inv_sum, Use::required}},
                       [](const auto& pass) { forward(pass); });
}

// The buffers every pass after the forward reads: the forward's output and statistics,
// the upstream gradient, and the scratch row sums.
#define ATTNGRAD_AFTER_FORWARD                                                                     \
    {buf_out, Use::required}, {buf_row_max, Use::required}, {buf_inv_sum, Use::required},          \
        {buf_dout, Use::required}, {buf_delta, Use::required}

// dq_parts holds `chunks` zeroed (B, H, Lq, d) partial sums of dQ, one per chunk of key
// blocks; dk and dv are zeroed; delta is (B, H, Lq) scratch; dbias_parts, where given,
// holds attngrad_bias_grad_parts zeroed parts of the bias's gradient.
int attngrad_backward(const AttngradCall* call) {
    const Use with_bias = call && call->data[buf_bias] ? Use::optional : Use::none;
    return run_checked("attngrad_backward", call,
                       {ATTNGRAD_AFTER_FORWARD, {buf_dq_parts, Use::required}, {buf_dk, Use::required},
                        {buf_dv, Use::required}, {buf_dbias_parts, with_bias}},
                       [](const auto& pass) { backward(pass); });
}

// gq, gk, gv, gbias may be null (zero cotangents; gbias has the bias's sizes), and g_dout
// (not asked for). gk_parts and gv_parts hold `chunks` zeroed (B, Hkv, Lk, .) partial sums,
// one per chunk of query blocks, and g_bias_parts, where given, attngrad_bias_grad_parts
// zeroed parts of the bias's; block_rows rows per query block, each holding whole rows.
int attngrad_double_backward(const AttngradCall* call) {
    const Use with_bias = call && call->data[buf_bias] ? Use::optional : Use::none;
    return run_checked("attngrad_double_backward", call,
                       {ATTNGRAD_AFTER_FORWARD, {buf_gq, Use::optional}, {buf_gk, Use::optional},
                        {buf_gv, Use::optional}, {buf_gbias, with_bias}, {buf_g_dout, Use::optional},
                        {buf_g_q, Use::required}, {buf_gk_parts, Use::required}, {buf_gv_parts, Use::required},
                        {buf_g_bias_parts, with_bias}},
                       [](const auto& pass) { double_backward(pass); });
}

// tout (B, H, Lq, dv) <- the output's tangent for tangents tq, tk, tv, tbias (each may be
// null: zero; tbias has the bias's sizes), from the forward's row_max and inv_sum;
// block_rows rows per query block, each holding whole rows of keys.
int attngrad_jvp(const AttngradCall* call) {
    const Use with_bias = call && call->data[buf_bias] ? Use::optional : Use::none;
    return run_checked("attngrad_jvp", call,
                       {{buf_row_max, Use::required}, {buf_inv_sum, Use::required}, {buf_tq, Use::optional},
                        {buf_tk, Use::optional}, {buf_tv, Use::optional}, {buf_tbias, with_bias},
                        {buf_tout, Use::required}},
                       [](const auto& pass) { jvp(pass); });
}

// tdq (B, H, Lq, d) and the zeroed `chunks` partial sums tdk_parts, tdv_parts (B, Hkv, Lk, .)
// <- the tangents of the backward's dQ, dK, dV for tangents tdout, tq, tk, tv, tbias (each
// may be null: zero; tbias has the bias's sizes), and where given the zeroed parts
// tdbias_parts of dbias's; delta is (B, H, Lq) scratch; block_rows rows per query block,
// each holding whole rows of keys.
int attngrad_backward_jvp(const AttngradCall* call) {
    const Use with_bias = call && call->data[buf_bias] ? Use::optional : Use::none;
    return run_checked("attngrad_backward_jvp", call,
                       {ATTNGRAD_AFTER_FORWARD, {buf_tdout, Use::optional}, {buf_tq, Use::optional},
                        {buf_tk, Use::optional}, {buf_tv, Use::optional}, {buf_tbias, with_bias},
                        {buf_tdq, Use::required}, {buf_tdk_parts, Use::required}, {buf_tdv_parts, Use::required},
                        {buf_tdbias_parts, with_bias}},
                       [](const auto& pass) { backward_jvp(pass); });
}

#undef ATTNGRAD_AFTER_FORWARD

// out (numel elements) <- the (B, H, R, keys) keep-scale tile of `dropout.keep_scale_into`
// for rows row_start..row_start + R and keys key_start..key_start + keys; `threshold` is
// ceil(p 2^32), `value` 1 / (1 - p).
int attngrad_dropout_keep_scale(int double_precision, void* out, int64_t numel, int64_t batch, int64_t heads,
                                int64_t row_start, int64_t rows, int64_t key_start, int64_t keys, uint64_t seed,
                                uint64_t threshold, double value, int threads) {
    const char* what = "attngrad_dropout_keep_scale";
    const int64_t sizes[6] = {batch, heads, row_start, rows, key_start, keys};
    const char* names[6] = {"batch", "heads", "row_start", "rows", "key_start", "keys"};
    for (int i = 0; i < 6; ++i) {
        if (sizes[i] < 0 || sizes[i] > (int64_t{1} << 31)) return fail(what, names[i], sizes[i], 0), 1;
    }
    if (threads < 1) return fail(what, "threads", threads, 1), 1;
    if (numel != batch * heads * rows * keys) return fail(what, "numel", numel, batch * heads * rows * keys), 1;
    const DropoutDraw draw{true, seed, threshold, value};
    if (double_precision) {
        dropout_keep_scale<double>(static_cast<double*>(out), batch, heads, row_start, rows, key_start, keys, draw, threads);
    } else {
        dropout_keep_scale<float>(static_cast<float*>(out), batch, heads, row_start, rows, key_start, keys, draw, threads);
    }
    return 0;
}

}  // extern "C"
