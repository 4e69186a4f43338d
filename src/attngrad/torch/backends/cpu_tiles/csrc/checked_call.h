// The checks every op of the tiles makes at its entry (ops.cpp): each tensor's device,
// dtype, shape against q, k, v's sizes and contiguity, each option's range, and the values
// of the index tensors a pass reads memory by (key bounds, key ranges, tile maps, mask
// blocks), with messages naming the argument and the shapes; a `Call` is an AttngradCall
// whose every buffer and option has passed them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <limits>
#include <optional>
#include <tuple>
#include <ostream>

#include "tiles.h"

namespace attngrad_tiles {

using OptTensor = std::optional<at::Tensor>;
constexpr int64_t kIntMax = std::numeric_limits<int>::max();  // the BLAS takes 32-bit sizes

// The options every pass takes, as the schemas below list them.
#define ATTNGRAD_OPTIONS_SCHEMA                                                                              \
    "int? causal, float scale, float softcap, bool dropout, int seed, int threshold, float keep_value, "     \
    "int row_offset, int key_offset, int head_offset, bool partial_rows, bool sink, int block_rows, "        \
    "int block_keys, int value_slice, int chunks, bool bf16_products=False, bool transposed_keys=False"
#define ATTNGRAD_OPTIONS_PARAMS                                                                                   \
    std::optional<int64_t> causal, double scale, double softcap, bool dropout, int64_t seed, int64_t threshold,    \
        double keep_value, int64_t row_offset, int64_t key_offset, int64_t head_offset, bool partial_rows,         \
        bool sink, int64_t block_rows, int64_t block_keys, int64_t value_slice, int64_t chunks, bool bf16_products, \
        bool transposed_keys
#define ATTNGRAD_OPTIONS_ARGS                                                                                      \
    Options { causal, scale, softcap, dropout, seed, threshold, keep_value, row_offset, key_offset, head_offset,   \
              partial_rows, sink, block_rows, block_keys, value_slice, chunks, bf16_products, transposed_keys }

// A mask kept per block, every pass's last two arguments (bind_mask_blocks).
#define MASK_BLOCKS_SCHEMA "Tensor? mask_blocks=None, Tensor? mask_tiles=None"

struct Options {
    std::optional<int64_t> causal;
    double scale, softcap;
    bool dropout;
    int64_t seed, threshold;  // the seed's 64 bits as int64
    double keep_value;
    int64_t row_offset, key_offset, head_offset;
    bool partial_rows, sink;
    int64_t block_rows, block_keys, value_slice, chunks;
    bool bf16_products, transposed_keys;
};

// The context every message ends with: the shapes of q, k, v. Streamed only into a message
// that is raised (TORCH_CHECK formats its message on failure alone), so a call that passes
// every check builds no string.
struct Context {
    const at::Tensor *q = nullptr, *k = nullptr, *v = nullptr;
};

std::ostream& operator<<(std::ostream& os, const Context& c);

// `t` on the CPU, of `dtype`, contiguous, and of `shape`
void check_tensor(const char* what, const char* name, const at::Tensor& t, at::ScalarType dtype,
                  c10::IntArrayRef shape, const Context& ctx);

struct Call {
    AttngradCall call;
    at::ScalarType dtype;
    const char* what;
    Context ctx;

    // Buffer `b` is `t` (checked against the call's sizes), or null: absent where allowed
    void bind(int b, const OptTensor& t, bool required);
};

// The call of pass `what` on q, k, v, the optional mask, bias and key bounds, and the
// options, every one of them checked.
Call make_call(const char* what, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& mask,
               const OptTensor& bias, const OptTensor& key_bounds, const Options& o);

void bind_tile_map(Call& call, const OptTensor& tile_map);
void bind_key_ranges(Call& call, const OptTensor& key_ranges);
void bind_mask_blocks(Call& call, const OptTensor& mask_blocks, const OptTensor& mask_tiles);

using Results = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// ops.cpp's forward_planned without a mask or bias, called from fast_entry.cpp without the
// dispatcher: (out, row_max, inv_sum), every entry check made as the op makes them.
Results forward_planned_unmasked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& key_ranges, const at::Tensor& packed);

// Runs `pass` on the checked call in its element type.
template <typename Run>
void run(const Call& call, Run&& pass) {
    if (call.call.double_precision) {
        pass(Pass<double>(call.call));
    } else {
        pass(Pass<float>(call.call));
    }
}

}  // namespace attngrad_tiles
