"""The floating dtypes attngrad takes, and the one each computes in: float64 stays float64,
float16, bfloat16 and float32 are computed in float32 (their products may stay in their own
type: the backends say where). One rule for every layer, so that no layer reads it from a
backend."""

from __future__ import annotations

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and row statistics are kept in for inputs of `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32
