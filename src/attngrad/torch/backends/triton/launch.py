"""The Triton backend's host side: one `Plan` per call and block size (the tensors' pointers
and strides, the block map, the constexpr switches), on the tiles and with the options that
`config` gives, and one function per pass that launches the kernels of `kernels` in order.

    forward          forward
    jvp              jvp
    forward_jvp      forward_jvp (the two above in one walk)
    backward         row_dot (D), then query_side, key_side, then bias_side where the bias
                     gradient is reduced (a bias with the scores' own shape is written by
                     query_side); a light call whose walks are contiguous: query_side and
                     key_side_light (or, with `Options.fused_backward`, key_side alone, fused
                     with dQ)
    backward_jvp     row_sums (t - c, D~, the centre), then as backward; along the tangents
                     of a forward_jvp that left its row sums (a Hessian-vector product),
                     given_row_sums instead: D~ from O', no walk over the keys
    double_backward  row_sums (t - c, u - c2, the centres), then as backward

Every result is written whole by its own program, so the bits do not depend on the launch
order; the one exception, the fused backward (`Options.fused_backward`), adds dQ's parts into a
zeroed buffer in an order that counters fix (`kernels.dq_rank`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from typing_extensions import Unpack

from ...masks import version_cache
from ...masks.block_map import ScoreFilter, empty_tiles, unmasked_tiles
from ...op.call import AttentionCall, PassInputs
from ...op.dropout import as_int64, keep_value, threshold
from ...op.key_constant_bias import is_key_constant, rows_to_bias, sink_share
from ...precision import compute_dtype
from . import kernels
from .config import TUNING, Blocks, blocks_for, dtype_class, is_light, padded_width
from .tile_ops import BACKWARD, BACKWARD_JVP, DOUBLE_BACKWARD, SUMS, Sizes, Switches


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _capability(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def arch_of(device: torch.device) -> int:
    """The compute capability of a CUDA device as one number (90 for an H100)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def _slice(blocks: Blocks, width: int) -> int:
    """The columns of a head width of `width` that its products take at a time."""
    whole = padded_width(width)
    return min(blocks.slice, whole) if blocks.slice else whole


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


# the split products `Options.float32_products` may name (Triton's input_precision on NVIDIA)
SPLIT_PRODUCTS = ("tf32x3", "bf16x3", "bf16x6")


def input_precision(dtype: torch.dtype, device: torch.device) -> str:
    """float32 GEMMs in TF32 where PyTorch's matmul may use it (on CUDA, when
    torch.backends.cuda.matmul.allow_tf32), else as `Options.float32_products` says: in full
    float32 ("ieee", FMA on the CUDA cores) or a split product on the tensor cores."""
    if dtype != torch.float32 or device.type != "cuda":
        return "ieee"
    if torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    products = TUNING().float32_products
    if products != "ieee" and products not in SPLIT_PRODUCTS:
        raise ValueError(f"attngrad triton: float32_products={products!r}; expected 'ieee' or one of {SPLIT_PRODUCTS}")
    return products


def _strides(t: Optional[Tensor]) -> tuple:
    """A 4-D tensor's strides as one kernel argument (0s for an absent one)."""
    return (0, 0, 0, 0) if t is None else tuple(t.stride())


def _strides_of(*tensors: Tensor) -> tuple:
    """Each tensor's strides, one tuple each, as one kernel argument."""
    return tuple(_strides(t) for t in tensors)


def _as_scores(t: Optional[Tensor], shape: tuple) -> Optional[Tensor]:
    """A mask or bias-shaped tensor as a (B, H, Lq, Lk) view (broadcast axes of stride 0)."""
    if t is None:
        return None
    return t[(None,) * (4 - t.dim())].expand(shape)


def _narrowed(t: Optional[Tensor]) -> Optional[Tensor]:
    """A 4-D mask with its broadcast (stride 0) axes narrowed to size 1, on the CPU: what
    `block_map.empty_tiles` reads."""
    if t is None:
        return None
    t = t[(None,) * (4 - t.dim())]
    for axis in range(4):
        if t.stride(axis) == 0 and t.shape[axis] > 1:
            t = t.narrow(axis, 0, 1)
    return t.cpu()


def _walks(empty: Tensor) -> tuple[Tensor, Tensor]:
    """From a block map (..., query blocks, key blocks) (True = empty): each query block's
    key blocks and each key block's query blocks to walk, (..., blocks, 2) int32 [first, stop),
    from its first to its last tile that is not empty (first = stop where there is none)."""
    def spans(kept: Tensor) -> Tensor:
        n = kept.shape[-1]
        index = torch.arange(n, dtype=torch.int32)
        stop = torch.where(kept, index + 1, 0).amax(-1)
        first = torch.minimum(torch.where(kept, index, n).amin(-1), stop)
        return torch.stack([first, stop], -1).to(torch.int32).contiguous()

    kept = ~empty
    return spans(kept), spans(kept.transpose(-1, -2))


