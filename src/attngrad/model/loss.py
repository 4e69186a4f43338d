"""Softmax cross-entropy with label smoothing that ignores padding, as a forward/backward pair.

    logits (N, V), targets (N,) ints, eps the smoothing, n the number of targets that are
    not padding. The smoothed target is q = (1 - eps) onehot(y) + eps / V (PyTorch's
    convention), and
        loss = (1 / n) sum_{i not pad} -sum_c q_ic log softmax(logits_i)_c
        dlogits_i = (softmax(logits_i) - q_i) / n, and 0 on padding rows.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class CrossEntropyCache(NamedTuple):
    probs: np.ndarray  # (N, V)
    target: np.ndarray  # q, (N, V), 0 on padding rows
    count: int  # n


def cross_entropy_forward(logits: np.ndarray, targets: np.ndarray, *, pad: int, smoothing: float = 0.0) -> tuple[float, CrossEntropyCache]:
    """Mean smoothed cross-entropy over the targets that are not `pad`."""
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    vocab = logits.shape[1]
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))  # (N, V)
    valid = targets != pad
    count = max(int(valid.sum()), 1)
    q = np.full(logits.shape, smoothing / vocab, dtype=logits.dtype)
    q[np.arange(len(targets)), targets] += 1.0 - smoothing
    q *= valid[:, None]
    loss = float(-(q * log_probs).sum() / count)
    return loss, CrossEntropyCache(np.exp(log_probs), q, count)


def cross_entropy_backward(cache: CrossEntropyCache) -> np.ndarray:
    """dloss / dlogits, (N, V): (softmax - q) / n on real targets, 0 on padding."""
    # the rows of q sum to 1 (or 0 on padding), so d/dlogits of -sum q log softmax is softmax * sum(q) - q
    weight = cache.target.sum(axis=1, keepdims=True)  # 1, or 0 on padding rows
    return (cache.probs * weight - cache.target) / cache.count
