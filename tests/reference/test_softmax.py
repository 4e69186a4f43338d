import numpy as np
import pytest

from attngrad.check import finite_difference_gradients
from attngrad.reference import softmax_backward, softmax_forward

from ..conftest import rel_err


def test_rows_sum_to_one_and_match_the_definition(rng):
    scores = rng.standard_normal((3, 4, 6))
    probs, _ = softmax_forward(scores)
    expected = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
    assert rel_err(probs, expected) < 1e-15
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=0, atol=1e-15)


@pytest.mark.parametrize("magnitude", [1e2, 1e3, 1e4])
def test_stable_for_large_scores(rng, magnitude):
    scores = rng.uniform(-magnitude, magnitude, size=(5, 7))
    probs, cache = softmax_forward(scores)
    assert np.isfinite(probs).all()
    shifted = scores - scores.max(-1, keepdims=True)  # the same softmax, computed safely by hand
    expected = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)
    np.testing.assert_allclose(probs, expected, rtol=1e-12, atol=0)
    dscores = softmax_backward(rng.standard_normal(scores.shape), cache)
    assert np.isfinite(dscores).all()


def test_masked_entries_are_exactly_zero_and_the_rest_renormalise(rng):
    scores = rng.standard_normal((4, 6))
    mask = rng.random((4, 6)) > 0.4
    mask[:, 0] = True
    probs, cache = softmax_forward(scores, mask)
    assert (probs[~mask] == 0.0).all()
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-15)
    # equal to the softmax of the allowed entries alone
    for row in range(4):
        kept = scores[row, mask[row]]
        assert rel_err(probs[row, mask[row]], np.exp(kept) / np.exp(kept).sum()) < 1e-15
    dscores = softmax_backward(rng.standard_normal(scores.shape), cache)
    assert (dscores[~mask] == 0.0).all()


def test_minus_inf_scores_are_excluded_like_a_mask(rng):
    scores = rng.standard_normal((3, 5))
    scores[1, 2] = -np.inf
    probs, _ = softmax_forward(scores)
    assert probs[1, 2] == 0.0 and np.isfinite(probs).all()


def test_fully_masked_row_gives_zero_output_and_zero_gradient(rng):
    scores = rng.standard_normal((3, 5))
    mask = np.ones((3, 5), dtype=bool)
    mask[1] = False
    scores[2] = -np.inf  # a row excluded by the scores themselves
    probs, cache = softmax_forward(scores, mask)
    assert (probs[1] == 0).all() and (probs[2] == 0).all()
    dscores = softmax_backward(rng.standard_normal(scores.shape), cache)
    assert np.isfinite(dscores).all()
    assert (dscores[1] == 0).all() and (dscores[2] == 0).all()


def test_backward_equals_the_explicit_jacobian(rng):
    """dS = P * (dP - rowsum(dP * P)) is J^T dP with J = Diag(P) - P P^T."""
    scores = rng.standard_normal((4, 6))
    dprobs = rng.standard_normal((4, 6))
    probs, cache = softmax_forward(scores)
    dscores = softmax_backward(dprobs, cache)
    for row in range(4):
        p = probs[row]
        jacobian = np.diag(p) - np.outer(p, p)
        assert rel_err(dscores[row], jacobian.T @ dprobs[row]) < 1e-14


def test_backward_against_finite_differences(rng):
    scores = rng.standard_normal((2, 3, 5))
    mask = rng.random((2, 3, 5)) > 0.3
    mask[..., 0] = True
    dprobs = rng.standard_normal(scores.shape)
    _, cache = softmax_forward(scores, mask)
    numeric = finite_difference_gradients(lambda x: softmax_forward(x["s"], mask)[0], {"s": scores}, dprobs)["s"]
    assert rel_err(softmax_backward(dprobs, cache), numeric) < 1e-8
