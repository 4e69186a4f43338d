// attngrad's compiled tiles: bfloat16's products (bf16_products.h): MKL's bfloat16 GEMM,
// and oneDNN's batch-reduce GEMM through PyTorch's cpublas where it packs bfloat16.
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <ATen/native/CPUBlas.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "tiles.h"

extern "C" {
// MKL's bfloat16 GEMM (bf16 x bf16 products, float32 sums and C): on the matrix units (AMX) or
// AVX512-BF16 where the CPU has them. Layout and transposes are CBLAS's enums (ints). Weak,
// as runtime.cpp's BLAS symbols: null where PyTorch's library has no MKL.
void cblas_gemm_bf16bf16f32(int layout, int trans_a, int trans_b, int m, int n, int k, float alpha, const uint16_t* a,
                            int lda, const uint16_t* b, int ldb, float beta, float* c, int ldc) __attribute__((weak));
}

namespace attngrad_tiles {

extern std::atomic<bool> use_aten_gemm;  // runtime.cpp

namespace {

// Whether this thread's matrix units hold a configuration that brgemm set and still counts
// on (PyTorch's cpublas skips setting it again for the same kernel): let go (release_brgemm)
// before MKL's bfloat16 GEMM sets its own, and when a worker ends, so that no later brgemm
// on this thread, ours or PyTorch's, runs on another's configuration
thread_local bool brgemm_configured = false;

}  // namespace

void release_brgemm() {
    if (!brgemm_configured) return;
    brgemm_configured = false;
    at::native::cpublas::brgemm_release(true);
}

namespace {

// float -> bfloat16, rounded to nearest even (NaN stays NaN): as c10::BFloat16 rounds.
// Branch-free, so that the loops below vectorise (AVX512-BF16's vcvtneps2bf16 rounds alike).
inline uint16_t to_bf16(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    const uint32_t even = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : even);
}

// x[0, n) times `power` as bfloat16 into out: a power of two (1 by default) scales exactly,
// in bfloat16's normal range, so the same as the rounded entries times `power`
inline void round_row(const float* x, index_t n, uint16_t* out, float power = 1.0f) {
    index_t j = 0;
#if defined(__AVX512BF16__)
    const __m512 times = _mm512_set1_ps(power);
    for (; j + 16 <= n; j += 16) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + j), times));
        std::memcpy(out + j, &h, sizeof h);
    }
#endif
    for (; j < n; ++j) out[j] = to_bf16(x[j] * power);
}

// The stored rows x cols of a (leading dimension ld) times `power` as bfloat16 (round_row),
// contiguous
const uint16_t* rounded(const float* a, index_t rows, index_t cols, index_t ld, std::vector<uint16_t>& buffer,
                        float power = 1.0f) {
    buffer.resize(rows * cols);
    for (index_t r = 0; r < rows; ++r) round_row(a + r * ld, cols, buffer.data() + r * cols, power);
    return buffer.data();
}

// The same rounded values, as float32 again (the fallback's operands)
const float* rounded_float(const uint16_t* a, index_t count, std::vector<float>& buffer) {
    buffer.resize(count);
    for (index_t i = 0; i < count; ++i) {
        const uint32_t u = static_cast<uint32_t>(a[i]) << 16;
        std::memcpy(&buffer[i], &u, sizeof(float));
    }
    return buffer.data();
}

}  // namespace

bool bf16_gemm_reads_copies() { return cblas_gemm_bf16bf16f32 && !use_aten_gemm.load(std::memory_order_relaxed); }

// -1 until asked, then the route of bfloat16's products (Bf16Route): oneDNN's brgemm on the
// matrix units where the CPU has AMX-BF16 and PyTorch's cpublas packs bfloat16 for it; else
// on AVX512-BF16's dot products where the CPU has them (an AMD Zen 4, an Intel CPU without
// AMX, or ONEDNN_MAX_CPU_ISA set below AMX): cpublas's brgemm takes bfloat16 in VNNI pairs
// from avx512_core up, and the pairs are made here (pack_vnni); else MKL's bfloat16 GEMM.
// The tests flip it through the op attngrad_tiles::brgemm_path to cover every route.
std::atomic<int> brgemm_route{-1};

