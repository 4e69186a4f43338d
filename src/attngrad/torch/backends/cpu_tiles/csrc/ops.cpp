// attngrad's compiled tiles as PyTorch operators, torch.ops.attngrad_tiles.*: each takes
// its tensors and options through its schema, checks every tensor (device, dtype, shape
// against q, k, v's sizes, contiguity) and every option at entry, with a message naming
// the argument and the shapes, fills an AttngradCall from them and runs its pass in the
// call's element type. Nothing is read or written before every check has passed: no
// input that reaches an op can make a pass read or write out of bounds.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "tiles.h"

namespace attngrad_tiles {

extern std::atomic<bool> use_aten_gemm;  // runtime.cpp
extern std::atomic<int> brgemm_route;    // bf16_products.cpp
bool blas_available();

namespace {

using OptTensor = std::optional<at::Tensor>;
constexpr int64_t kIntMax = std::numeric_limits<int>::max();  // the BLAS takes 32-bit sizes

const char* const kBufferNames[kBufferCount] = {
#define ATTNGRAD_NAME(name) #name,
    ATTNGRAD_BUFFERS(ATTNGRAD_NAME)
#undef ATTNGRAD_NAME
};

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

std::vector<int64_t> sizes_of(const AttngradCall& c, std::initializer_list<int64_t> lead, const int64_t* four) {
    std::vector<int64_t> sizes(lead);
    sizes.insert(sizes.end(), four, four + 4);
    return sizes;
}

// The shape buffer `b` must have in call `c` (its sizes and options already checked).
std::vector<int64_t> expected_shape(const AttngradCall& c, int b) {
    const int64_t B = c.batch, H = c.heads, Hkv = c.kv_heads, Lq = c.len_q, Lk = c.len_k;
    switch (b) {
        case buf_q: case buf_gq: case buf_g_q: case buf_tq: case buf_tdq: case buf_dq: return {B, H, Lq, c.dim};
        case buf_k: case buf_dk: case buf_gk: case buf_tk: case buf_tdk: return {B, Hkv, Lk, c.dim};
        case buf_v: case buf_dv: case buf_gv: case buf_tv: case buf_tdv: return {B, Hkv, Lk, c.dim_v};
        case buf_out: case buf_dout: case buf_g_dout: case buf_tout: case buf_tdout: return {B, H, Lq, c.dim_v};
        case buf_row_max: case buf_inv_sum: case buf_delta: case buf_centre: case buf_delta_t: case buf_peak: case buf_sink_rows:
            return {B, H, Lq};
        case buf_bias: case buf_tbias: case buf_gbias: return sizes_of(c, {}, c.bias_sizes);  // the bias's own
        case buf_dq_parts: case buf_tdq_parts: return {c.chunks, B, H, Lq, c.dim};
        case buf_gk_parts: case buf_tdk_parts: case buf_dk_parts: return {c.chunks, B, Hkv, Lk, c.dim};
        case buf_gv_parts: case buf_tdv_parts: case buf_dv_parts: return {c.chunks, B, Hkv, Lk, c.dim_v};
        case buf_dbias_parts: return sizes_of(c, {bias_grad_parts(c, 3)}, c.bias_sizes);
        case buf_tdbias_parts: case buf_g_bias_parts: case buf_dbias_row_parts: return sizes_of(c, {bias_grad_parts(c, 2)}, c.bias_sizes);
        default: TORCH_CHECK(false, "attngrad_tiles: no shape for buffer ", kBufferNames[b]);
    }
    return {};
}

// The context every message ends with: the shapes of q, k, v. Streamed only into a message
// that is raised (TORCH_CHECK formats its message on failure alone), so a call that passes
// every check builds no string.
struct Context {
    const at::Tensor *q = nullptr, *k = nullptr, *v = nullptr;
};

std::ostream& operator<<(std::ostream& os, const Context& c) {
    if (c.q) os << " (q " << c.q->sizes() << ", k " << c.k->sizes() << ", v " << c.v->sizes() << ")";
    return os;
}

// `t` on the CPU, of `dtype`, contiguous, and of `shape`
void check_tensor(const char* what, const char* name, const at::Tensor& t, at::ScalarType dtype,
                  c10::IntArrayRef shape, const Context& ctx) {
    TORCH_CHECK(t.device().is_cpu(), what, ": ", name, " must be a CPU tensor, got one on ", t.device(), ctx);
    TORCH_CHECK(t.scalar_type() == dtype, what, ": ", name, " must be ", dtype, ", got ", t.scalar_type(), ctx);
    TORCH_CHECK(t.sizes() == shape, what, ": ", name, " has shape ", t.sizes(), ", expected ", shape, ctx);
    TORCH_CHECK(t.is_contiguous(), what, ": ", name, " must be contiguous, got strides ", t.strides(), " for shape ",
                t.sizes(), ctx);
}

// A mask's or bias's (b, h, i, j) sizes: 4-D, each 1 or the scores' own
void take_broadcast(const char* what, const char* name, const at::Tensor& t, const AttngradCall& c, int64_t* sizes,
                    const Context& ctx) {
    TORCH_CHECK(t.dim() == 4, what, ": ", name, " must be 4-D (b, h, i, j), got shape ", t.sizes(), ctx);
    const int64_t full[4] = {c.batch, c.heads, c.len_q, c.len_k};
    for (int d = 0; d < 4; ++d) {
        TORCH_CHECK(t.size(d) == 1 || t.size(d) == full[d], what, ": ", name, " has shape ", t.sizes(),
                    "; each size must be 1 or the scores' ", c10::IntArrayRef(full, 4), ctx);
        sizes[d] = t.size(d);
    }
}

struct Call {
    AttngradCall call;
    at::ScalarType dtype;
    const char* what;
    Context ctx;

