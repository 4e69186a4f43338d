"""The ring forward's merge of partial rows (`ring_passes._RowMerge`), in one process: the
units' (O_b, m_b, 1/l_b) of a row make the whole row's softmax attention; a unit in which
the row sees no key, (0, 0, 0), has weight 0; and a NaN that reached a unit's row (issue 58:
1/l_b NaN, its m_b NaN or, as the compiled tiles leave it, finite) leaves the merged row
NaN, where a test `1/l > 0` once gave the unit weight 0 and the row a finite output."""

import math

import pytest

torch = pytest.importorskip("torch")

from attngrad.torch.distributed.ring_passes import _RowMerge  # noqa: E402

from ...conftest import EXACT, rel_err  # noqa: E402


def unit(s, v):
    """(O_b, m_b, 1/l_b) of scores s (rows, keys; -inf masked) over values v (keys, dv), as a
    backend's forward on those keys leaves them: m_b the largest score past any NaN (the
    compiled tiles' max), a row that sees no key (0, 0, 0)."""
    m = torch.where(s.isnan(), -math.inf, s).amax(-1)
    empty = m == -math.inf
    e = torch.exp(s - torch.where(empty, 0.0, m)[:, None])
    total = e.sum(-1)
    inv = torch.where(empty, 0.0, 1 / total)
    return torch.where(empty[:, None], 0.0, e @ v * inv[:, None]), torch.where(empty, 0.0, m), inv


def test_merge_keeps_nan_rows_nan_and_rows_with_no_key_zero():
    g = torch.Generator().manual_seed(58)
    s = torch.randn(6, 8, generator=g, dtype=torch.float64) * 3
    v = torch.randn(8, 5, generator=g, dtype=torch.float64)
    s[1, 4:] = -math.inf  # row 1 sees keys of the first unit alone
    s[2, :4] = -math.inf  # row 2 those of the second alone
    s[3] = -math.inf      # row 3 sees no key
    s[4, 6] = math.nan    # a NaN in the second unit (m_b finite, 1/l_b NaN)
    s[5, 1] = math.nan    # one in the first
    merge = _RowMerge(s, v.shape[-1], torch.float64)
    for keys in (slice(0, 4), slice(4, 8)):
        merge.add(*unit(s[:, keys], v[keys]))
    out, row_max, inv_sum = merge.result()
    whole = torch.softmax(s[:3], -1) @ v
    assert rel_err(out[:3], whole) <= EXACT
    assert rel_err(row_max[:3], s[:3].amax(-1)) <= EXACT
    assert rel_err(inv_sum[:3], 1 / torch.exp(s[:3] - s[:3].amax(-1, keepdim=True)).sum(-1)) <= EXACT
    assert torch.equal(out[3], torch.zeros(5, dtype=torch.float64))
    assert (row_max[3], inv_sum[3]) == (0.0, 0.0)
    for row in (4, 5):
        assert out[row].isnan().all() and inv_sum[row].isnan(), row
