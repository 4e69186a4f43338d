"""The Triton kernels of attention, written in two modules (`forward_kernels`: forward,
jvp, forward_jvp; `backward_kernels`: the rest) and named here. Each program owns a block
of outputs and walks the score tiles that feed it, skipping those the block map marks
empty, in a fixed order, so nothing is reduced in a varying order and the same inputs give
the same bits (the fused backward adds dQ's parts in an order fixed by counters,
`add_in_order`).

    forward     per query block: online softmax (FlashAttention-2), O, m and 1/l
    jvp         per query block: O' = sum (P Z S') V + (P Z) V' - rowsum(P S') O, one pass
    forward_jvp per query block: forward and jvp in one online-softmax walk (O, m, 1/l and O';
                where asked, each row's t - c, c and peak key for a backward's JVP)
    row_sums    per query block: the row sums of the backward's JVP or the double backward, centred
                on each row's peak key (kept for the walks)
    given_row_sums  per query block: the backward's JVP's row sums from forward_jvp's and O',
                with no walk over the keys
    query_side  per query block: dQ (or its tangent, or g_Q and g_dO)
    key_side    per key block, over the GQA group's query heads: dK, dV (or theirs); fused
                with the backward's dQ for calls whose walks are contiguous runs (`dq_rank`)
    key_side_light  key_side's backward for a light call, in the keys' orientation
    row_dot     per query block: D = rowsum(dO * O)
    bias_side   per block of the bias's own shape: dbias (or its tangent, or g_bias),
                summed over the axes the bias broadcasts along

Each walk takes its block's tiles from a list (`launch._walk_lists`) in two loops: those
that need no masking (`block_map.unmasked_tiles`: the masks neither read nor applied), then
the others; no branch in either, so that Triton pipelines both.

Shapes: q (B, H, Lq, d), k (B, Hkv, Lk, d), v (B, Hkv, Lk, dv), any strides; row statistics
(B, H, Lq) contiguous; the walks' lists (B, H, blocks, 2 + other blocks), the walks' ranges
(B, H, blocks, 2) [first, stop) and the block map (B, H, query blocks, key blocks) int8
(1 = empty; bias_side's) may be expanded views (stride 0). The
mask and bias arguments are 4-D views broadcast to (B, H, Lq, Lk) by their strides.
fmeta (float64): [scale, cap, 1 / cap, 1 / (1 - p)]; meta (int64): `tile_ops.keep_scale`.

Arguments come packed in Triton's tuple arguments, built once per call (`launch.Plan`):

    tensors     the kernel's pointers, unpacked on its first line (None where absent)
    strides     each of q, k, v, and o or dO: a 4-tuple (sq, sk, sv, so or sd; the tangents
                and cotangents share their input's); a bias-shaped tensor beside its own
                (tbias stb, cbias sc, DBIAS sg)
    masks       what `tile_ops.scores` reads: (bias, its strides, mask, its strides, key bounds,
                their (batch, row) strides, the mask kept per block's index, its (batch, head,
                row) strides, its tiles)
    walks       (the walks' lists, their first three strides); the ranges and the block map
                likewise, where a kernel takes them
    sizes       `tile_ops.Sizes` (H, G, Lq, Lk, D, DV, causal)
    SW          the call's constexprs, one `tile_ops.Switches`; a pass's own (MODE, CENTRE,
                the HAS_ of its second inputs, ...) stay apart

Triton specialises each integer in a tuple as it does a lone integer argument (a 1 becomes a
constexpr, a multiple of 16 is known divisible for aligned loads), so the kernels compile to
the PTX of flat arguments (Triton 3.9, `attngrad gpu-report` at d = 64 and 128 for sm_80 and
sm_90: each of its 740 variants, key_side's less three parameters it never read).
A tuple unpacked in a kernel gives values, not constexprs: the tile's sizes, which tl.arange
needs constant, are taken from SW by name (`BM: tl.constexpr = SW.BM`), and the switches read
as SW.CAUSAL.
"""

from __future__ import annotations

import triton

from .backward_kernels import (
    add_in_order,
    bias_side,
    dq_rank,
    given_row_sums,
    key_side,
    key_side_light,
    query_side,
    row_dot,
    row_sums,
)
from .forward_kernels import forward, forward_jvp, jvp

__all__ = ["add_in_order", "bias_side", "dq_rank", "forward", "forward_jvp", "given_row_sums", "jvp", "key_side",
           "key_side_light", "query_side", "row_dot", "row_sums"]

# Whether @triton.jit made the kernels interpreted (TRITON_INTERPRET=1 at import) or compiled.
INTERPRETED = bool(triton.knobs.runtime.interpret)