    // Buffer `b` is `t` (checked against the call's sizes), or null: absent where allowed
    void bind(int b, const OptTensor& t, bool required) {
        const char* name = kBufferNames[b];
        if (!t.has_value()) {
            TORCH_CHECK(!required, what, ": ", name, " is required", ctx);
            return;
        }
        const bool bias_like = b == buf_tbias || b == buf_gbias || b == buf_dbias_parts || b == buf_tdbias_parts ||
                               b == buf_g_bias_parts || b == buf_dbias_row_parts;
        TORCH_CHECK(!bias_like || call.data[buf_bias], what, ": ", name, " was given without a bias", ctx);
        check_tensor(what, name, *t, dtype, expected_shape(call, b), ctx);
        call.data[b] = t->data_ptr();
    }
};

// The call of pass `what` on q, k, v, the optional mask, bias and key bounds, and the
// options, every one of them checked.
Call make_call(const char* what, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& mask,
               const OptTensor& bias, const OptTensor& key_bounds, const Options& o) {
    Call out{AttngradCall{}, q.scalar_type(), what, Context{&q, &k, &v}};
    const Context& ctx = out.ctx;
    AttngradCall& c = out.call;
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, what, ": q, k and v must be 4-D", ctx);
    TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, what,
                ": q must be float32 or float64, got ", q.scalar_type(), ctx);
    c.batch = q.size(0), c.heads = q.size(1), c.len_q = q.size(2), c.dim = q.size(3);
    c.kv_heads = k.size(1), c.len_k = k.size(2), c.dim_v = v.size(3);
    const int64_t sizes[7] = {c.batch, c.heads, c.kv_heads, c.len_q, c.len_k, c.dim, c.dim_v};
    const char* const size_names[7] = {"batch", "heads", "kv_heads", "len_q", "len_k", "dim", "dim_v"};
    for (int i = 0; i < 7; ++i) {
        TORCH_CHECK(sizes[i] >= 1 && sizes[i] <= kIntMax, what, ": ", size_names[i], " is ", sizes[i],
                    ", expected 1 to 2^31 - 1", ctx);
    }
    TORCH_CHECK(c.heads % c.kv_heads == 0, what, ": heads (", c.heads, ") must be a multiple of kv_heads (",
                c.kv_heads, ")", ctx);
    check_tensor(what, "q", q, out.dtype, q.sizes(), ctx);
    check_tensor(what, "k", k, out.dtype, expected_shape(c, buf_k), ctx);
    check_tensor(what, "v", v, out.dtype, expected_shape(c, buf_v), ctx);
    const int64_t options[4] = {o.block_rows, o.block_keys, o.value_slice, o.chunks};
    const char* const option_names[4] = {"block_rows", "block_keys", "value_slice", "chunks"};
    for (int i = 0; i < 4; ++i) {
        TORCH_CHECK(options[i] >= 1 && options[i] <= kIntMax, what, ": ", option_names[i], " is ", options[i],
                    ", expected 1 to 2^31 - 1", ctx);
    }
    TORCH_CHECK(o.block_rows * c.len_k <= (int64_t{1} << 40), what, ": block_rows * len_k is ",
                o.block_rows * c.len_k, ", expected at most 2^40", ctx);
    TORCH_CHECK(o.threshold >= 0 && o.threshold <= (int64_t{1} << 32), what, ": threshold is ", o.threshold,
                ", expected 0 to 2^32");
    // the draws' row counter is 32 bits wide, their key counter (plus one) too
    TORCH_CHECK(o.row_offset >= 0 && o.row_offset <= kIntMax - c.len_q, what, ": row_offset is ", o.row_offset,
                ", expected 0 to 2^31 - 1 - len_q", ctx);
    TORCH_CHECK(o.key_offset >= 0 && o.key_offset <= kIntMax - c.len_k, what, ": key_offset is ", o.key_offset,
                ", expected 0 to 2^31 - 1 - len_k", ctx);
    TORCH_CHECK(o.head_offset >= 0 && o.head_offset <= kIntMax - c.heads, what, ": head_offset is ", o.head_offset,
                ", expected 0 to 2^31 - 1 - heads", ctx);
    TORCH_CHECK(!o.causal || (*o.causal >= -kIntMax && *o.causal <= kIntMax), what, ": causal is ", *o.causal, ctx);
    c.double_precision = out.dtype == at::kDouble;
    TORCH_CHECK(!o.bf16_products || !c.double_precision, what, ": bf16_products needs float32 buffers", ctx);
    c.bf16_products = o.bf16_products;
    c.transposed_keys = o.transposed_keys;
    c.causal = o.causal.has_value(), c.causal_offset = o.causal.value_or(0);
    c.scale = o.scale, c.softcap = o.softcap;
    c.dropout = o.dropout, c.seed = static_cast<uint64_t>(o.seed), c.threshold = static_cast<uint64_t>(o.threshold);
    c.keep_value = o.keep_value;
    c.dropout_row_offset = o.row_offset, c.dropout_key_offset = o.key_offset, c.dropout_head_offset = o.head_offset;
    c.partial_rows = o.partial_rows, c.sink = o.sink;
    c.block_rows = o.block_rows, c.block_keys = o.block_keys, c.value_slice = o.value_slice, c.chunks = o.chunks;
    c.data[buf_q] = q.data_ptr(), c.data[buf_k] = k.data_ptr(), c.data[buf_v] = v.data_ptr();
    if (mask) {
        take_broadcast(what, "mask", *mask, c, c.mask_sizes, ctx);
        check_tensor(what, "mask", *mask, at::kBool, mask->sizes(), ctx);
        c.data[buf_mask] = mask->data_ptr();
    }
    if (bias) {
        take_broadcast(what, "bias", *bias, c, c.bias_sizes, ctx);
        check_tensor(what, "bias", *bias, out.dtype, bias->sizes(), ctx);
        c.data[buf_bias] = bias->data_ptr();
    }
    if (key_bounds) {
        const at::Tensor& t = *key_bounds;
        TORCH_CHECK(t.dim() == 3 && (t.size(0) == 1 || t.size(0) == c.batch), what,
                    ": key_bounds has shape ", t.sizes(), ", expected (1 or batch ", c.batch, ", ", c.len_q, ", 2)",
                    ctx);
        c.bounds_batch = t.size(0);
        check_tensor(what, "key_bounds", t, at::kLong, {c.bounds_batch, c.len_q, 2}, ctx);
        const int64_t* bounds = t.const_data_ptr<int64_t>();
        for (int64_t r = 0; r < 2 * c.bounds_batch * c.len_q; ++r) {
            TORCH_CHECK(bounds[r] >= 0 && bounds[r] <= c.len_k, what, ": a key bound is ", bounds[r],
                        ", expected 0 to len_k ", c.len_k, ctx);
        }
        c.data[buf_key_bounds] = t.data_ptr();
    }
    return out;
}

