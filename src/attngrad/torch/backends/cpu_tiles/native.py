"""The compiled tiles (`csrc/`, the ops `torch.ops.attngrad_tiles.*`): every pass of
attention (forward, backward, JVP, the backward's JVP, double backward) with the causal
diagonal, a boolean mask, a float bias and its gradient, key bounds (the structured masks),
a soft cap, dropout and GQA; float32 or float64 (float16 computed in float32, bfloat16's
products in bfloat16 with float32 sums and softmax statistics), on the CPU; and the dropout
keep-masks of `dropout` for the torch-ops kernels.

The torch-ops kernels (`first_order`) run any case on any device, but each of their passes is a
separate sweep over a score tile too large for the cache. The compiled tiles fuse those
passes per thread on tiles that stay in cache, as PyTorch's own flash kernel does, and
reach its speed. They are a PyTorch C++ extension, built on first use by
`torch.utils.cpp_extension` with the system's C++ compiler into a cache folder
(`build`), whose TORCH_LIBRARY ops take tensors and options through their schemas
and check every size, dtype and layout against the others before touching memory. Their
threads are PyTorch's own pool (at::parallel_for); their GEMMs the BLAS inside PyTorch (MKL
on x86-64 Linux), or ATen's matrix product where PyTorch has no Fortran BLAS to link. Where
the build is impossible, `library()` is None and `first_order` runs instead: the same numbers
to rounding, more slowly. ATTNGRAD_NATIVE, ATTNGRAD_CACHE, CXX and ATTNGRAD_SANITIZE: see
`build`.

The results do not depend on the thread count: work items own their outputs, and how
the work is split into items depends on the shapes alone.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ...masks import version_cache
from ...masks.block_map import ScoreFilter, kept_keys, key_ranges, tile_map
from ...masks.blocks import MaskBlocks
from ...op.call import AttentionCall, PassInputs
from ...op.dropout import Placement, as_int64, keep_value, threshold
from ...precision import compute_dtype
from . import buffer_cache
from .build import build_info, fast_entry, fresh_build_seconds, library
from .tiling import (
    TILING,
    band_keys_transposed,
    chunk_count,
    independent_items,
    keys_per_block,
    keys_transposed,
    query_block_rows,
    whole_row_split,
)

__all__ = ["attention_forward", "attention_backward", "attention_double_backward", "attention_jvp",
           "attention_forward_jvp", "attention_backward_jvp", "attention_backward_jvp_given_sums", "forward_plan",
           "dropout_keep_scale_into", "status", "available", "library", "build_info", "fresh_build_seconds"]



def available() -> bool:
    """Whether the compiled tiles run in this process (else `build_info.reason` says why)."""
    return library() is not None


def status() -> str:
    """One line for reports: whether the tiles run, and what their first use costs."""
    if library() is None:
        return f"compiled tiles unavailable ({build_info.reason}); torch-ops kernels throughout"
    return (f"compiled tiles for every pass with masks, a bias and its gradient, and dropout (first use compiles "
            f"them once: {fresh_build_seconds():.1f} s on this machine, then cached)")


# What `bf16_products` names each route of the C++ `bf16_route` (bf16_products.h)
BF16_ROUTES = {0: "MKL bf16 GEMM", 1: "oneDNN brgemm on AMX", 2: "oneDNN brgemm on AVX512-BF16"}


def bf16_products() -> str:
    """What multiplies bfloat16 here: oneDNN's brgemm on the matrix units (AMX-BF16) or on
    AVX512-BF16's dot products, else MKL's bfloat16 GEMM (`attngrad_tiles.brgemm_path`)."""
    return BF16_ROUTES[int(_ops().brgemm_path(-1))]


def _ops():
    """The ops, the library loaded first (the tiles backend asks `library()` before it calls)."""
    if library() is None:
        raise RuntimeError(f"attngrad's compiled tiles are unavailable: {build_info.reason}")
    return torch.ops.attngrad_tiles


@functools.cache
def _op(name: str) -> tuple:
    """The tiles' op `name` (its overload) and its arguments' names in schema order."""
    op = getattr(_ops(), name).default
    return op, tuple(argument.name for argument in op._schema.arguments)


class _Layout(NamedTuple):
    """How a pass lays its work out on the tiles (the ops' block_rows, block_keys, chunks and
    transposed_keys): query rows and keys per block, work items per head's blocks, and
    whether it reads the key side from transposed copies."""

    block_rows: int
    block_keys: int = 0  # 0: the tiling's, read at the call
    chunks: int = 1
    transposed_keys: bool = False


def _arguments(name: str, call: AttentionCall, layout: _Layout, masks: dict, tensors: dict) -> tuple:
    """The tiles' op `name` and its flat arguments in schema order for a pass of `call`: the
    one place a call becomes an op's arguments. Its mask arguments from `masks`
    (`_score_masks`), the pass's `tensors` by name (q, k, v and the rest, in the work dtype),
    its options from the call and `layout` (`_options`); a KeyError for an argument the op
    gains."""
    op, names = _op(name)
    given = {**_mask_args(masks), **tensors, **_options(call, layout)}
    return op, [given[n] for n in names]


def _run(name: str, call: AttentionCall, layout: _Layout, masks: dict, **tensors: Tensor | None) -> None:
    """Run the tiles' op `name` on `_arguments`'s list, every one positional: PyTorch matches a
    C++ op's keywords to its schema one by one, about half of a small call's time in the op
    (torch 2.13)."""
    op, arguments = _arguments(name, call, layout, masks, tensors)
    op(*arguments)


def _options(call: AttentionCall, layout: _Layout) -> dict:
    """The options every op takes (ATTNGRAD_OPTIONS_SCHEMA in csrc/ops.cpp): the call's
    (`_call_options`) and the pass's `layout`, the tiling's block keys and value slice read
    now (tests set them)."""
    tiling = TILING()
    return dict(_call_options(call.causal, call.scale, call.softcap, call.sink, call.placement, call.dropout_p),
                block_rows=layout.block_rows, block_keys=layout.block_keys or tiling.block_keys,
                value_slice=tiling.value_slice, chunks=layout.chunks, bf16_products=_bf16(call.q),
                transposed_keys=layout.transposed_keys)


@functools.lru_cache(maxsize=256)  # a model's calls repeat a few option sets
def _call_options(causal: int | None, scale: float, softcap: float, sink: bool, key: Placement,
                  dropout_p: float) -> tuple:
    """The ops' options of a call: its causal diagonal (None: none), scale, soft cap and sink,
    the dropout's placement and draws."""
    options = dict(causal=None if causal is None else int(causal), scale=float(scale), softcap=float(softcap),
                   dropout=dropout_p > 0.0, seed=as_int64(key.seed),
                   threshold=threshold(dropout_p), keep_value=keep_value(dropout_p), row_offset=key.row_offset,
                   key_offset=key.key_offset, head_offset=key.head_offset, partial_rows=bool(key.partial_rows),
                   sink=bool(sink))
    return tuple(options.items())


