"""What the compiled tiles' tests share: the calls and inputs their passes take, drawn causal
diagonals and masks, inputs, the whole-row passes' settings, and counts of the tiles a pass
computes."""

import contextlib
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
from hypothesis import strategies as st  # noqa: E402

from attngrad.torch.backends.cpu_tiles import native, tiling  # noqa: E402
from attngrad.torch.backends.torch_ops import first_order, higher_order  # noqa: E402
from attngrad.torch.op.call import AttentionCall  # noqa: E402
from attngrad.torch.op.dropout import Placement  # noqa: E402

from ...conftest import make_call  # noqa: E402

compiler = shutil.which(os.environ.get("CXX", "c++"))


needs_tiles = pytest.mark.skipif(native.library() is None, reason=f"no compiled tiles: {native.build_info.reason}")


def tiles_call(q, k, v, causal=None, scale=0.5, seed=0, **options) -> AttentionCall:
    """The call the tiles' passes take (`make_call`'s keywords in `options`), its dropout
    `seed` an int or a `Placement`."""
    return make_call(q, k, v, causal=causal, scale=scale, seed=Placement.of(seed).tensor(), **options)


def after_forward(dout, forward, **inputs) -> dict:
    """A later pass's inputs: the output's cotangent `dout`, the `forward`'s (out, row_max,
    inv_sum), and `inputs`."""
    out, row_max, inv_sum = forward
    return dict(dout=dout, out=out, row_max=row_max, inv_sum=inv_sum, **inputs)


# The causal diagonal: none, top-left, bottom-right, or any offset from "no row sees a key"
# to "every row sees every key" (a ring step of context parallelism meets all of these).
CAUSAL = st.one_of(st.none(), st.just("top-left"), st.just("bottom-right"), st.integers(-80, 80))


def causal_offset(causal, len_q, len_k):
    """The op's causal offset for a drawn CAUSAL value."""
    return {"top-left": 0, "bottom-right": len_k - len_q}.get(causal, causal)


def at_most_one_key(causal, len_q, len_k, mask=None, bias=None):
    """Whether no row sees two keys: then P is 1 or 0 everywhere whatever the scores, dQ and
    dK are 0, and both sides hold rounding noise there."""
    allowed = torch.ones(len_q, len_k, dtype=torch.bool)
    if causal is not None:
        allowed = allowed.tril(causal)
    if mask is not None:
        allowed = allowed & mask
    if bias is not None:
        allowed = allowed & (bias > float("-inf"))
    return int(allowed.sum(dim=-1).max()) <= 1


# Which of a boolean mask and a float bias a call has, and the axes each broadcasts along
MASKING = st.tuples(st.sampled_from(["none", "mask", "bias", "both"]),
                    st.sampled_from([(1, 1, 0, 0), (0, 1, 0, 0), (1, 0, 1, 0), (0, 0, 0, 0), (1, 1, 1, 0)]))


def drawn_masks(masking, batch, heads, len_q, len_k, dtype, seed):
    """(mask or None, bias or None) for a drawn MASKING: a mask that drops about a third of
    the keys (some rows all of them), a bias with some -inf entries; 1 along the axes marked."""
    kind, broadcast = masking
    shape = tuple(1 if one else n for one, n in zip(broadcast, (batch, heads, len_q, len_k)))
    g = torch.Generator().manual_seed(seed + 2)
    mask = bias = None
    if kind in ("mask", "both"):
        mask = torch.rand(shape, generator=g) > 0.35
    if kind in ("bias", "both"):
        bias = torch.randn(shape, generator=g, dtype=dtype).masked_fill(torch.rand(shape, generator=g) < 0.1, float("-inf"))
    return mask, bias


# The calls of the whole-row passes' property tests (JVP, the backward's JVP, double
# backward): shapes with GQA and Lq != Lk, causal diagonals, masks, and block heights of
# 3 rows (many blocks, row tails) or 128 (one block).
WHOLE_ROW_CALLS = dict(
    batch=st.integers(1, 2), kv_heads=st.integers(1, 2), groups=st.integers(1, 3), len_q=st.integers(1, 50),
    len_k=st.integers(1, 50), dim=st.sampled_from([1, 5, 16]), dim_v=st.sampled_from([3, 16]), causal=CAUSAL,
    masking=MASKING, rows=st.sampled_from([3, 128]), softcap=st.sampled_from([0.0, 0.0, 0.7]),
    transposed_keys=st.booleans(),
)


@contextlib.contextmanager
def whole_row_settings(rows: int, transposed_keys: bool):
    """The whole-row passes' block height, and whether they take the key side transposed
    (csrc/whole_rows.h, KeySide) or in place, for the calls inside."""
    keys = native.TILING().transposed_keys if transposed_keys else 0
    with native.TILING.override(block_rows=rows, transposed_keys=keys):
        yield


def random_inputs(batch, heads, kv_heads, len_q, len_k, dim, dim_v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, len_q, dim, generator=g, dtype=dtype)
    k = torch.randn(batch, kv_heads, len_k, dim, generator=g, dtype=dtype)
    v = torch.randn(batch, kv_heads, len_k, dim_v, generator=g, dtype=dtype)
    dout = torch.randn(batch, heads, len_q, dim_v, generator=g, dtype=dtype)
    return q, k, v, dout