// The tile map of the call's tiles (`block_map.tile_map`), where given: (1 or B, 1 or H,
// query blocks, key blocks) uint8 for the call's blocks, checked like every other tensor,
// each entry one of TileMap's kinds.
void bind_tile_map(Call& call, const OptTensor& tile_map) {
    if (!tile_map) return;
    const at::Tensor& t = *tile_map;
    AttngradCall& c = call.call;
    const int64_t query_blocks = (c.len_q + c.block_rows - 1) / c.block_rows;
    const int64_t key_blocks = (c.len_k + c.block_keys - 1) / c.block_keys;
    TORCH_CHECK(t.dim() == 4 && (t.size(0) == 1 || t.size(0) == c.batch) && (t.size(1) == 1 || t.size(1) == c.heads),
                call.what, ": tile_map has shape ", t.sizes(), ", expected (1 or batch ", c.batch, ", 1 or heads ",
                c.heads, ", query blocks ", query_blocks, ", key blocks ", key_blocks, ")", call.ctx);
    check_tensor(call.what, "tile_map", t, at::kByte, {t.size(0), t.size(1), query_blocks, key_blocks}, call.ctx);
    const uint8_t* kinds = t.data_ptr<uint8_t>();
    for (int64_t e = 0; e < t.numel(); ++e) {
        TORCH_CHECK(kinds[e] <= TileMap::unmasked, call.what, ": tile_map entry ", e, " is ",
                    int(kinds[e]), ", expected 0 (computed), 1 (skipped) or 2 (unmasked)", call.ctx);
    }
    c.tile_map_sizes[0] = t.size(0), c.tile_map_sizes[1] = t.size(1);
    c.data[buf_tile_map] = t.data_ptr();
}

// The key range of each query block (`block_map.key_ranges`), where given: (1 or B, query
// blocks of the call's block_rows, 2) int64 of [key0, key0 + keys), each within [0, len_k):
// checked, values too, like every other tensor, before a pass reads keys by them.
void bind_key_ranges(Call& call, const OptTensor& key_ranges) {
    if (!key_ranges) return;
    const at::Tensor& t = *key_ranges;
    AttngradCall& c = call.call;
    const int64_t query_blocks = (c.len_q + c.block_rows - 1) / c.block_rows;
    TORCH_CHECK(t.dim() == 3 && (t.size(0) == 1 || t.size(0) == c.batch), call.what, ": key_ranges has shape ",
                t.sizes(), ", expected (1 or batch ", c.batch, ", query blocks ", query_blocks, ", 2)", call.ctx);
    check_tensor(call.what, "key_ranges", t, at::kLong, {t.size(0), query_blocks, 2}, call.ctx);
    const int64_t* ranges = t.const_data_ptr<int64_t>();
    for (int64_t r = 0; r < t.size(0) * query_blocks; ++r) {
        const int64_t key0 = ranges[2 * r], keys = ranges[2 * r + 1];
        TORCH_CHECK(key0 >= 0 && key0 <= c.len_k && keys >= 0 && keys <= c.len_k - key0, call.what,
                    ": key_ranges holds [", key0, ", ", key0, " + ", keys, ") for query block ", r % query_blocks,
                    " of batch entry ", r / query_blocks, ", expected 0 <= key0 <= key0 + keys <= len_k ", c.len_k,
                    call.ctx);
    }
    c.key_ranges_batch = t.size(0);
    c.data[buf_key_ranges] = t.data_ptr();
}