def _bias_grad_parts(bias_sizes: tuple, chunks: int, whole_rows: bool) -> int:
    """How many parts a bias gradient's buffer holds (the op checks the same): 1, or
    `chunks` where the bias is constant along the chunked axis (keys in the backward, query
    rows in the whole-row passes): each chunk adds into all of it there."""
    return chunks if bias_sizes[2 if whole_rows else 3] == 1 else 1


def _bias_grad_buffer(masks: dict, wanted: bool, chunks: int, whole_rows: bool, dtype: torch.dtype) -> Tensor | None:
    """The parts of a bias gradient (None where not wanted), in the bias's 4-D sizes, from
    `buffer_cache` (a gradient the scores' size arrives as fresh pages otherwise): zeroed
    for the whole-row passes, which add into them; uninitialised for the backward, which
    writes every entry (or zeroes them first where it adds)."""
    if not wanted:
        return None
    sizes = masks["bias_sizes"]
    parts = buffer_cache.empty((_bias_grad_parts(sizes, chunks, whole_rows), *sizes), dtype)
    return parts.zero_() if whole_rows else parts


def _finish_bias_grad(parts: Tensor | None, bias: Tensor | None) -> Tensor | None:
    return None if parts is None else _sum_parts(parts).view(bias.shape)


def _bf16(q: Tensor) -> bool:
    """Whether a pass's GEMMs multiply in bfloat16 (float32 sums): for bfloat16 inputs, as
    PyTorch's own kernels do; float16 inputs are computed in float32 (MKL's float16 GEMM is
    no faster than its float32 one on the CPUs here)."""
    return q.dtype == torch.bfloat16


def _work(*tensors: Tensor | None) -> list:
    """Each tensor contiguous in the tiles' element type: float64 stays, everything else is
    computed in float32 (float16 and bfloat16 inputs too; the ops return results in the
    inputs' own dtypes). None stays None."""
    work = torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32
    # a tensor already so is taken as it is: .to and .contiguous are a dispatcher trip each
    return [t if t is None or (t.dtype == work and t.is_contiguous()) else t.to(work).contiguous() for t in tensors]


