"""Shared helpers: random data, the error figure, and PyTorch as the oracle."""

from __future__ import annotations

import numpy as np
import pytest

from attngrad.check.compare import error_figure

# float64 bar against PyTorch autograd (GUIDE section 1).
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
