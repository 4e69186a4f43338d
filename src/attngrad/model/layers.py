"""The Transformer's layers other than attention, as forward/backward pairs in NumPy.

Shape legend: B batch, L length, D d_model, F d_ff, V vocabulary.

    embedding      y = E[tokens] * sqrt(D)                 dE[t] += sqrt(D) dy  (scatter-add)
    positions      PE[l, 2i] = sin(l / 10000^(2i/D)), PE[l, 2i+1] = cos(...)   (no parameters)
    layer norm     y = (x - mean) / sqrt(var + eps) * gamma + beta, over D
    feed-forward   y = relu(x W1^T + b1) W2^T + b2
    dropout        y = x * keep / (1 - p), the keep-mask drawn by a `Dropout`
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from ..reference.linear import LinearCache, linear_backward, linear_forward


class EmbeddingCache(NamedTuple):
    tokens: np.ndarray  # (B, L) int
    vocab: int
    scale: float


def embedding_forward(tokens: np.ndarray, table: np.ndarray) -> tuple[np.ndarray, EmbeddingCache]:
    """y = E[tokens] * sqrt(D): (B, L) ints -> (B, L, D)."""
    scale = math.sqrt(table.shape[1])
    return table[tokens] * table.dtype.type(scale), EmbeddingCache(tokens, table.shape[0], scale)


def embedding_backward(dy: np.ndarray, cache: EmbeddingCache) -> np.ndarray:
    # forward: y[b, l] = E[tokens[b, l]] * sqrt(D)  ->  dE[t] = sqrt(D) * sum of dy where tokens == t
    dtable = np.zeros((cache.vocab, dy.shape[-1]), dtype=dy.dtype)
    np.add.at(dtable, cache.tokens.reshape(-1), dy.reshape(-1, dy.shape[-1]) * dy.dtype.type(cache.scale))
    return dtable


def positional_encoding(length: int, d_model: int, dtype: Any = np.float32) -> np.ndarray:
    """The paper's sinusoids, (L, D): sin on even features, cos on odd ones."""
    position = np.arange(length)[:, None]  # (L, 1)
    rate = np.exp(-math.log(10000.0) * np.arange(0, d_model, 2) / d_model)  # (ceil(D/2),)
    table = np.zeros((length, d_model))
    table[:, 0::2] = np.sin(position * rate)
    table[:, 1::2] = np.cos(position * rate[: d_model // 2])
    return table.astype(dtype)


class LayerNormCache(NamedTuple):
    normalized: np.ndarray  # x_hat, (..., D)
    inv_std: np.ndarray  # 1 / sqrt(var + eps), (..., 1)
    gamma: np.ndarray  # (D,)


def layer_norm_forward(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float = 1e-5) -> tuple[np.ndarray, LayerNormCache]:
    mean = x.mean(axis=-1, keepdims=True)
    centered = x - mean
    inv_std = 1.0 / np.sqrt((centered * centered).mean(axis=-1, keepdims=True) + eps)  # (..., 1)
    normalized = centered * inv_std  # x_hat
    return normalized * gamma + beta, LayerNormCache(normalized, inv_std, gamma)


def layer_norm_backward(dy: np.ndarray, cache: LayerNormCache) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dx, dgamma, dbeta)."""
    # forward: y = x_hat * gamma + beta
    rows = dy.reshape(-1, dy.shape[-1])
    dgamma = (rows * cache.normalized.reshape(rows.shape)).sum(axis=0)
    dbeta = rows.sum(axis=0)
    dxhat = dy * cache.gamma
    # forward: x_hat = (x - mean) * inv_std; the mean and the variance depend on every x of the row:
    # dx = inv_std * (dxhat - mean(dxhat) - x_hat * mean(dxhat * x_hat))
    mean_d = dxhat.mean(axis=-1, keepdims=True)
    mean_dx = (dxhat * cache.normalized).mean(axis=-1, keepdims=True)
    dx = cache.inv_std * (dxhat - mean_d - cache.normalized * mean_dx)
    return dx, dgamma, dbeta


class FeedForwardCache(NamedTuple):
    first: LinearCache
    active: np.ndarray  # relu'(h) as booleans, (..., F)
    second: LinearCache


def feed_forward_forward(x: np.ndarray, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray, b2: np.ndarray) -> tuple[np.ndarray, FeedForwardCache]:
    """y = relu(x W1^T + b1) W2^T + b2: (..., D) -> (..., D) through (..., F)."""
    h, first = linear_forward(x, w1, b1)  # (..., F)
    active = h > 0
    y, second = linear_forward(h * active, w2, b2)  # (..., D)
    return y, FeedForwardCache(first, active, second)


def feed_forward_backward(dy: np.ndarray, cache: FeedForwardCache) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(dx, {"w1", "b1", "w2", "b2"})."""
    # forward: y = r W2^T + b2, r = relu(h)
    g2 = linear_backward(dy, cache.second)
    # forward: r = relu(h), h = x W1^T + b1
    g1 = linear_backward(g2.dx * cache.active, cache.first)
    return g1.dx, {"w1": g1.dw, "b1": g1.db, "w2": g2.dw, "b2": g2.db}


class Dropout:
    """Draws the keep-masks of one forward pass: Z = keep / (1 - p), keep ~ Bernoulli(1 - p).

    Every mask is drawn under a name and kept in `masks`, so that a test can hand the very
    same masks to an equivalent PyTorch model (`replay`). p = 0 draws nothing.
    """

    def __init__(self, p: float = 0.0, rng: np.random.Generator | None = None, replay: dict[str, np.ndarray] | None = None):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout must be in [0, 1); got {p}")
        self.p = p
        self.rng = rng if rng is not None else np.random.default_rng()
        self.replay = replay
        self.masks: dict[str, np.ndarray] = {}

    def keep(self, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """The boolean keep-mask for `name` (None without dropout)."""
        if self.p == 0.0:
            return None
        if self.replay is not None:
            mask = self.replay[name]
        else:
            mask = self.rng.random(shape) >= self.p
        self.masks[name] = mask
        return mask

    def apply(self, name: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(x * Z, Z) for a fresh mask of x's shape; (x, None) without dropout."""
        keep = self.keep(name, x.shape)
        if keep is None:
            return x, None
        scaled = keep * x.dtype.type(1.0 / (1.0 - self.p))
        return x * scaled, scaled


NO_DROPOUT = Dropout(0.0)
