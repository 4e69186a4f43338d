// attngrad's compiled tiles: bfloat16's products (bf16_products.cpp), for the passes of a
// call with bf16_products. Included by tiles.h within its namespace, after the call and the float32 GEMM.
#pragma once

// A pass's key-side inputs (K, V and their tangents or cotangents) rounded to bfloat16 once,
// for the GEMMs of a call with bf16_products: each GEMM would otherwise round its operands
// anew, K and V once per query block that sees them (a query block's own rows are rounded
// by the few products of its tiles, and a copy of them would cost as much memory).
//
// Where the matrix units take oneDNN's batch-reduce GEMM (use_brgemm), the forward's and
// the backward's K and V are kept instead in the layouts that GEMM reads as its B operand,
// pairs of bfloat16 along the summed axis in one 32-bit word (VNNI): `by_width`, per key
// block of each head [width/2][panel_ld], for products with the input transposed (S = Q K^T,
// dP = dO V^T: summed over the head width), `by_rows`, per head [rows/2][width] (a last odd
// row paired with 0), for products with it as it is (E V, dS K: summed over keys).
//
// PyTorch keeps every brgemm kernel it builds, one per shape and leading dimensions, for the
// thread's life: brgemm takes only the shapes of a bounded set (BrgemmShapes), whatever the
// call's lengths (300 bfloat16 calls at lengths 256 to 555 otherwise held 149 MiB more).
class RoundedInputs {
   public:
    RoundedInputs() = default;
    explicit RoundedInputs(const AttngradCall& c);

    struct Input {
        const float* base;
        index_t count, width;             // count = rows x width, row-major
        index_t head_rows = 0;            // rows of a head
        std::vector<uint16_t> rounded;    // as the input's own layout (MKL's bfloat16 GEMM)
        std::vector<uint32_t> by_width;   // per head and key block [width/2][panel_ld] words (use_brgemm)
        std::vector<uint32_t> by_rows;    // per head [ceil(head_rows/2)][width] words (use_brgemm)
        index_t rows() const { return count / width; }
    };

    // The input `a` lies in, or null
    const Input* holding(const float* a) const {
        for (const Input& in : inputs_) {
            if (a >= in.base && a < in.base + in.count) return &in;
        }
        return nullptr;
    }
    // The rounded copy of `a` where `a` lies in an input buffer kept in its own layout (the
    // copy keeps it, so `a`'s leading dimension holds), else null
    const uint16_t* find(const float* a) const {
        const Input* in = holding(a);
        return in && !in->rounded.empty() ? in->rounded.data() + (a - in->base) : nullptr;
    }
    // Whether the inputs are kept in VNNI words: the pass's products run on brgemm
    bool vnni() const { return vnni_; }
    // The tiles' query rows and key block, by which brgemm's shapes are bounded
    index_t block_rows() const { return block_rows_; }
    index_t block_keys() const { return block_keys_; }
    index_t panel_ld() const { return panel_ld_; }  // by_width's words per pair of a key block

   private:
    std::vector<Input> inputs_;
    bool vnni_ = false;
    index_t block_rows_ = 0, block_keys_ = 0, panel_ld_ = 0;
};

// The shapes brgemm takes (a bounded set: each new one builds a kernel PyTorch keeps): a
// block of `block_rows` rows (or a head width) by a multiple of 64 keys up to a key block,
// leading dimensions among those and the widths. Other products run on MKL's GEMM.
inline bool brgemm_keys_shape(index_t n, index_t block_keys) { return n % 64 == 0 && n > 0 && n <= block_keys; }

// The same with A and B rounded to bfloat16 first, multiplied by MKL's bfloat16 GEMM (the
// matrix units where the CPU has them), sums in float32; where there is none (or ATen's path
// is chosen), the rounded operands go through the float32 GEMM: the same products. An operand
// in `inputs` takes its rounded copy there, and A takes `a_rounded` where given (A rounded
// already, in its own layout: a RoundedTile's).
void gemm_bf16(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, float alpha, const float* a, index_t lda,
               const float* b, index_t ldb, float beta, float* c, index_t ldc, const RoundedInputs& inputs,
               const uint16_t* a_rounded = nullptr);

// Whether gemm_bf16 runs MKL's bfloat16 GEMM (the one that reads rounded copies)
bool bf16_gemm_reads_copies();