namespace {

// Whether oneDNN's brgemm runs a bfloat16 product here: it refuses where its effective ISA is
// below what the CPU reports (ONEDNN_MAX_CPU_ISA under avx512_core). Asked once, before any
// product, so that a route is whole: no call mixes the two routes' sums
bool brgemm_runs() {
    const uint16_t a[2 * 2] = {};
    const uint32_t b[64] = {};
    float c[2 * 64];
    try {
        brgemm_bf16(2, 64, 2, a, 2, b, 64, false, c, 64);
    } catch (const std::exception&) {
        release_brgemm();
        return false;
    }
    release_brgemm();
    return true;
}

}  // namespace

int bf16_route() {
    // cpublas's brgemm refuses while torch.backends.mkldnn is off: asked at every call, and
    // the CPU's answer kept only once asked with it on
    if (!bf16_gemm_reads_copies() || !at::globalContext().userEnabledMkldnn()) return kBf16Mkl;
    int route = brgemm_route.load(std::memory_order_relaxed);
    if (route < 0) {
        route = kBf16Mkl;
        try {
            const auto capabilities = at::cpu::get_cpu_capabilities();
            const auto has = [&](const char* name) {
                const auto found = capabilities.find(name);
                return found != capabilities.end() && found->second.isBool() && found->second.toBool();
            };
            if (has("amx_bf16") && at::native::cpublas::could_pack(at::kBFloat16)) {
                route = kBf16BrgemmAmx;
            } else if (has("avx512_bf16")) {
                route = kBf16BrgemmAvx512;
            }
        } catch (const std::exception&) {
        }
        if (route != kBf16Mkl && !brgemm_runs()) route = kBf16Mkl;
        brgemm_route.store(route, std::memory_order_relaxed);
    }
    return route;
}

bool use_brgemm() { return bf16_route() != kBf16Mkl; }

void round_to_bf16(const float* x, index_t n, uint16_t* out) { round_row(x, n, out); }

namespace {

// A leading dimension of at least `n` entries of `bytes` bytes whose stride is an odd number
// of cache lines: the matrix units load a product's operand row by row, and rows a power of
// two apart (4 KiB and up) share their cache sets
index_t odd_lines(index_t n, index_t bytes) {
    const index_t line = 64 / bytes;
    const index_t lines = (n + line - 1) / line;
    return (lines % 2 == 0 ? lines + 1 : lines) * line;
}

// The 32-bit word of two bfloat16, `lo` in the low half: a VNNI pair
inline uint32_t vnni_word(uint16_t lo, uint16_t hi) { return static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16; }

// `in`'s by_width (panels of `block_keys` keys, `panel_ld` words a pair) and by_rows
// (RoundedInputs), where asked, from its float32 rows, a strip of a head's rows at a time
// across the pool: each row rounded once into the strip
void pack_vnni(RoundedInputs::Input& in, bool by_width, bool by_rows, index_t block_keys, index_t panel_ld) {
    const index_t width = in.width, half = width / 2, head_rows = in.head_rows, heads = in.rows() / head_rows;
    const index_t panels = (head_rows + block_keys - 1) / block_keys, pairs = (head_rows + 1) / 2;
    if (by_width) in.by_width.assign(heads * panels * half * panel_ld, 0);
    if (by_rows) in.by_rows.assign(heads * pairs * width, 0);
    constexpr index_t strip = 64;  // rows of a task: an even number, so that pairs of rows stay in one task
    const index_t strips = (head_rows + strip - 1) / strip;
    parallel_range(heads * strips, 1, [&](index_t begin, index_t end) {
        std::vector<uint16_t> bits(strip * width);
        for (index_t t = begin; t < end; ++t) {
            const index_t head = t / strips, r0 = t % strips * strip, n = std::min(strip, head_rows - r0);
            const float* x = in.base + (head * head_rows + r0) * width;
            for (index_t r = 0; r < n; ++r) round_row(x + r * width, width, bits.data() + r * width);
            // by_width: word (p, row) = (x[row][2p], x[row][2p + 1]), in the row's key block's panel
            for (index_t r = 0; by_width && r < n; ++r) {
                const index_t row = r0 + r;
                uint32_t* out = in.by_width.data() + ((head * panels + row / block_keys) * half) * panel_ld +
                                row % block_keys;
                for (index_t p = 0; p < half; ++p) {
                    out[p * panel_ld] = vnni_word(bits[r * width + 2 * p], bits[r * width + 2 * p + 1]);
                }
            }
            // by_rows: word (row / 2, c) = (x[row][c], x[row + 1][c]) for the head's even rows
            for (index_t r = 0; by_rows && r < n; r += 2) {
                const uint16_t* lo = bits.data() + r * width;
                uint32_t* out = in.by_rows.data() + (head * pairs + (r0 + r) / 2) * width;
                if (r + 1 < n) {
                    const uint16_t* hi = lo + width;
                    for (index_t c = 0; c < width; ++c) out[c] = vnni_word(lo[c], hi[c]);
                } else {
                    for (index_t c = 0; c < width; ++c) out[c] = vnni_word(lo[c], 0);
                }
            }
        }
    });
}

}  // namespace

