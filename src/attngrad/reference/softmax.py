"""Row softmax with an optional mask, as a forward/backward pair.

Shapes: S (..., N) scores; mask (..., N) boolean, True = the entry takes part; P like S.

Forward, per row s with allowed set A:
    m   = max_{j in A} s_j                      (0 if A is empty)
    e_j = exp(s_j - m) if j in A else 0
    P_j = e_j / sum_j e_j                       (0 everywhere if A is empty)
Subtracting the row maximum keeps exp() in range for any finite scores (|s| up to 1e4
and far beyond), and masked entries never enter exp(), so they are exactly 0.

Backward: the Jacobian of one row is dP/ds = Diag(P) - P P^T, so the vector-Jacobian
product is dS = P * (dP - sum_j(dP_j P_j)); it needs no explicit N x N Jacobian. Masked
entries have P = 0 and so get dS = 0; an empty row has P = 0 everywhere and gets 0.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class SoftmaxCache(NamedTuple):
    probs: np.ndarray  # P, (..., N)


def softmax_forward(scores: np.ndarray, mask: np.ndarray | None = None) -> tuple[np.ndarray, SoftmaxCache]:
    """Softmax over the last axis; entries where `mask` is False or the score is -inf get 0.

    Returns (P, cache); P has the shape of `scores`.
    """
    allowed = np.isfinite(scores) if mask is None else (mask & np.isfinite(scores))
    row_max = np.max(scores, axis=-1, keepdims=True, where=allowed, initial=-np.inf)  # (..., 1)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)  # empty row: any shift will do
    exps = np.exp(np.where(allowed, scores - row_max, -np.inf))  # (..., N), exactly 0 where masked
    denom = exps.sum(axis=-1, keepdims=True)  # (..., 1), >= 1 unless the row is empty
    probs = exps / np.where(denom > 0, denom, 1.0)
    return probs, SoftmaxCache(probs)


def softmax_backward(dprobs: np.ndarray, cache: SoftmaxCache) -> np.ndarray:
    """Vector-Jacobian product of the row softmax: dS = P * (dP - rowsum(dP * P))."""
    probs = cache.probs
    # forward was: P = exp(S - m) / sum(exp(S - m))
    row_dot = np.sum(dprobs * probs, axis=-1, keepdims=True)  # (..., 1)
    return probs * (dprobs - row_dot)
