"""The Triton backend's configuration: the tiles (`Blocks`) each pass takes per dtype class,
padded head width and GPU (`blocks_for`: `_TABLE`, and sm_90's `_HOPPER_LIGHT` for calls that
`is_light`), and how the walks go (`Options`, in force as `TUNING`). `launch` reads them to
build each call's `Plan`; nothing here makes a kernel argument or launches a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ...op.call import AttentionCall
from ...tuning import Tuning


@dataclass(frozen=True)
class Blocks:
    """A kernel's tile (rows x keys), its launch shape on a GPU, the columns of the head width
    its products over that width take at a time (0: the whole width at once), the
    registers per thread ptxas may use (0: its own choice, which can stop at 128 and spill
    where 255 would not), and whether its walks take the tiles that need no masking in a
    loop of their own (`tile_ops.segment`; off where the second loop made them spill)."""

    rows: int
    keys: int
    warps: int = 4
    stages: int = 2
    slice: int = 0
    registers: int = 0
    split: bool = True


# Per pass, dtype class and padded head width (64 and up), for d <= 128 in half, float32
# and TF32: the first tiles, from 64x64 w8 (128x64 for the forward) down to 16x16 w4, each
# with its products over the whole head width, then by slices of 64, 32 and 16 columns,
# with ptxas's choice of registers, then 255, whose kernels compile without register
# spills for sm_80 and sm_90 in every feature set of `attngrad gpu-report` (a sweep with
# Triton 3.9). float64 and d = 256 may spill (`gpu-report` lists it): their forward tiles
# come from an earlier sweep of whole-width tiles, their other passes take 16x16 w4 by 16
# columns (32 in half precision) with 255 registers, not swept (float64 at d <= 128: at
# most 300 bytes of spills, from 18 KB over the whole width). Any other key gets 16x16
# with 4 warps. docs/gpu.md says why the tiles shrink with the pass and why the slices.
# The branch-free walks (2026-11-29) made eleven entries spill, pipelined or not: each took the
# first candidate of `benchmarks/tile_candidates.py` that compiles clean (its own tile with
# 255 registers, or its walks in one loop, or one stage, or half its rows), not yet timed.
_TABLE: dict[tuple[str, str, int], Blocks] = {
    ("forward", "half", 64): Blocks(64, 64, 8, 2),
    ("forward", "half", 128): Blocks(64, 64, 8, 2, registers=255, split=False),
    ("forward", "half", 256): Blocks(64, 32, 8, 2),
    ("forward", "float32", 64): Blocks(64, 32, 8, 2),
    ("forward", "float32", 128): Blocks(64, 32, 8, 1, slice=32, registers=255),
    ("forward", "float32", 256): Blocks(32, 32, 8, 2),
    ("forward", "tf32", 64): Blocks(64, 64, 8, 2, slice=32),
    ("forward", "tf32", 128): Blocks(64, 64, 8, 2, slice=64),
    ("forward", "tf32", 256): Blocks(32, 32, 8, 2),
    ("forward", "float64", 64): Blocks(64, 64, 8, 2, slice=16),
    ("forward", "float64", 128): Blocks(32, 32, 8, 2),
    ("forward", "float64", 256): Blocks(32, 32, 8, 2),
    ("jvp", "half", 64): Blocks(64, 64, 8, 1, slice=32),
    ("jvp", "half", 128): Blocks(64, 32, 8, 1, slice=64),
    ("jvp", "float32", 64): Blocks(32, 16, 8, 1, slice=32, registers=255),
    ("jvp", "float32", 128): Blocks(32, 16, 8, 1, slice=64),
    ("jvp", "tf32", 64): Blocks(64, 32, 8, 1, slice=32),
    ("jvp", "tf32", 128): Blocks(32, 32, 8, 1, slice=64),
    # the fused forward and JVP takes the JVP's tiles (`blocks_for`) but here, where they spilled
    # 120 B on sm_80 with every feature (half the keys keeps the query block's reuse of K and V;
    # two stages compile clean too, at d = 128 they spilled 152 B on sm_90)
    ("forward_jvp", "half", 64): Blocks(64, 32, 8, 2, slice=32),
    ("backward", "half", 64): Blocks(64, 32, 8, 1),
    ("backward", "half", 128): Blocks(32, 32, 8, 1, slice=16, registers=255),
    ("backward", "float32", 64): Blocks(32, 32, 8, 1, registers=255),
    ("backward", "float32", 128): Blocks(16, 32, 8, 1, slice=32, registers=255),
    ("backward", "tf32", 64): Blocks(32, 32, 8, 1, slice=32, registers=255),
    ("backward", "tf32", 128): Blocks(32, 32, 8, 1, slice=64, registers=255),
    ("backward_jvp", "half", 64): Blocks(32, 32, 8, 1, slice=32, registers=255),  # ptxas's own choice spilled 12 B
    ("backward_jvp", "half", 128): Blocks(32, 32, 8, 1, slice=64, registers=255, split=False),
    ("backward_jvp", "float32", 64): Blocks(16, 16, 8, 1, slice=32, registers=255),
    # centred (`kernels.row_sums`), the float32 key side of these two took 16x16 w4 and slices of
    # 32 (backward's JVP) or 64 to compile for sm_80 without spills (Triton 3.9; not timed)
    ("backward_jvp", "float32", 128): Blocks(16, 16, 4, 1, slice=32, registers=255),
    ("backward_jvp", "tf32", 64): Blocks(16, 32, 8, 1, slice=32, registers=255),
    ("backward_jvp", "tf32", 128): Blocks(32, 16, 8, 1, slice=64),
    ("double_backward", "half", 64): Blocks(32, 32, 8, 1, slice=32, registers=255),
    ("double_backward", "half", 128): Blocks(32, 32, 8, 1, slice=64, registers=255),
    ("double_backward", "float32", 64): Blocks(16, 16, 8, 1, slice=32, registers=255),
    ("double_backward", "float32", 128): Blocks(16, 16, 4, 1, slice=64, registers=255),
    ("double_backward", "tf32", 64): Blocks(32, 16, 8, 1, slice=32, registers=255),  # ptxas's own spilled row_sums
    ("double_backward", "tf32", 128): Blocks(32, 16, 8, 1, slice=64),
}
# float64, and d = 256 beyond the forward: one entry for every pass, not swept
_TABLE.update({(name, kind, width): Blocks(16, 16, 4, 1, slice=32 if kind == "half" else 16, registers=255)
               for name in ("jvp", "backward", "backward_jvp", "double_backward")
               for kind, width in (("float64", 64), ("float64", 128), ("float64", 256), ("half", 256),
                                   ("float32", 256), ("tf32", 256))})
MAX_WIDTH = 256

# Hopper (sm_90) tiles for light calls: no bias, boolean mask, block mask, softcap or
# dropout (causal, key bounds and GQA allowed). Such a call keeps fewer values per score,
# so larger tiles fit 255 registers; these were the fastest, on an H200 with the walks
# pipelined (Triton 3.6, 2026-11-27: `benchmarks/gpu_tiles.py`, each walk one masked loop
# over a contiguous run then), among those that compile for sm_90 without spills (Triton
# 3.9, `attngrad gpu-report --features light`): a second stage spills the backward's
# key_side at d = 128. Products over the whole head width: a
# slice of the width costs the tensor cores more than the registers it frees here. Other
# GPUs and heavier calls keep `_TABLE` (sm_80 spilled at the earlier entries).
_HOPPER_LIGHT: dict[tuple[str, str, int], Blocks] = {
    ("forward", "half", 64): Blocks(128, 64, 4, 2),
    ("forward", "half", 128): Blocks(64, 64, 4, 3),
    ("backward", "half", 64): Blocks(64, 64, 4, 1),
    ("backward", "half", 128): Blocks(128, 64, 8, 1),
}


@dataclass(frozen=True)
class Options:
    """How the backend walks, as data (`tuning`): `TUNING()` is in force,
    `TUNING.override(fused_backward=True)` changes it inside a block (tests, sweeps)."""

    # the interpreter runs one program at a time on NumPy: the smallest tiles tl.dot takes,
    # which also cross many block boundaries at the tests' small shapes, over the whole width
    interpreted: Blocks = Blocks(16, 16, 1, 1)
    # each walk takes the tiles that need no masking first, in a loop that applies none (no
    # mask, bounds or causal test read, the bias loaded unmasked), then the others in a loop
    # that applies them (`launch._walk_lists`). Off: every tile in the second loop, in key order
    # (a sweep's A/B; the sums' order, so their rounding, differs between the two)
    interior_tiles: bool = True
    # the backward of a light call whose walks are contiguous runs (`launch.Plan.fused`): one walk
    # per key block that adds its parts of dQ in a fixed order (`kernels.dq_rank`), 5
    # products per tile where query_side and key_side take 7; in half precision on a GPU,
    # everywhere in the interpreter. Off: on an H200 it took 1.29-1.57x the split backward's
    # time, the ordered adds' waits and loads being the cost (docs/gpu.md)
    fused_backward: bool = False
    # IEEE float32's products (allow_tf32 off): "ieee", FMA on the CUDA cores, or a split
    # product on the tensor cores, "tf32x3", "bf16x3" or "bf16x6" (Triton's input_precision;
    # TF32's tiles, uncentred as TF32 is). "ieee" until a GPU has measured the others'
    # accuracy against float64 beside its, and their time (`gpu_check.py`, dtypes tf32x3, bf16x6)
    float32_products: str = "ieee"
    # the backward's key side of a light call whose walks are contiguous runs, in the keys'
    # orientation (`kernels.key_side_light`), on tiles of its own where sm_90's table has a "key_side"
    # entry. Off until a GPU has timed it (`gpu_tiles.py --key-side`)
    light_key_side: bool = False
    # the dtypes whose scores are taken in base 2, log2(e) folded into the scale (`tile_ops.in_base`),
    # where a call has no bias or cap: one multiply per score fewer in every kernel a light call runs
    # but `jvp` and `row_sums`; the row maxima are stored in natural units all the same
    exp2_dtypes: tuple = (torch.float16, torch.bfloat16)
    # the walks' loads through tensor descriptors (TMA on sm_90; in the interpreter for the tests):
    # K and V in forward, forward_jvp and query_side, Q and dO in key_side, where the tensors and
    # the products allow them (`launch._descriptors`). Off until a GPU has timed it (`gpu_tiles.py --tma`)
    tensor_descriptors: bool = False


TUNING: Tuning[Options] = Tuning("attngrad_triton_tuning", Options())


def padded_width(width: int) -> int:
    """A head width as a tile's: a power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(width))


