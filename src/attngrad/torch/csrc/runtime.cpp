// attngrad's compiled tiles: the GEMM and the work loop on PyTorch's thread pool.
//
// GEMM: the BLAS inside PyTorch (MKL on x86-64 Linux), through its Fortran sgemm_/dgemm_,
// declared weak and resolved when the library loads, against PyTorch's CPU library, which it links;
// where that library has no such symbols (another BLAS, macOS) they are null and ATen's
// own CPU kernel, at::cpu::addmm_out on from_blob views, runs instead (reaching the same
// BLAS wherever PyTorch has one). A tile of one query row takes neither: its products are
// row_products.h's, the same on both paths.
// Threads: at::parallel_for, PyTorch's pool. With PyTorch's OpenMP backend it is inline
// code, an `omp parallel` region, so these sources are built with -fopenmp (native_build),
// on PyTorch's own libgomp (loaded first, under the same soname): one pool in the process.
// Both GEMMs run single-threaded inside a worker: at::parallel_for marks its threads as in a
// parallel region, so ATen's own loops run inline there, and OpenMP does not nest
// (max-active-levels 1), so an OpenMP BLAS called from a worker uses that one thread;
// MKL's per-thread count is also set to 1 for the worker's life where MKL is linked in
// (MKL_Set_Num_Threads_Local, weak as well).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/from_blob.h>

#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "row_products.h"
#include "tiles.h"

extern "C" {
// The Fortran BLAS interface (32-bit integers), where the loaded libraries have it.
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
            const float*, const int*, const float*, float*, const int*) __attribute__((weak));
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*, const int*,
            const double*, const int*, const double*, double*, const int*) __attribute__((weak));
int MKL_Set_Num_Threads_Local(int) __attribute__((weak));  // MKL's C interface (its lowercase name is the Fortran one)
// MKL's out-of-place transposes, C interface as well (row-major 'R', transposed 'T')
void MKL_Somatcopy(char, char, size_t, size_t, float, const float*, size_t, float*, size_t) __attribute__((weak));
void MKL_Domatcopy(char, char, size_t, size_t, double, const double*, size_t, double*, size_t) __attribute__((weak));
// MKL's bfloat16 GEMM (bf16 x bf16 products, float32 sums and C): on the matrix units (AMX) or
// AVX512-BF16 where the CPU has them. Layout and transposes are CBLAS's enums (ints).
void cblas_gemm_bf16bf16f32(int layout, int trans_a, int trans_b, int m, int n, int k, float alpha, const uint16_t* a,
                            int lda, const uint16_t* b, int ldb, float beta, float* c, int ldc) __attribute__((weak));
}