def _dense(empty: Tensor, walks: Tensor) -> bool:
    """Whether `walks` (from `_walks(empty)`) pass no empty tile: the tiles they span are all
    the map's kept ones."""
    return int((walks[..., 1] - walks[..., 0]).sum()) == int((~empty).sum())


def _walk_lists(empty: Tensor, interior: Tensor) -> tuple[Tensor, Tensor]:
    """Each query block's key blocks and each key block's query blocks to walk, as lists:
    (..., blocks, 2 + other blocks) int32, [n interior, n kept, the interior blocks in order,
    then the others kept in order, then padding]. Read one entry an iteration, a list leaves
    the loops without a branch on the tile map, so that Triton pipelines them."""
    kept, interior = torch.broadcast_tensors(~empty, interior & ~empty)

    def lists(kept: Tensor, interior: Tensor) -> Tensor:
        n = kept.shape[-1]
        index = torch.arange(n)
        rank = torch.where(interior, index, torch.where(kept, n + index, 2 * n + index))
        order = rank.sort(-1).values % n
        return torch.cat([interior.sum(-1, keepdim=True), kept.sum(-1, keepdim=True), order], -1) \
            .to(torch.int32).contiguous()

    return lists(kept, interior), lists(kept.transpose(-1, -2), interior.transpose(-1, -2))