// The route of bfloat16's products: oneDNN's batch-reduce GEMM (PyTorch's cpublas::brgemm)
// on the products whose B is a pass input (RoundedInputs), on the matrix units (AMX-BF16,
// where PyTorch packs bfloat16: cpublas::could_pack) or on AVX512-BF16's dot products; or
// MKL's bfloat16 GEMM alone. MKL's GEMM runs every other product on either brgemm route.
enum Bf16Route : int { kBf16Mkl = 0, kBf16BrgemmAmx = 1, kBf16BrgemmAvx512 = 2 };
int bf16_route();

// Whether gemm_bf16 runs oneDNN's brgemm on the products it takes (either brgemm route)
bool use_brgemm();

// x[0, n) rounded to bfloat16 into out, as gemm_bf16 rounds its operands
void round_to_bf16(const float* x, index_t n, uint16_t* out);

// C (m x n, ldc) (+)= A B on oneDNN's brgemm (use_brgemm), for A (m x k, lda) bfloat16 and
// B as k/2 rows of ldb VNNI words (k even), adding into C where `add`
void brgemm_bf16(index_t m, index_t n, index_t k, const uint16_t* a, index_t lda, const uint32_t* b, index_t ldb,
                 bool add, float* c, index_t ldc);

// The backward's dK and dV of a key block on the brgemm route (RoundedInputs::vnni): summed
// transposed, dK^T += Q^T dS and dV^T += dO^T P, whose B, the tile's P or dS, brgemm reads
// as pairs of rows in VNNI words, and whose A comes from copies of Q and dO transposed once
// per pass (each head's rows padded to an even count with zeros); MKL's bfloat16 GEMM
// would repack P^T, dS^T and the query rows at every product.
class TransposedKeyGrads {
   public:
    // Q^T and dO^T of every query block of every head, rounded to bfloat16
    TransposedKeyGrads(const float* q, const float* dout, index_t heads, index_t rows, index_t dim, index_t dim_v,
                       index_t block_rows, index_t block_keys);

    // Per worker: a key block's dK^T and dV^T sums (f32) and a tile's pairs of rows
    struct Scratch {
        std::vector<float> dk_t, dv_t;  // (dim, block_keys), (dim_v, block_keys)
        std::vector<uint32_t> pairs;    // (block_rows / 2, width) words
    };
    void start(Scratch& w) const;  // the sums zeroed

    // dK^T[:, j0, j0 + width) += Q^T dS and dV^T += dO^T P for query rows [r0, r0 + rows)
    // of head bh, from the tile's rows p, ds (rows x width, row-major) and, where brgemm
    // takes the shape, their bfloat16 copies p16, ds16 (else MKL's GEMM from q and dout)
    void add(Scratch& w, index_t bh, index_t r0, index_t rows, index_t j0, index_t width, const float* p,
             const float* ds, const uint16_t* p16, const uint16_t* ds16, const float* q, const float* dout,
             const RoundedInputs& inputs) const;

    // dk (keys x dim) = scale dK^T^T and dv = dV^T^T for the block's first `keys` keys
    void finish(const Scratch& w, index_t keys, float scale, float* dk, float* dv) const;

   private:
    index_t heads_, rows_, dim_, dim_v_, block_rows_, block_keys_, blocks_, ld_;
    std::vector<uint16_t> q_t_, dout_t_;  // (B H, query block, width, ld_): a block's rows transposed
};

// A score-sized tile (E, P, dS) rounded to bfloat16 row by row as a pass finishes each row,
// while the row is in the cache, for the products that read it (dS feeds two): on where the
// call has bf16_products and the bfloat16 GEMM reads copies, else empty and never read.
class RoundedTile {
   public:
    RoundedTile(bool bf16_products, index_t size) : on_(bf16_products && bf16_gemm_reads_copies()) {
        if (on_) bits_.resize(size);
    }
    // x[0, n), the tile's entries from `offset` on, rounded (float32 only: float64 never rounds)
    template <typename T>
    void round(const T* x, index_t offset, index_t n) {
        if constexpr (std::is_same_v<T, float>) {
            if (on_) round_to_bf16(x, n, bits_.data() + offset);
        }
    }
    // The rounded entries from `offset` on, or null where off (the GEMM then rounds them)
    const uint16_t* at(index_t offset) const { return on_ ? bits_.data() + offset : nullptr; }

   private:
    bool on_;
    std::vector<uint16_t> bits_;
};

// Lets go of this thread's matrix-unit configuration where brgemm set one (every worker's
// end, and before MKL's bfloat16 GEMM, which sets its own)
void release_brgemm();