def _tensors(call: AttentionCall, inputs: dict, names: tuple[str, ...]) -> dict:
    """q, k, v and the `inputs` named `names` (None where absent), by name, each as `_work`
    makes it: the work dtype is float64 if any of them is."""
    given = (call.q, call.k, call.v, *(inputs.get(name) for name in names))
    return dict(zip(("q", "k", "v", *names), _work(*given)))


def _score_masks(call: AttentionCall, dtype: torch.dtype, full_bias: bool = False) -> dict:
    """The call's mask and bias as the ops take them, each 4-D and contiguous in its own
    (broadcast) sizes, the bias in the compute dtype, and their sizes; its key bounds and a
    mask's blocks and tiles, contiguous. An expanded axis (stride 0) is read as a broadcast
    one, except in the bias with `full_bias` (its gradient or tangent is wanted, which has
    its shape)."""
    described = {}
    if call.bounds is not None:
        described["key_bounds"] = call.bounds.contiguous()
    if call.blocks is not None:
        described["mask_blocks"], described["mask_tiles"] = call.blocks.index.contiguous(), call.blocks.tiles.contiguous()
    return _mask_and_bias(described, call.mask, call.bias, dtype, full_bias)


def _mask_and_bias(described: dict, mask: Tensor | None, bias: Tensor | None, dtype: torch.dtype,
                   full_bias: bool) -> dict:
    """`described` with `_score_masks`'s mask and bias and their sizes (each where given)."""
    for name, t, kind in (("mask", mask, torch.bool), ("bias", bias, dtype)):
        if t is None:
            continue
        t = t[(None,) * (4 - t.dim())]
        for axis in range(4):
            if t.stride(axis) == 0 and t.shape[axis] > 1 and not (name == "bias" and full_bias):
                t = t.narrow(axis, 0, 1)
        described[name] = t = t.to(kind).contiguous()
        described[f"{name}_sizes"] = tuple(t.shape)
    return described


def _mask_args(masks: dict) -> dict:
    """The ops' mask, bias, key_bounds and mask blocks arguments from `_score_masks`'s (None
    where absent)."""
    return dict(mask=masks.get("mask"), bias=masks.get("bias"), key_bounds=masks.get("key_bounds"),
                mask_blocks=masks.get("mask_blocks"), mask_tiles=masks.get("mask_tiles"))


def _tile_map(q: Tensor, k: Tensor, masks: dict, causal: int | None, block_rows: int, block_keys: int,
              ranges: Tensor) -> Tensor | None:
    """The tile map the forward and the backward read (`block_map.tile_map`: (1 or B, 1 or H,
    query blocks, key blocks), which tiles to skip and which to compute without the mask and
    bias), from the op's own mask, bias (in the compute dtype) and key bounds, for
    `block_rows` x `block_keys` tiles and the passes' key `ranges`; None where there is none
    of them (the causal diagonal alone the passes keep to by their key ranges)."""
    sources = (masks.get("mask"), masks.get("bias"), masks.get("key_bounds"), masks.get("mask_blocks"),
               masks.get("mask_tiles"))
    if all(t is None for t in sources):
        return None
    mask, bias, bounds, index, mask_tiles = sources
    blocks = None if index is None else MaskBlocks(index, mask_tiles)
    return version_cache.value("tile_map", (q.shape[2], k.shape[2], causal, block_rows, block_keys), sources,
                 lambda: tile_map(ScoreFilter(q.shape[2], k.shape[2], causal, bounds, mask, bias, blocks), block_rows,
                                  block_keys, ranges))


@functools.lru_cache(maxsize=64)
def _causal_key_ranges(len_q: int, len_k: int, causal: int | None, block_rows: int) -> Tensor:
    return key_ranges(len_q, len_k, causal, None, block_rows)


def _key_ranges(q: Tensor, k: Tensor, causal: int | None, block_rows: int, masks: dict) -> Tensor:
    """The key range of each query block of `block_rows` rows the passes read
    (`block_map.key_ranges`: (1 or B, query blocks, 2)): the causal prefix, narrowed by the
    key bounds and to the keys a mask or bias keeps to each block (`block_map.kept_keys`). A
    range need not start at a key block's edge: the forward's and the backward's tiles start
    where it does (a sliding window's band). Kept while the tensors it is made from live
    unchanged (`version_cache.value`)."""
    bounds = masks.get("key_bounds")
    mask, bias = masks.get("mask"), masks.get("bias")
    len_q, len_k = q.shape[2], k.shape[2]
    if bounds is None and mask is None and bias is None:
        return _causal_key_ranges(len_q, len_k, causal, block_rows)

    def make() -> Tensor:
        kept_by_masks = kept_keys(mask, bias, len_q, block_rows)
        if bounds is None and kept_by_masks is None:
            return _causal_key_ranges(len_q, len_k, causal, block_rows)
        return key_ranges(len_q, len_k, causal, bounds, block_rows, kept_by_masks)

    return version_cache.value("key_ranges", (len_q, len_k, causal, block_rows), (mask, bias, bounds), make)