namespace attngrad_tiles {

// Which GEMM runs: the BLAS where both symbols resolved, else ATen's (the tests flip it
// through the op attngrad_tiles::gemm_path to cover both).
// Measured (2 cores, the 7 benchmark cases, 3 interleaved runs): ATen's path took -2.0% to +4.6%, median +2.4%, over the BLAS's: above the 2% bar, so the BLAS comes first.
std::atomic<bool> use_aten_gemm{sgemm_ == nullptr || dgemm_ == nullptr};

std::atomic<int64_t> tiles_computed{0};

namespace {

void fortran_gemm(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
                  const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                  const int* ldc) {
    sgemm_(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void fortran_gemm(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
                  const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
                  const int* ldc) {
    dgemm_(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// A row-major matrix is its transpose in column-major, so the Fortran call computes
// C^T = op(B)^T op(A)^T with the operands swapped.
template <typename T>
void blas_gemm(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, T alpha, const T* a, index_t lda,
               const T* b, index_t ldb, T beta, T* c, index_t ldc) {
    const int mi = static_cast<int>(n), ni = static_cast<int>(m), ki = static_cast<int>(k);
    const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
    fortran_gemm(trans_b ? "T" : "N", trans_a ? "T" : "N", &mi, &ni, &ki, &alpha, b, &la, a, &lb, &beta, c, &lc);
}

// The same through ATen: op(A), op(B) and C as strided views of the caller's memory.
template <typename T>
void aten_gemm(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, T alpha, const T* a, index_t lda,
               const T* b, index_t ldb, T beta, T* c, index_t ldc) {
    const auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
    const auto view = [&](const T* p, index_t rows, index_t cols, index_t ld, bool trans) {
        return trans ? at::from_blob(const_cast<T*>(p), {rows, cols}, {1, ld}, options)
                     : at::from_blob(const_cast<T*>(p), {rows, cols}, {ld, 1}, options);
    };
    at::Tensor out = at::from_blob(c, {m, n}, {ldc, 1}, options);
    // beta 0: addmm ignores out's old values (NaN included), as the BLAS does
    at::cpu::addmm_out(out, out, view(a, m, k, lda, trans_a), view(b, k, n, ldb, trans_b), beta, alpha);
}

// While it lives, MKL runs on the calling thread alone (where MKL is linked in).
class SingleThreadedBlas {
   public:
    SingleThreadedBlas() : previous_(MKL_Set_Num_Threads_Local ? MKL_Set_Num_Threads_Local(1) : 0) {}
    ~SingleThreadedBlas() {
        if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(previous_);
    }
    SingleThreadedBlas(const SingleThreadedBlas&) = delete;
    SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

   private:
    int previous_;
};

template <typename T>
void any_gemm(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, T alpha, const T* a, index_t lda,
              const T* b, index_t ldb, T beta, T* c, index_t ldc) {
    if (m == 0 || n == 0) return;
    if (m == 1 && !trans_a) {  // a tile of one row, on either path (row_products.h)
        if (trans_b) {
            row_times_transposed(n, k, alpha, a, b, ldb, beta, c);
        } else {
            row_times(n, k, alpha, a, b, ldb, beta, c);
        }
        return;
    }
    if (use_aten_gemm.load(std::memory_order_relaxed)) {
        aten_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    } else {
        blas_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    }
}

// b = a^T in strips of rows, each read once from the cache (what runs without MKL)
template <typename T>
void transpose_loop(index_t rows, index_t cols, const T* a, index_t lda, T* b, index_t ldb) {
    constexpr index_t kStrip = 32;
    for (index_t r0 = 0; r0 < rows; r0 += kStrip) {
        const index_t r1 = std::min(rows, r0 + kStrip);
        for (index_t c = 0; c < cols; ++c) {
            for (index_t r = r0; r < r1; ++r) b[c * ldb + r] = a[r * lda + c];
        }
    }
}

// MKL's transpose where the BLAS path runs (0.24 ns an entry for a 1024 x 64 matrix, against
// 0.63 for ATen's copy of the transposed view), else the loop: the same numbers either way
template <typename T>
void any_transpose(void (*omatcopy)(char, char, size_t, size_t, T, const T*, size_t, T*, size_t), index_t rows,
                   index_t cols, const T* a, index_t lda, T* b, index_t ldb) {
    if (rows == 0 || cols == 0) return;
    if (omatcopy && !use_aten_gemm.load(std::memory_order_relaxed)) {
        omatcopy('R', 'T', rows, cols, T(1), a, lda, b, ldb);
        return;
    }
    transpose_loop(rows, cols, a, lda, b, ldb);
}

}  // namespace

void transpose(index_t rows, index_t cols, const float* a, index_t lda, float* b, index_t ldb) {
    any_transpose(MKL_Somatcopy, rows, cols, a, lda, b, ldb);
}

void transpose(index_t rows, index_t cols, const double* a, index_t lda, double* b, index_t ldb) {
    any_transpose(MKL_Domatcopy, rows, cols, a, lda, b, ldb);
}

// Whether the BLAS path exists here, and switching between the two (false: the BLAS).
bool blas_available() { return sgemm_ != nullptr && dgemm_ != nullptr; }

void gemm(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, float alpha, const float* a, index_t lda,
          const float* b, index_t ldb, float beta, float* c, index_t ldc) {
    any_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void gemm(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, double alpha, const double* a, index_t lda,
          const double* b, index_t ldb, double beta, double* c, index_t ldc) {
    any_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
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

// x[0, n) as bfloat16 into out
inline void round_row(const float* x, index_t n, uint16_t* out) {
    index_t j = 0;
#if defined(__AVX512BF16__)
    for (; j + 16 <= n; j += 16) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + j));
        std::memcpy(out + j, &h, sizeof h);
    }
#endif
    for (; j < n; ++j) out[j] = to_bf16(x[j]);
}

// The stored rows x cols of a (leading dimension ld) as bfloat16, contiguous
const uint16_t* rounded(const float* a, index_t rows, index_t cols, index_t ld, std::vector<uint16_t>& buffer) {
    buffer.resize(rows * cols);
    for (index_t r = 0; r < rows; ++r) round_row(a + r * ld, cols, buffer.data() + r * cols);
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

void round_to_bf16(const float* x, index_t n, uint16_t* out) { round_row(x, n, out); }

RoundedInputs::RoundedInputs(const AttngradCall& c) {
    // only the bfloat16 GEMM reads them (the fallback rounds each product's operands itself)
    if (!bf16_gemm_reads_copies()) return;
    const index_t heads = c.batch * c.kv_heads * c.len_k;
    const std::pair<AttngradBuffer, index_t> inputs[] = {
        {buf_k, heads * c.dim},  {buf_v, heads * c.dim_v}, {buf_tk, heads * c.dim},
        {buf_tv, heads * c.dim_v}, {buf_gk, heads * c.dim}, {buf_gv, heads * c.dim_v},
    };
    for (const auto& [buffer, count] : inputs) {
        const float* base = static_cast<const float*>(c.data[buffer]);
        if (!base || count == 0) continue;
        Input& in = inputs_.emplace_back(Input{base, count, std::vector<uint16_t>(count)});
        uint16_t* out = in.rounded.data();
        parallel_range(count, 1 << 16,
                       [&](index_t begin, index_t end) { round_row(base + begin, end - begin, out + begin); });
    }
}

void gemm_bf16(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, float alpha, const float* a, index_t lda,
               const float* b, index_t ldb, float beta, float* c, index_t ldc, const RoundedInputs& inputs,
               const uint16_t* a_rounded) {
    if (m == 0 || n == 0) return;
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

index_t ItemSource::next() const {
    const index_t item = next_.fetch_add(1, std::memory_order_relaxed);
    return item < count_ ? item : -1;
}

index_t pool_threads() { return std::max(1, at::get_num_threads()); }

void parallel_items(index_t count, const std::function<void(const ItemSource&)>& worker) {
    if (count <= 0) return;
    const ItemSource items(count);
    const index_t workers = std::min<index_t>(count, pool_threads());
    // grain 1 over `workers` indices: one index, so one worker, per thread of the pool
    at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
        const SingleThreadedBlas blas_guard;
        for (int64_t w = begin; w < end; ++w) worker(items);
    });
}

void parallel_range(index_t count, index_t grain, const std::function<void(index_t, index_t)>& fn) {
    if (count <= 0) return;
    at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) { fn(begin, end); });
}

}  // namespace attngrad_tiles