// A boolean mask kept per block (`mask_blocks.py`), where given: mask_blocks (1 or B, 1 or H,
// ceil(Lq / R), ceil(Lk / K)) int32, each a tile of mask_tiles (T, R, K) bool, T >= 2. Every
// index is read here and must lie in [0, T); tile 0 must keep no entry and tile 1 every
// entry, as the passes skip reading those: nothing a pass reads by them is out of bounds.
void bind_mask_blocks(Call& call, const OptTensor& mask_blocks, const OptTensor& mask_tiles) {
    TORCH_CHECK(mask_blocks.has_value() == mask_tiles.has_value(), call.what,
                ": mask_blocks and mask_tiles come together", call.ctx);
    if (!mask_blocks) return;
    AttngradCall& c = call.call;
    const at::Tensor &index = *mask_blocks, &tiles = *mask_tiles;
    TORCH_CHECK(tiles.dim() == 3 && tiles.size(0) >= 2 && tiles.size(1) >= 1 && tiles.size(2) >= 1 &&
                    tiles.size(1) <= kIntMax && tiles.size(2) <= kIntMax && tiles.size(0) <= kIntMax,
                call.what, ": mask_tiles has shape ", tiles.sizes(), ", expected (T >= 2, R >= 1, K >= 1)", call.ctx);
    check_tensor(call.what, "mask_tiles", tiles, at::kBool, tiles.sizes(), call.ctx);
    const int64_t rows = tiles.size(1), keys = tiles.size(2);
    const int64_t query_blocks = (c.len_q + rows - 1) / rows, key_blocks = (c.len_k + keys - 1) / keys;
    TORCH_CHECK(index.dim() == 4 && (index.size(0) == 1 || index.size(0) == c.batch) &&
                    (index.size(1) == 1 || index.size(1) == c.heads),
                call.what, ": mask_blocks has shape ", index.sizes(), ", expected (1 or batch ", c.batch,
                ", 1 or heads ", c.heads, ", ", query_blocks, ", ", key_blocks, ")", call.ctx);
    check_tensor(call.what, "mask_blocks", index, at::kInt, {index.size(0), index.size(1), query_blocks, key_blocks},
                 call.ctx);
    const int32_t* at_block = index.const_data_ptr<int32_t>();
    for (int64_t r = 0; r < index.numel(); ++r) {
        TORCH_CHECK(at_block[r] >= 0 && at_block[r] < tiles.size(0), call.what, ": mask_blocks holds tile ",
                    at_block[r], ", expected 0 to ", tiles.size(0) - 1, call.ctx);
    }
    const uint8_t* entries = static_cast<const uint8_t*>(tiles.const_data_ptr());
    for (int64_t e = 0; e < rows * keys; ++e) {
        TORCH_CHECK(!entries[e] && entries[rows * keys + e], call.what,
                    ": mask_tiles[0] must keep no entry and mask_tiles[1] every entry", call.ctx);
    }
    for (int d = 0; d < 4; ++d) c.mask_blocks_sizes[d] = index.size(d);
    c.mask_tile_rows = rows, c.mask_tile_keys = keys;
    c.data[buf_mask_blocks] = index.data_ptr();
    c.data[buf_mask_tiles] = tiles.data_ptr();
}

// Runs `pass` on the checked call in its element type.
template <typename Run>
void run(const Call& call, Run&& pass) {
    if (call.call.double_precision) {
        pass(Pass<double>(call.call));
    } else {
        pass(Pass<float>(call.call));
    }
}

// out (B, H, Lq, dv), row_max and inv_sum (B, H, Lq) from q, k, v; mask (bool, true = take
// part), bias and key bounds optional; dropout in the output's E V; tile_map, where given,
// the tiles to skip and those to compute without the mask and bias (bind_tile_map).
void forward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& mask,
                const OptTensor& bias, const OptTensor& key_bounds, const at::Tensor& out, const at::Tensor& row_max,
                const at::Tensor& inv_sum, ATTNGRAD_OPTIONS_PARAMS, const OptTensor& tile_map,
                const OptTensor& key_ranges, const OptTensor& mask_blocks, const OptTensor& mask_tiles) {
    Call call = make_call("attngrad_tiles.forward", q, k, v, mask, bias, key_bounds, ATTNGRAD_OPTIONS_ARGS);
    call.call.key_readers = AttngradCall::KeyReaders::forward;
    bind_mask_blocks(call, mask_blocks, mask_tiles);
    bind_key_ranges(call, key_ranges);
    bind_tile_map(call, tile_map);
    call.bind(buf_out, out, true);
    call.bind(buf_row_max, row_max, true);
    call.bind(buf_inv_sum, inv_sum, true);
    run(call, [](const auto& pass) { forward(pass); });
}

// The buffers every pass after the forward reads: the forward's output and statistics,
// the upstream gradient, and the scratch row sums.
void bind_after_forward(Call& call, const at::Tensor& out, const at::Tensor& row_max, const at::Tensor& inv_sum,
                        const at::Tensor& dout, const at::Tensor& delta) {
    call.bind(buf_out, out, true);
    call.bind(buf_row_max, row_max, true);
    call.bind(buf_inv_sum, inv_sum, true);
    call.bind(buf_dout, dout, true);
    call.bind(buf_delta, delta, true);
}

// dq_parts holds `chunks` (B, H, Lq, d) partial sums of dQ, one per chunk of key blocks;
// the pass writes every entry of them, of dk and of dv, reading none first; delta is
// (B, H, Lq) scratch; dbias_parts, where given, holds the zeroed parts of the bias's
// gradient (bias_grad_parts of them); tile_map as the forward's (bind_tile_map).
void backward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& mask,
                 const OptTensor& bias, const OptTensor& key_bounds, const at::Tensor& out, const at::Tensor& row_max,
                 const at::Tensor& inv_sum, const at::Tensor& dout, const at::Tensor& delta,
                 const at::Tensor& dq_parts, const at::Tensor& dk, const at::Tensor& dv, const OptTensor& dbias_parts,
                 ATTNGRAD_OPTIONS_PARAMS, const OptTensor& tile_map, const OptTensor& key_ranges,
                 const OptTensor& mask_blocks, const OptTensor& mask_tiles) {
    Call call = make_call("attngrad_tiles.backward", q, k, v, mask, bias, key_bounds, ATTNGRAD_OPTIONS_ARGS);
    call.call.key_readers = AttngradCall::KeyReaders::backward;
    bind_mask_blocks(call, mask_blocks, mask_tiles);
    bind_key_ranges(call, key_ranges);
    bind_tile_map(call, tile_map);
    bind_after_forward(call, out, row_max, inv_sum, dout, delta);
    call.bind(buf_dq_parts, dq_parts, true);
    call.bind(buf_dk, dk, true);
    call.bind(buf_dv, dv, true);
    call.bind(buf_dbias_parts, dbias_parts, false);
    run(call, [](const auto& pass) { backward(pass); });
}

// sink_rows (B, H, Lq), where given, <- each row's share of the sink logit's gradient
// (double_backward's or backward_jvp's per-row closed form); it needs the `sink` option.
void bind_sink_rows(Call& call, const OptTensor& sink_rows) {
    TORCH_CHECK(!sink_rows.has_value() || call.call.sink, call.what, ": sink_rows is given without the sink option",
                call.ctx);
    call.bind(buf_sink_rows, sink_rows, false);
}

