"""Full Jacobians from the closed-form backward equal autograd's, entry by entry."""

import numpy as np
import pytest

from attngrad import reference as ref

from ..conftest import EXACT, rel_err

torch = pytest.importorskip("torch")
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402


@pytest.mark.parametrize("wrt", ["query", "key", "value", "bias"])
def test_sdpa_jacobian_matches_autograd(rng, wrt):
    q, k, v = rng.standard_normal((2, 2, 3, 4)), rng.standard_normal((2, 1, 5, 4)), rng.standard_normal((2, 1, 5, 3))
    bias = rng.standard_normal((2, 3, 5))
    inputs = {"query": q, "key": k, "value": v, "bias": bias}
    jac = ref.sdpa_jacobian(q, k, v, wrt=wrt, bias=bias, enable_gqa=True)

    def f(t):
        args = {n: torch.tensor(a) for n, a in inputs.items()}
        args[wrt] = t
        with sdpa_kernel(SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(
                args["query"], args["key"], args["value"], attn_mask=args["bias"], enable_gqa=True
            )

    auto = torch.autograd.functional.jacobian(f, torch.tensor(inputs[wrt]))
    assert jac.shape == (2, 2, 3, 3) + inputs[wrt].shape
    assert rel_err(jac, auto) < EXACT


def test_selection_is_a_slice_of_the_full_jacobian(rng):
    q, k, v = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 2, 4, 4)), rng.standard_normal((1, 2, 4, 2))
    full = ref.sdpa_jacobian(q, k, v, wrt="query")
    column = ref.sdpa_jacobian(q, k, v, wrt="query", select=np.s_[0, 1, :, 2])
    assert np.array_equal(column, full[..., 0, 1, :, 2])


@pytest.mark.parametrize("wrt", ["query", "key", "w_q", "b_v", "w_o", "attn_mask"])
def test_mha_jacobian_matches_autograd(rng, wrt):
    params = ref.MHAParams.random(4, 2, kdim=3, vdim=3, rng=rng)
    x, memory = rng.standard_normal((1, 2, 4)), rng.standard_normal((1, 3, 3))
    bias = rng.standard_normal((2, 3))
    jac = ref.mha_jacobian(x, memory, memory, params, 2, wrt=wrt, attn_mask=bias)
    names = dict(params.items())

    def f(t):
        p = {n: torch.tensor(a) for n, a in names.items()}
        xq, mk, am = torch.tensor(x), torch.tensor(memory), torch.tensor(bias)
        if wrt == "query":
            xq = t
        elif wrt == "key":
            mk = t
        elif wrt == "attn_mask":
            am = t
        else:
            p[wrt] = t
        heads = lambda y: y.unflatten(-1, (2, -1)).transpose(1, 2)  # noqa: E731
        qh = heads(torch.nn.functional.linear(xq, p["w_q"], p["b_q"]))
        kh = heads(torch.nn.functional.linear(mk, p["w_k"], p["b_k"]))
        vh = heads(torch.nn.functional.linear(torch.tensor(memory), p["w_v"], p["b_v"]))
        o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=am)
        return torch.nn.functional.linear(o.transpose(1, 2).reshape(1, 2, 4), p["w_o"], p["b_o"])

    start = {"query": x, "key": memory, "attn_mask": bias}.get(wrt, names.get(wrt))
    auto = torch.autograd.functional.jacobian(f, torch.tensor(start))
    assert rel_err(jac, auto) < EXACT


def test_bad_wrt():
    q = np.ones((1, 1, 2, 2))
    with pytest.raises(ValueError, match="wrt must be one of"):
        ref.sdpa_jacobian(q, q, q, wrt="scores")
    with pytest.raises(ValueError, match="no gradient with respect to 'bias'"):
        ref.sdpa_jacobian(q, q, q, wrt="bias")
    params = ref.MHAParams.random(2, 1)
    with pytest.raises(ValueError, match="wrt must be query"):
        ref.mha_jacobian(np.ones((1, 2, 2)), np.ones((1, 2, 2)), np.ones((1, 2, 2)), params, 1, wrt="w_x")
