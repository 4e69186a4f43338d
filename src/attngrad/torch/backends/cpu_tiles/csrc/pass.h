// A call with its buffers typed (Pass), what every pass takes, and how a pass lays the
// keys out: the E V product's slices and a narrow band's transposed keys (BandKeys).
#pragma once

#include "score_masks.h"

namespace attngrad_tiles {

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

}  // namespace attngrad_tiles