def attention_forward(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
    """(out (B, H, Lq, dv), row max m, inverse row sum 1/l (B, H, Lq)): `first_order.attention_forward`'s results."""
    bf16, causal, bounds = _bf16(call.q), call.causal, call.bounds
    q, k, v = _work(call.q, call.k, call.v)
    batch, heads, len_q, _ = q.shape
    out = q.new_empty(batch, heads, len_q, v.shape[-1])
    row_max, inv_sum = q.new_empty(batch, heads, len_q), q.new_empty(batch, heads, len_q)
    masks, block_keys = _score_masks(call, q.dtype), keys_per_block(bounds)
    rows = query_block_rows(len_q, k.shape[2], causal, bf16, masks.get("key_bounds"))
    ranges = _key_ranges(q, k, causal, rows, masks)
    layout = _Layout(rows, block_keys, transposed_keys=band_keys_transposed(len_q, rows, bounds, bf16))
    _run("forward", call, layout, masks, q=q, k=k, v=v, out=out, row_max=row_max, inv_sum=inv_sum,
         tile_map=_tile_map(q, k, masks, causal, rows, block_keys, ranges), key_ranges=ranges)
    return out, row_max, inv_sum


def _planned_options(call: AttentionCall, layout: _Layout) -> Tensor:
    """`_options` of `call` and `layout` as the planned ops take them, made once per plan:
    (19,) int64, causal's presence and value, then the rest in the passes' schema order,
    each float as its bits (`unpack_options` in csrc/ops.cpp)."""
    options = _options(call, layout)
    causal = options.pop("causal")
    packed = [causal is not None, causal or 0] + [
        _float_bits(options[name]) if name in _REAL_OPTIONS else int(options[name])
        for name in _op("forward")[1] if name in options]
    return torch.tensor(packed, dtype=torch.int64)


_REAL_OPTIONS = frozenset({"scale", "softcap", "keep_value"})  # the options' doubles (float in the schema)


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _plan_masks(call: AttentionCall, layout: _Layout) -> Callable[..., tuple]:
    """masks(q, k, mask, bias) -> (mask, bias, tile_map, key_ranges) as the planned ops take
    them, for the calls of a plan (`forward_plan`): a mask and bias as `_score_masks` makes
    them, with their tile map and key ranges, kept while the mask lives (`version_cache`);
    without either, the causal key ranges, made once."""
    if call.mask is None and call.bias is None:
        ranges = _causal_key_ranges(call.q.shape[2], call.k.shape[2], call.causal, layout.block_rows)
        return lambda q, k, mask, bias: (None, None, None, ranges)
    causal, rows, block_keys = call.causal, layout.block_rows, layout.block_keys

    def masks(q: Tensor, k: Tensor, mask: Tensor | None, bias: Tensor | None) -> tuple:
        described = _mask_and_bias({}, mask, bias, q.dtype, full_bias=False)
        ranges = _key_ranges(q, k, causal, rows, described)
        tile_map = _tile_map(q, k, described, causal, rows, block_keys, ranges)
        return described.get("mask"), described.get("bias"), tile_map, ranges

    return masks


def forward_plan(call: AttentionCall) -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """`attention_forward` of a call without key bounds, mask blocks, dropout or a sink,
    prepared for every call like `call` (q, k, v of these sizes, dtypes and layouts, a mask
    and bias of theirs, the same options): run(q, k, v, mask, bias) -> (out, row_max,
    inv_sum) in the compute dtype. The blocks and options are worked out once, so that a
    call is its masks' maps (kept while a mask lives) and one op, `forward_planned`, which
    makes its results (`eager_plans`)."""
    q, k, v = call.q, call.k, call.v
    converted = any(t.dtype != compute_dtype(q.dtype) or not t.is_contiguous() for t in (q, k, v))
    layout = _Layout(query_block_rows(q.shape[2], k.shape[2], call.causal, _bf16(q)), keys_per_block(None))
    options, masks, op = _planned_options(call, layout), _plan_masks(call, layout), _ops().forward_planned.default

    def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None) -> tuple:
        if converted:
            q, k, v = _work(q, k, v)
        return op(q, k, v, *masks(q, k, mask, bias), options)

    if call.mask is None and call.bias is None and q.dtype == k.dtype == v.dtype:
        ranges = masks(q, k, None, None)[3]

        def publish(query: Tensor, key: Tensor, value: Tensor, *arguments: Any) -> Any:
            """Put this forward in the fast entry's table for the calls (query, key, value,
            is_causal, scale, enable_gqa, dispatch state) like this one, which run it as
            `run` would, the output in the inputs' dtype (`eager_plans.unmasked`); the
            entry."""
            entry = fast_entry()
            entry.publish(query, key, value, *arguments, ranges, options)
            return entry

        run.publish = publish
    return run


