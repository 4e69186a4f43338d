// attngrad's compiled tiles: the products of a tile of one query row (a decode step's
// tile, a block's last row), which runtime.cpp's gemm takes instead of the BLAS. A BLAS call
// at m = 1 is a matrix-vector product that costs its entry and blocking on every key block
// (a decode step made 40 of them per head); these stream the keys once with 64-byte vectors
// (GCC's vector extensions, as tiles_math.h), at the memory's pace.
//
// Each output's sum has an order fixed by k alone (a dot's lanes in turn, then a fixed tree;
// a row times a block, key after key), whatever n or its position, so the forward and the
// backward, which both come here for a one-row tile, get the same scores bit for bit, on
// either GEMM path.
#pragma once

#include <cmath>
#include <cstring>

#include "tiles_math.h"

namespace attngrad_tiles {

template <typename T>
struct RowVector;  // 64 bytes of T
template <>
struct RowVector<float> {
    using type = floatv;
};
template <>
struct RowVector<double> {
    using type = double __attribute__((vector_size(64)));
};

template <typename T, typename V = typename RowVector<T>::type>
inline V load_row(const T* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// The lanes' sum by halves, [0, n/2) + [n/2, n) down to one lane, in registers (the same
// sum through memory stalled on its stores: 8% of a decode step)
using float8v = float __attribute__((vector_size(32)));
using float4v = float __attribute__((vector_size(16)));
using double8v = RowVector<double>::type;
using double4v = double __attribute__((vector_size(32)));
using double2v = double __attribute__((vector_size(16)));

inline float sum_of_lanes(float4v v) {
    const float4v pair = v + __builtin_shufflevector(v, v, 2, 3, 0, 1);
    return pair[0] + pair[1];
}
inline float sum_of_lanes(float8v v) {
    return sum_of_lanes(__builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7));
}
inline float sum_of_lanes(floatv v) {
    return sum_of_lanes(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                        __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}
inline double sum_of_lanes(double2v v) { return v[0] + v[1]; }
inline double sum_of_lanes(double4v v) {
    return sum_of_lanes(__builtin_shufflevector(v, v, 0, 1) + __builtin_shufflevector(v, v, 2, 3));
}
inline double sum_of_lanes(double8v v) {
    return sum_of_lanes(__builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7));
}

// alpha x + beta y, where beta 0 ignores y (NaN included), as the BLAS does
template <typename T>
inline T scaled_sum(T alpha, T x, T beta, T y) {
    return beta == T(0) ? alpha * x : alpha * x + beta * y;
}

// c[j] = alpha a . b_j + beta c[j] for j < n, b_j = b + j ldb, each dot over k entries
// (a one-row tile's scores: S = scale q K^T, dP = dO V^T)
template <typename T>
void row_times_transposed(index_t n, index_t k, T alpha, const T* a, const T* b, index_t ldb, T beta, T* c) {
    using V = typename RowVector<T>::type;
    constexpr index_t lanes = sizeof(V) / sizeof(T);
    const index_t whole = k / lanes * lanes;
    // a . b_j: its lanes over the whole vectors, their tree, then the last k mod lanes in turn
    // (std::fma: as sum += a * b GCC vectorised them by the target's width, bits by -march)
    const auto finish = [&](V lanes_sum, const T* bj) {
        T sum = sum_of_lanes(lanes_sum);
        for (index_t e = whole; e < k; ++e) sum = std::fma(a[e], bj[e], sum);
        return sum;
    };
    const index_t pairs = k / (2 * lanes) * (2 * lanes);
    for (index_t j = 0; j < n; ++j) {  // two chains of FMAs per key: even and odd vectors
        const T* bj = b + j * ldb;
        V s0{}, s1{};
        for (index_t e = 0; e < pairs; e += 2 * lanes) {
            s0 += load_row(a + e) * load_row(bj + e);
            s1 += load_row(a + e + lanes) * load_row(bj + e + lanes);
        }
        if (pairs < whole) s0 += load_row(a + pairs) * load_row(bj + pairs);
        c[j] = scaled_sum(alpha, finish(s0 + s1, bj), beta, c[j]);
    }
}

// c[0, n) = alpha sum_{j < k} a[j] b_j[0, n) + beta c, b_j = b + j ldb: each output a sum
// over j in turn (a one-row tile times a block: O += E V, dQ += dS K)
template <typename T>
void row_times(index_t n, index_t k, T alpha, const T* a, const T* b, index_t ldb, T beta, T* c) {
    using V = typename RowVector<T>::type;
    constexpr index_t lanes = sizeof(V) / sizeof(T);
    const auto put = [&](index_t e, V sum) {
        V out = alpha * sum;
        if (beta != T(0)) out += beta * load_row(c + e);
        std::memcpy(c + e, &out, sizeof out);
    };
    index_t e = 0;
    for (; e + 4 * lanes <= n; e += 4 * lanes) {  // 4 vectors of outputs held over the keys
        V s0{}, s1{}, s2{}, s3{};
        for (index_t j = 0; j < k; ++j) {
            const T* bj = b + j * ldb + e;
            const V x = V{} + a[j];
            s0 += x * load_row(bj);
            s1 += x * load_row(bj + lanes);
            s2 += x * load_row(bj + 2 * lanes);
            s3 += x * load_row(bj + 3 * lanes);
        }
        put(e, s0), put(e + lanes, s1), put(e + 2 * lanes, s2), put(e + 3 * lanes, s3);
    }
    for (; e + lanes <= n; e += lanes) {
        V s{};
        for (index_t j = 0; j < k; ++j) s += (V{} + a[j]) * load_row(b + j * ldb + e);
        put(e, s);
    }
    for (; e < n; ++e) {
        T s = 0;
        for (index_t j = 0; j < k; ++j) s += a[j] * b[j * ldb + e];
        c[e] = scaled_sum(alpha, s, beta, c[e]);
    }
}

}  // namespace attngrad_tiles