def query_blocks_taken(monkeypatch, q, k, v, dout, causal, **masks) -> dict:
    """The rows per query block the compiled forward and backward took, by pass name."""
    rows = {}

    def recording(name, call, layout, *args, **kwargs):
        rows[name] = layout.block_rows
        return run(name, call, layout, *args, **kwargs)

    run = native._run
    monkeypatch.setattr(native, "_run", recording)
    call = tiles_call(q, k, v, causal, 0.3, **masks)
    native.attention_backward(call, after_forward(dout, native.attention_forward(call)))
    return rows


def torch_ops_first_order(call, dout, bias_grad=False):
    """The torch-ops kernels' forward and backward of an `AttentionCall`: (out, row_max,
    inv_sum) and (dq, dk, dv, dbias or None)."""
    out, row_max, inv_sum = first_order.attention_forward(call)
    grads = first_order.attention_backward(call, dout=dout, out=out, row_max=row_max, inv_sum=inv_sum, bias_grad=bias_grad)
    return (out, row_max, inv_sum), grads


def given_row_sums(call, stats, tangents):
    """The torch-ops kernels' whole-row sums (B, H, Lq, 1) of an `AttentionCall` for
    tangents (tdO, tQ, tK, tV, tbias): the centre rowsum(P * S') and D' = rowsum(tdO * O + dO * O').
    `stats`: dout and the forward's out, row_max, inv_sum by name."""
    tdout, tq, tk, tv, tbias = tangents
    q, dout, out = call.q, stats["dout"], stats["out"]
    centre = torch.zeros(*q.shape[:3], 1, dtype=q.dtype)
    inputs = dict(row_max=stats["row_max"], inv_sum=stats["inv_sum"], tq=tq, tk=tk, tv=tv, tbias=tbias)
    # adds rowsum(P * S') into centre
    higher_order.attention_jvp(call, **inputs, row_sums=dict(centre=torch.zeros_like(centre), centre_sums=centre))
    delta_t = (dout * higher_order.attention_jvp(call, **inputs)).sum(-1, keepdim=True)
    if tdout is not None:
        delta_t += (tdout * out).sum(-1, keepdim=True)
    return centre, delta_t


def brgemm_route_on() -> int:
    """Turns bfloat16's brgemm route on and returns the choice that restores the route before
    (`brgemm_path`'s 0 or 1); skips where there is none."""
    ops = torch.ops.attngrad_tiles
    before = 1 if ops.brgemm_path(-1) else 0
    try:
        ops.brgemm_path(1)
    except RuntimeError as error:
        pytest.skip(str(error))
    return before


def tiles_not_empty(q, k, causal, mask=None, bias=None, bounds=None, block_keys=None):
    """Score tiles of the forward (and of the backward: the same tiling) that the block map
    leaves to compute: all B H Lq/R Lk/C of them less its EMPTY ones, and how many those are."""
    from attngrad.torch.masks.block_map import ScoreFilter, empty_tiles

    masks = native._score_masks(tiles_call(q, k, q, causal, mask=mask, bias=bias, bounds=bounds), q.dtype)
    block_keys = block_keys or tiling.keys_per_block(bounds)
    rows = tiling.query_block_rows(q.shape[2], k.shape[2], causal, q.dtype == torch.bfloat16, masks.get("key_bounds"))
    scores = ScoreFilter(q.shape[2], k.shape[2], causal, masks.get("key_bounds"), masks.get("mask"), masks.get("bias"))
    empty = empty_tiles(scores, rows, block_keys)
    empty = empty.expand(q.shape[0], q.shape[1], *empty.shape[2:])
    return int((~empty).sum()), int(empty.sum())


def tiles_counted(run):
    """run()'s result and the score tiles the compiled passes computed during it."""
    torch.ops.attngrad_tiles.tiles_computed(True)
    result = run()
    return result, torch.ops.attngrad_tiles.tiles_computed(True)


# Key bounds of a narrow band (each a (B or 1, Lq, 2) tensor of [lo, hi) per row): a causal
# window of `width` keys, packed documents of `width` keys, or random bounds (empty rows
# too, but not only)
BANDS = st.sampled_from(["window", "documents", "random"])


def band_bounds(band, batch, len_q, len_k, width, seed):
    rows = torch.arange(len_q)
    if band == "window":
        lo, hi = (rows - width + 1).clamp(0, len_k), (rows + 1).clamp(max=len_k)
    elif band == "documents":
        lo = (rows // width * width).clamp(max=len_k)
        hi = (lo + width).clamp(max=len_k)
    else:
        g = torch.Generator().manual_seed(seed + 3)
        lo = torch.randint(0, len_k + 1, (batch, len_q), generator=g)
        hi = (lo + torch.randint(0, width + 1, (batch, len_q), generator=g)).clamp(max=len_k)
        lo[:, 0], hi[:, 0] = 0, min(width, len_k)  # some row sees a key: else every block height costs nothing
        return torch.stack([lo, hi], -1)
    return torch.stack([lo, hi], -1)[None]