def backward_plan(call: AttentionCall) -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """`attention_backward` of the calls `forward_plan` takes, without a bias gradient,
    prepared as it is: run(q, k, v, mask, bias, dout, out, row_max, inv_sum) -> (dq, dk, dv)
    in the compute dtype, the same tiles, chunks and bits as the whole path's, from one op,
    `backward_planned`."""
    q, k = call.q, call.k
    block_keys = keys_per_block(None)
    chunks = chunk_count(independent_items(k, None), -(-k.shape[2] // block_keys))
    layout = _Layout(query_block_rows(q.shape[2], k.shape[2], call.causal, _bf16(q)), block_keys, chunks)
    options, masks, op = _planned_options(call, layout), _plan_masks(call, layout), _ops().backward_planned.default

    def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, *after_forward: Tensor) -> tuple:
        q, k, v, dout, out, row_max, inv_sum = _work(q, k, v, *after_forward)
        mask, bias, tile_map, ranges = masks(q, k, mask, bias)
        return op(q, k, v, mask, bias, out, row_max, inv_sum, dout, tile_map, ranges, options)

    return run


def _with_bias_like(masks: dict, name: str, t: Tensor | None, dtype: torch.dtype) -> dict:
    """`masks` with `t`, a tangent or cotangent of the bias, as buffer `name` in the bias's
    4-D sizes (absent where `t` is None)."""
    if t is not None:
        masks[name] = t.to(dtype).reshape(masks["bias_sizes"]).contiguous()
    return masks


def _sum_parts(parts: Tensor, out: Tensor | None = None) -> Tensor:
    """parts[0] + parts[1] + ... in that order (a reduction kernel might pair them
    otherwise), into `out` where given."""
    if len(parts) == 1:
        return parts[0] if out is None else out.copy_(parts[0])
    total = torch.add(parts[0], parts[1], out=out) if out is not None else parts[0] + parts[1]
    for part in parts[2:]:
        total += part
    return total


def _results_into(results: Sequence[Tensor] | None, shapes: tuple, dtype: torch.dtype, pass_name: str) -> list:
    """The tensors a fused pass writes its primal results into: `results` (the ones a
    Function's forward returned before the pass ran, `hvp_fusion.Deferred`), each checked
    to be contiguous, on the CPU, of its shape and in the compute dtype; else new ones."""
    if results is None:
        return [torch.empty(shape, dtype=dtype) for shape in shapes]
    for i, (r, shape) in enumerate(zip(results, shapes)):
        if tuple(r.shape) != tuple(shape) or r.dtype != dtype or not r.is_contiguous() or r.device.type != "cpu":
            raise ValueError(f"attngrad tiles {pass_name}: results[{i}] is {tuple(r.shape)} {r.dtype} on {r.device} "
                             f"(contiguous: {r.is_contiguous()}); the pass writes contiguous {tuple(shape)} {dtype} on "
                             "the CPU")
    return list(results)


# The inputs of the passes after the forward: the output's cotangent, the forward's results.
_AFTER_FORWARD = ("dout", "out", "row_max", "inv_sum")
_TANGENTS = ("tq", "tk", "tv")


def attention_backward(call: AttentionCall, inputs: PassInputs,
                       chunks: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(dq, dk, dv, dbias or None): `first_order.attention_backward`'s results for the cases
    the tiles backend takes, from the pass's `inputs` (dout, out, row_max, inv_sum,
    bias_grad); dbias in the bias's shape and the compute dtype. `chunks` splits each head's
    keys into that many work items (default: `chunk_count`)."""
    bf16, causal, bias_grad = _bf16(call.q), call.causal, inputs.get("bias_grad", False)
    tensors = _tensors(call, inputs, _AFTER_FORWARD)
    q, k = tensors["q"], tensors["k"]
    masks = _score_masks(call, q.dtype, full_bias=bias_grad)
    block_keys = keys_per_block(call.bounds)
    if bias_grad and q.dtype == torch.float32 and masks["bias_sizes"][3] > 1 and k.shape[2] <= TILING().whole_row_keys:
        # a float32 bias gradient: each row in one key block, whose D = rowsum(P dP) follows the
        # block's own P and dP where rowsum(dO O) carries O's rounding (ALiBi, GQA, d=40, Lq=1024:
        # dbias 2.0x PyTorch's error -> see docs/api.md)
        block_keys = max(block_keys, k.shape[2])
    if chunks is None:
        chunks = chunk_count(independent_items(k, masks["bias_sizes"] if bias_grad else None), -(-k.shape[2] // block_keys))
    dq_parts = q.new_empty(chunks, *q.shape)  # the pass zeroes its parts, dk and dv itself
    dk, dv = torch.empty_like(k), torch.empty_like(tensors["v"])
    delta = q.new_empty(q.shape[:-1])
    dbias_parts = _bias_grad_buffer(masks, bias_grad, chunks, False, q.dtype)
    rows = query_block_rows(q.shape[2], k.shape[2], causal, bf16, masks.get("key_bounds"))
    ranges = _key_ranges(q, k, causal, rows, masks)
    layout = _Layout(rows, block_keys, chunks, band_keys_transposed(q.shape[2], rows, call.bounds, bf16))
    _run("backward", call, layout, masks, **tensors, delta=delta, dq_parts=dq_parts, dk=dk, dv=dv,
         dbias_parts=dbias_parts, tile_map=_tile_map(q, k, masks, causal, rows, block_keys, ranges), key_ranges=ranges)
    return _sum_parts(dq_parts), dk, dv, _finish_bias_grad(dbias_parts, call.bias)


def attention_double_backward(call: AttentionCall, inputs: PassInputs, chunks: int | None = None
                              ) -> tuple[Tensor | None, Tensor, Tensor, Tensor, Tensor | None]:
    """(g_dout or None, g_q, g_k, g_v, g_bias or None): `higher_order.attention_double_backward`'s
    results for the cases the tiles backend takes, from the pass's `inputs` (dout, out,
    row_max, inv_sum, bias_grad, dout_grad, gq, gk, gv, gbias, sink_rows), in the compute
    dtype; an absent cotangent is zero (`gbias`, dbias's, only with `bias_grad`). `chunks`
    splits each head's query blocks into that many work items (default: `chunk_count`). With a
    sink, `sink_rows` (B, H, Lq, compute dtype), where given, takes each row's P_sink (u - t
    D), its share of the sink logit's gradient (`sink_logits`)."""
    bias_grad = inputs.get("bias_grad", False)
    tensors = _tensors(call, inputs, (*_AFTER_FORWARD, "gq", "gk", "gv"))
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    masks = _score_masks(call, q.dtype, full_bias=bias_grad)
    _with_bias_like(masks, "gbias", inputs.get("gbias") if bias_grad else None, q.dtype)
    rows, chunks = whole_row_split(q, k, masks, bias_grad, chunks, call.causal, double_backward=True)
    g_dout = torch.empty_like(tensors["dout"]) if inputs["dout_grad"] else None
    g_q = torch.empty_like(q)
    gk_parts, gv_parts = k.new_zeros(chunks, *k.shape), v.new_zeros(chunks, *v.shape)
    g_bias_parts = _bias_grad_buffer(masks, bias_grad, chunks, True, q.dtype)
    layout = _Layout(rows, chunks=chunks, transposed_keys=keys_transposed(k, v))
    _run("double_backward", call, layout, masks, **tensors, delta=q.new_empty(q.shape[:-1]), gbias=masks.get("gbias"),
         g_dout=g_dout, g_q=g_q, gk_parts=gk_parts, gv_parts=gv_parts, g_bias_parts=g_bias_parts,
         key_ranges=_key_ranges(q, k, call.causal, rows, masks), sink_rows=inputs.get("sink_rows"))
    return g_dout, g_q, _sum_parts(gk_parts), _sum_parts(gv_parts), _finish_bias_grad(g_bias_parts, call.bias)


