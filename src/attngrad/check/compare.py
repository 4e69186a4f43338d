"""Error figures and tolerances: how one tensor is judged against a reference."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Relative-error bars (max|ours - ref| / max|ref|). In float64 the reference is PyTorch's
# autograd (expect 1e-16..1e-13) and central differences with step 1e-6 (truncation
# ~eps^2 and rounding ~1e-16/eps put them near 1e-9). In float32 ours is compared with the
# float64 truth: about a hundred float32 ulps (eps32 = 1.2e-7) of accumulated rounding
# (the worst seen at the default sizes is 8e-7).
TOLERANCES = {
    "float64": {"autograd": 1e-12, "finite_diff": 1e-7},
    "float32": {"autograd": 1e-5, "finite_diff": 1e-5},
}


@dataclass(frozen=True)
class ErrorFigure:
    max_abs: float  # max |ours - ref|
    rel: float  # max |ours - ref| / max |ref| (max_abs when ref is all zeros)


def error_figure(ours: np.ndarray, ref: np.ndarray, *, floor: float = 0.0) -> ErrorFigure:
    """The error of `ours` against `ref`: max|ours - ref| / max(max|ref|, floor).

    `floor` is for a tensor that is zero in exact arithmetic (such as the gradient of the
    key bias): its reference is rounding noise, so it is measured against the scale of the
    other gradients of the same computation instead. NaN anywhere is an error.
    """
    ours = np.asarray(ours, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if ours.shape != ref.shape:
        raise ValueError(f"shapes differ: ours {ours.shape}, reference {ref.shape}")
    if ours.size == 0:
        return ErrorFigure(0.0, 0.0)
    if np.isnan(ours).any() or np.isnan(ref).any():
        return ErrorFigure(float("nan"), float("nan"))
    max_abs = float(np.max(np.abs(ours - ref)))
    scale = max(float(np.max(np.abs(ref))), floor)
    return ErrorFigure(max_abs, max_abs / scale if scale > 0 else max_abs)


def within(figure: ErrorFigure | None, tol: float) -> bool:
    """True when the figure is within `tol` (NaN never passes); a skipped column (None)
    does not fail the row."""
    return figure is None or bool(figure.rel <= tol)
