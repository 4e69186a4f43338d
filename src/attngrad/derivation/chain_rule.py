"""The exercise sheet's chain-rule structure (seed file 002), computed literally as sums.

One self-attention head, written with columns as the sheet does:

    x_i  in R^D, i = 1..L    the inputs in their role as keys and values
    x'_j in R^D, j = 1..L    the same inputs in their role as queries
    W_K (D, D_K), W_Q (D, D_Q), D_K = D_Q
    q_ij = x_i^T W_K W_Q^T x'_j                     raw query-key score          (a)
    p_ij = exp(q_ij) / sum_i' exp(q_i'j)            softmax over i: a COLUMN softmax (2)
    y_j  = sum_i x_i p_ij                           output j                     (1)
    f    = a scalar function of y_1..y_L, given through g_j = df/dy_j in R^D

The local derivatives (each an edge of the computation graph `GRAPH`):
    dq_lk/dx'_j = delta_kj W_Q W_K^T x_l           dq_mj/dx_i = delta_mi W_K W_Q^T x'_j
    dp_ik/dq_lk = p_ik (delta_il - p_lk)            (the softmax Jacobian, column k)
    dy_k/dp_ik  = x_i                               dy_j/dx_i  = p_ij I_D

Equation (3): df/dx'_j = sum_k sum_i  df/dy_k . dy_k/dp_ik . dp_ik/dx'_j
Equation (4): df/dx_i  = sum_j df/dy_j . dy_j/dx_i  +  sum_l sum_j df/dy_j . dy_j/dp_lj . dp_lj/dx_i
In self-attention x' = x, so the gradient of the one input x_i is (4)_i + (3)_{j=i}: one
tensor, two roles, their paths added. `literal_*` evaluate these sums index by index, with
no matrix shortcut; the tests show them equal to attngrad's efficient backward.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Edge(NamedTuple):
    source: str
    target: str
    local: str  # the local derivative carried along the edge (matplotlib mathtext)


# The computation graph of one head, node -> node. The drawing in docs/ is made from it,
# and the literal sums below have one term per path from an input to f.
GRAPH: tuple[Edge, ...] = (
    Edge("W_K", "q", r"$\partial q_{ij}/\partial W_K$"),
    Edge("W_Q", "q", r"$\partial q_{ij}/\partial W_Q$"),
    Edge("x", "q", r"$\partial q_{ij}/\partial x_i = W_K W_Q^\top x'_j$"),
    Edge("x'", "q", r"$\partial q_{ij}/\partial x'_j = W_Q W_K^\top x_i$"),
    Edge("q", "p", r"$\partial p_{ij}/\partial q_{lj} = p_{ij}(\delta_{il} - p_{lj})$"),
    Edge("p", "y", r"$\partial y_j/\partial p_{ij} = x_i$"),
    Edge("x", "y", r"$\partial y_j/\partial x_i = p_{ij} I$"),
    Edge("y", "f", r"$\partial f/\partial y_j = g_j$"),
)


def paths(source: str, target: str, graph: tuple[Edge, ...] = GRAPH) -> list[list[str]]:
    """Every path source -> target in the graph: each is one product term of the chain rule."""
    if source == target:
        return [[target]]
    return [[source] + rest for e in graph if e.source == source for rest in paths(e.target, target, graph)]


def forward(x: np.ndarray, x_prime: np.ndarray, w_k: np.ndarray, w_q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y, p): x, x' (L, D) with rows x_i, x'_j; y (L, D) with rows y_j; p (L, L) indexed [i, j]."""
    q = x @ w_k @ w_q.T @ x_prime.T  # q[i, j] = x_i^T W_K W_Q^T x'_j
    e = np.exp(q - q.max(axis=0, keepdims=True))
    p = e / e.sum(axis=0, keepdims=True)  # softmax over i, for every column j
    y = p.T @ x  # y_j = sum_i p_ij x_i
    return y, p


def _dp_dq(p: np.ndarray, i: int, l: int, k: int) -> float:
    """dp_ik / dq_lk = p_ik (delta_il - p_lk); p_ik does not depend on q_lm for m != k."""
    return p[i, k] * ((i == l) - p[l, k])


def literal_dx_prime(x: np.ndarray, x_prime: np.ndarray, w_k: np.ndarray, w_q: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Equation (3), the sums as written: df/dx'_j = sum_k sum_i df/dy_k . dy_k/dp_ik . dp_ik/dx'_j."""
    _, p = forward(x, x_prime, w_k, w_q)
    n = x.shape[0]
    out = np.zeros_like(x_prime)
    for j in range(n):
        for k in range(n):
            for i in range(n):
                df_dp = g[k] @ x[i]  # df/dy_k . dy_k/dp_ik
                # dp_ik/dx'_j = sum_l dp_ik/dq_lk . dq_lk/dx'_j, and dq_lk/dx'_j = delta_kj W_Q W_K^T x_l
                dp_dxp = sum(_dp_dq(p, i, l, k) * (w_q @ w_k.T @ x[l]) for l in range(n)) if k == j else 0.0
                out[j] += df_dp * dp_dxp
    return out


def literal_dx(x: np.ndarray, x_prime: np.ndarray, w_k: np.ndarray, w_q: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Equation (4), the sums as written:
    df/dx_i = sum_j df/dy_j . dy_j/dx_i + sum_l sum_j df/dy_j . dy_j/dp_lj . dp_lj/dx_i."""
    _, p = forward(x, x_prime, w_k, w_q)
    n, dim = x.shape
    out = np.zeros_like(x)
    for i in range(n):
        for j in range(n):
            out[i] += (p[i, j] * np.eye(dim)).T @ g[j]  # df/dy_j . dy_j/dx_i, dy_j/dx_i = p_ij I
        for l in range(n):
            for j in range(n):
                df_dp = g[j] @ x[l]  # df/dy_j . dy_j/dp_lj
                # dp_lj/dx_i = sum_m dp_lj/dq_mj . dq_mj/dx_i, and dq_mj/dx_i = delta_mi W_K W_Q^T x'_j
                out[i] += df_dp * _dp_dq(p, l, i, j) * (w_k @ w_q.T @ x_prime[j])
    return out


def literal_self_attention_dx(x: np.ndarray, w_k: np.ndarray, w_q: np.ndarray, g: np.ndarray) -> np.ndarray:
    """x' = x: the input's gradient is the sum over its two roles, (4)_i + (3)_{j=i}."""
    return literal_dx(x, x, w_k, w_q, g) + literal_dx_prime(x, x, w_k, w_q, g)
