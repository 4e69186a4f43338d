import numpy as np

from attngrad.check import error_figure, finite_difference_gradients


def test_gradient_of_a_known_function(rng):
    x, w = rng.standard_normal((3, 4)), rng.standard_normal(4)
    dout = rng.standard_normal(3)

    def forward(a):
        return np.tanh(a["x"]) @ a["w"]

    numeric = finite_difference_gradients(forward, {"x": x, "w": w}, dout)
    exact_x = np.outer(dout, w) * (1 - np.tanh(x) ** 2)
    exact_w = np.tanh(x).T @ dout
    assert error_figure(numeric["x"], exact_x).rel < 1e-8
    assert error_figure(numeric["w"], exact_w).rel < 1e-8


def test_names_select_inputs_and_inputs_are_left_unchanged(rng):
    x, w = rng.standard_normal(3), rng.standard_normal(3)
    before = x.copy()
    grads = finite_difference_gradients(lambda a: a["x"] * a["w"], {"x": x, "w": w}, np.ones(3), names=["w"])
    assert list(grads) == ["w"]
    np.testing.assert_array_equal(x, before)
    np.testing.assert_allclose(grads["w"], x, rtol=1e-8)  # rounding: ~1e-16 / step


def test_error_figure():
    fig = error_figure(np.array([1.0, 2.0]), np.array([1.0, 4.0]))
    assert fig.max_abs == 2.0 and fig.rel == 0.5
    assert np.isnan(error_figure(np.array([np.nan]), np.array([1.0])).rel)
    assert error_figure(np.zeros(2), np.zeros(2)).rel == 0.0
    # a reference that is exactly zero is measured against the floor given
    assert error_figure(np.array([1e-15]), np.array([-1e-15]), floor=1.0).rel == 2e-15