RoundedInputs::RoundedInputs(const AttngradCall& c) {
    // only the bfloat16 GEMM reads them (the fallback rounds each product's operands itself)
    if (!bf16_gemm_reads_copies()) return;
    // the layouts cost a sweep over K and V per pass: short calls run MKL's GEMM alone (bf16
    // causal fwd+bwd, brgemm over MKL: B=4 L=128 1.02x, L=256 0.99x; B=1 L=512 0.98x, 1024 0.92x);
    // the whole-row passes (their products span whole rows of keys) as well
    constexpr int64_t kBrgemmMinLength = 256;
    using Readers = AttngradCall::KeyReaders;
    const Readers readers = c.key_readers;
    const bool vnni = readers != Readers::any && use_brgemm() && c.len_q >= kBrgemmMinLength &&
                      c.len_k >= kBrgemmMinLength && c.block_rows % 2 == 0;
    block_rows_ = c.block_rows, block_keys_ = c.block_keys, panel_ld_ = odd_lines(c.block_keys, 4);
    const index_t heads = c.batch * c.kv_heads * c.len_k;
    const std::tuple<AttngradBuffer, index_t> inputs[] = {
        {buf_k, c.dim}, {buf_v, c.dim_v}, {buf_tk, c.dim}, {buf_tv, c.dim_v}, {buf_gk, c.dim}, {buf_gv, c.dim_v},
    };
    for (const auto& [buffer, width] : inputs) {
        const float* base = static_cast<const float*>(c.data[buffer]);
        const index_t count = heads * width;
        if (!base || count == 0) continue;
        Input& in = inputs_.emplace_back(Input{base, count, width, c.len_k, {}, {}, {}});
        if (vnni && width % 2 == 0) {  // the brgemm route pairs entries along the width
            // the forward reads K transposed (S = Q K^T) and V as it is (E V) alone, the
            // backward K transposed and as it is (dS K) and V transposed (dP = dO V^T)
            const bool forward = readers == Readers::forward;
            pack_vnni(in, !forward || buffer == buf_k, forward == (buffer == buf_v), block_keys_, panel_ld_);
            vnni_ = true;
            continue;
        }
        in.rounded.resize(count);
        uint16_t* out = in.rounded.data();
        parallel_range(count, 1 << 16,
                       [&](index_t begin, index_t end) { round_row(base + begin, end - begin, out + begin); });
    }
}

