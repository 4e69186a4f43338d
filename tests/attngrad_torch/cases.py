"""Cases that several test modules share: `calls`, a hypothesis strategy of `AttentionCall`s
with their tangents over every score option (the tiles' fused forward and JVP are tested on
it, and Triton's against the tiles'), drawn from float64 normal values (`_randn`)."""

import pytest

torch = pytest.importorskip("torch")

from hypothesis import strategies as st  # noqa: E402

from .conftest import make_call  # noqa: E402


def _randn(*shape, g, transposed=False):
    if transposed:  # the same values' layout with its last two axes swapped: non-contiguous
        return torch.randn(*shape[:-2], shape[-1], shape[-2], generator=g, dtype=torch.float64).transpose(-1, -2)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


@st.composite
def calls(draw):
    """A call with its tangents: B, H, Lq != Lk, GQA, every score option, rows that see one
    key or none (a mask's rows), transposed inputs."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    b, kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    len_q, len_k, dim = draw(st.integers(1, 40)), draw(st.integers(1, 45)), draw(st.sampled_from([4, 16, 17]))
    transposed = draw(st.booleans())
    q = _randn(b, kv_heads * group, len_q, dim, g=g, transposed=transposed)
    k = _randn(b, kv_heads, len_k, dim, g=g, transposed=transposed)
    v = _randn(b, kv_heads, len_k, dim + 3, g=g)
    mask = None
    if draw(st.booleans()):
        mask = torch.rand(b, 1, len_q, len_k, generator=g) > 0.3
        mask[..., 0, :] = False  # a row that sees no key
        if len_q > 1:
            mask[..., 1, :] = False
            mask[..., 1, len_k // 2] = True  # a row that sees one
    bias = _randn(1, kv_heads * group, len_q, len_k, g=g) if draw(st.booleans()) else None
    causal = draw(st.sampled_from([None, 0, len_k - len_q]))
    call = make_call(q, k, v, mask=mask, bias=bias, causal=causal, seed=torch.tensor(draw(st.integers(0, 99))),
                     softcap=draw(st.sampled_from([0.0, 2.5])), dropout_p=draw(st.sampled_from([0.0, 0.25])),
                     sink=draw(st.booleans()))
    tangents = dict(tq=_randn(*q.shape, g=g), tk=_randn(*k.shape, g=g), tv=_randn(*v.shape, g=g),
                    tbias=None if bias is None else _randn(*bias.shape, g=g))
    for name in draw(st.sets(st.sampled_from(sorted(tangents)))):  # an absent tangent is zero
        tangents[name] = None
    return call, tangents
