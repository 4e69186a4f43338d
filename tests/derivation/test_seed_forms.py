"""The seeds' own forms equal attngrad's efficient gradients (float64, 1e-12)."""

import numpy as np
import pytest

from attngrad import reference as ref
from attngrad.check import finite_difference_jacobian
from attngrad.derivation import chain_rule, element_jacobians
from attngrad.derivation.head_selector import block_selector, head_selector_gradients

from ..conftest import EXACT, rel_err


@pytest.mark.parametrize("heads,len_q,len_k,batch", [(3, 4, 6, 2), (1, 5, 5, 1), (4, 2, 3, 3)])
def test_head_selector_form_equals_the_efficient_gradient(rng, heads, len_q, len_k, batch):
    width = 4 * heads
    params = ref.MHAParams.random(width, heads, bias=False, rng=rng)
    x, memory = rng.standard_normal((batch, len_q, width)), rng.standard_normal((batch, len_k, width))
    out, cache = ref.encoder_decoder_attention_forward(x, memory, params, heads)
    dout = rng.standard_normal(out.shape)
    g = ref.encoder_decoder_attention_backward(dout, cache)
    blog = head_selector_gradients(x, memory, params.w_q.T, params.w_k.T, params.w_v.T, params.w_o.T, heads, dout)
    for ours, theirs in zip(blog, (g.params.w_q, g.params.w_k, g.params.w_v, g.params.w_o)):
        assert rel_err(ours, theirs.T) < EXACT


def test_block_selector_picks_one_block(rng):
    a = rng.standard_normal((3, 4 * 5))
    assert np.array_equal(a @ block_selector(2, 4, 5).T, a[:, 10:15])


@pytest.mark.parametrize("dim,key_dim,length", [(1, 1, 4), (1, 2, 5), (3, 2, 4), (4, 4, 3)])
def test_chain_rule_sums_equal_the_efficient_gradient(rng, dim, key_dim, length):
    x, x_prime = rng.standard_normal((2, length, dim))
    w_k, w_q = rng.standard_normal((2, dim, key_dim))
    g = rng.standard_normal((length, dim))
    out, cache = ref.sdpa_forward((x_prime @ w_q)[None, None], (x @ w_k)[None, None], x[None, None], scale=1.0)
    y, p = chain_rule.forward(x, x_prime, w_k, w_q)
    assert rel_err(y, out[0, 0]) < EXACT
    np.testing.assert_allclose(p.sum(axis=0), 1.0, atol=1e-15)  # a column softmax
    dq, dk, dv, _ = ref.sdpa_backward(g[None, None], cache)
    assert rel_err(chain_rule.literal_dx_prime(x, x_prime, w_k, w_q, g), dq[0, 0] @ w_q.T) < EXACT
    assert rel_err(chain_rule.literal_dx(x, x_prime, w_k, w_q, g), dk[0, 0] @ w_k.T + dv[0, 0]) < EXACT


def test_self_attention_gradient_is_the_sum_of_both_roles(rng):
    x = rng.standard_normal((5, 3))
    w_k, w_q = rng.standard_normal((2, 3, 2))
    g = rng.standard_normal((5, 3))
    out, cache = ref.sdpa_forward((x @ w_q)[None, None], (x @ w_k)[None, None], x[None, None], scale=1.0)
    dq, dk, dv, _ = ref.sdpa_backward(g[None, None], cache)
    efficient = dq[0, 0] @ w_q.T + dk[0, 0] @ w_k.T + dv[0, 0]
    assert rel_err(chain_rule.literal_self_attention_dx(x, w_k, w_q, g), efficient) < EXACT


def test_graph_paths_are_the_terms_of_equations_3_and_4():
    assert chain_rule.paths("x'", "f") == [["x'", "q", "p", "y", "f"]]
    assert sorted(map(len, chain_rule.paths("x", "f"))) == [3, 5]
    assert chain_rule.paths("W_K", "f") == [["W_K", "q", "p", "y", "f"]]
    assert chain_rule.paths("f", "x") == []


@pytest.mark.parametrize("n,m,k", [(4, 3, 5), (2, 5, 1), (3, 3, 3)])
def test_element_jacobians_equal_autograd_and_finite_differences(rng, n, m, k):
    torch = pytest.importorskip("torch")
    x, y = rng.standard_normal((2, n, m))
    a, b = rng.standard_normal((2, k, n))
    c = rng.standard_normal((m, n))
    lam = 0.8
    jx, jy = element_jacobians.jacobian_x(x, y, a, b, c, lam), element_jacobians.jacobian_y(x, y, a, b, c, lam)
    assert rel_err(element_jacobians.literal_jacobian_x(x, y, a, b, c, lam), jx) < EXACT
    assert rel_err(element_jacobians.literal_jacobian_y(x, y, a, b, c, lam), jy) < EXACT

    def f(tx, ty):
        return torch.softmax(lam * tx.T @ torch.tensor(a).T @ torch.tensor(b) @ ty, dim=1) @ torch.tensor(c) @ tx

    auto_x, auto_y = torch.autograd.functional.jacobian(f, (torch.tensor(x), torch.tensor(y)))
    assert rel_err(jx, auto_x) < EXACT and rel_err(jy, auto_y) < EXACT
    fd_x = finite_difference_jacobian(lambda z: element_jacobians.forward(z, y, a, b, c, lam)[0], x)
    assert rel_err(jx, fd_x) < 1e-7
