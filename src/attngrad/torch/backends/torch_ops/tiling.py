"""The torch-ops kernels' block sizes, as data (`tuning`): `TILING()` is the tiling in
force, `TILING.override(min_rows=3)` changes it inside a block. The timings that chose each
value are in docs/bench.md, "How the torch-ops kernels' sizes were chosen"."""

from __future__ import annotations

from dataclasses import dataclass

from ...tuning import Tuning


@dataclass(frozen=True)
class Tiling:
    # numbers in one (B, H, R, Lk') score tile (16 MiB of float32): a handful are alive at
    # once in the backward, which bounds the extra memory whatever the length
    tile_elements: int = 1 << 22
    # rows of a query block: at least min_rows (higher_min_rows in the higher passes), at
    # most max_rows (a causal block computes the upper half of its diagonal square for nothing)
    min_rows: int = 16
    higher_min_rows: int = 128
    max_rows: int = 128
    # keys per product of the forward's E V~, added one after another, for float32 accuracy
    value_slice: int = 128


TILING: Tuning[Tiling] = Tuning("attngrad_torch_ops_tiling", Tiling())
