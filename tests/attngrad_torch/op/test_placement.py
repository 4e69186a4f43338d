"""A call on a part of a larger one (`dropout.Placement`): a ring step's rows and keys, an
all-to-all's head group. Its dropout masks are the whole's, and its forward and backward,
given the whole rows' statistics and output, are the whole's restricted to it, in both
implementations (what `attngrad.torch.distributed` builds on)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attngrad.torch import list_backends, use_backend  # noqa: E402
from attngrad.torch.op import dropout  # noqa: E402
from attngrad.torch.op import ops as op  # noqa: E402
from attngrad.torch.op.dropout import Placement  # noqa: E402

IMPLEMENTATIONS = [b.name for b in list_backends() if b.available]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_tiles_keep_scale_is_the_wholes_at_its_offsets(dtype):
    whole = dropout.keep_scale_torch(torch.empty(2, 6, 40, 50, dtype=dtype), 99, 0, 0.4)
    part = Placement(99, row_offset=7, key_offset=11, head_offset=2)
    ours = dropout.keep_scale_into(torch.empty(2, 3, 20, 30, dtype=dtype), part, 0, 0.4)
    assert torch.equal(ours, whole[:, 2:5, 7:27, 11:41])
    assert bool(whole[1, 4, 9, 13] > 0) == dropout.keep_int(99, 1, 4, 9, 13, 0.4)
    # with row and key offsets alone, the compiled tiles' generator fills it: the same bits
    rows_keys = Placement(99, row_offset=7, key_offset=11)
    assert torch.equal(dropout.keep_scale_into(torch.empty(2, 6, 20, 30, dtype=dtype), rows_keys, 0, 0.4), whole[:, :, 7:27, 11:41])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_head_group_draws_the_wholes_masks(implementation):
    """An all-to-all rank's call on heads 2..4 of 6 (its head offset in the seed) gives the
    whole call's output for those heads, dropout included, in both implementations."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 6, 30, 8, generator=g, dtype=torch.float64) for _ in range(3))
    with use_backend(implementation):
        whole, _, _ = op.attention_forward(q, k, v, None, None, None, torch.tensor(7), 0, 0.3, 0.0, 0.4)
        part, _, _ = op.attention_forward(q[:, 2:5], k[:, 2:5], v[:, 2:5], None, None, None,
                                          Placement(7, head_offset=2).tensor(), 0, 0.3, 0.0, 0.4)
    assert _rel(part, whole[:, 2:5]) < 1e-15
    other, _, _ = op.attention_forward(q[:, 2:5], k[:, 2:5], v[:, 2:5], None, None, None, torch.tensor(7), 0, 0.3, 0.0, 0.4)
    assert _rel(other, whole[:, 2:5]) > 1e-3  # without the offset, other masks: the test can tell


def _parts(q, k, v, mask, causal, dropout_p, bias=None):
    """Rows 5:17 of the whole, against keys 0:9, 9:20 and 20:L as three calls; then the
    statistics merged as `ring_passes` merges them."""
    rows, cuts = slice(5, 17), (0, 9, 20, k.shape[2])
    parts = []
    for a, b in zip(cuts, cuts[1:]):
        diagonal = None if causal is None else causal + rows.start - a
        part = Placement(1234, rows.start, a, 0, 1).tensor()
        m = None if mask is None else mask[..., rows, a:b]
        bb = None if bias is None else bias[..., rows, a:b]
        parts.append(((a, b), part, diagonal, m, bb,
                      op.attention_forward(q[:, :, rows], k[:, :, a:b], v[:, :, a:b], m, bb, None, part, diagonal, 0.4, 0.0,
                                           dropout_p)))
    return rows, parts


# Triton's interpreter takes about 2 s a case: there, the plain case and the one with both options
@pytest.mark.parametrize("implementation, causal, dropout_p", [
    (implementation, causal, dropout_p) for implementation in IMPLEMENTATIONS for causal in (None, 3)
    for dropout_p in (0.0, 0.3) if implementation != "triton" or (causal is None) == (dropout_p == 0.0)])
def test_parts_of_rows_and_keys_add_up_to_the_whole(implementation, causal, dropout_p):
    g = torch.Generator().manual_seed(3)
    B, H, L, E = 2, 3, 28, 8
    q, k, v, dout = (torch.randn(B, H, L, E, generator=g, dtype=torch.float64) for _ in range(4))
    mask = torch.rand(B, 1, L, L, generator=g) > 0.3
    mask[:, :, 6, :] = False
    mask[:, :, 6, 12] = True  # a row whose one key is in the second part
    mask[:, :, 7, :] = False
    mask[:, :, 7, [2, 15]] = True  # a row with one key in each of two parts
    bias = torch.randn(B, H, L, L, generator=g, dtype=torch.float64)
    with use_backend(implementation):
        seed = torch.tensor(1234)
        out, row_max, inv_sum = op.attention_forward(q, k, v, mask, bias, None, seed, causal, 0.4, 0.0, dropout_p)
        whole = op.attention_backward(q, k, v, mask, bias, None, seed, causal, 0.4, 0.0, dropout_p, dout=dout, out=out,
                                      row_max=row_max, inv_sum=inv_sum, bias_grad=True)
        rows, parts = _parts(q, k, v, mask, causal, dropout_p, bias)
        dq = torch.zeros_like(q[:, :, rows])
        for (a, b), part, diagonal, m, bb, _ in parts:
            dq_p, _, _, db_p, _ = op.attention_backward(
                q[:, :, rows], k[:, :, a:b], v[:, :, a:b], m, bb, None, part, diagonal, 0.4, 0.0, dropout_p,
                dout=dout[:, :, rows], out=out[:, :, rows], row_max=row_max[:, :, rows], inv_sum=inv_sum[:, :, rows],
                bias_grad=True)
            dq += dq_p
            assert _rel(db_p, whole[3][:, :, rows, a:b]) < 1e-13
    # the rows' dq is the whole's (dk, dv need every row: a ring adds them up round the ring)
    assert _rel(dq, whole[0][:, :, rows]) < 1e-13


def test_the_higher_passes_refuse_a_part_of_the_rows():
    q = torch.randn(1, 1, 4, 2, dtype=torch.float64)
    _, row_max, inv_sum = op.attention_forward(q, q, q, None, None, None, torch.tensor(0), None, 1.0, 0.0, 0.0)
    part = Placement(0, 0, 0, 0, 1).tensor()
    with pytest.raises(ValueError, match="attention_jvp needs each row's whole keys"):
        op.attention_jvp(q, q, q, None, None, None, part, None, 1.0, 0.0, 0.0, row_max=row_max, inv_sum=inv_sum, tq=q,
                         tk=None, tv=None, tbias=None)
