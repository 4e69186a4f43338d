// attngrad's compiled tiles: the row arithmetic every pass shares. exp and tanh in float32
// as explicit 16-lane SIMD (GCC's vector extensions), and the row loops built on them; each
// row loop has a plain loop over elements (float64, and float32's last n mod 16 entries)
// and a float32 version over 16-float vectors.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace attngrad_tiles {

using index_t = int64_t;

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
using halfv = float __attribute__((vector_size(kLanes / 2 * sizeof(float))));
using doublev = double __attribute__((vector_size(kLanes / 2 * sizeof(double))));

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

// The type a row's float32 sums are kept in: double (float64's own stays double)
template <typename T>
using wide_t = std::conditional_t<std::is_same_v<T, float>, double, T>;

// The last n < 16 entries of a row as one vector, `pad` in the lanes past them, and back:
// a row's tail runs the vector code (a row ending at the causal diagonal or a window's edge
// has one in most tiles, and 15 scalar exps cost more than the vector's 16)
inline floatv load_tail(const float* x, index_t n, float pad) {
#if defined(__AVX512F__)
    // one masked load, which reads nothing past x + n (the portable lane loop costs a short
    // row's tail up to 15 scalar loads and a trip through the stack)
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(pad), static_cast<__mmask16>((1u << n) - 1), x);
    floatv out;
    std::memcpy(&out, &v, sizeof out);
    return out;
#else
    float lanes[kLanes];
    for (index_t i = 0; i < kLanes; ++i) lanes[i] = i < n ? x[i] : pad;
    return load(lanes);
#endif
}

inline void store_tail(float* x, index_t n, floatv v) {
#if defined(__AVX512F__)
    __m512 w;
    std::memcpy(&w, &v, sizeof w);
    _mm512_mask_storeu_ps(x, static_cast<__mmask16>((1u << n) - 1), w);
#else
    for (index_t i = 0; i < n; ++i) x[i] = v[i];
#endif
}

// The sum of 8 doubles, halves added to halves
inline double lanes_sum(doublev v) {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    return v[0];
}

// A row's float32 sum over 4 x 16 lanes, each lane summed in float32 and the 64 partial sums
// in double: a row of 512 keys leaves each lane 8 terms (against 32 in 16 lanes), and the
// four chains hide the adds' latency. term(j) makes (and stores) the 16 summands from j on,
// tail(j, count) the last count < 16 of them, zeros past them.
template <typename Term, typename Tail>
inline double wide_row_sum(index_t n, Term&& term, Tail&& tail) {
    floatv a0{}, a1{}, a2{}, a3{};
    index_t j = 0;
    for (; j + 4 * kLanes <= n; j += 4 * kLanes) {
        a0 += term(j);
        a1 += term(j + kLanes);
        a2 += term(j + 2 * kLanes);
        a3 += term(j + 3 * kLanes);
    }
    for (; j + kLanes <= n; j += kLanes) a0 += term(j);
    if (j < n) a1 += tail(j, n - j);
    // the 64 partial sums as 8-double vectors, then halves added to halves (a scalar loop
    // over them cost as much again)
    const auto low = [](floatv x) {
        return __builtin_convertvector(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7), doublev);
    };
    const auto high = [](floatv x) {
        return __builtin_convertvector(__builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15), doublev);
    };
    return lanes_sum(((low(a0) + low(a1)) + (low(a2) + low(a3))) + ((high(a0) + high(a1)) + (high(a2) + high(a3))));
}

// rowsum(a * b) of a row of n, in double: 8 lanes of exact float products (or of doubles'),
// the last n mod 8 one by one (std::fma: see the row operations below)
template <typename T>
inline double wide_dot(const T* a, const T* b, index_t n) {
    doublev lanes{};
    index_t j = 0;
    for (; j + kLanes / 2 <= n; j += kLanes / 2) {
        if constexpr (std::is_same_v<T, float>) {
            halfv x, y;
            std::memcpy(&x, a + j, sizeof x);
            std::memcpy(&y, b + j, sizeof y);
            lanes += __builtin_convertvector(x, doublev) * __builtin_convertvector(y, doublev);
        } else {
            doublev x, y;
            std::memcpy(&x, a + j, sizeof x);
            std::memcpy(&y, b + j, sizeof y);
            lanes += x * y;
        }
    }
    double sum = lanes_sum(lanes);
    for (; j < n; ++j) sum = std::fma(double(a[j]), double(b[j]), sum);
    return sum;
}