namespace {

// brgemm_bf16, or false where the kernel refused and nothing was written (the caller's
// product then runs on MKL's GEMM)
bool brgemm_taken(index_t m, index_t n, index_t k, const uint16_t* a, index_t lda, const uint32_t* b, index_t ldb,
                  bool add, float* c, index_t ldc) {
    try {
        brgemm_bf16(m, n, k, a, lda, b, ldb, add, c, ldc);
        return true;
    } catch (const std::exception&) {
        release_brgemm();
        return false;
    }
}

// C (m x n, ldc) = alpha A B + beta C by oneDNN's brgemm, for A (m x k, lda) bfloat16 and B
// given in VNNI words (k/2 rows of ldb words), k even; false where the call does not suit
// it (beta other than 0 or 1) or the kernel refused, and nothing was written
bool brgemm_product(index_t m, index_t n, index_t k, float alpha, const uint16_t* a, index_t lda,
                    const uint32_t* b, index_t ldb, float beta, float* c, index_t ldc) {
    if (beta != 0.0f && beta != 1.0f) return false;
    // C += alpha (A B) with alpha other than 1: the product into a scratch first
    thread_local std::vector<float> scratch;
    const bool direct = beta == 0.0f || alpha == 1.0f;
    float* out = c;
    index_t ldo = ldc;
    if (!direct) {
        scratch.resize(m * n);
        out = scratch.data(), ldo = n;
    }
    if (!brgemm_taken(m, n, k, a, lda, b, ldb, direct && beta == 1.0f, out, ldo)) return false;
    if (direct) {
        if (alpha != 1.0f) {
            for (index_t i = 0; i < m; ++i) {
                for (index_t j = 0; j < n; ++j) c[i * ldc + j] *= alpha;
            }
        }
    } else {
        for (index_t i = 0; i < m; ++i) {
            for (index_t j = 0; j < n; ++j) c[i * ldc + j] += alpha * out[i * n + j];
        }
    }
    return true;
}

// gemm_bf16 on oneDNN's brgemm where B is a pass input kept in VNNI words (RoundedInputs)
// and the product has a shape of the bounded set (a block's rows by a multiple of 64 keys
// within one key block): B = X^T over rows [g, g + n) of X (by_width), or B = X's rows [g,
// g + k) from an even row of a head (by_rows); false where it does not apply
bool brgemm_gemm(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, float alpha, const float* a,
                 index_t lda, const float* b, index_t ldb, float beta, float* c, index_t ldc,
                 const RoundedInputs& inputs, const uint16_t* a_rounded) {
    if (trans_a || !inputs.vnni() || m != inputs.block_rows() || ldc != n || !use_brgemm()) return false;
    const RoundedInputs::Input* in = inputs.holding(b);
    if (!in || ldb != in->width || (trans_b ? in->by_width : in->by_rows).empty()) return false;
    const index_t offset = b - in->base;
    if (offset % in->width != 0) return false;
    const index_t g = offset / in->width, head = g / in->head_rows, row = g % in->head_rows;  // B's first row
    const index_t block_keys = inputs.block_keys(), half = in->width / 2;
    const uint32_t* words;
    index_t ld_words;
    if (trans_b) {  // op(B) = X[g, g + n)^T: k = width, the rows in one key block
        const index_t panels = (in->head_rows + block_keys - 1) / block_keys, off = row % block_keys;
        if (k != in->width || !brgemm_keys_shape(n, block_keys) || off + n > block_keys) return false;
        words = in->by_width.data() + ((head * panels + row / block_keys) * half) * inputs.panel_ld() + off;
        ld_words = inputs.panel_ld();
    } else {  // op(B) = X[g, g + k): n = width, from an even row of the head
        if (n != in->width || row % 2 != 0 || !brgemm_keys_shape(k, block_keys) || row + k > in->head_rows) {
            return false;
        }
        words = in->by_rows.data() + (head * ((in->head_rows + 1) / 2) + row / 2) * in->width;
        ld_words = in->width;
    }
    const uint16_t* a_bf = a_rounded ? a_rounded : inputs.find(a);
    index_t a_ld = lda;
    if (a_bf && a_ld != k && !brgemm_keys_shape(a_ld, block_keys)) return false;  // a bounded set of A's too
    thread_local std::vector<uint16_t> a16;
    if (!a_bf) {
        // C = alpha A B with alpha a power of two (the scale of a head width 4^j): A's
        // entries rounded, then times alpha, exactly, rather than a second sweep over C
        int exponent = 0;
        const bool fold = beta == 0.0f && std::frexp(alpha, &exponent) == 0.5f && exponent > -100 && exponent < 100;
        a_bf = rounded(a, m, k, lda, a16, fold ? alpha : 1.0f);
        if (fold) alpha = 1.0f;
        a_ld = k;
    }
    return brgemm_product(m, n, k, alpha, a_bf, a_ld, words, ld_words, beta, c, ldc);
}

}  // namespace

