"""Element Jacobians of f(X, Y) = softmax(lambda X^T A^T B Y) C X (seed file 003).

Symbols, as the math Q&A uses them:
    X, Y (n, m)       inputs; x_i, y_j their columns (tokens are columns here)
    A, B (k, n)       key and query maps; a_l, b_l their columns
    C (m, n)          so that C X is (m, m); c_l its columns
    lambda            a scalar (1/sqrt(k) in attention)
    G = lambda X^T A^T B Y  (m, m)
    F = softmax of each row of G  (m, m); s_i = F^T e_i its i-th row, S_i = Diag(s_i)
    P = F C X  (m, m), the function's value
    e_i, epsilon_l    standard basis vectors of R^m and R^n

The answer's closed forms, one element of the Jacobian at a time:
    dP_im / dY_lk = lambda (b_l^T A x_i) e_k^T (S_i - s_i s_i^T) C x_m
    dP_im / dX_lk = lambda [a_l^T B Y (S_k - s_k s_k^T) C x_m] delta_ik + (e_i^T F c_l) delta_mk
The first term of dP/dX is the path through the softmax (X^T feeds row k of G); the second
is the direct path (X also multiplies F C on the right). S_i - s_i s_i^T is the Jacobian of
one row's softmax.

Jacobians here are arrays J[i, m, l, k] = dP_im / dZ_lk. The column Jacobian the question
asks for, dP / dz_k for the k-th column z_k of Z, is J[:, :, :, k].
"""

from __future__ import annotations

import numpy as np


def forward(x: np.ndarray, y: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """(P, F): P = F C X with F = row softmax of G = lambda X^T A^T B Y."""
    g = lam * x.T @ a.T @ b @ y  # (m, m)
    e = np.exp(g - g.max(axis=1, keepdims=True))
    f = e / e.sum(axis=1, keepdims=True)
    return f @ c @ x, f


def _softmax_jacobians(f: np.ndarray) -> np.ndarray:
    """(m, m, m): J[i] = S_i - s_i s_i^T, the Jacobian of row i of the softmax."""
    return np.einsum("ij,jk->ijk", f, np.eye(f.shape[1])) - np.einsum("ij,ik->ijk", f, f)


def literal_jacobian_y(x, y, a, b, c, lam) -> np.ndarray:
    """dP_im/dY_lk by the answer's formula, element by element."""
    _, f = forward(x, y, a, b, c, lam)
    n, m = x.shape
    jac = np.zeros((m, m, n, m))
    for i in range(m):
        s_i = f[i]
        softmax_jac = np.diag(s_i) - np.outer(s_i, s_i)  # S_i - s_i s_i^T
        for mm in range(m):
            for l in range(n):
                for k in range(m):
                    e_k = np.eye(m)[k]
                    jac[i, mm, l, k] = lam * (b[:, l] @ a @ x[:, i]) * (e_k @ softmax_jac @ c @ x[:, mm])
    return jac


def literal_jacobian_x(x, y, a, b, c, lam) -> np.ndarray:
    """dP_im/dX_lk by the answer's formula, element by element."""
    _, f = forward(x, y, a, b, c, lam)
    n, m = x.shape
    jac = np.zeros((m, m, n, m))
    for i in range(m):
        for mm in range(m):
            for l in range(n):
                for k in range(m):
                    s_k = f[k]
                    through_softmax = lam * (a[:, l] @ b @ y @ (np.diag(s_k) - np.outer(s_k, s_k)) @ c @ x[:, mm])
                    direct = np.eye(m)[i] @ f @ c[:, l]
                    jac[i, mm, l, k] = through_softmax * (i == k) + direct * (mm == k)
    return jac


def jacobian_y(x, y, a, b, c, lam) -> np.ndarray:
    """The same closed form as `literal_jacobian_y`, vectorised: J[i, m, l, k]."""
    _, f = forward(x, y, a, b, c, lam)
    bax = lam * b.T @ a @ x  # [l, i] = lambda b_l^T A x_i
    rows = np.einsum("ikj,jm->ikm", _softmax_jacobians(f), c @ x)  # [i, k, m] = e_k^T (S_i - s_i s_i^T) C x_m
    return np.einsum("li,ikm->imlk", bax, rows)


def jacobian_x(x, y, a, b, c, lam) -> np.ndarray:
    """The same closed form as `literal_jacobian_x`, vectorised: J[i, m, l, k]."""
    _, f = forward(x, y, a, b, c, lam)
    n, m = x.shape
    aby = lam * a.T @ b @ y  # [l, :] = lambda a_l^T B Y
    through = np.einsum("lj,kjp,pm->klm", aby, _softmax_jacobians(f), c @ x)  # [k, l, m]
    jac = np.zeros((m, m, n, m))
    idx = np.arange(m)
    jac[idx, :, :, idx] = through.transpose(0, 2, 1)  # delta_ik: only i = k; indexed [k, m, l]
    jac[:, idx, :, idx] += (f @ c)[None]  # delta_mk: e_i^T F c_l; indexed [k, i, l]
    return jac
