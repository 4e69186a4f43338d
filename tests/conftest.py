"""Shared helpers: random data, the error figure, and PyTorch as the oracle."""

from __future__ import annotations

import os

# The Triton backend's tests run its kernels in Triton's interpreter, on CPU tensors. The
# switch must come before anything imports triton (PyTorch may), so it is set here, first;
# on a GPU, TRITON_INTERPRET=0 makes the `gpu` tests compile them instead.
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest

from attngrad.check.compare import error_figure

# float64 bar against PyTorch autograd: max|ours - ref| / max|ref| (README, `attngrad check`).
EXACT = 1e-12


def rel_err(ours, ref) -> float:
    """max|ours - ref| / max|ref|, NaN-aware (NaN never compares below a bar)."""
    if hasattr(ref, "detach"):
        ref = ref.detach().numpy()
    if hasattr(ours, "detach"):
        ours = ours.detach().numpy()
    return error_figure(np.asarray(ours), np.asarray(ref)).rel


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261122)


def assert_all_close(ours: dict, theirs: dict, *, zeros=frozenset(), floor_fraction: float = 0.0, bar: float = EXACT) -> None:
    """Judge several gradients of one computation (numpy arrays or tensors) against a reference.

    scale = the largest reference magnitude over all of them. A name in `zeros` is 0 in exact
    arithmetic, so both sides hold rounding noise: it is measured against `scale`. Otherwise
    the error is relative to max(max|ref|, floor_fraction * scale); the property tests set
    floor_fraction = 1e-3 because the tiny shapes they draw can make a whole tensor the result
    of cancellation, which no two summation orders reproduce to 1e-12 of its own size.
    """
    ours = {k: v.detach().numpy() if hasattr(v, "detach") else np.asarray(v) for k, v in ours.items()}
    theirs = {k: v.detach().numpy() if hasattr(v, "detach") else np.asarray(v) for k, v in theirs.items()}
    assert ours.keys() == theirs.keys()
    scale = max((float(np.abs(v).max()) for v in theirs.values() if v.size), default=0.0)
    for name in ours:
        floor = scale if name in zeros else floor_fraction * scale
        figure = error_figure(ours[name], theirs[name], floor=floor)
        assert figure.rel <= bar, f"{name}: {figure}"
