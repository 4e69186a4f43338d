// attngrad's compiled tiles: what the passes on query blocks of whole rows share (the JVP,
// the backward's JVP and the double backward, passes_higher.cpp): the blocks, their work
// loop, the key side of their products, and the rows' probabilities.
#pragma once

#include "tiles.h"

namespace attngrad_tiles {

// A key-side operand of a block's products from the block's first key on: keys x width as
// the (B, Hkv, Lk, width) tensors hold it, or width x keys (KeySide's transposed copy,
// leading dimension `ld`); null for an absent tangent or cotangent.
template <typename T>
struct KeyOperand {
    const T* p = nullptr;
    index_t ld = 0;
    bool transposed = false;
    explicit operator bool() const { return p != nullptr; }
};

// A key-side gradient from a block's first key on: its part (keys x width), or KeySide's
// transposed sum (width x keys, leading dimension `ld`).
template <typename T>
struct KeyGradient {
    T* p = nullptr;
    index_t ld = 0;
    bool transposed = false;
};

// out (rows x keys) = alpha (a1 k1^T + a2 k2^T), a1 and a2 rows x width and row-major; a pair
// with a null factor is left out, and with neither out is 0. The score-sized products:
// scale Q K^T, scale (tQ K^T + Q tK^T), dO V^T, dO tV^T + tdO V^T, ...
template <typename T>
void times_keys(const Pass<T>& pass, index_t rows, index_t keys, index_t width, T alpha, const T* a1,
                const KeyOperand<T>& k1, const T* a2, const KeyOperand<T>& k2, T* out) {
    const bool first = a1 && k1, second = a2 && k2;
    if (first) pass.gemm(false, !k1.transposed, rows, keys, width, alpha, a1, width, k1.p, k1.ld, T(0), out, keys);
    if (second) {
        pass.gemm(false, !k2.transposed, rows, keys, width, alpha, a2, width, k2.p, k2.ld, T(first ? 1 : 0), out,
                  keys);
    }
    if (!first && !second) std::fill(out, out + rows * keys, T(0));
}
template <typename T>
void times_keys(const Pass<T>& pass, index_t rows, index_t keys, index_t width, T alpha, const T* a,
                const KeyOperand<T>& k, T* out) {
    times_keys<T>(pass, rows, keys, width, alpha, a, k, nullptr, KeyOperand<T>{}, out);
}

// g += alpha x^T a for x (rows x keys, row-major) and a (rows x width, row-major), or
// nothing where a is null: the key-side gradients' products, dK += scale dS^T Q, ...
template <typename T>
void add_keys_product(const Pass<T>& pass, index_t rows, index_t keys, index_t width, T alpha, const T* x,
                      const T* a, const KeyGradient<T>& g) {
    if (!a) return;
    if (g.transposed) {  // g^T += alpha a^T x
        pass.gemm(true, false, width, keys, rows, alpha, a, width, x, keys, T(1), g.p, g.ld);
    } else {
        pass.gemm(true, false, keys, width, rows, alpha, x, keys, a, width, T(1), g.p, g.ld);
    }
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

// The whole-row passes' probabilities: p <- P = exp(S - m) / l over a row's n keys; returns
// t = rowsum(P * form). A row whose one key takes part (`single`, with l = 1) has P = 1 there
// exactly, so t is the form there.
template <typename T>
T row_probs(T* p, const T* form, index_t n, T m, T inv, bool single) {
    const T t = probs_and_dot(p, form, n, m, inv);
    return single ? single_key_probs(p, form, n) : t;
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

// The numbers in one tile of whole rows: block_rows x Lk, or fewer rows where the call has fewer
template <typename T>
index_t row_block_tile(const Pass<T>& pass) {
    return std::min<index_t>(pass.call.block_rows, pass.s.len_q) * pass.s.len_k;
}

// The key side of a whole-row pass, one work item's key/value head at a time: its inputs (K,
// V and their tangents or cotangents, (B, Hkv, Lk, width), each may be null) and its
// gradients (chunks x (B, Hkv, Lk, width) parts). With the call's `transposed_keys`, each
// thread copies an item's inputs transposed (width x keys) over the keys its blocks see and
// sums its gradients transposed, writing them into the item's parts when it ends: MKL's NN
// kernel runs the products by K^T and into dK^T 9-13% faster than its NT and TN kernels run
// them on the heads as they are (128 x Lk x 64 float32 tiles, Lk 512-4096, Intel Xeon). The
// copies hold (Lk x the widths) numbers per thread, so Python asks for them only up to a
// size (native.TRANSPOSED_KEYS); without, the products read and write the heads in place.
template <typename T>
class KeySide {
   public:
    struct Input {
        const T* base;
        index_t width;
    };
    struct Gradient {
        T* parts;
        index_t width;
    };

    KeySide(const Pass<T>& pass, std::vector<Input> inputs, std::vector<Gradient> grads)
        : transposed_(pass.call.transposed_keys), len_k_(pass.s.len_k),
          kv_size_(pass.s.batch * pass.s.kv_heads * pass.s.len_k), inputs_(std::move(inputs)),
          grads_(std::move(grads)) {}

    // A thread's copies, for the items it takes in turn
    class Local {
       public:
        explicit Local(const KeySide& side) : side_(side) {
            if (!side.transposed_) return;
            index_t numbers = 0;
            for (const Input& in : side.inputs_) numbers += in.base ? in.width * side.len_k_ : 0;
            for (const Gradient& g : side.grads_) numbers += g.width * side.len_k_;
            buffer_.resize(numbers);
        }

        // Item `it`, whose blocks see keys [lo, hi): its inputs copied, its sums zeroed
        void begin(const KvItem& it, index_t lo, index_t hi) {
            lo_ = lo, span_ = hi - lo;
            if (!side_.transposed_) return;
            T* at = buffer_.data();
            for (const Input& in : side_.inputs_) {
                if (!in.base) continue;
                transpose(span_, in.width, in.base + (it.bhk * side_.len_k_ + lo) * in.width, in.width, at, span_);
                at += in.width * span_;
            }
            std::fill(gradients(), gradients() + gradient_numbers(), T(0));
        }

        // The item's sums into its parts' keys [lo, hi), written: no other item writes that
        // part's head (KvItems), and the pass's caller zeroes the parts
        void end(const KvItem& it) const {
            if (!side_.transposed_) return;
            const T* at = gradients();
            for (const Gradient& g : side_.grads_) {
                T* head = g.parts + it.chunk * side_.kv_size_ * g.width + (it.bhk * side_.len_k_ + lo_) * g.width;
                transpose(g.width, span_, at, span_, head, g.width);
                at += g.width * span_;
            }
        }

        // Input i from block blk's first key on (null where the input is)
        KeyOperand<T> input(int i, const RowBlock& blk) const {
            const Input& in = side_.inputs_[i];
            if (!in.base) return {};
            if (!side_.transposed_) return {blk.head(in.base, in.width), in.width, false};
            const T* at = buffer_.data();
            for (int e = 0; e < i; ++e) at += side_.inputs_[e].base ? side_.inputs_[e].width * span_ : 0;
            return {at + (blk.key0 - lo_), span_, true};
        }

        // out (rows x keys) = alpha (a1 K1^T + a2 K2^T) over block blk's keys, K1 and K2 inputs
        // i1 and i2 (-1: none; a null factor leaves its pair out). Transposed copies of inputs
        // i and i + 1 lie stacked, so that pair runs as one product twice as deep,
        // [a1 | a2] [K1^T; K2^T], 11% faster than two (128 x 4096 x 64, float32, Intel Xeon).
        void times_keys(const Pass<T>& pass, const RowBlock& blk, index_t width, T alpha, const T* a1, int i1,
                        const T* a2, int i2, T* out) {
            const KeyOperand<T> k1 = input(i1, blk), k2 = i2 < 0 ? KeyOperand<T>{} : input(i2, blk);
            if (!(a1 && k1 && a2 && k2 && k1.transposed && k2.p == k1.p + width * k1.ld)) {
                attngrad_tiles::times_keys(pass, blk.rows, blk.keys, width, alpha, a1, k1, a2, k2, out);
                return;
            }
            pair_.resize(blk.rows * 2 * width);
            for (index_t r = 0; r < blk.rows; ++r) {
                std::copy(a1 + r * width, a1 + (r + 1) * width, pair_.data() + r * 2 * width);
                std::copy(a2 + r * width, a2 + (r + 1) * width, pair_.data() + r * 2 * width + width);
            }
            pass.gemm(false, false, blk.rows, blk.keys, 2 * width, alpha, pair_.data(), 2 * width, k1.p, k1.ld, T(0),
                      out, blk.keys);
        }
        void times_keys(const Pass<T>& pass, const RowBlock& blk, index_t width, T alpha, const T* a, int i, T* out) {
            times_keys(pass, blk, width, alpha, a, i, nullptr, -1, out);
        }

        // Gradient i from block blk's first key on
        KeyGradient<T> gradient(int i, const RowBlock& blk) {
            const Gradient& g = side_.grads_[i];
            if (!side_.transposed_) return {blk.part_head(g.parts, side_.kv_size_, g.width), g.width, false};
            T* at = gradients();
            for (int e = 0; e < i; ++e) at += side_.grads_[e].width * span_;
            return {at + (blk.key0 - lo_), span_, true};
        }

       private:
        index_t gradient_numbers() const {
            index_t n = 0;
            for (const Gradient& g : side_.grads_) n += g.width * span_;
            return n;
        }
        T* gradients() { return buffer_.data() + input_numbers(); }
        const T* gradients() const { return buffer_.data() + input_numbers(); }
        index_t input_numbers() const {
            index_t n = 0;
            for (const Input& in : side_.inputs_) n += in.base ? in.width * span_ : 0;
            return n;
        }
        const KeySide& side_;
        std::vector<T> buffer_, pair_;  // the copies; [a1 | a2]
        index_t lo_ = 0, span_ = 0;
    };

   private:
    bool transposed_;
    index_t len_k_, kv_size_;
    std::vector<Input> inputs_;
    std::vector<Gradient> grads_;
};

// body(block, scratch, side) for every query block of whole rows: the work `items` in
// parallel, each visiting, for its (chunk of query blocks, b, key/value head)s in order, its
// chunk of blocks for every query head of the group in order (so its sums into its own parts
// have a fixed order); `scratch` holds `tiles` tiles of block_rows x Lk per thread, and
// `side` is the thread's KeySide::Local, begun on each (chunk, b, key/value head) over the
// keys its blocks see and ended after them.
template <typename T, typename Body>
void for_each_row_block(const Pass<T>& pass, const KvItems& items, int tiles, const KeySide<T>& key_side,
                        Body&& body) {
    const Shape& s = pass.s;
    const index_t block_rows = pass.call.block_rows, chunks = pass.call.chunks;
    const index_t group = s.heads / s.kv_heads;
    const index_t query_blocks = (s.len_q + block_rows - 1) / block_rows;
    const KeyRanges ranges(pass.call);
    parallel_items(items.count(), [&](const ItemSource& source) {
        std::vector<T> scratch(tiles * row_block_tile(pass));
        typename KeySide<T>::Local side(key_side);
        for (index_t item; (item = source.next()) >= 0;) {
            items.visit(item, [&](const KvItem& it) {
                const index_t qb0 = it.chunk * query_blocks / chunks, qb1 = (it.chunk + 1) * query_blocks / chunks;
                index_t lo = s.len_k, hi = 0;  // the keys any of the item's blocks sees
                for (index_t qb = qb0; qb < qb1; ++qb) {
                    const auto [key0, n] = ranges(it.b, qb);
                    if (n > 0) lo = std::min(lo, key0), hi = std::max(hi, key0 + n);
                }
                side.begin(it, std::min(lo, hi), hi);
                for (index_t h = it.hk * group; h < (it.hk + 1) * group; ++h) {
                    for (index_t qb = qb0; qb < qb1; ++qb) {
                        RowBlock blk{it.chunk, it.b, it.hk, it.bhk, h, it.b * s.heads + h, qb * block_rows, 0, 0, 0,
                                     s.len_k};
                        blk.rows = std::min(block_rows, s.len_q - blk.r0);
                        blk.first = blk.bh * s.len_q + blk.r0;
                        std::tie(blk.key0, blk.keys) = ranges(it.b, qb);  // block_map.key_ranges
                        body(blk, scratch.data(), side);
                    }
                }
                side.end(it);
            });
        }
    });
}

}  // namespace attngrad_tiles