// gq, gk, gv, gbias may be absent (zero cotangents; gbias has the bias's sizes), and g_dout
// (not asked for). gk_parts and gv_parts hold `chunks` zeroed (B, Hkv, Lk, .) partial sums,
// one per chunk of query blocks, and g_bias_parts, where given, the zeroed parts of the
// bias's; block_rows rows per query block, each holding whole rows.
void double_backward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& mask,
                        const OptTensor& bias, const OptTensor& key_bounds, const at::Tensor& out,
                        const at::Tensor& row_max, const at::Tensor& inv_sum, const at::Tensor& dout,
                        const at::Tensor& delta, const OptTensor& gq, const OptTensor& gk, const OptTensor& gv,
                        const OptTensor& gbias, const OptTensor& g_dout, const at::Tensor& g_q,
                        const at::Tensor& gk_parts, const at::Tensor& gv_parts, const OptTensor& g_bias_parts,
                        ATTNGRAD_OPTIONS_PARAMS, const OptTensor& key_ranges, const OptTensor& mask_blocks,
                        const OptTensor& mask_tiles, const OptTensor& sink_rows) {
    TORCH_CHECK(!partial_rows, "attngrad_tiles.double_backward: the pass sums each row over its keys; "
                "partial_rows says they are a part of the row's");
    Call call = make_call("attngrad_tiles.double_backward", q, k, v, mask, bias, key_bounds, ATTNGRAD_OPTIONS_ARGS);
    bind_mask_blocks(call, mask_blocks, mask_tiles);
    bind_key_ranges(call, key_ranges);
    bind_after_forward(call, out, row_max, inv_sum, dout, delta);
    call.bind(buf_gq, gq, false);
    call.bind(buf_gk, gk, false);
    call.bind(buf_gv, gv, false);
    call.bind(buf_gbias, gbias, false);
    call.bind(buf_g_dout, g_dout, false);
    call.bind(buf_g_q, g_q, true);
    call.bind(buf_gk_parts, gk_parts, true);
    call.bind(buf_gv_parts, gv_parts, true);
    call.bind(buf_g_bias_parts, g_bias_parts, false);
    bind_sink_rows(call, sink_rows);
    run(call, [](const auto& pass) { double_backward(pass); });
}

// The tangents tq, tk, tv, tbias of the forward-mode passes, each may be absent (zero)
void bind_tangents(Call& call, const OptTensor& tq, const OptTensor& tk, const OptTensor& tv, const OptTensor& tbias) {
    call.bind(buf_tq, tq, false);
    call.bind(buf_tk, tk, false);
    call.bind(buf_tv, tv, false);
    call.bind(buf_tbias, tbias, false);
}

// The inputs of the backward's JVP: the forward's results, dout, delta scratch, and the
// tangents of dout, q, k, v and the bias (each may be absent: zero)
void bind_backward_jvp_inputs(Call& call, const at::Tensor& out, const at::Tensor& row_max, const at::Tensor& inv_sum,
                              const at::Tensor& dout, const at::Tensor& delta, const OptTensor& tdout,
                              const OptTensor& tq, const OptTensor& tk, const OptTensor& tv, const OptTensor& tbias) {
    bind_after_forward(call, out, row_max, inv_sum, dout, delta);
    call.bind(buf_tdout, tdout, false);
    bind_tangents(call, tq, tk, tv, tbias);
}

// tout (B, H, Lq, dv) <- the output's tangent for tangents tq, tk, tv, tbias (each may be
// absent: zero; tbias has the bias's sizes), from the forward's row_max and inv_sum;
// block_rows rows per query block, each holding whole rows of keys.
void jvp_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& mask,
            const OptTensor& bias, const OptTensor& key_bounds, const at::Tensor& row_max, const at::Tensor& inv_sum,
            const OptTensor& tq, const OptTensor& tk, const OptTensor& tv, const OptTensor& tbias,
            const at::Tensor& tout, ATTNGRAD_OPTIONS_PARAMS, const OptTensor& key_ranges,
            const OptTensor& mask_blocks, const OptTensor& mask_tiles) {
    Call call = make_call("attngrad_tiles.jvp", q, k, v, mask, bias, key_bounds, ATTNGRAD_OPTIONS_ARGS);
    bind_mask_blocks(call, mask_blocks, mask_tiles);
    bind_key_ranges(call, key_ranges);
    call.bind(buf_row_max, row_max, true);
    call.bind(buf_inv_sum, inv_sum, true);
    bind_tangents(call, tq, tk, tv, tbias);
    call.bind(buf_tout, tout, true);
    run(call, [](const auto& pass) { jvp(pass); });
}

// out and tout (B, H, Lq, dv) <- the output and its tangent for tangents tq, tk, tv, tbias
// (as in jvp_op), in one pass of whole rows that makes its own statistics and writes them to
// row_max and inv_sum (B, H, Lq) as the forward does (the `sink` option adds its term to each
// row's sum), and where given centre (B, H, Lq) <- t = rowsum(P * S'), the tangent of each
// row's log-sum-exp, which backward_jvp_given_sums takes; given peak too, peak <- c = S' at
// the row's most probable key and centre <- t - c (see centre_on_peak).
void forward_jvp_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& mask,
                    const OptTensor& bias, const OptTensor& key_bounds, const OptTensor& tq, const OptTensor& tk,
                    const OptTensor& tv, const OptTensor& tbias, const at::Tensor& out, const at::Tensor& tout,
                    const at::Tensor& row_max, const at::Tensor& inv_sum, ATTNGRAD_OPTIONS_PARAMS, const OptTensor& key_ranges, const OptTensor& mask_blocks,
                    const OptTensor& mask_tiles, const OptTensor& centre, const OptTensor& peak) {
    TORCH_CHECK(!partial_rows, "attngrad_tiles.forward_jvp: the pass takes each row's statistics from its keys; "
                "partial_rows says they are a part of the row's");
    Call call = make_call("attngrad_tiles.forward_jvp", q, k, v, mask, bias, key_bounds, ATTNGRAD_OPTIONS_ARGS);
    bind_mask_blocks(call, mask_blocks, mask_tiles);
    bind_key_ranges(call, key_ranges);
    bind_tangents(call, tq, tk, tv, tbias);
    call.bind(buf_out, out, true);
    call.bind(buf_tout, tout, true);
    call.bind(buf_row_max, row_max, true);
    call.bind(buf_inv_sum, inv_sum, true);
    call.bind(buf_centre, centre, false);
    TORCH_CHECK(!peak.has_value() || centre.has_value(), "attngrad_tiles.forward_jvp: peak is given with centre",
                call.ctx);
    call.bind(buf_peak, peak, false);
    run(call, [](const auto& pass) { jvp(pass); });
}

