"""Nested jagged tensors: `scaled_dot_product_attention` on (B, H, j, E) jagged q, k, v equals
PyTorch's nested SDPA (float64, 1e-12), outputs and gradients, with self- and
cross-attention lengths, GQA, and in every backend; causal within each sequence (which
PyTorch's CPU nested SDPA refuses) equals per-sequence dense calls (PyTorch's jagged
tensors take no double backward, attngrad's op under them aside);
`MultiheadAttention` trains on jagged (N, j, E) inputs as torch's module does on each
sequence alone; what jagged inputs cannot take is refused by name.
"""

import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from attngrad.torch import MultiheadAttention, attention, scaled_dot_product_attention  # noqa: E402
from attngrad.torch.arguments import ATTENTION  # noqa: E402
from attngrad.torch.nested import PER_SEQUENCE  # noqa: E402

from ..conftest import assert_all_close  # noqa: E402

E = 8
gen = torch.Generator().manual_seed(5)


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nested's prototype notices
        yield


def jagged(lengths, heads):
    """(B, H, j, E): a (B, j, H, E) jagged tensor of float64 values, transposed, a leaf."""
    rows = torch.nested.nested_tensor([torch.randn(n, heads, E, generator=gen, dtype=torch.float64) for n in lengths],
                                      layout=torch.jagged, requires_grad=True)
    return rows, rows.transpose(1, 2)


def value_grads(out, leaves, seed=9):
    values = out.transpose(1, 2).values()
    up = torch.randn(values.shape, generator=torch.Generator().manual_seed(seed), dtype=values.dtype)
    grads = torch.autograd.grad(values, leaves, up)
    return dict(out=values, **{f"d{i}": g.values() for i, g in enumerate(grads)})


@pytest.mark.parametrize("kv_lengths,heads,kv_heads", [(None, 2, 2), ([4, 1, 7], 2, 2), (None, 4, 2)],
                         ids=["self", "cross", "gqa"])
def test_jagged_sdpa_equals_pytorchs_nested_sdpa(kv_lengths, heads, kv_heads, backend):
    q_lengths = [3, 6, 2]
    kv_lengths = kv_lengths or q_lengths
    (q_rows, q), (k_rows, k), (v_rows, v) = jagged(q_lengths, heads), jagged(kv_lengths, kv_heads), \
        jagged(kv_lengths, kv_heads)
    gqa = heads != kv_heads
    ours = value_grads(scaled_dot_product_attention(q, k, v, enable_gqa=gqa), (q_rows, k_rows, v_rows))
    if gqa:  # PyTorch's nested SDPA takes no GQA: its heads repeated
        k, v = (t.transpose(1, 2).repeat_interleave(2, dim=2).transpose(1, 2) for t in (k, v))
    theirs = value_grads(F.scaled_dot_product_attention(q, k, v), (q_rows, k_rows, v_rows))
    assert_all_close(ours, theirs)


def test_causal_equals_each_sequence_alone():
    """Causal within each sequence (top-left), with a soft cap: output and gradients."""
    lengths = [5, 2, 7]
    (q_rows, q), (k_rows, k), (v_rows, v) = (jagged(lengths, 2) for _ in range(3))
    ours = value_grads(attention(q, k, v, is_causal=True, softcap=3.0), (q_rows, k_rows, v_rows))
    pieces = [[x.detach().clone().requires_grad_() for x in t.values().split(lengths)]
              for t in (q_rows, k_rows, v_rows)]  # each (j, H, E)
    outs = [attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1), is_causal=True,
                      softcap=3.0).transpose(0, 1) for qi, ki, vi in zip(*pieces)]
    out = torch.cat(outs)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    grads = torch.autograd.grad(out, [x for parts in pieces for x in parts], up)
    n = len(lengths)
    theirs = dict(out=out, **{f"d{i}": torch.cat(grads[i * n:(i + 1) * n]) for i in range(3)})
    assert_all_close(ours, theirs)


@pytest.mark.parametrize("is_causal", [False, True])
def test_multihead_attention_trains_on_jagged_inputs(is_causal):
    """Outputs and every parameter's gradient equal torch's module run on each sequence alone."""
    ours = MultiheadAttention(16, 2, batch_first=True, dtype=torch.float64)
    theirs = torch.nn.MultiheadAttention(16, 2, batch_first=True, dtype=torch.float64)
    theirs.load_state_dict(ours.state_dict())
    pieces = [torch.randn(n, 16, generator=gen, dtype=torch.float64) for n in (4, 1, 6)]
    x = torch.nested.nested_tensor(pieces, layout=torch.jagged)
    out, weights = ours(x, x, x, need_weights=False, is_causal=is_causal)
    assert weights is None
    up = [torch.randn(n, 16, generator=gen, dtype=torch.float64) for n in (4, 1, 6)]
    (out.values() * torch.cat(up)).sum().backward()
    total, outs = 0.0, []
    for piece, u in zip(pieces, up):
        mask = torch.ones(len(piece), len(piece), dtype=torch.bool).triu(1) if is_causal else None
        o, _ = theirs(piece[None], piece[None], piece[None], need_weights=False, attn_mask=mask)
        outs.append(o[0])
        total = total + (o[0] * u).sum()
    total.backward()
    mine = dict(out=out.values(), **{n: p.grad for n, p in ours.named_parameters()})
    reference = dict(out=torch.cat(outs), **{n: p.grad for n, p in theirs.named_parameters()})
    assert_all_close(mine, reference)


def test_what_jagged_inputs_cannot_take_is_named():
    assert PER_SEQUENCE < ATTENTION.names  # declared options, of which the others are refused
    (q_rows, q), (_, k) = jagged([3, 4], 2), jagged([3, 4, 5], 2)
    with pytest.raises(ValueError, match="attn_bias, key_padding"):  # every one given, in declared order
        attention(q, q, q, key_padding=torch.tensor([3, 4]), attn_bias=torch.zeros(1), attn_mask=None)
    with pytest.raises(ValueError, match="attn_mask"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="window"):
        attention(q, q, q, window=(2, None))
    with pytest.raises(ValueError, match="bottom_right"):
        attention(q, q, q, is_causal="bottom_right")
    with pytest.raises(ValueError, match="as many as query's"):
        attention(q, k, k)
    with pytest.raises(TypeError, match="key must be a nested jagged tensor"):
        attention(q, torch.randn(2, 2, 4, E, dtype=torch.float64), torch.randn(2, 2, 4, E, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\(B, H, j, E\)"):
        attention(q_rows, q_rows, q_rows)
    module = MultiheadAttention(16, 2, batch_first=True, dtype=torch.float64)
    x = torch.nested.nested_tensor([torch.randn(2, 16, dtype=torch.float64)], layout=torch.jagged)
    with pytest.raises(ValueError, match="need_weights"):
        module(x, x, x)
    with pytest.raises(ValueError, match="batch_first"):
        MultiheadAttention(16, 2, dtype=torch.float64)(x, x, x, need_weights=False)
