// attngrad's compiled tiles: every pass of exact attention (forward, backward, JVP, the
// backward's JVP, double backward) with the causal diagonal, a boolean mask, a float bias
// and its gradient, per-row key bounds (structured masks: padding lengths, sliding windows,
// packed documents), a soft cap, dropout and GQA, in the manner of FlashAttention-2 (Dao,
// 2023) on per-thread tiles small enough to stay in a core's cache; and the dropout
// keep-masks of the counter-based generator in `dropout.py`.
//
// The sources: tiles_math.h (SIMD exp and tanh, the row loops), this header (the overview and
// the passes), tile_call.h (the call, its buffers, work items, the GEMM and thread-pool
// interface, dropout), score_masks.h (masks, bounds, tile maps, the soft cap), pass.h (the
// typed call and the key layouts), accumulation.h (the shared sums), runtime.cpp (the GEMM and
// the work loop on PyTorch's thread pool), row_products.h (the GEMM of a one-row tile),
// passes.cpp (forward, backward), passes_higher.cpp
// (double backward, JVP, the backward's JVP), passes_given_sums.cpp (the backward's JVP on the
// backward's tiles, given each row's sums) and ops.cpp (the TORCH_LIBRARY ops
// attngrad_tiles::*, which check every tensor against the others before a pass runs).
//
// Shape legend (row-major, contiguous)
//   q (B, H, Lq, d), k (B, Hkv, Lk, d), v (B, Hkv, Lk, dv), out and dout (B, H, Lq, dv),
//   row_max and inv_sum (B, H, Lq). G = H / Hkv query heads share one key/value head.
//   R rows of a query block, C keys of a key block.
//
// forward, per (b, h, query block), over key blocks with an online softmax:
//   S = scale Q_blk K_blk^T                                    (R, C)
//   m' = max(m, rowmax S),  E = exp(S - m'),  l = l exp(m - m') + rowsum E
//   acc = acc exp(m - m') + E V_blk                            (R, dv)
//   out = acc / l;  row_max = m, inv_sum = 1 / l              (the statistics attngrad keeps)
// backward, per (b, key/value head, chunk of key blocks), over query blocks:
//   P  = exp(S - m) / l,  dP = dO V_blk^T,  dS = P (dP - D)    D = rowsum(dO * O), or
//   rowsum(P * dP) where the block holds all of the row's keys (the same in exact arithmetic)
//   dV_blk += P^T dO,  dK_blk += scale dS^T Q,  dQ += scale dS K_blk,  dbias += dS
// jvp, backward_jvp, double_backward: see each in passes_higher.cpp; they take query blocks
// of whole rows. backward_jvp_given_sums (passes_given_sums.cpp) takes the backward's tiles.
// A work item owns its dK and dV rows, and its own copy of dQ when the keys are split into
// chunks (the double backward and the backward's JVP: their dQ-shaped rows, and their own
// dK, dV-shaped sums when the query blocks are split; a bias gradient: the batch entries
// and heads sharing a broadcast bias form one item (KvItems), and chunks adding into the
// same entries own parts): nothing is written by two threads, and the parts are added in a
// fixed order, so the bits do not depend on the schedule. The items run on PyTorch's own
// thread pool (at::parallel_for), one worker per thread, each taking the next item from an
// atomic counter (parallel_items): dynamic load balancing, with the GEMMs single-threaded
// inside a worker.
// The causal mask is a diagonal: row i sees keys j <= i + c (c = 0 top-left, Lk - Lq
// bottom-right). Key bounds leave row i of batch entry b the keys [lo, hi): tiles outside
// every row's bounds are skipped, and the whole-row passes hold only the keys between them.
// A row that sees no key has output 0 and sends back 0; a row that sees one key has P = 1
// there exactly and dS = 0 (a recomputed score can round apart from the forward's maximum).
// A row that a NaN or Inf reached (a NaN score, or +inf: exp(inf - inf)) has l NaN, and keeps
// 1/l NaN, so its output and all it sends back are NaN: "no key" is l = 0 (its maximum -inf
// with no NaN among the scores, has_nan), never !(l > 0), in every pass.
#pragma once

#include "accumulation.h"

namespace attngrad_tiles {

// The passes (passes.cpp, passes_higher.cpp), for float and double.
template <typename T> void forward(const Pass<T>& pass);
template <typename T> void backward(const Pass<T>& pass);
template <typename T> void double_backward(const Pass<T>& pass);
template <typename T> void jvp(const Pass<T>& pass);
template <typename T> void backward_jvp(const Pass<T>& pass);
template <typename T> void backward_jvp_given_sums(const Pass<T>& pass);

}  // namespace attngrad_tiles