// tdq (B, H, Lq, d) and the zeroed `chunks` partial sums tdk_parts, tdv_parts (B, Hkv, Lk, .)
// <- the tangents of the backward's dQ, dK, dV for tangents tdout, tq, tk, tv, tbias (each
// may be absent: zero; tbias has the bias's sizes), and where given the zeroed parts
// tdbias_parts of dbias's; delta is (B, H, Lq) scratch. Given dq (B, H, Lq, d), the zeroed
// dk_parts and dv_parts (as tdk_parts, tdv_parts) and, with tdbias_parts, the zeroed
// dbias_row_parts, the pass is the backward too and writes dQ, dK, dV and dbias there.
void backward_jvp_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& mask,
                     const OptTensor& bias, const OptTensor& key_bounds, const at::Tensor& out,
                     const at::Tensor& row_max, const at::Tensor& inv_sum, const at::Tensor& dout,
                     const at::Tensor& delta, const OptTensor& tdout, const OptTensor& tq, const OptTensor& tk,
                     const OptTensor& tv, const OptTensor& tbias, const at::Tensor& tdq, const at::Tensor& tdk_parts,
                     const at::Tensor& tdv_parts, const OptTensor& tdbias_parts, const OptTensor& dq,
                     const OptTensor& dk_parts, const OptTensor& dv_parts, const OptTensor& dbias_row_parts,
                     ATTNGRAD_OPTIONS_PARAMS,
                     const OptTensor& key_ranges, const OptTensor& mask_blocks, const OptTensor& mask_tiles,
                     const OptTensor& sink_rows) {
    TORCH_CHECK(!partial_rows, "attngrad_tiles.backward_jvp: the pass sums each row over its keys; "
                "partial_rows says they are a part of the row's (backward_jvp_given_sums takes a ring step's)");
    Call call = make_call("attngrad_tiles.backward_jvp", q, k, v, mask, bias, key_bounds, ATTNGRAD_OPTIONS_ARGS);
    bind_mask_blocks(call, mask_blocks, mask_tiles);
    bind_key_ranges(call, key_ranges);
    bind_backward_jvp_inputs(call, out, row_max, inv_sum, dout, delta, tdout, tq, tk, tv, tbias);
    call.bind(buf_tdq, tdq, true);
    call.bind(buf_tdk_parts, tdk_parts, true);
    call.bind(buf_tdv_parts, tdv_parts, true);
    call.bind(buf_tdbias_parts, tdbias_parts, false);
    const bool with_backward = dq.has_value();
    TORCH_CHECK(dk_parts.has_value() == with_backward && dv_parts.has_value() == with_backward &&
                dbias_row_parts.has_value() == (with_backward && tdbias_parts.has_value()),
                "attngrad_tiles.backward_jvp: dq, dk_parts, dv_parts (and dbias_row_parts with tdbias_parts) are "
                "given together or not at all", call.ctx);
    call.bind(buf_dq, dq, false);
    call.bind(buf_dk_parts, dk_parts, false);
    call.bind(buf_dv_parts, dv_parts, false);
    call.bind(buf_dbias_row_parts, dbias_row_parts, false);
    bind_sink_rows(call, sink_rows);
    run(call, [](const auto& pass) { backward_jvp(pass); });
}

// The backward's JVP (backward_jvp_op's) on the backward's tiles, given each row's centre
// t = rowsum(P * S') (with peak c, centre is t - c: forward_jvp_op's) and delta_t
// D' = rowsum(tdout * out + dout * tout) (B, H, Lq): tdq_parts
// holds `chunks` zeroed (B, H, Lq, d) partial sums of dQ', one per chunk of key blocks, tdk and
// tdv are zeroed; given dq_parts, dk and dv (as tdq_parts, tdk, tdv), the pass is the backward
// too. No bias gradient (backward_jvp_op takes those calls); tile_map as the forward's.
void backward_jvp_given_sums_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const OptTensor& mask, const OptTensor& bias, const OptTensor& key_bounds,
                                const at::Tensor& out, const at::Tensor& row_max, const at::Tensor& inv_sum,
                                const at::Tensor& dout, const at::Tensor& delta, const OptTensor& tdout,
                                const OptTensor& tq, const OptTensor& tk, const OptTensor& tv, const OptTensor& tbias,
                                const at::Tensor& centre, const at::Tensor& delta_t, const at::Tensor& tdq_parts,
                                const at::Tensor& tdk, const at::Tensor& tdv, const OptTensor& dq_parts,
                                const OptTensor& dk, const OptTensor& dv, ATTNGRAD_OPTIONS_PARAMS,
                                const OptTensor& tile_map, const OptTensor& key_ranges, const OptTensor& mask_blocks,
                                const OptTensor& mask_tiles, const OptTensor& peak) {
    Call call = make_call("attngrad_tiles.backward_jvp_given_sums", q, k, v, mask, bias, key_bounds,
                          ATTNGRAD_OPTIONS_ARGS);
    bind_mask_blocks(call, mask_blocks, mask_tiles);
    bind_key_ranges(call, key_ranges);
    bind_tile_map(call, tile_map);
    bind_backward_jvp_inputs(call, out, row_max, inv_sum, dout, delta, tdout, tq, tk, tv, tbias);
    call.bind(buf_centre, centre, true);
    call.bind(buf_peak, peak, false);
    call.bind(buf_delta_t, delta_t, true);
    call.bind(buf_tdq_parts, tdq_parts, true);
    call.bind(buf_tdk, tdk, true);
    call.bind(buf_tdv, tdv, true);
    TORCH_CHECK(dk.has_value() == dq_parts.has_value() && dv.has_value() == dq_parts.has_value(),
                "attngrad_tiles.backward_jvp_given_sums: dq_parts, dk and dv are given together or not at all",
                call.ctx);
    call.bind(buf_dq_parts, dq_parts, false);
    call.bind(buf_dk, dk, false);
    call.bind(buf_dv, dv, false);
    run(call, [](const auto& pass) { backward_jvp_given_sums(pass); });
}

