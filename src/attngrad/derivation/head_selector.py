"""The per-head head-selector form of the gradients (seed file 001), every symbol defined.

The Q&A answer states, without defining its symbols,
    dW_h^K = gamma K^T P_h (df/dA)^T Q W_h^Q,    dW_h^Q = gamma Q^T (df/dA) P_h^T K W_h^K,
    dW^V = A^T (df/dX) (W^O)^T,                  dW^O = Concat(head_1..head_H)^T df/dX.
Here is what they mean, for one sequence, in the blog's right-multiplying convention
(y = x W, so W = torch's weight transposed):

    X_q (Lq, d)  the rows that make the queries ("Q" in the answer; x in self-attention)
    X_k (Lk, d)  the rows that make the keys and values ("K"; x again in self-attention)
    W^Q, W^K (d, H dk), W^V (d, H dv), W^O (H dv, d); W_h^Q = W^Q R_h, the h-th block of
                 dk columns, with the block selector R_h = e_h (x) I_dk  (H dk, dk)
    gamma = 1/sqrt(dk)
    A   = [A_1 | ... | A_H]  (Lq, H Lk), A_h = gamma X_q W_h^Q (X_k W_h^K)^T: every head's
                 scores side by side
    P_h = e_h^T (x) I_Lk  (Lk, H Lk): the head selector, A P_h^T = A_h
    S   = [softmax(A_1) | ... | softmax(A_H)]  (Lq, H Lk), a row softmax per block
    Vbar = blockdiag(X_k W_1^V, ..., X_k W_H^V)  (H Lk, H dv)
    C   = Concat(head_1, ..., head_H) = S Vbar  (Lq, H dv)
    Y   = C W^O  (Lq, d), the layer output ("X" in the answer's df/dX); f a scalar loss.

Then, with G_Y = df/dY:
    df/dW^O  = C^T G_Y                                   (the answer's fourth formula)
    df/dC    = G_Y (W^O)^T
    df/dVbar = S^T df/dC        (the answer's third formula is this, with A standing for
                                 the attention weights S: it is the gradient of the values
                                 Vbar, not yet of W^V)
    df/dW_h^V = X_k^T (df/dVbar)_hh, the h-th diagonal block
    df/dS    = df/dC Vbar^T, and per block df/dA_h = S_h * (df/dS_h - rowsum(df/dS_h * S_h))
    df/dW_h^Q = gamma X_q^T (df/dA) P_h^T X_k W_h^K      (the answer's second formula)
    df/dW_h^K = gamma X_k^T P_h (df/dA)^T X_q W_h^Q      (the answer's first formula)

No biases appear in the answer, so none here: compare with MHAParams(bias=False).
Over a batch, the weight gradients of the sequences add up.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class HeadSelectorGrads(NamedTuple):
    """Gradients in the blog's convention (right-multiplied weights): torch's are the transposes."""

    w_q: np.ndarray  # (d, H dk)
    w_k: np.ndarray  # (d, H dk)
    w_v: np.ndarray  # (d, H dv)
    w_o: np.ndarray  # (H dv, d)


def block_selector(h: int, heads: int, n: int) -> np.ndarray:
    """e_h^T (x) I_n, shape (n, heads * n): right-multiplying by its transpose picks block h."""
    return np.kron(np.eye(heads)[h : h + 1], np.eye(n))


def _row_softmax(a: np.ndarray) -> np.ndarray:
    e = np.exp(a - a.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def head_selector_gradients(
    x_q: np.ndarray, x_k: np.ndarray, w_q: np.ndarray, w_k: np.ndarray, w_v: np.ndarray, w_o: np.ndarray,
    heads: int, dout: np.ndarray,
) -> HeadSelectorGrads:
    """The answer's formulas, head by head, summed over the batch.

    x_q (B, Lq, d), x_k (B, Lk, d); weights right-multiplied (see module docstring);
    dout = df/dY (B, Lq, d). Returns df/dW for W^Q, W^K, W^V, W^O.
    """
    dk, dv = w_q.shape[1] // heads, w_v.shape[1] // heads
    gamma = 1.0 / np.sqrt(dk)
    grads = [np.zeros_like(w) for w in (w_q, w_k, w_v, w_o)]
    for xq, xk, g_y in zip(x_q, x_k, dout):  # one sequence at a time
        len_k = xk.shape[0]
        w_q_h = [w_q @ block_selector(h, heads, dk).T for h in range(heads)]  # W_h^Q (d, dk)
        w_k_h = [w_k @ block_selector(h, heads, dk).T for h in range(heads)]
        w_v_h = [w_v @ block_selector(h, heads, dv).T for h in range(heads)]
        p = [block_selector(h, heads, len_k) for h in range(heads)]  # P_h (Lk, H Lk)
        a = np.hstack([gamma * xq @ w_q_h[h] @ (xk @ w_k_h[h]).T for h in range(heads)])  # A (Lq, H Lk)
        s = np.hstack([_row_softmax(a @ p[h].T) for h in range(heads)])  # S (Lq, H Lk)
        v_bar = np.zeros((heads * len_k, heads * dv))  # blockdiag(X_k W_h^V)
        for h in range(heads):
            v_bar[h * len_k : (h + 1) * len_k, h * dv : (h + 1) * dv] = xk @ w_v_h[h]
        c = s @ v_bar  # Concat(head_1..head_H) (Lq, H dv)

        grads[3] += c.T @ g_y  # df/dW^O = C^T G_Y
        d_c = g_y @ w_o.T  # df/dC
        d_v_bar = s.T @ d_c  # df/dVbar = S^T df/dC
        for h in range(heads):  # df/dW_h^V = X_k^T (df/dVbar)_hh
            grads[2][:, h * dv : (h + 1) * dv] += xk.T @ d_v_bar[h * len_k : (h + 1) * len_k, h * dv : (h + 1) * dv]
        d_s = d_c @ v_bar.T  # df/dS (Lq, H Lk)
        d_a = np.hstack([  # softmax backward, block by block
            (s @ p[h].T) * (d_s @ p[h].T - np.sum(d_s @ p[h].T * (s @ p[h].T), axis=-1, keepdims=True))
            for h in range(heads)
        ])
        for h in range(heads):
            cols = slice(h * dk, (h + 1) * dk)
            grads[0][:, cols] += gamma * xq.T @ d_a @ p[h].T @ xk @ w_k_h[h]  # gamma Q^T (df/dA) P_h^T K W_h^K
            grads[1][:, cols] += gamma * xk.T @ p[h] @ d_a.T @ xq @ w_q_h[h]  # gamma K^T P_h (df/dA)^T Q W_h^Q
    return HeadSelectorGrads(*grads)
