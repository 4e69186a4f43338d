// attngrad's compiled tiles as PyTorch operators, torch.ops.attngrad_tiles.*: each takes
// its tensors and options through its schema, checks every tensor (device, dtype, shape
// against q, k, v's sizes, contiguity) and every option at entry, with a message naming
// the argument and the shapes, fills an AttngradCall from them and runs its pass in the
// call's element type. Nothing is read or written before every check has passed: no
// input that reaches an op can make a pass read or write out of bounds.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <bit>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "checked_call.h"

namespace attngrad_tiles {

extern std::atomic<bool> use_aten_gemm;  // runtime.cpp
extern std::atomic<int> brgemm_route;    // bf16_products.cpp
bool blas_available();

namespace {

// out (B, H, Lq, dv), row_max and inv_sum (B, H, Lq) from q, k, v; mask (bool, true = take
// part), bias and key bounds optional; dropout in the output's E V; tile_map, where given,
// the tiles to skip and those to compute without the mask and bias (bind_tile_map).
void run_forward(const char* what, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const OptTensor& mask, const OptTensor& bias, const OptTensor& key_bounds, const at::Tensor& out,
                 const at::Tensor& row_max, const at::Tensor& inv_sum, const Options& options,
                 const OptTensor& tile_map, const OptTensor& key_ranges, const OptTensor& mask_blocks,
                 const OptTensor& mask_tiles) {
    Call call = make_call(what, q, k, v, mask, bias, key_bounds, options);
    call.call.key_readers = AttngradCall::KeyReaders::forward;
    bind_mask_blocks(call, mask_blocks, mask_tiles);
    bind_key_ranges(call, key_ranges);
    bind_tile_map(call, tile_map);
    call.bind(buf_out, out, true);
    call.bind(buf_row_max, row_max, true);
    call.bind(buf_inv_sum, inv_sum, true);
    run(call, [](const auto& pass) { forward(pass); });
}

void forward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& mask,
                const OptTensor& bias, const OptTensor& key_bounds, const at::Tensor& out, const at::Tensor& row_max,
                const at::Tensor& inv_sum, ATTNGRAD_OPTIONS_PARAMS, const OptTensor& tile_map,
                const OptTensor& key_ranges, const OptTensor& mask_blocks, const OptTensor& mask_tiles) {
    run_forward("attngrad_tiles.forward", q, k, v, mask, bias, key_bounds, out, row_max, inv_sum,
                ATTNGRAD_OPTIONS_ARGS, tile_map, key_ranges, mask_blocks, mask_tiles);
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
void run_backward(const char* what, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const OptTensor& mask, const OptTensor& bias, const OptTensor& key_bounds, const at::Tensor& out,
                  const at::Tensor& row_max, const at::Tensor& inv_sum, const at::Tensor& dout, const at::Tensor& delta,
                  const at::Tensor& dq_parts, const at::Tensor& dk, const at::Tensor& dv, const OptTensor& dbias_parts,
                  const Options& options, const OptTensor& tile_map, const OptTensor& key_ranges,
                  const OptTensor& mask_blocks, const OptTensor& mask_tiles) {
    Call call = make_call(what, q, k, v, mask, bias, key_bounds, options);
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

void backward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& mask,
                 const OptTensor& bias, const OptTensor& key_bounds, const at::Tensor& out, const at::Tensor& row_max,
                 const at::Tensor& inv_sum, const at::Tensor& dout, const at::Tensor& delta,
                 const at::Tensor& dq_parts, const at::Tensor& dk, const at::Tensor& dv, const OptTensor& dbias_parts,
                 ATTNGRAD_OPTIONS_PARAMS, const OptTensor& tile_map, const OptTensor& key_ranges,
                 const OptTensor& mask_blocks, const OptTensor& mask_tiles) {
    run_backward("attngrad_tiles.backward", q, k, v, mask, bias, key_bounds, out, row_max, inv_sum, dout, delta,
                 dq_parts, dk, dv, dbias_parts, ATTNGRAD_OPTIONS_ARGS, tile_map, key_ranges, mask_blocks, mask_tiles);
}

// A pass's options made once for a run of calls alike (attngrad.torch.eager_plans) and
// taken whole by the planned ops below, which take only what changes from call to call and
// make their results themselves: a small call hands PyTorch's dispatcher 8 to 12 tensors,
// not 30 arguments. Packed as (19,) int64 (native._planned_options): causal's presence and
// value, then Options' fields in order, each double as its bits.
constexpr int64_t kPackedOptions = 19;

Options unpack_options(const char* what, const at::Tensor& packed) {
    check_tensor(what, "options", packed, at::kLong, {kPackedOptions}, Context{});
    const int64_t* o = packed.const_data_ptr<int64_t>();
    const auto real = [](int64_t bits) { return std::bit_cast<double>(bits); };
    return Options{o[0] ? std::optional<int64_t>(o[1]) : std::nullopt, real(o[2]), real(o[3]), o[4] != 0, o[5], o[6],
                   real(o[7]), o[8], o[9], o[10], o[11] != 0, o[12] != 0, o[13], o[14], o[15], o[16], o[17] != 0,
                   o[18] != 0};
}

// The sizes the planned ops allocate by, checked before they allocate: q, k, v 4-D, and the
// options' chunks in range (make_call checks everything else before the pass runs).
void check_planned(const char* what, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const Options& o) {
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, what, ": q, k and v must be 4-D",
                Context{&q, &k, &v});
    TORCH_CHECK(o.chunks >= 1 && o.chunks <= kIntMax, what, ": chunks is ", o.chunks, ", expected 1 to 2^31 - 1");
}

// forward_op's (out, row_max, inv_sum), made here, for a call without key bounds or mask blocks
Results forward_planned_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& mask,
                           const OptTensor& bias, const OptTensor& tile_map, const at::Tensor& key_ranges,
                           const at::Tensor& packed) {
    const char* what = "attngrad_tiles.forward_planned";
    const Options options = unpack_options(what, packed);
    check_planned(what, q, k, v, options);
    at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
    at::Tensor row_max = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
    at::Tensor inv_sum = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
    run_forward(what, q, k, v, mask, bias, std::nullopt, out, row_max, inv_sum, options, tile_map, key_ranges,
                std::nullopt, std::nullopt);
    return {out, row_max, inv_sum};
}