// out (B, H, R, keys) <- Z for rows row_start.. and keys key_start..: 1 / (1 - p) where kept, else 0
template <typename T>
void dropout_keep_scale(T* out, index_t batch, index_t heads, index_t row_start, index_t rows, index_t key_start,
                        index_t keys, const DropoutDraw& draw) {
    parallel_range(batch * heads * rows, 16, [&](index_t begin, index_t end) {
        for (index_t row = begin; row < end; ++row) {
            const index_t bh = row / rows;
            T* out_row = out + row * keys;
            std::fill(out_row, out_row + keys, T(1));
            draw.scale_row(out_row, bh / heads, bh % heads, row_start + row % rows, key_start, keys);
        }
    });
}

// out, a contiguous (B, H, R, keys) float32 or float64 tile, <- the keep-scale tile of
// `dropout.keep_scale_into` for rows row_start.. and keys key_start..; `threshold` is
// ceil(p 2^32), `value` 1 / (1 - p).
void dropout_keep_scale_op(const at::Tensor& out, int64_t seed, int64_t row_start, int64_t key_start,
                           int64_t threshold, double value) {
    const char* what = "attngrad_tiles.dropout_keep_scale";
    TORCH_CHECK(out.dim() == 4, what, ": out must be 4-D (B, H, R, keys), got shape ", out.sizes());
    TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble, what,
                ": out must be float32 or float64, got ", out.scalar_type());
    check_tensor(what, "out", out, out.scalar_type(), out.sizes(), Context{});
    const int64_t sizes[6] = {out.size(0), out.size(1), row_start, out.size(2), key_start, out.size(3)};
    const char* names[6] = {"batch", "heads", "row_start", "rows", "key_start", "keys"};
    for (int i = 0; i < 6; ++i) {
        TORCH_CHECK(sizes[i] >= 0 && sizes[i] <= (int64_t{1} << 31), what, ": ", names[i], " is ", sizes[i],
                    ", expected 0 to 2^31");
    }
    TORCH_CHECK(threshold >= 0 && threshold <= (int64_t{1} << 32), what, ": threshold is ", threshold,
                ", expected 0 to 2^32");
    if (out.numel() == 0) return;
    const DropoutDraw draw{true, static_cast<uint64_t>(seed), static_cast<uint64_t>(threshold), value};
    if (out.scalar_type() == at::kDouble) {
        dropout_keep_scale(out.data_ptr<double>(), sizes[0], sizes[1], row_start, sizes[3], key_start, sizes[5], draw);
    } else {
        dropout_keep_scale(out.data_ptr<float>(), sizes[0], sizes[1], row_start, sizes[3], key_start, sizes[5], draw);
    }
}

// Which GEMM the passes use: choose -1 asks, 0 picks the BLAS (where it resolved), 1
// ATen's at::cpu::addmm_out; returns the one in effect after the call (0 or 1).
int64_t gemm_path_op(int64_t choose) {
    TORCH_CHECK(choose >= -1 && choose <= 1, "attngrad_tiles.gemm_path: choose is ", choose, ", expected -1, 0 or 1");
    TORCH_CHECK(choose != 0 || blas_available(), "attngrad_tiles.gemm_path: no BLAS sgemm_/dgemm_ in this process");
    if (choose >= 0) use_aten_gemm.store(choose == 1);
    return use_aten_gemm.load() ? 1 : 0;
}

// Whether bfloat16 products whose B is a pass input run on oneDNN's brgemm (bf16_route):
// choose -1 asks, 0 turns it off (MKL's bfloat16 GEMM for all), 1 on where this CPU has a
// brgemm route; returns the route in effect after the call: 0 MKL's GEMM, 1 brgemm on the
// matrix units (AMX-BF16), 2 brgemm on AVX512-BF16.
int64_t brgemm_path_op(int64_t choose) {
    TORCH_CHECK(choose >= -1 && choose <= 1, "attngrad_tiles.brgemm_path: choose is ", choose,
                ", expected -1, 0 or 1");
    if (choose >= 0) brgemm_route.store(choose == 1 ? -1 : kBf16Mkl);
    TORCH_CHECK(choose != 1 || use_brgemm(), "attngrad_tiles.brgemm_path: no brgemm route here: the CPU has "
                "neither AMX-BF16 (with PyTorch packing bfloat16) nor AVX512-BF16, torch.backends.mkldnn is off, "
                "or MKL's bfloat16 GEMM is not in this process");
    return bf16_route();
}

// The number of parts a bias gradient's buffer holds: 1, or `chunks` where the bias is
// constant along the chunked axis (keys in the backward, whole_rows false; query rows in
// the whole-row passes).
// The score tiles the forward and the backward have computed in this process since the
// last reset; with `reset`, the count is set back to 0 (the value before it returned).
int64_t tiles_computed_op(bool reset) {
    return reset ? tiles_computed.exchange(0) : tiles_computed.load();
}