void brgemm_bf16(index_t m, index_t n, index_t k, const uint16_t* a, index_t lda, const uint32_t* b, index_t ldb,
                 bool add, float* c, index_t ldc) {
    if (m == 0 || n == 0) return;
    brgemm_configured = true;
    at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add, reinterpret_cast<const at::BFloat16*>(a),
                                reinterpret_cast<const at::BFloat16*>(b), c, true);
}

TransposedKeyGrads::TransposedKeyGrads(const float* q, const float* dout, index_t heads, index_t rows, index_t dim,
                                       index_t dim_v, index_t block_rows, index_t block_keys)
    : heads_(heads), rows_(rows), dim_(dim), dim_v_(dim_v), block_rows_(block_rows), block_keys_(block_keys),
      blocks_((rows + block_rows - 1) / block_rows), ld_(odd_lines(block_rows, 2)),
      q_t_(heads * blocks_ * dim * ld_, 0), dout_t_(heads * blocks_ * dim_v * ld_, 0) {
    parallel_range(heads * blocks_, 1, [&](index_t begin, index_t end) {
        std::vector<uint16_t> bits(block_rows_ * std::max(dim_, dim_v_));
        for (index_t t = begin; t < end; ++t) {
            const index_t bh = t / blocks_, r0 = t % blocks_ * block_rows_, n = std::min(block_rows_, rows_ - r0);
            for (auto [src, width, dst] : {std::tuple{q, dim_, q_t_.data()}, std::tuple{dout, dim_v_, dout_t_.data()}}) {
                for (index_t r = 0; r < n; ++r) round_row(src + (bh * rows_ + r0 + r) * width, width, bits.data() + r * width);
                uint16_t* block = dst + t * width * ld_;
                for (index_t c = 0; c < width; ++c) {
                    for (index_t r = 0; r < n; ++r) block[c * ld_ + r] = bits[r * width + c];
                }
            }
        }
    });
}

void TransposedKeyGrads::start(Scratch& w) const {
    w.dk_t.assign(dim_ * block_keys_, 0.0f);
    w.dv_t.assign(dim_v_ * block_keys_, 0.0f);
}