def dropout_keep_scale_into(out: Tensor, seed: int, row_start: int, threshold: int, value: float,
                            key_start: int = 0) -> Tensor:
    """`dropout.keep_scale_into` for a contiguous float32 or float64 CPU tile (B, H, R, keys)."""
    _ops().dropout_keep_scale(out, as_int64(seed), row_start, key_start, threshold, value)
    return out


def attention_jvp(call: AttentionCall, inputs: PassInputs) -> Tensor:
    """The output's tangent (B, H, Lq, dv): `higher_order.attention_jvp`'s result for the
    cases the tiles backend takes, from the pass's `inputs` (row_max, inv_sum, tq, tk, tv,
    tbias); an absent tangent is zero. With a sink, the rows' sums are centred with the
    sink's share (`centre_on_peak`)."""
    tensors = _tensors(call, inputs, ("row_max", "inv_sum", *_TANGENTS))
    q, k, v, tbias = tensors["q"], tensors["k"], tensors["v"], inputs.get("tbias")
    masks = _with_bias_like(_score_masks(call, q.dtype, full_bias=tbias is not None), "tbias", tbias, q.dtype)
    out_t = q.new_empty(*q.shape[:3], v.shape[-1])
    rows, chunks = whole_row_split(q, k, masks, False, None, call.causal)  # each work item owns its rows
    layout = _Layout(rows, chunks=chunks, transposed_keys=keys_transposed(k, v))
    _run("jvp", call, layout, masks, **tensors, tbias=masks.get("tbias"), tout=out_t,
         key_ranges=_key_ranges(q, k, call.causal, rows, masks))
    return out_t