int64_t bias_grad_parts_op(c10::IntArrayRef bias_sizes, int64_t chunks, bool whole_rows) {
    TORCH_CHECK(bias_sizes.size() == 4, "attngrad_tiles.bias_grad_parts: bias_sizes must have 4 entries, got ",
                bias_sizes);
    return bias_sizes[whole_rows ? 2 : 3] == 1 ? chunks : 1;
}

}  // namespace

TORCH_LIBRARY(attngrad_tiles, m) {
    m.def("forward(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? bias, Tensor? key_bounds, Tensor(a!) out, "
          "Tensor(b!) row_max, Tensor(c!) inv_sum, " ATTNGRAD_OPTIONS_SCHEMA ", Tensor? tile_map=None, "
          "Tensor? key_ranges=None, " MASK_BLOCKS_SCHEMA ") -> ()");
    m.def("backward(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? bias, Tensor? key_bounds, Tensor out, "
          "Tensor row_max, Tensor inv_sum, Tensor dout, Tensor(a!) delta, Tensor(b!) dq_parts, Tensor(c!) dk, "
          "Tensor(d!) dv, Tensor(e!)? dbias_parts, " ATTNGRAD_OPTIONS_SCHEMA ", Tensor? tile_map=None, "
          "Tensor? key_ranges=None, " MASK_BLOCKS_SCHEMA ") -> ()");
    m.def("double_backward(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? bias, Tensor? key_bounds, Tensor out, "
          "Tensor row_max, Tensor inv_sum, Tensor dout, Tensor(a!) delta, Tensor? gq, Tensor? gk, Tensor? gv, "
          "Tensor? gbias, Tensor(b!)? g_dout, Tensor(c!) g_q, Tensor(d!) gk_parts, Tensor(e!) gv_parts, "
          "Tensor(f!)? g_bias_parts, " ATTNGRAD_OPTIONS_SCHEMA ", Tensor? key_ranges=None, " MASK_BLOCKS_SCHEMA
          ", Tensor(g!)? sink_rows=None) -> ()");
    m.def("jvp(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? bias, Tensor? key_bounds, Tensor row_max, "
          "Tensor inv_sum, Tensor? tq, Tensor? tk, Tensor? tv, Tensor? tbias, Tensor(a!) tout, "
          ATTNGRAD_OPTIONS_SCHEMA ", Tensor? key_ranges=None, " MASK_BLOCKS_SCHEMA ") -> ()");
    m.def("forward_jvp(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? bias, Tensor? key_bounds, Tensor? tq, "
          "Tensor? tk, Tensor? tv, Tensor? tbias, Tensor(a!) out, Tensor(b!) tout, Tensor(c!) row_max, "
          "Tensor(d!) inv_sum, " ATTNGRAD_OPTIONS_SCHEMA
          ", Tensor? key_ranges=None, " MASK_BLOCKS_SCHEMA ", Tensor(e!)? centre=None, Tensor(f!)? peak=None) -> ()");
    m.def("backward_jvp(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? bias, Tensor? key_bounds, Tensor out, "
          "Tensor row_max, Tensor inv_sum, Tensor dout, Tensor(a!) delta, Tensor? tdout, Tensor? tq, Tensor? tk, "
          "Tensor? tv, Tensor? tbias, Tensor(b!) tdq, Tensor(c!) tdk_parts, Tensor(d!) tdv_parts, "
          "Tensor(e!)? tdbias_parts, Tensor(f!)? dq, Tensor(g!)? dk_parts, Tensor(h!)? dv_parts, "
          "Tensor(i!)? dbias_row_parts, " ATTNGRAD_OPTIONS_SCHEMA ", Tensor? key_ranges=None, " MASK_BLOCKS_SCHEMA
          ", Tensor(j!)? sink_rows=None) -> ()");
    m.def("backward_jvp_given_sums(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? bias, Tensor? key_bounds, "
          "Tensor out, Tensor row_max, Tensor inv_sum, Tensor dout, Tensor(a!) delta, Tensor? tdout, Tensor? tq, "
          "Tensor? tk, Tensor? tv, Tensor? tbias, Tensor centre, Tensor delta_t, Tensor(b!) tdq_parts, Tensor(c!) tdk, "
          "Tensor(d!) tdv, Tensor(e!)? dq_parts, Tensor(f!)? dk, Tensor(g!)? dv, " ATTNGRAD_OPTIONS_SCHEMA
          ", Tensor? tile_map=None, Tensor? key_ranges=None, " MASK_BLOCKS_SCHEMA ", Tensor? peak=None) -> ()");
    m.def("dropout_keep_scale(Tensor(a!) out, int seed, int row_start, int key_start, int threshold, float value) -> ()");
    m.def("gemm_path(int choose) -> int", &gemm_path_op);
    m.def("brgemm_path(int choose) -> int", &brgemm_path_op);
    m.def("tiles_computed(bool reset=False) -> int", &tiles_computed_op);
    m.def("bias_grad_parts(int[] bias_sizes, int chunks, bool whole_rows) -> int", &bias_grad_parts_op);
}

TORCH_LIBRARY_IMPL(attngrad_tiles, CPU, m) {
    m.impl("forward", &forward_op);
    m.impl("backward", &backward_op);
    m.impl("double_backward", &double_backward_op);
    m.impl("jvp", &jvp_op);
    m.impl("forward_jvp", &forward_jvp_op);
    m.impl("backward_jvp", &backward_jvp_op);
    m.impl("backward_jvp_given_sums", &backward_jvp_given_sums_op);
    m.impl("dropout_keep_scale", &dropout_keep_scale_op);
}

}  // namespace attngrad_tiles