def dtype_class(dtype: torch.dtype, tf32: bool = False) -> str:
    """"half", "float32", "tf32" (float32 on the tensor cores) or "float64": the products'
    kind, which sets how many registers a tile takes."""
    if dtype in (torch.float16, torch.bfloat16):
        return "half"
    return "tf32" if tf32 and dtype == torch.float32 else str(dtype).removeprefix("torch.")


def blocks_for(pass_name: str, dtype: torch.dtype, width: int, interpreted: bool, tf32: bool = False,
               arch: int = 0, light: bool = False) -> Blocks:
    """The tiles of pass `pass_name` for inputs of `dtype` and head width `width` (the
    larger of d and dv), float32 in TF32 if `tf32`, on a GPU of compute capability `arch`
    (90 for sm_90), for a light call (`is_light`) or not; every kernel of a pass shares them
    (and so its block map)."""
    if interpreted:
        return TUNING().interpreted
    key = (pass_name, dtype_class(dtype, tf32), max(64, padded_width(width)))
    if light and arch == 90 and key in _HOPPER_LIGHT:
        return _HOPPER_LIGHT[key]
    if pass_name == "key_side":  # the backward's tiles, where the key side has none of its own
        return blocks_for("backward", dtype, width, interpreted, tf32, arch, light)
    if pass_name == "forward_jvp" and key not in _TABLE:  # the JVP's, which holds as much per row
        return blocks_for("jvp", dtype, width, interpreted, tf32, arch, light)
    return _TABLE.get(key, Blocks(16, 16, 4, 1))


def is_light(call: AttentionCall) -> bool:
    """Whether a call has none of the per-score operands and options that cost registers: a
    bias, a boolean mask, a block mask, a softcap, dropout."""
    return (call.bias is None and call.mask is None and call.blocks is None and not call.softcap
            and call.dropout_p == 0.0)