// tanh in float32, for the soft cap: below |x| = 0.625 the odd minimax polynomial of Cephes'
// tanhf (x + x^3 p(x^2), about 2 ulp), above it (1 - e) / (1 + e) with e = exp(-2 |x|) from
// exp_score (e <= 0.29 there: no cancellation), signed. One body for a float and a 16-float
// vector, like exp_score_any; float64 keeps the C library's tanh.
template <typename F>
inline F tanh_small(F x) {  // the polynomial branch, |x| < 0.625
    const F z = x * x;
    F p = F{} - 5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    return p * z * x + x;
}

template <typename F, typename I>
inline F tanh_any(F x) {
    const F zero{}, one = F{} + 1.0f, cut = F{} + 0.625f;
    const F ax = x < zero ? -x : x;
    const F e = exp_score_any<F, I>(ax * -2.0f);
    const F large = (one - e) / (one + e);
    return ax < cut ? tanh_small(x) : (x < zero ? -large : large);
}

inline float tanh_cap(float x) { return tanh_any<float, int32_t>(x); }
// 16 lanes: where every lane is below the cut (a soft cap well above the scores, as
// Gemma's 50), the polynomial alone, without the exp and the division of the other branch;
// each lane's value is the one tanh_any gives it either way
inline floatv tanh_cap(floatv x) {
    const floatv ax = x < floatv{} ? -x : x;
#if defined(__AVX512F__)
    const bool small = _mm512_cmp_ps_mask(reinterpret_cast<__m512>(ax), _mm512_set1_ps(0.625f), _CMP_GE_OQ) == 0;
#else
    bool small = true;
    for (int t = 0; t < kLanes; ++t) small &= ax[t] < 0.625f;
#endif
    return small ? tanh_small(x) : tanh_any<floatv, intv>(x);
}
inline double tanh_cap(double x) { return std::tanh(x); }