// backward_op's (dq, dk, dv), made here, for the same calls and without a bias gradient; dq
// is the sum of its chunks' parts in chunk order (native._sum_parts's order: the same bits).
Results backward_planned_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& mask,
                            const OptTensor& bias, const at::Tensor& out, const at::Tensor& row_max,
                            const at::Tensor& inv_sum, const at::Tensor& dout, const OptTensor& tile_map,
                            const at::Tensor& key_ranges, const at::Tensor& packed) {
    const char* what = "attngrad_tiles.backward_planned";
    const Options o = unpack_options(what, packed);
    check_planned(what, q, k, v, o);
    at::Tensor delta = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
    at::Tensor dq_parts = at::empty({o.chunks, q.size(0), q.size(1), q.size(2), q.size(3)}, q.options());
    at::Tensor dk = at::empty(k.sizes(), q.options()), dv = at::empty(v.sizes(), q.options());
    run_backward(what, q, k, v, mask, bias, std::nullopt, out, row_max, inv_sum, dout, delta, dq_parts, dk, dv,
                 std::nullopt, o, tile_map, key_ranges, std::nullopt, std::nullopt);
    if (o.chunks == 1) return {dq_parts.select(0, 0), dk, dv};
    at::Tensor dq = dq_parts.select(0, 0).add(dq_parts.select(0, 1));
    for (int64_t part = 2; part < o.chunks; ++part) dq.add_(dq_parts.select(0, part));
    return {dq, dk, dv};
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

Results forward_planned_unmasked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& key_ranges, const at::Tensor& packed) {
    return forward_planned_op(q, k, v, std::nullopt, std::nullopt, std::nullopt, key_ranges, packed);
}

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
    m.def("forward_planned(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? bias, Tensor? tile_map, "
          "Tensor key_ranges, Tensor options) -> (Tensor, Tensor, Tensor)");
    m.def("backward_planned(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? bias, Tensor out, Tensor row_max, "
          "Tensor inv_sum, Tensor dout, Tensor? tile_map, Tensor key_ranges, Tensor options) "
          "-> (Tensor, Tensor, Tensor)");
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
    m.impl("forward_planned", &forward_planned_op);
    m.impl("backward_planned", &backward_planned_op);
    m.impl("dropout_keep_scale", &dropout_keep_scale_op);
}

}  // namespace attngrad_tiles