void TransposedKeyGrads::add(Scratch& w, index_t bh, index_t r0, index_t rows, index_t j0, index_t width,
                             const float* p, const float* ds, const uint16_t* p16, const uint16_t* ds16,
                             const float* q, const float* dout, const RoundedInputs& inputs) const {
    const index_t t = bh * blocks_ + r0 / block_rows_;  // the query block
    const bool shape = rows == block_rows_ && brgemm_keys_shape(width, block_keys_) && p16 && ds16 && use_brgemm();
    for (auto [tile, tile16, a_t, a, out, width_out] :
         {std::tuple{p, p16, dout_t_.data() + t * dim_v_ * ld_, dout + (bh * rows_ + r0) * dim_v_, w.dv_t.data(), dim_v_},
          std::tuple{ds, ds16, q_t_.data() + t * dim_ * ld_, q + (bh * rows_ + r0) * dim_, w.dk_t.data(), dim_}}) {
        if (shape) {
            // the tile's rows in pairs: word (r / 2, j) = (x[r][j], x[r + 1][j]) (rows even here)
            w.pairs.resize(rows / 2 * width);
            for (index_t r = 0; r < rows; r += 2) {
                const uint16_t* lo = tile16 + r * width;
                const uint16_t* hi = lo + width;
                uint32_t* words = w.pairs.data() + r / 2 * width;
                for (index_t j = 0; j < width; ++j) words[j] = vnni_word(lo[j], hi[j]);
            }
            // (width_out x width) += A (width_out x rows: the block's rows transposed) B
            if (brgemm_taken(width_out, width, rows, a_t, ld_, w.pairs.data(), width, true, out + j0, block_keys_)) {
                continue;
            }
        }
        // the sum untransposed on MKL's GEMM: (width_out x width) += A^T tile
        gemm_bf16(true, false, width_out, width, rows, 1.0f, a, width_out, tile, width, 1.0f, out + j0, block_keys_,
                  inputs);
    }
}

void TransposedKeyGrads::finish(const Scratch& w, index_t keys, float scale, float* dk, float* dv) const {
    for (index_t j = 0; j < keys; ++j) {
        for (index_t c = 0; c < dim_; ++c) dk[j * dim_ + c] = scale * w.dk_t[c * block_keys_ + j];
        for (index_t c = 0; c < dim_v_; ++c) dv[j * dim_v_ + c] = w.dv_t[c * block_keys_ + j];
    }
}

void gemm_bf16(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, float alpha, const float* a, index_t lda,
               const float* b, index_t ldb, float beta, float* c, index_t ldc, const RoundedInputs& inputs,
               const uint16_t* a_rounded) {
    if (m == 0 || n == 0) return;
    if (brgemm_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, inputs, a_rounded)) return;
    release_brgemm();
    // per thread: the operands rounded to bfloat16, contiguous (op(A) stored m x k or k x m)
    thread_local std::vector<uint16_t> a16, b16;
    const index_t a_rows = trans_a ? k : m, a_cols = trans_a ? m : k;
    const index_t b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
    if (bf16_gemm_reads_copies()) {
        // an input's or a tile's rounded copy, in its own layout (leading dimension lda or ldb)
        const uint16_t* a_in = a_rounded ? a_rounded : inputs.find(a);
        const uint16_t* b_in = inputs.find(b);
        const uint16_t* a_bf = a_in ? a_in : rounded(a, a_rows, a_cols, lda, a16);
        const uint16_t* b_bf = b_in ? b_in : rounded(b, b_rows, b_cols, ldb, b16);
        constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
        cblas_gemm_bf16bf16f32(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans,
                               static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a_bf,
                               static_cast<int>(a_in ? lda : a_cols), b_bf, static_cast<int>(b_in ? ldb : b_cols), beta,
                               c, static_cast<int>(ldc));
        return;
    }
    const uint16_t* a_bf = rounded(a, a_rows, a_cols, lda, a16);
    const uint16_t* b_bf = rounded(b, b_rows, b_cols, ldb, b16);
    // no bfloat16 GEMM here: the same rounded operands multiplied in float32 (exact products,
    // float32 sums, in the float32 GEMM's order)
    thread_local std::vector<float> a32, b32;
    gemm(trans_a, trans_b, m, n, k, alpha, rounded_float(a_bf, a_rows * a_cols, a32), a_cols,
         rounded_float(b_bf, b_rows * b_cols, b32), b_cols, beta, c, ldc);
}

}  // namespace attngrad_tiles
