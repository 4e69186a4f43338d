"""Central finite differences of any function, driven by a random upstream gradient.

For f: inputs -> out and an upstream gradient dout, the gradient of the scalar
L = sum(f(inputs) * dout) with respect to each element x_i is approximated by
    (L(x_i + h) - L(x_i - h)) / (2 h),
which is what a backward pass must return for the same dout. A random dout, not
out.sum(), makes every output element matter with its own weight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

Forward = Callable[[Mapping[str, np.ndarray]], np.ndarray]


def finite_difference_gradients(
    forward: Forward,
    inputs: Mapping[str, np.ndarray],
    dout: np.ndarray,
    *,
    step: float = 1e-6,
    names: Iterable[str] | None = None,
) -> dict[str, np.ndarray]:
    """d sum(forward(inputs) * dout) / d inputs[name], element by element, in float64.

    `forward` takes a mapping of named float64 arrays and returns the output; `names`
    picks which inputs to differentiate (default: all). Costs 2 forward calls per element.
    """
    point = {name: np.array(value, dtype=np.float64) for name, value in inputs.items()}
    dout = np.asarray(dout, dtype=np.float64)

    def loss() -> float:
        return float(np.sum(forward(point) * dout))

    grads = {}
    for name in inputs if names is None else names:
        x = point[name]
        grad = np.zeros_like(x)
        flat_x, flat_g = x.reshape(-1), grad.reshape(-1)  # views into x and grad
        for i in range(flat_x.size):
            saved = flat_x[i]
            flat_x[i] = saved + step
            plus = loss()
            flat_x[i] = saved - step
            minus = loss()
            flat_x[i] = saved
            flat_g[i] = (plus - minus) / (2.0 * step)
        grads[name] = grad
    return grads


def finite_difference_jacobian(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray, *, step: float = 1e-6) -> np.ndarray:
    """Full Jacobian d fn(x) / d x by central differences: shape fn(x).shape + x.shape, float64."""
    x = np.array(x, dtype=np.float64)
    out_shape = np.shape(fn(x))
    columns = []
    flat = x.reshape(-1)  # a view into x
    for i in range(flat.size):
        saved = flat[i]
        flat[i] = saved + step
        plus = np.asarray(fn(x), dtype=np.float64)
        flat[i] = saved - step
        minus = np.asarray(fn(x), dtype=np.float64)
        flat[i] = saved
        columns.append((plus - minus) / (2.0 * step))
    return np.stack(columns, axis=-1).reshape(out_shape + x.shape)
