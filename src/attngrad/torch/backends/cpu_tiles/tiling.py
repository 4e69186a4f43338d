"""The compiled tiles' block sizes and thresholds, as data (`tuning`): `TILING()` is the
tiling in force, `TILING.override(block_keys=8)` changes it inside a block. The timings that
chose each value are in docs/bench.md, "How the compiled tiles' sizes were chosen"."""

from __future__ import annotations

from dataclasses import dataclass

from ...tuning import Tuning


@dataclass(frozen=True)
class Tiling:
    # rows of a query block and keys of a key block: the backward's two (128, 512) float32
    # score tiles and their K, V blocks stay in a core's L2 cache
    block_rows: int = 128
    block_keys: int = 512
    # keys up to which a float32 backward with a bias gradient takes each row in one key block
    whole_row_keys: int = 2048
    # a causal call below this many query rows takes blocks of 32 to 64 rows (float32 and
    # float64; bfloat16's products keep block_rows)
    causal_short: int = 1024
    # query blocks whose rows' key bounds span at most narrow_band keys (a sliding window,
    # packed documents) take block_rows, a half or a quarter of it (`_band_rows`: the fewest
    # scores, each weighted by band_row_cost, the time per score of those three), and key
    # blocks of narrow_block_keys
    narrow_band: int = 1024
    narrow_block_keys: int = 2048
    band_row_cost: tuple[float, ...] = (1.0, 1.075, 1.18)
    # query rows from which a narrow band's forward and backward copy K and V transposed
    band_transpose_rows: int = 128
    # keys per GEMM of the forward's E V product, for float32 accuracy
    value_slice: int = 128
    # numbers in each of the double backward's four whole-row tiles (4 MiB of float32)
    double_tile: int = 1 << 20
    # rows of the double backward's causal blocks, (longest query length, rows)
    double_causal_rows: tuple[tuple[int, int], ...] = ((256, 32), (2048, 64))
    # rows of the whole-row passes' blocks, in block_rows, where no causal mask or band is
    whole_rows: int = 2
    # numbers per thread up to which the whole-row passes copy the key side transposed
    transposed_keys: int = 1 << 23
    # work items a backward pass aims for, each extra chunk a partial gradient of its own
    target_items: int = 8
    # bytes from which a gradient buffer is kept between calls (`buffer_cache`): below it the
    # allocator's own free lists serve as well (glibc keeps freed blocks up to 32 MiB)
    smallest_kept_buffer: int = 4 << 20


TILING: Tuning[Tiling] = Tuning("attngrad_cpu_tiles_tiling", Tiling())
