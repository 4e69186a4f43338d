"""Adam with the paper's warm-up schedule, and gradient clipping by the global norm.

    lr(step) = factor * D^-0.5 * min(step^-0.5, step * warmup^-1.5)       (step from 1)
    m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2
    p -= lr * (m / (1 - b1^step)) / (sqrt(v / (1 - b2^step)) + eps)
"""

from __future__ import annotations

import math

import numpy as np


def warmup_lr(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """The learning rate of "Attention Is All You Need", section 5.3: linear warm-up, then 1/sqrt(step)."""
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def clip_grad_norm(grads: dict[str, np.ndarray], max_norm: float) -> float:
    """Scale every gradient in place so that their global L2 norm is at most max_norm;
    return the norm before clipping."""
    norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads.values():
            g *= g.dtype.type(scale)
    return norm


class Adam:
    """Adam over a dict of parameters (updated in place), with state that can be saved."""

    def __init__(self, params: dict[str, np.ndarray], *, betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-9):
        self.params = params
        self.betas, self.eps = betas, eps
        self.m = {name: np.zeros_like(p) for name, p in params.items()}
        self.v = {name: np.zeros_like(p) for name, p in params.items()}
        self.step_count = 0

    def step(self, grads: dict[str, np.ndarray], lr: float) -> None:
        if grads.keys() != self.params.keys():
            missing = sorted(set(self.params) ^ set(grads))
            raise ValueError(f"gradients and parameters differ in their names: {missing[:5]}")
        self.step_count += 1
        b1, b2 = self.betas
        correction1 = 1.0 - b1**self.step_count
        correction2 = 1.0 - b2**self.step_count
        for name, p in self.params.items():
            g = grads[name]
            m, v = self.m[name], self.v[name]
            m *= b1
            m += (1.0 - b1) * g
            v *= b2
            v += (1.0 - b2) * g * g
            p -= (lr / correction1) * m / (np.sqrt(v / correction2) + self.eps)

    def state(self) -> dict[str, np.ndarray]:
        """Flat arrays for a checkpoint: 'adam.m.NAME', 'adam.v.NAME', 'adam.step'."""
        out = {f"adam.m.{n}": a for n, a in self.m.items()}
        out.update({f"adam.v.{n}": a for n, a in self.v.items()})
        out["adam.step"] = np.array(self.step_count)
        return out

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        for name in self.params:
            self.m[name][...] = arrays[f"adam.m.{name}"]
            self.v[name][...] = arrays[f"adam.v.{name}"]
        self.step_count = int(arrays["adam.step"])
