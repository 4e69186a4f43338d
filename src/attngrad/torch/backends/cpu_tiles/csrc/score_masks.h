// What decides each score and which tiles a pass computes: the mask, bias and key bounds
// (ScoreMask), the rows that see one key, the tile map and each query block's key range
// (TileMap, KeyRanges), and the soft cap (Softcap, CapRows).
#pragma once

#include "tile_call.h"

namespace attngrad_tiles {

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

}  // namespace attngrad_tiles