def attention_forward_jvp(call: AttentionCall, inputs: PassInputs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, row_max, inv_sum, out's tangent) in the compute dtype, in one pass of whole rows (the
    JVP's, taking each row's statistics from the row): the forward's output and statistics,
    with a sink's share (`ops.add_sink`), and `attention_jvp`'s tangent, to rounding, from the
    pass's `inputs` (tq, tk, tv, tbias, row_sums). Given row_sums' "centre_sums" ((B, H, Lq)
    or (B, H, Lq, 1), compute dtype, contiguous), each row's t = rowsum(P * S') goes there
    (what `attention_backward_jvp_given_sums` takes); given its "peak_sums" (as centre) too,
    c = S' at the row's most probable key goes there and t - c to "centre_sums", so that a
    later pass can centre its rows on their peaks as this one does. Given its "results"
    (out, row_max, inv_sum), the primal results are written there (`_results_into`)."""
    row_sums = inputs.get("row_sums") or {}
    tensors = _tensors(call, inputs, _TANGENTS)
    q, k, v, tbias = tensors["q"], tensors["k"], tensors["v"], inputs.get("tbias")
    centre, peak = (row_sums[name].view(q.shape[:3]) if name in row_sums else None
                    for name in ("centre_sums", "peak_sums"))
    masks = _with_bias_like(_score_masks(call, q.dtype, full_bias=tbias is not None), "tbias", tbias, q.dtype)
    out_shape = (*q.shape[:3], v.shape[-1])
    out, row_max, inv_sum = _results_into(row_sums.get("results"), (out_shape, q.shape[:3], q.shape[:3]), q.dtype,
                                          "forward_jvp")
    out_t = q.new_empty(out_shape)
    rows, chunks = whole_row_split(q, k, masks, False, None, call.causal)  # each work item owns its rows
    layout = _Layout(rows, chunks=chunks, transposed_keys=keys_transposed(k, v))
    _run("forward_jvp", call, layout, masks, **tensors, tbias=masks.get("tbias"), out=out, tout=out_t,
         row_max=row_max, inv_sum=inv_sum, key_ranges=_key_ranges(q, k, call.causal, rows, masks), centre=centre,
         peak=peak)
    return out, row_max, inv_sum, out_t


def attention_backward_jvp_given_sums(call: AttentionCall, inputs: PassInputs, with_backward: bool = False,
                                      chunks: int | None = None) -> tuple[Tensor, ...]:
    """`attention_backward_jvp`'s tangents of (dq, dk, dv), without a bias gradient, on the
    backward's tiles, from the pass's `inputs` (dout, out, row_max, inv_sum, tdout, tq, tk,
    tv, tbias) given each row's sums over its keys in their row_sums ((B, H, Lq) or (B, H, Lq,
    1)): "centre" t = rowsum(P * S') (with "peak" c, t - c: `attention_forward_jvp`'s) and
    "delta_t" D' = rowsum(tdout * out + dout * tout). The keys may be a part of each row's (a
    ring step: its seed's placement says so), the sums the whole row's. In the compute
    dtype; `with_backward`: the backward's (dq, dk, dv) first, from the same pass, written
    into row_sums' "results" where given (`_results_into`). `chunks` splits each head's keys
    into that many work items (default: `chunk_count`)."""
    bf16, causal, row_sums, tbias = _bf16(call.q), call.causal, inputs["row_sums"], inputs.get("tbias")
    # the sums are work tensors too: their dtype counts towards the work dtype
    tensors = _tensors(call, {**inputs, **row_sums}, (*_AFTER_FORWARD, "tdout", *_TANGENTS, "centre", "delta_t"))
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    masks = _with_bias_like(_score_masks(call, q.dtype, full_bias=tbias is not None), "tbias", tbias, q.dtype)
    block_keys = keys_per_block(call.bounds)
    if chunks is None:
        chunks = chunk_count(independent_items(k, None), -(-k.shape[2] // block_keys))
    tdq_parts = q.new_zeros(chunks, *q.shape)
    tdk, tdv = torch.zeros_like(k), torch.zeros_like(v)
    grads = dict(dq_parts=None, dk=None, dv=None)
    if with_backward:
        dq, dk, dv = _results_into(row_sums.get("results"), (q.shape, k.shape, v.shape), q.dtype,
                                   "backward_jvp_given_sums")
        dq_parts = dq[None] if chunks == 1 else q.new_empty(chunks, *q.shape)  # one part: dq itself
        grads = dict(dq_parts=dq_parts.zero_(), dk=dk.zero_(), dv=dv.zero_())
    rows = query_block_rows(q.shape[2], k.shape[2], causal, bf16, masks.get("key_bounds"))
    ranges = _key_ranges(q, k, causal, rows, masks)
    peak = row_sums.get("peak")
    tensors.update(centre=tensors["centre"].reshape(q.shape[:-1]).contiguous(),
                   delta_t=tensors["delta_t"].reshape(q.shape[:-1]).contiguous(),
                   peak=None if peak is None else peak.to(q.dtype).reshape(q.shape[:-1]).contiguous())
    _run("backward_jvp_given_sums", call, _Layout(rows, block_keys, chunks), masks, **tensors,
         delta=q.new_empty(q.shape[:-1]), tbias=masks.get("tbias"), tdq_parts=tdq_parts, tdk=tdk, tdv=tdv, **grads,
         tile_map=_tile_map(q, k, masks, causal, rows, block_keys, ranges), key_ranges=ranges)
    tangents = _sum_parts(tdq_parts), tdk, tdv
    if not with_backward:
        return tangents
    if chunks > 1:
        _sum_parts(grads["dq_parts"], out=dq)
    return (dq, dk, dv, *tangents)


def attention_backward_jvp(call: AttentionCall, inputs: PassInputs, with_backward: bool = False,
                           chunks: int | None = None) -> tuple[Tensor | None, ...]:
    """The tangents of (dq, dk, dv, dbias or None): `higher_order.attention_backward_jvp`'s
    results for the cases the tiles backend takes, from the pass's `inputs` (dout, out,
    row_max, inv_sum, bias_grad, tdout, tq, tk, tv, tbias, sink_rows), in the compute dtype;
    an absent tangent is zero. `chunks` splits each head's query blocks into that many work
    items (default: `chunk_count`). `with_backward`: the backward's (dq, dk, dv, dbias or None)
    first, then the tangents, from the one pass (the backward's P and dS are the JVP's too).
    A sink (the call's) says the statistics hold its term, which a bias constant along the
    keys needs for its gradient's tangent in closed form; `sink_rows` (B, H, Lq, compute
    dtype), where given, takes each row's P_sink (D' - t D), its share of the sink logit's
    gradient's tangent."""
    bias_grad, tbias = inputs.get("bias_grad", False), inputs.get("tbias")
    tensors = _tensors(call, inputs, (*_AFTER_FORWARD, "tdout", *_TANGENTS))
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    masks = _score_masks(call, q.dtype, full_bias=bias_grad or tbias is not None)
    _with_bias_like(masks, "tbias", tbias, q.dtype)
    rows, chunks = whole_row_split(q, k, masks, bias_grad, chunks, call.causal)
    tdq = q.new_empty(q.shape)
    tdk_parts, tdv_parts = k.new_zeros(chunks, *k.shape), v.new_zeros(chunks, *v.shape)
    tdbias_parts = _bias_grad_buffer(masks, bias_grad, chunks, True, q.dtype)
    grads = dict.fromkeys(("dq", "dk_parts", "dv_parts", "dbias_row_parts"))
    if with_backward:
        grads = dict(dq=q.new_empty(q.shape), dk_parts=k.new_zeros(chunks, *k.shape),
                     dv_parts=v.new_zeros(chunks, *v.shape),
                     dbias_row_parts=_bias_grad_buffer(masks, bias_grad, chunks, True, q.dtype))
    layout = _Layout(rows, chunks=chunks, transposed_keys=keys_transposed(k, v))
    _run("backward_jvp", call, layout, masks, **tensors, delta=q.new_empty(q.shape[:-1]), tbias=masks.get("tbias"),
         tdq=tdq, tdk_parts=tdk_parts, tdv_parts=tdv_parts, tdbias_parts=tdbias_parts, **grads,
         key_ranges=_key_ranges(q, k, call.causal, rows, masks), sink_rows=inputs.get("sink_rows"))
    tangents = tdq, _sum_parts(tdk_parts), _sum_parts(tdv_parts), _finish_bias_grad(tdbias_parts, call.bias)
    if not with_backward:
        return tangents
    return (grads["dq"], _sum_parts(grads["dk_parts"]), _sum_parts(grads["dv_parts"]),
            _finish_bias_grad(grads["dbias_row_parts"], call.bias), *tangents)
