// attngrad's compiled tiles: the GEMM and the work loop on PyTorch's thread pool.
//
// GEMM: the BLAS inside PyTorch (MKL on x86-64 Linux), through its Fortran sgemm_/dgemm_,
// declared weak and resolved when the library loads, against PyTorch's CPU library, which it links;
// where that library has no such symbols (another BLAS, macOS) they are null and ATen's
// own CPU kernel, at::cpu::addmm_out on from_blob views, runs instead (reaching the same
// BLAS wherever PyTorch has one). A tile of one query row takes neither: its products are
// row_products.h's, the same on both paths.
// Threads: at::parallel_for, PyTorch's pool. With PyTorch's OpenMP backend it is inline
// code, an `omp parallel` region, so these sources are built with -fopenmp (build.py),
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

// When it goes, this thread's brgemm configuration is let go (release_brgemm)
class BrgemmReleased {
   public:
    BrgemmReleased() = default;
    ~BrgemmReleased() { release_brgemm(); }
    BrgemmReleased(const BrgemmReleased&) = delete;
    BrgemmReleased& operator=(const BrgemmReleased&) = delete;
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
        const BrgemmReleased brgemm_guard;
        for (int64_t w = begin; w < end; ++w) worker(items);
    });
}

void parallel_range(index_t count, index_t grain, const std::function<void(index_t, index_t)>& fn) {
    if (count <= 0) return;
    at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) { fn(begin, end); });
}

}  // namespace attngrad_tiles
