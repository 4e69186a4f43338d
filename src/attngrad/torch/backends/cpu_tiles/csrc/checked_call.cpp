// The entry checks of checked_call.h.
#include "checked_call.h"

#include <vector>

namespace attngrad_tiles {

namespace {

const char* const kBufferNames[kBufferCount] = {
#define ATTNGRAD_NAME(name) #name,
    ATTNGRAD_BUFFERS(ATTNGRAD_NAME)
#undef ATTNGRAD_NAME
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


}  // namespace

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

void Call::bind(int b, const OptTensor& t, bool required) {
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

}  // namespace attngrad_tiles