// Each row operation below has a loop over elements, which float32 also runs on a row's
// last n mod 16 entries, and a float32 version over 16-float vectors. A loop's sum of
// products is std::fma(a, b, sum), one rounding each, in any build: as sum += a * b GCC
// vectorised the sum in order (products rounded, then added) by the target's vector width
// and made FMAs of the entries left over, so the bits changed with -march (float64 JVPs).

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
inline float max_of(const float* x, index_t n) {
    constexpr float neg_inf = -std::numeric_limits<float>::infinity();
    floatv lanes = floatv{} + neg_inf;
    const auto take = [&lanes](floatv v) { lanes = v > lanes ? v : lanes; };
    index_t j = 0;
    for (; j + kLanes <= n; j += kLanes) take(load(x + j));
    if (j < n) take(load_tail(x + j, n - j, neg_inf));
    // halves against halves: four steps, not a chain of 16
    take(__builtin_shufflevector(lanes, lanes, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    take(__builtin_shufflevector(lanes, lanes, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    take(__builtin_shufflevector(lanes, lanes, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    take(__builtin_shufflevector(lanes, lanes, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return lanes[0];
}

// Whether any x_j is NaN: asked only of a row whose maximum came out -inf (max_of passes over
// NaN, as x > top is false for it), to tell a row that sees no key (every score -inf) from
// one that a NaN reached (issue 58: the NaN must come out, not a row of 0)
template <typename T>
bool has_nan(const T* x, index_t n) {
    bool nan = false;
    for (index_t j = 0; j < n; ++j) nan |= x[j] != x[j];
    return nan;
}

// The row's maximum so far m and a tile's t, NaN if either is (std::max(m, NaN) is m)
template <typename T>
T max_keeping_nan(T m, T t) {
    return m != m || t != t ? m + t : std::max(m, t);
}

// x_j <- exp(x_j - shift); returns the sum of the new x_j (wide_row_sum's for float32: l
// divides every P of its row, and its rounding in 16 float lanes was most of P's own)
template <typename T>
wide_t<T> exp_and_sum_each(T* x, index_t n, T shift) {
    wide_t<T> sum = 0;
    for (index_t j = 0; j < n; ++j) {
        x[j] = exp_score(x[j] - shift);
        sum += x[j];
    }
    return sum;
}

template <typename T>
wide_t<T> exp_and_sum(T* x, index_t n, T shift) {
    return exp_and_sum_each(x, n, shift);
}

template <>
inline double exp_and_sum(float* x, index_t n, float shift) {
    constexpr float neg_inf = -std::numeric_limits<float>::infinity();
    return wide_row_sum(
            n,
            [&](index_t at) {
                const floatv e = exp_score(load(x + at) - shift);
                store(x + at, e);
                return e;
            },
            [&](index_t at, index_t count) {
                const floatv e = exp_score(load_tail(x + at, count, neg_inf) - shift);  // exp(-inf) = 0
                store_tail(x + at, count, e);
                return e;
            });
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
inline void probs_and_score_grad(float* p, float* ds, index_t n, float m, float inv, float d) {
    index_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
        const floatv pj = exp_score(load(p + j) - m) * inv;
        store(p + j, pj);
        store(ds + j, pj * (load(ds + j) - d));
    }
    if (j < n) {
        const floatv pj = exp_score(load_tail(p + j, n - j, 0) - m) * inv;
        store_tail(p + j, n - j, pj);
        store_tail(ds + j, n - j, pj * (load_tail(ds + j, n - j, 0) - d));
    }
}

// The double backward's row work, in three sweeps over one row (in the manner of the row
// operations above: a loop for any type, 16-float vectors for float32).
// p <- P = exp(S - m) / l; returns t = rowsum(P * T), summed as wide_row_sum does: t (the
// backward's D) is subtracted from every entry of its row, so its rounding lands in each
template <typename T>
wide_t<T> probs_and_dot_each(T* p, const T* t, index_t n, T m, T inv) {
    wide_t<T> sum = 0;
    for (index_t j = 0; j < n; ++j) {
        p[j] = exp_score(p[j] - m) * inv;
        sum = std::fma(p[j], t[j], sum);
    }
    return sum;
}

template <typename T>
T probs_and_dot(T* p, const T* t, index_t n, T m, T inv) {
    return probs_and_dot_each(p, t, n, m, inv);
}

template <>
inline float probs_and_dot(float* p, const float* t, index_t n, float m, float inv) {
    constexpr float neg_inf = -std::numeric_limits<float>::infinity();
    return static_cast<float>(wide_row_sum(
            n,
            [&](index_t at) {
                const floatv pj = exp_score(load(p + at) - m) * inv;
                store(p + at, pj);
                return pj * load(t + at);
            },
            [&](index_t at, index_t count) {
                const floatv pj = exp_score(load_tail(p + at, count, neg_inf) - m) * inv;  // P = 0 past them
                store_tail(p + at, count, pj);
                return pj * load_tail(t + at, count, 0);
            }));
}

// p <- p * inv (E = exp(S - m) to P = E / l, as probs_and_dot rounds it); returns rowsum(P * t)
template <typename T>
wide_t<T> scale_and_dot_each(T* p, const T* t, index_t n, T inv) {
    wide_t<T> sum = 0;
    for (index_t j = 0; j < n; ++j) {
        p[j] *= inv;
        sum = std::fma(p[j], t[j], sum);
    }
    return sum;
}

template <typename T>
T scale_and_dot(T* p, const T* t, index_t n, T inv) {
    return scale_and_dot_each(p, t, n, inv);
}

template <>
inline float scale_and_dot(float* p, const float* t, index_t n, float inv) {
    return static_cast<float>(wide_row_sum(
            n,
            [&](index_t at) {
                const floatv pj = load(p + at) * inv;
                store(p + at, pj);
                return pj * load(t + at);
            },
            [&](index_t at, index_t count) {
                const floatv pj = load_tail(p + at, count, 0) * inv;
                store_tail(p + at, count, pj);
                return pj * load_tail(t + at, count, 0);
            }));
}

// x <- g_P = (dP - D) (T - t) + X,  t <- g_dP = P (T - t),  dp <- dS = P (dP - D);
// returns u = rowsum(P * g_P)
template <typename T>
T second_order_terms_each(const T* p, T* t, T* dp, T* x, index_t n, T t_sum, T d_row) {
    T sum = 0;
    for (index_t j = 0; j < n; ++j) {
        const T t_centred = t[j] - t_sum, dp_centred = dp[j] - d_row;
        const T g_p = dp_centred * t_centred + x[j];
        sum = std::fma(p[j], g_p, sum);
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
inline float second_order_terms(const float* p, float* t, float* dp, float* x, index_t n, float t_sum, float d_row) {
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

// A row's sink probability P_sink = exp(0 - m) / l from its statistics (1/l includes the
// sink's term); 0 without a sink or on a row that sees no key (1/l = 0)
template <typename T>
T sink_probability(bool sink, T m, T inv) {
    return sink && inv != T(0) ? std::exp(std::log(inv) - m) : T(0);
}

// x <- x - c
template <typename T>
void shift_row(T* x, index_t n, T c) {
    for (index_t j = 0; j < n; ++j) x[j] -= c;
}

// The first key of a row's largest P: the key its sums are centred on (centre_on_peak);
// 0 for a row without a finite largest P (none: all NaN)
template <typename T>
index_t peak_of(const T* p, index_t n) {
    index_t at = 0;
    for (index_t j = 1; j < n; ++j) at = p[j] > p[at] || !(p[at] == p[at]) ? j : at;
    return at;
}

// float32 in one sweep of 16 lanes, each keeping its first largest P and where (the index as
// a float: exact below 2^24 keys), then the lanes' largest, the first on a tie
template <>
inline index_t peak_of(const float* p, index_t n) {
    constexpr float neg_inf = -std::numeric_limits<float>::infinity();
    if (n >= (index_t(1) << 24)) {  // past float's exact integers: the plain sweep
        index_t at = 0;
        for (index_t j = 1; j < n; ++j) at = p[j] > p[at] || !(p[at] == p[at]) ? j : at;
        return at;
    }
    floatv best = floatv{} + neg_inf, best_at{}, lane{};
    for (int i = 0; i < kLanes; ++i) lane[i] = static_cast<float>(i);
    const auto take = [&](floatv v, floatv where) {
        const auto larger = v > best;
        best = larger ? v : best;
        best_at = larger ? where : best_at;
    };
    index_t j = 0;
    for (; j + kLanes <= n; j += kLanes) take(load(p + j), lane + static_cast<float>(j));
    if (j < n) take(load_tail(p + j, n - j, neg_inf), lane + static_cast<float>(j));
    float top = neg_inf, top_at = 0.0f;
    for (int i = 0; i < kLanes; ++i) {
        if (best[i] > top || (best[i] == top && best_at[i] < top_at)) top = best[i], top_at = best_at[i];
    }
    return static_cast<index_t>(top_at);
}

// x <- x - c, with c = x at the row's most probable entry; returns {c, t - c}, t =
// rowsum(P * x) + P_sink x_sink (a sink is an entry of the row too, of probability p_sink
// and value x_sink: 0 for S' and T, whose sink's logit has no tangent; t D for g_P). On a
// peaked row t is nearly x at the peak, and x - t there would cancel t's rounding (about
// |x| eps: float64 backward JVPs erred up to 1e-10 so); centred, the peak's term of the sum
// is 0 exactly. Where the sink is the most probable entry, c = x_sink (a row that gives the
// sink 0.9997 of its weight erred 2.4e-12 centred on its one key). rowsum(P) = 1 - P_sink,
// so t - c = rowsum(P (x - c)) + P_sink (x_sink - c). Summed in double: float32 as
// wide_row_sum does, float64 in wide_dot's 8 lanes (as a plain loop's sum, which GCC
// vectorised by the target's width, its bits changed with -march; and 8 chains run faster).
template <typename T>
T peak_value(const T* p, const T* x, index_t n, T p_sink, T x_sink) {
    const index_t at = peak_of(p, n);
    return p_sink > p[at] ? x_sink : x[at];
}

template <typename T>
std::pair<T, T> centre_on_peak_each(const T* p, T* x, index_t n, T p_sink, T x_sink) {
    if (n == 0) return {T(0), T(0)};
    const T c = peak_value(p, x, n, p_sink, x_sink);
    shift_row(x, n, c);
    const wide_t<T> sum = wide_dot(p, x, n);
    return {c, static_cast<T>(sum + static_cast<wide_t<T>>(p_sink) * (static_cast<wide_t<T>>(x_sink) - c))};
}

template <typename T>
std::pair<T, T> centre_on_peak(const T* p, T* x, index_t n, T p_sink, T x_sink = T(0)) {
    return centre_on_peak_each(p, x, n, p_sink, x_sink);
}

template <>
inline std::pair<float, float> centre_on_peak(const float* p, float* x, index_t n, float p_sink, float x_sink) {
    if (n == 0) return {0.0f, 0.0f};
    const float c = peak_value(p, x, n, p_sink, x_sink);
    const double sum = wide_row_sum(
            n,
            [&](index_t at) {
                const floatv xj = load(x + at) - c;
                store(x + at, xj);
                return load(p + at) * xj;
            },
            [&](index_t at, index_t count) {
                const floatv xj = load_tail(x + at, count, 0) - c;
                store_tail(x + at, count, xj);
                return load_tail(p + at, count, 0) * xj;
            });
    return {c, static_cast<float>(sum + static_cast<double>(p_sink) * (static_cast<double>(x_sink) - c))};
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
inline void centre_and_scale(const float* p, float* x, index_t n, float u) {
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
inline float tangent_delta(const float* p, const float* p_t, const float* dp, const float* dp_t, index_t n) {
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
inline void score_grad_tangents(const float* p, const float* p_t, float* dp, float* dp_t, index_t n, float d, float d_t) {
    index_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
        const floatv pj = load(p + j), centred = load(dp + j) - d;
        store(dp_t + j, load(p_t + j) * centred + pj * (load(dp_t + j) - d_t));
        store(dp + j, pj * centred);
    }
    score_grad_tangents_each(p + j, p_t + j, dp + j, dp_t + j, n - j, d, d_t);
}

}  // namespace attngrad_tiles
