"""The compiled tiles' block sizes and thresholds, as data (`tuning`), and the rules that
size a pass from them. `TILING()` is the tiling in force, `TILING.override(block_keys=8)`
changes it inside a block. The timings that chose each value are in docs/bench.md, "How
the compiled tiles' sizes were chosen". The rules below read the tiling at each call and
depend on the shapes and masks alone, never on the thread count: the same inputs give the
same blocks, so the same bits. `native` lays each pass out by them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...masks import version_cache
from ...masks.block_map import key_ranges
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


def query_block_rows(len_q: int, len_k: int, causal: int | None, bf16: bool, bounds: Tensor | None = None) -> int:
    """Rows per query block of the forward and the backward (both: their tiles must be the
    same for the backward to recompute the forward's scores bit for bit): block_rows; for a
    causal call shorter than causal_short rows a quarter of them, 32 to 64; where the key
    `bounds` leave every row a band of at most narrow_band keys, `_band_rows`'s. bfloat16's
    products keep block_rows (`tiling.Tiling`)."""
    tiling = TILING()
    if bf16:
        return tiling.block_rows
    if is_narrow(bounds):
        return _band_rows(len_q, len_k, causal, bounds)
    if causal is None or len_q >= tiling.causal_short:
        return tiling.block_rows
    return min(tiling.block_rows, max(32, min(64, 1 << max(0, (len_q // 4).bit_length() - 1))))


def _band_rows(len_q: int, len_k: int, causal: int | None, bounds: Tensor) -> int:
    """block_rows, a half or a quarter of it: the one whose query blocks' key ranges
    (`block_map.key_ranges`), rows times keys, cover the fewest scores, weighted by
    band_row_cost. Kept while the bounds live unchanged (`version_cache.value`)."""
    tiling = TILING()

    def make() -> Tensor:
        costs = {}
        for rows, weight in zip((tiling.block_rows, tiling.block_rows // 2, tiling.block_rows // 4),
                                tiling.band_row_cost):
            if rows >= 1:
                keys = key_ranges(len_q, len_k, causal, bounds, rows)[..., 1]  # (1 or B, query blocks)
                sizes = torch.full((keys.shape[1],), rows)
                sizes[-1] = len_q - rows * (keys.shape[1] - 1)  # the last block's rows
                costs.setdefault(rows, float((keys * sizes).sum()) * weight)
        return torch.tensor(min(costs, key=costs.get))

    return int(version_cache.value("band_rows", (len_q, len_k, causal, tiling.block_rows, tiling.band_row_cost),
                                   (bounds,), make))


def keys_per_block(bounds: Tensor | None) -> int:
    """Keys per block of the forward and backward: block_keys, or narrow_block_keys where the
    key bounds leave every row a narrow band (a query block's range then rarely straddles
    two blocks, each straddle a second, smaller tile)."""
    return TILING().narrow_block_keys if is_narrow(bounds) else TILING().block_keys


def band_keys_transposed(len_q: int, rows: int, bounds: Tensor | None, bf16: bool) -> bool:
    """Whether the forward and the backward take S and dP from transposed copies of K and V
    (csrc/pass.h, BandKeys): on a narrow band's query blocks of a quarter of block_rows (a
    causal window's 32 rows), whose NT products run slowest (with 64 rows, documents of 512
    ran 2-4% slower with the copies), for float32 and float64 products over at least
    band_transpose_rows query rows, which share the copies (a decode step's one row keeps
    its own one-row product). Both passes decide from the same sizes and bounds: the
    backward recomputes the forward's scores with the same product."""
    tiling = TILING()
    return not bf16 and rows <= tiling.block_rows // 4 and len_q >= tiling.band_transpose_rows and is_narrow(bounds)


def is_narrow(bounds: Tensor | None) -> bool:
    """Whether key `bounds` are given and leave every row at most narrow_band keys. Kept while
    the bounds live unchanged (`version_cache.value`): a pass asks three times, a reduction each."""
    if bounds is None or bounds.numel() == 0:
        return False

    def make() -> bool:
        return int((bounds[..., 1] - bounds[..., 0]).max()) <= TILING().narrow_band

    return version_cache.value("narrow", (TILING().narrow_band,), (bounds,), make)


def chunk_count(batch_kv_heads: int, blocks: int) -> int:
    """Work items of the backward passes are (batch, key/value head, chunk of blocks); each
    chunk sums its own copy of the gradients its blocks share, and the copies are added in
    chunk order. One chunk when there are `Tiling.target_items` heads or more; otherwise
    enough chunks for about that many items, no more than the blocks. The count follows the
    shapes alone, never the thread count, so the bits do not either."""
    target = TILING().target_items
    if batch_kv_heads >= target:
        return 1
    return max(1, min(blocks, -(-target // batch_kv_heads)))


def independent_items(k: Tensor, bias_sizes: tuple | None) -> int:
    """How many (b, key/value head) work items a backward pass can run apart: all of them,
    except that the tiles give one item the batch entries or heads whose gradient of a
    broadcast bias (of 4-D `bias_sizes`, None without a gradient) adds into the same entries."""
    batch, kv_heads = k.shape[:2]
    if bias_sizes is None:
        return batch * kv_heads
    return (1 if bias_sizes[0] == 1 else batch) * (1 if bias_sizes[1] == 1 else kv_heads)


def whole_row_split(q: Tensor, k: Tensor, masks: dict, bias_grad: bool, chunks: int | None, causal: int | None,
                     double_backward: bool = False) -> tuple[int, int]:
    """(rows per query block, chunks) of a pass on whole rows (JVP, the backward's JVP,
    double backward): `chunks` as given, or enough for its independent work items. Blocks
    take up to twice block_rows rows (whole_rows); a causal call's, or a band's, block_rows,
    and a short causal call's double backward fewer (double_causal_rows)."""
    banded = causal is not None or masks.get("key_bounds") is not None or masks.get("mask_blocks") is not None
    tiling = TILING()
    rows = _whole_row_block_rows(k.shape[2], tiling.block_rows if banded else tiling.whole_rows * tiling.block_rows)
    if double_backward and causal is not None:
        rows = min([rows] + [r for longest, r in tiling.double_causal_rows if q.shape[2] <= longest])
    if chunks is None:
        chunks = chunk_count(independent_items(k, masks["bias_sizes"] if bias_grad else None), -(-q.shape[2] // rows))
    return rows, chunks


def keys_transposed(k: Tensor, v: Tensor) -> bool:
    """Whether the whole-row passes take the key side transposed (transposed_keys): at most
    three K-like and three V-like heads of Lk keys."""
    return k.shape[2] * 3 * (k.shape[3] + v.shape[3]) <= TILING().transposed_keys


def _whole_row_block_rows(len_k: int, most: int) -> int:
    """Query rows per block of a whole-row pass (the double backward holds four R x Lk'
    tiles of whole rows): at most double_tile numbers each, 8 (or `most` if fewer) to `most`
    rows."""
    return max(min(8, most), min(most, TILING().double_tile // max(1, len_k)))