@functools.lru_cache(maxsize=64)
def _on_device(values: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A few scalars as a tensor on `device`, made once per value (the kernels only read it):
    no host-to-device copy for each launch."""
    return torch.tensor(values, dtype=dtype, device=device)


class BlockMap(NamedTuple):
    """A call's tiles at one tile size, on its device: the tile map (1 or B, 1 or H, n_q, n_k)
    int8 (1: skipped), the walks as ranges [first, stop) per query block and per key block
    (`_walks`), the walks as lists (`_walk_lists`), and whether every range is dense (no
    skipped tile between its first and its stop: the fused backward and key_side_light walk
    the ranges then)."""

    tile_map: Tensor
    key_ranges: Tensor
    query_ranges: Tensor
    key_lists: Tensor
    query_lists: Tensor
    dense: bool


def _block_map(call: AttentionCall, blocks: Blocks) -> BlockMap:
    """The call's `BlockMap` for tiles of `blocks`. Made on the CPU (a mask and key bounds are
    copied there), which costs milliseconds of host time a call (20 ms for a plain call at
    L = 4096 on 2 cores), so they are kept while the mask, the bounds and the mask kept per
    block live unchanged (`version_cache`); a call with none of them keeps one per shape."""
    mask_blocks = call.blocks
    sources = (call.mask, call.bounds, None if mask_blocks is None else mask_blocks.index,
               None if mask_blocks is None else mask_blocks.tiles)
    len_q, len_k, device = call.q.shape[2], call.k.shape[2], call.q.device
    split = TUNING().interior_tiles

    def make() -> BlockMap:
        bounds = None if call.bounds is None else call.bounds.contiguous().cpu()
        scores = ScoreFilter(len_q, len_k, call.causal, bounds, _narrowed(call.mask),
                             blocks=None if mask_blocks is None else mask_blocks.to("cpu"))
        empty = empty_tiles(scores, blocks.rows, blocks.keys)  # (1 or B, 1 or H, n_q, n_k)
        interior = unmasked_tiles(scores, blocks.rows, blocks.keys) if split else torch.zeros(1, 1, 1, 1, dtype=torch.bool)
        key_ranges, query_ranges = _walks(empty)
        key_lists, query_lists = _walk_lists(empty, interior)
        dense = _dense(empty, key_ranges) and _dense(empty, query_ranges)
        return BlockMap(empty.to(torch.int8).to(device), key_ranges.to(device), query_ranges.to(device),
                        key_lists.to(device), query_lists.to(device), dense)

    return version_cache.value("triton_block_map", (len_q, len_k, call.causal, blocks.rows, blocks.keys, split, device),
                               sources, make)


class Plan:
    """One call's arguments for the kernels at one tile size, packed once (`kernels` says how
    they are laid out): the score masks, the block map (B, H, query blocks, key blocks) and its
    walks, the dropout's and the scalars' tensors, the sizes and the constexpr switches."""

    def __init__(self, call: AttentionCall, blocks: Blocks) -> None:
        q, k, v = call.q, call.k, call.v
        options = TUNING()
        self.call, self.blocks = call, blocks
        self.B, self.H, self.Lq, self.D = q.shape
        self.Hkv, self.Lk, self.DV = k.shape[1], k.shape[2], v.shape[-1]
        self.G = self.H // self.Hkv
        self.device = q.device
        self.acc_dtype = compute_dtype(q.dtype)
        shape = (self.B, self.H, self.Lq, self.Lk)
        self.scores_shape = shape
        self.n_q, self.n_k = triton.cdiv(self.Lq, blocks.rows), triton.cdiv(self.Lk, blocks.keys)
        mask = _as_scores(call.mask, shape)
        mask = None if mask is None else mask.view(torch.uint8)
        bias = _as_scores(call.bias, shape)
        bounds = None if call.bounds is None else call.bounds.contiguous()
        bound_strides = (0, 0) if bounds is None else (0 if bounds.shape[0] == 1 else bounds.stride(0), bounds.stride(1))
        placement = call.placement
        meta = [as_int64(placement.seed), placement.row_offset, placement.key_offset,
                placement.head_offset, threshold(call.dropout_p)]
        self.meta = _on_device(tuple(meta), torch.int64, self.device)
        cap = call.softcap
        self.fmeta = _on_device((call.scale, cap, 1.0 / cap if cap else 0.0, keep_value(call.dropout_p)),
                                torch.float64, self.device)
        mask_blocks = call.blocks
        tiles = _block_map(call, blocks)
        dense = tiles.dense
        self.tile_map = tiles.tile_map.expand(self.B, self.H, self.n_q, self.n_k)
        ranges = {"keys": tiles.key_ranges.expand(self.B, self.H, self.n_q, 2),
                  "queries": tiles.query_ranges.expand(self.B, self.H, self.n_k, 2)}
        lists = {"keys": tiles.key_lists.expand(self.B, self.H, self.n_q, 2 + self.n_k),
                 "queries": tiles.query_lists.expand(self.B, self.H, self.n_k, 2 + self.n_q)}
        causal = 0 if call.causal is None else int(call.causal)
        block_args, block_sizes = (None, (0, 0, 0), None), (1, 1)
        if mask_blocks is not None:  # (1 or B, 1 or H, ., .) index of (T, R, K) tiles; broadcast axes of stride 0
            index = mask_blocks.index.contiguous()
            block_strides = tuple(0 if index.shape[axis] == 1 else index.stride(axis) for axis in (0, 1))
            block_args = (index, (*block_strides, index.stride(2)), mask_blocks.tiles.contiguous().view(torch.uint8))
            block_sizes = mask_blocks.block
        self.key_bounds = (bounds, bound_strides)
        self.masks = (bias, _strides(bias), mask, _strides(mask), *self.key_bounds, *block_args)
        self.sizes = Sizes(self.H, self.G, self.Lq, self.Lk, self.D, self.DV, causal)
        self.switches = Switches(
            HAS_BIAS=bias is not None, HAS_MASK=mask is not None, HAS_BLOCKS=mask_blocks is not None,
            MR=block_sizes[0], MK=block_sizes[1], HAS_BOUNDS=bounds is not None, CAUSAL=call.causal is not None,
            SOFTCAP=bool(cap), DROPOUT=call.dropout_p > 0.0, SPLIT=blocks.split,
            EXP2=q.dtype in options.exp2_dtypes and bias is None and not cap,
            BM=blocks.rows, BN=blocks.keys, BD=padded_width(self.D), BDV=padded_width(self.DV),
            SD=_slice(blocks, self.D), SDV=_slice(blocks, self.DV), IP=input_precision(q.dtype, self.device),
            ACC=_acc(q.dtype))
        # what a walk over the tiles reads beside its own tensors, per orientation: the score
        # masks, the dropout's and the scalars' tensors, the walks' lists (each query block's
        # key blocks, or each key block's query blocks); the ranges for the walks that take
        # contiguous runs, the tile map for bias_side's
        self.ranges = {of: (walks, _strides(walks)[:3]) for of, walks in ranges.items()}
        self.lists = {of: (walks, _strides(walks)[:3]) for of, walks in lists.items()}
        self.walk_args = {of: (self.masks, self.meta, self.fmeta, self.lists[of]) for of in lists}
        # the fused backward: every walk a contiguous run (so the key blocks that add into a
        # query block are a run too). ROTATE, where every key block walks every query block,
        # waits both ways between a head's key blocks, so all of them must be resident at once:
        # no more key blocks than the GPU has multiprocessors
        contiguous_light = dense and is_light(call) and (not on_gpu(call) or dtype_class(q.dtype) == "half")
        self.fused = options.fused_backward and contiguous_light
        self.light_keys = options.light_key_side and contiguous_light
        full = call.causal is None and bounds is None
        self.rotate = full and (self.device.type != "cuda" or self.n_k <= _multiprocessors(
            self.device.index if self.device.index is not None else torch.cuda.current_device()))
        # each row's sums centred on its peak key (`kernels.row_sums`) in float64 and IEEE
        # float32, whose peak index (kept in the compute dtype) is exact below 2^24 keys; the
        # half and TF32 kernels' rounding is far above what centring saves, and it would make them spill
        self.centre = (q.dtype == torch.float64 or (q.dtype == torch.float32 and self.switches.IP == "ieee"
                                                    and self.Lk < 2 ** 24))
        # FMA contraction on, stated: Triton 3.9 warns that its default changes in 3.10
        self.launch = dict(num_warps=blocks.warps, num_stages=blocks.stages, enable_fp_fusion=True)
        if blocks.registers:
            self.launch["maxnreg"] = blocks.registers

    def rows(self) -> Tensor:
        return torch.empty(self.B, self.H, self.Lq, dtype=self.acc_dtype, device=self.device)


def on_gpu(call: AttentionCall) -> bool:
    """Whether the call's kernels are compiled for its GPU (else Triton's interpreter runs
    them on the CPU)."""
    return call.q.device.type == "cuda"


def _blocks(call: AttentionCall, pass_name: str) -> Blocks:
    """The call's tiles for a pass, from `blocks_for` as this module holds it (a patch of
    `launch.blocks_for`, as the tests and benchmarks make, takes effect here)."""
    width = max(call.q.shape[-1], call.v.shape[-1])
    tf32 = input_precision(call.q.dtype, call.q.device) != "ieee"  # tensor-core products take TF32's tiles
    gpu = on_gpu(call)
    return blocks_for(pass_name, call.q.dtype, width, interpreted=not gpu, tf32=tf32,
                      arch=arch_of(call.q.device) if gpu else 0, light=is_light(call))


def _plan(call: AttentionCall, pass_name: str) -> Plan:
    return Plan(call, _blocks(call, pass_name))


def _same_strides(*tensors: Optional[Tensor]) -> list:
    """Tensors the kernels read with one set of strides (an input and its tangents or
    cotangents): as they are where their strides agree, else each contiguous."""
    present = [t for t in tensors if t is not None]
    if all(t.stride() == present[0].stride() for t in present):
        return list(tensors)
    return [None if t is None else t.contiguous() for t in tensors]


def _descriptors(plan: Plan, rows: int, *tensors: Optional[Tensor]) -> Optional[tuple]:
    """Tensor descriptors of (B, H, L, width) tensors that a walk loads `rows` rows of at a
    time (4-D, blocks of (1, 1, rows, the padded width); None for an absent tensor) where
    `Options.tensor_descriptors` asks for them, the target has TMA (sm_90 and later; the
    interpreter too, in any dtype), the products run on the tensor cores (half precision,
    TF32: an FMA product's operands held a row per thread spilled kilobytes when TMA put
    them in shared memory) over the whole width, and each tensor is as TMA takes one:
    16-byte aligned, its last axis contiguous, every other stride a positive multiple of 16
    bytes. Else None: the kernels' pointer loads, for all of them."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    sw = plan.switches
    if not TUNING().tensor_descriptors or sw.SD != sw.BD or sw.SDV != sw.BDV:
        return None
    tensor_cores = plan.call.q.dtype in (torch.float16, torch.bfloat16) or sw.IP != "ieee"
    if on_gpu(plan.call) and (arch_of(plan.device) < 90 or not tensor_cores):
        return None
    present = [t for t in tensors if t is not None]
    for t in present:
        size = t.element_size()
        if t.data_ptr() % 16 or t.stride(-1) != 1 or any(s <= 0 or s * size % 16 for s in t.stride()[:-1]):
            return None
    return tuple(None if t is None else TensorDescriptor(t, list(t.shape), list(t.stride()),
                                                         [1, 1, rows, padded_width(t.shape[-1])])
                 for t in tensors)


def forward(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
    plan = _plan(call, "forward")
    q, k, v = call.q, call.k, call.v
    out = torch.empty(plan.B, plan.H, plan.Lq, plan.DV, dtype=q.dtype, device=q.device)
    row_max, inv_sum = plan.rows(), plan.rows()
    descriptors = _descriptors(plan, plan.blocks.keys, k, v)
    kernels.forward[(plan.n_q, plan.B * plan.H)](
        (q, k, v, out, row_max, inv_sum), _strides_of(q, k, v, out), *plan.walk_args["keys"], plan.sizes,
        descriptors, SW=plan.switches, TMA=descriptors is not None, **plan.launch)
    return out, row_max, inv_sum


def _with_tangents(plan: Plan, inputs: PassInputs) -> tuple:
    """(q, k, v, q', k', v') as the forward-mode kernels take them (each input and its tangent
    with one set of strides; an absent tangent None), and the bias's tangent as scores."""
    call = plan.call
    q, tq = _same_strides(call.q, inputs["tq"])
    k, tk = _same_strides(call.k, inputs["tk"])
    v, tv = _same_strides(call.v, inputs["tv"])
    return (q, k, v, tq, tk, tv), _as_scores(inputs["tbias"], plan.scores_shape)


def jvp(call: AttentionCall, **inputs: Unpack[PassInputs]) -> Tensor:
    plan = _plan(call, "jvp")
    (q, k, v, tq, tk, tv), t_bias = _with_tangents(plan, inputs)
    out_t = torch.empty(plan.B, plan.H, plan.Lq, plan.DV, dtype=q.dtype, device=q.device)
    kernels.jvp[(plan.n_q, plan.B * plan.H)](
        (q, k, v, tq, tk, tv, out_t, inputs["row_max"].contiguous(), inputs["inv_sum"].contiguous()),
        _strides_of(q, k, v, out_t), t_bias, _strides(t_bias), *plan.walk_args["keys"], plan.sizes,
        HAS_TQ=tq is not None, HAS_TK=tk is not None, HAS_TV=tv is not None, HAS_TBIAS=t_bias is not None,
        SW=plan.switches, CENTRE=plan.centre, SINK=call.sink, **plan.launch)
    return out_t


def forward_jvp(call: AttentionCall, **inputs: Unpack[PassInputs]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, row_max, inv_sum, out's tangent) from one walk (`kernels.forward_jvp`): 6
    products per tile where the forward and the JVP take 8; a sink's share already in out
    and inv_sum, as `ops.add_sink` gives the forward's. Given `row_sums` (a Hessian-vector
    product's forward, `hvp_fusion.ForwardSums`), each row's t - c, c and peak key's index go
    to its "centre_sums", "peak_sums" and "peak_index" ((B, H, Lq, 1), contiguous), and the
    primal results into its "results" (out, row_max, inv_sum)."""
    plan = _plan(call, "forward_jvp")
    (q, k, v, tq, tk, tv), t_bias = _with_tangents(plan, inputs)
    row_sums = inputs.get("row_sums")
    if row_sums is not None and row_sums.get("results") is not None:
        out, row_max, inv_sum = row_sums["results"]
        _check_rows(plan, row_max=row_max, inv_sum=inv_sum)
    else:
        out = torch.empty(plan.B, plan.H, plan.Lq, plan.DV, dtype=q.dtype, device=q.device)
        row_max, inv_sum = plan.rows(), plan.rows()
    out_t = torch.empty_like(out)
    sums = None
    if row_sums is not None:
        sums = tuple(row_sums[name] for name in ("centre_sums", "peak_sums", "peak_index"))
        _check_rows(plan, **{name: row_sums[name] for name in ("centre_sums", "peak_sums", "peak_index")})
    descriptors = _descriptors(plan, plan.blocks.keys, k, v, tk, tv)
    kernels.forward_jvp[(plan.n_q, plan.B * plan.H)](
        (q, k, v, tq, tk, tv, out, out_t, row_max, inv_sum), _strides_of(q, k, v, out), t_bias, _strides(t_bias),
        *plan.walk_args["keys"], plan.sizes, descriptors, HAS_TQ=tq is not None, HAS_TK=tk is not None,
        HAS_TV=tv is not None, HAS_TBIAS=t_bias is not None, SW=plan.switches, CENTRE=plan.centre, SINK=call.sink,
        TMA=descriptors is not None, row_sums=sums, SUMS=sums is not None, **plan.launch)
    return out, row_max, inv_sum, out_t


class _Second:
    """The inputs of a backward-type pass as the kernels take them: Q, K, V, dO and the
    second set (Q2, K2, V2, dO2: tangents or cotangents), each set with one set of strides,
    the bias-shaped C (bias' or gbias), the row statistics m, 1/l, D and the row sums
    (`kernels.row_sums`; none for the backward)."""

    def __init__(self, plan: Plan, inputs: PassInputs, q2: Optional[Tensor] = None, k2: Optional[Tensor] = None,
                 v2: Optional[Tensor] = None, do2: Optional[Tensor] = None, c: Optional[Tensor] = None) -> None:
        call, out = plan.call, inputs["out"]
        self.q, self.q2 = _same_strides(call.q, q2)
        self.k, self.k2 = _same_strides(call.k, k2)
        self.v, self.v2 = _same_strides(call.v, v2)
        self.do, self.do2 = _same_strides(inputs["dout"], do2)
        self.c = _as_scores(c, plan.scores_shape)
        self.row_max, self.inv_sum = inputs["row_max"].contiguous(), inputs["inv_sum"].contiguous()
        self.delta = plan.rows()  # D = rowsum(dO * O)
        block = 64 if on_gpu(call) else 16
        kernels.row_dot[(triton.cdiv(plan.Lq, block), plan.B * plan.H)](
            self.do, out, self.delta, _strides(self.do), _strides(out), plan.H, plan.Lq, plan.DV, BM=block,
            BDV=padded_width(plan.DV), ACC=_acc(call.q.dtype), num_warps=4, num_stages=1)
        self.sums: Optional[Tensor] = None  # (B, H, SUMS, Lq), from `_row_sums`
        self.strides = _strides_of(self.q, self.k, self.v, self.do)  # the second set's too
        self.c_args = (self.c, _strides(self.c))

    def tensors(self) -> tuple:
        """The twelve tensors every backward-type kernel takes first (the row sums once made)."""
        return (self.q, self.k, self.v, self.do, self.q2, self.k2, self.v2, self.do2, self.row_max, self.inv_sum,
                self.delta, self.sums)

    def switches(self) -> dict:
        return dict(HAS_Q2=self.q2 is not None, HAS_K2=self.k2 is not None, HAS_V2=self.v2 is not None,
                    HAS_DO2=self.do2 is not None, HAS_C=self.c is not None)


def _row_sums(plan: Plan, inputs: _Second, mode: int) -> None:
    inputs.sums = torch.empty(plan.B, plan.H, SUMS.value, plan.Lq, dtype=plan.acc_dtype, device=plan.device)
    kernels.row_sums[(plan.n_q, plan.B * plan.H)](
        inputs.tensors(), inputs.strides, *inputs.c_args, *plan.walk_args["keys"], plan.sizes, MODE=mode,
        **inputs.switches(), SW=plan.switches, CENTRE=plan.centre, SINK=plan.call.sink, **plan.launch)


def _check_rows(plan: Plan, **rows: Tensor) -> None:
    """The per-row tensors a kernel writes by row index: contiguous, one entry per query row."""
    for name, t in rows.items():
        if t.numel() != plan.B * plan.H * plan.Lq or not t.is_contiguous() or t.device != plan.device:
            raise ValueError(f"attngrad triton: row_sums' {name} must be contiguous on {plan.device} with one entry "
                             f"per (batch, head, query row) {(plan.B, plan.H, plan.Lq)}; got {tuple(t.shape)}, "
                             f"strides {t.stride()} on {t.device}")


def _given_row_sums(plan: Plan, inputs: _Second, given: dict, out: Tensor) -> None:
    """The row sums of a backward's JVP from the forward's JVP along the same tangents
    (`given`: its "centre" t - c, "peak" c, "peak_index" ((B, H, Lq, 1) contiguous) and
    "out_t" O'), with no walk over the keys (`kernels.given_row_sums`)."""
    inputs.sums = torch.empty(plan.B, plan.H, SUMS.value, plan.Lq, dtype=plan.acc_dtype, device=plan.device)
    out_t = given["out_t"]
    # four (rows, dv) tiles held at once: float64 at dv = 128 spilled 312-328 B with 64 rows, 8 with 32
    block = (16 if plan.acc_dtype == torch.float64 and plan.DV > 64 else 64) if on_gpu(plan.call) else 16
    kernels.given_row_sums[(triton.cdiv(plan.Lq, block), plan.B * plan.H)](
        (inputs.do, out, out_t, inputs.do2), _strides(inputs.do), _strides(out), _strides(out_t),
        tuple(given[name].contiguous() for name in ("centre", "peak", "peak_index")), inputs.sums, plan.H, plan.Lq,
        plan.DV, HAS_DO2=inputs.do2 is not None, BM=block, BDV=padded_width(plan.DV), ACC=_acc(plan.call.q.dtype),
        num_warps=4, num_stages=1)


def _bias_is_direct(plan: Plan) -> bool:
    """Whether the bias has the scores' own shape: its gradient is then each tile's term,
    stored by the query-side walk."""
    bias = plan.call.bias
    return bias.dim() == 4 and tuple(bias.shape) == plan.scores_shape


def _backward_walks(plan: Plan, inputs: _Second, mode: int, bias_grad: bool,
                    dout_grad: bool = False) -> tuple[Optional[Tensor], Tensor, Tensor, Tensor, Optional[Tensor]]:
    """The walks every backward-type pass ends with: (the dO-side result or None, the Q-side,
    the K-side, the V-side, the bias-side or None), in the inputs' dtypes."""
    call = plan.call
    q, k, v = call.q, call.k, call.v
    out_q = torch.empty(plan.B, plan.H, plan.Lq, plan.D, dtype=q.dtype, device=q.device)
    out_do = torch.empty(plan.B, plan.H, plan.Lq, plan.DV, dtype=inputs.do.dtype, device=q.device) if dout_grad else None
    # a bias constant along the keys takes its closed form (even with the scores' own shape,
    # one key: each term alone cancels as the sum does)
    row_constant = bias_grad and is_key_constant(call.bias) and not call.partial_rows
    direct = bias_grad and not row_constant and _bias_is_direct(plan)
    bias_out = None
    if bias_grad and not row_constant:
        bias4 = call.bias[(None,) * (4 - call.bias.dim())]
        bias_out = (torch.zeros if direct else torch.empty)(bias4.shape, dtype=call.bias.dtype, device=q.device)
    fused = mode == BACKWARD and plan.fused and not bias_grad
    fused_args: dict = {}
    if fused:
        dq = torch.zeros(plan.B, plan.H, plan.Lq, plan.D, dtype=plan.acc_dtype, device=q.device)
        locks = torch.zeros(plan.B * plan.H * plan.n_q, dtype=torch.int32, device=q.device)
        fused_args = dict(DQ=dq, LOCKS=locks, key_walks=plan.ranges["keys"],
                          query_ranges=plan.ranges["queries"], FUSED=True, ROTATE=plan.rotate,
                          # the interpreter runs the programs in turn: in rotation none could wait
                          WAIT=on_gpu(call) or not plan.rotate)
    else:
        descriptors = _descriptors(plan, plan.blocks.keys, inputs.k, inputs.v)
        kernels.query_side[(plan.n_q, plan.B * plan.H)](
            inputs.tensors(), out_q, out_do, bias_out if direct else None, inputs.strides,
            _strides(bias_out if direct else None), *inputs.c_args, *plan.walk_args["keys"], plan.sizes, MODE=mode,
            **inputs.switches(), DOUT_GRAD=dout_grad, BIAS_DIRECT=direct, SW=plan.switches, CENTRE=plan.centre,
            descriptors=descriptors, TMA=descriptors is not None, **plan.launch)
    out_k = torch.empty(plan.B, plan.Hkv, plan.Lk, plan.D, dtype=k.dtype, device=q.device)
    out_v = torch.empty(plan.B, plan.Hkv, plan.Lk, plan.DV, dtype=v.dtype, device=q.device)
    if mode == BACKWARD and plan.light_keys and not fused:
        _key_side_light(plan, inputs, out_k, out_v)
    else:
        descriptors = _descriptors(plan, plan.blocks.rows, inputs.q, inputs.do)
        kernels.key_side[(plan.n_k, plan.B * plan.Hkv)](
            inputs.tensors(), out_k, out_v, inputs.strides, *inputs.c_args, *plan.walk_args["queries"], plan.sizes,
            MODE=mode, **inputs.switches(), SW=plan.switches, **fused_args, CENTRE=plan.centre,
            descriptors=descriptors, TMA=descriptors is not None, **plan.launch)
    if fused:
        out_q = fused_args["DQ"].mul_(call.scale).to(q.dtype)  # scale, as query_side applies it, then round
    if row_constant:
        bias_out = _row_constant_bias(plan, inputs, mode)
    elif bias_grad and not direct:
        _bias_side(plan, inputs, mode, bias_out)
    return out_do, out_q, out_k, out_v, None if bias_out is None else bias_out.view(call.bias.shape)


def _key_side_light(plan: Plan, inputs: _Second, out_k: Tensor, out_v: Tensor) -> None:
    """dK and dV of a light call's backward (`kernels.key_side_light`), on the key side's tiles."""
    blocks = _blocks(plan.call, "key_side")
    kplan = plan if blocks == plan.blocks else Plan(plan.call, blocks)  # the backward's own tiles, or its own
    kernels.key_side_light[(kplan.n_k, kplan.B * kplan.Hkv)](
        inputs.tensors(), out_k, out_v, inputs.strides, kplan.key_bounds, kplan.fmeta, kplan.ranges["queries"],
        kplan.sizes, SW=kplan.switches, **kplan.launch)


def _row_constant_bias(plan: Plan, inputs: _Second, mode: int) -> Tensor:
    """The result for a bias constant along the keys (a sink's) on whole rows: each row's sum
    of dS (backward), g_S (double backward) or dS~ (backward's JVP) in closed form, D P_sink,
    or P_sink (y - t D) with the row sums (`_sink_terms`); 0
    without a sink (`key_constant_bias`). The kernels' sum of the row's terms would cancel
    down to it, and bias_side walks every score of a head in one program."""
    call = plan.call
    if not call.sink:
        return torch.zeros(call.bias.shape, dtype=call.bias.dtype, device=call.q.device)
    return rows_to_bias(_sink_terms(plan, inputs, mode), call.bias, call.bias.dtype)


def _sink_terms(plan: Plan, inputs: _Second, mode: int) -> Tensor:
    """Each row's closed form (B, H, Lq) float64: P_sink D (backward), P_sink (D~ - t D)
    (backward's JVP) or P_sink (u - t D) (double backward), from the row sums (`kernels.row_sums`:
    t - c, D~ or u - c2, c, c2)."""
    per_row = inputs.delta.double()
    if mode != BACKWARD:
        x_less, y, c, c2 = inputs.sums.double().unbind(-2)[:4]
        y = y if mode == BACKWARD_JVP else c2 + y  # u
        per_row = y - (c + x_less) * per_row
    return sink_share(inputs.row_max, inputs.inv_sum) * per_row.view(plan.B, plan.H, plan.Lq)


def _bias_side(plan: Plan, inputs: _Second, mode: int, bias_out: Tensor) -> None:
    """A bias gradient (or tangent) reduced to the bias's broadcast shape, one program per
    block of it."""
    bb, bh, br, bk = bias_out.shape
    rows_broadcast, keys_broadcast = br == 1 and plan.Lq > 1, bk == 1 and plan.Lk > 1
    grid = (1 if rows_broadcast else plan.n_q, 1 if keys_broadcast else plan.n_k, bb * bh)
    kernels.bias_side[grid](
        inputs.tensors(), bias_out, inputs.strides, _strides(bias_out), *inputs.c_args, plan.masks, plan.meta,
        plan.fmeta, (plan.tile_map, _strides(plan.tile_map)), plan.ranges["keys"],
        plan.B, plan.sizes, bh, MODE=mode, **inputs.switches(), BATCH_BROADCAST=bb == 1 and plan.B > 1,
        HEADS_BROADCAST=bh == 1 and plan.H > 1, ROWS_BROADCAST=rows_broadcast, KEYS_BROADCAST=keys_broadcast,
        SW=plan.switches, CENTRE=plan.centre, **plan.launch)


def backward(call: AttentionCall, **inputs: Unpack[PassInputs]) -> tuple:
    plan = _plan(call, "backward")
    return _backward_walks(plan, _Second(plan, inputs), BACKWARD, inputs["bias_grad"])[1:]


def _sink_rows(plan: Plan, inputs: _Second, mode: int, sink_rows: Optional[Tensor]) -> None:
    """Each row's share of the sink logit's gradient (double backward) or of its tangent
    (backward's JVP), P_sink (Y - X D), into `sink_rows` (B, H, Lq) where given (`sink_logits`)."""
    if sink_rows is None:
        return
    if not plan.call.sink:
        raise ValueError("attngrad triton: sink_rows needs a sink")
    sink_rows.copy_(_sink_terms(plan, inputs, mode))


def backward_jvp(call: AttentionCall, **inputs: Unpack[PassInputs]) -> tuple:
    plan = _plan(call, "backward_jvp")
    second = _Second(plan, inputs, inputs["tq"], inputs["tk"], inputs["tv"], inputs["tdout"], inputs["tbias"])
    given = inputs.get("row_sums")
    if given is not None:  # a Hessian-vector product's: the forward's JVP left t - c and O'
        _given_row_sums(plan, second, given, inputs["out"])
    else:
        _row_sums(plan, second, BACKWARD_JVP)  # t = rowsum(P S'), D~
    _sink_rows(plan, second, BACKWARD_JVP, inputs.get("sink_rows"))
    return _backward_walks(plan, second, BACKWARD_JVP, inputs["bias_grad"])[1:]


def double_backward(call: AttentionCall, **inputs: Unpack[PassInputs]) -> tuple:
    plan = _plan(call, "double_backward")
    bias_grad = inputs["bias_grad"]
    second = _Second(plan, inputs, inputs["gq"], inputs["gk"], inputs["gv"], None,
                     inputs["gbias"] if bias_grad else None)
    _row_sums(plan, second, DOUBLE_BACKWARD)  # t = rowsum(P T), u
    _sink_rows(plan, second, DOUBLE_BACKWARD, inputs.get("sink_rows"))
    return _backward_walks(plan, second, DOUBLE_BACKWARD, bias_grad, inputs["dout_grad"])
