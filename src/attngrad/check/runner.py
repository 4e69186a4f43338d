"""Run the cases: attngrad's gradients against PyTorch autograd and finite differences.

For each case: draw a random upstream gradient dout, compute attngrad's output and
gradients in the requested dtype, then the float64 truth twice over (PyTorch autograd
when torch is importable, central finite differences of attngrad's own float64 forward),
and judge every tensor by its relative error against the stated tolerance.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .cases import FLAVORS, Case, CheckConfig, all_cases
from .compare import TOLERANCES, ErrorFigure, error_figure, within
from .finite_diff import finite_difference_gradients


@dataclass(frozen=True)
class Row:
    """One tensor of one case, judged."""

    flavor: str
    variant: str
    tensor: str  # "out" for the forward value, else the input the gradient is taken for
    shape: tuple[int, ...]
    autograd: ErrorFigure | None  # None: torch not installed
    finite_diff: ErrorFigure | None  # None: not applicable (the forward value)
    passed: bool
    oracle: str | None
    exact_zero: bool = False  # 0 in exact arithmetic: judged against the case's gradient scale


@dataclass
class CheckReport:
    config: CheckConfig
    rows: list[Row] = field(default_factory=list)
    torch_version: str | None = None  # None when the autograd column was skipped
    seconds: float = 0.0
    backend_rows: list = field(default_factory=list)  # torch_backend.BackendRow: attngrad.torch, when checked
    backend_skipped: str | None = None  # why attngrad.torch was not checked, if it was not

    @property
    def passed(self) -> bool:
        return all(row.passed for row in self.rows) and all(row.passed for row in self.backend_rows)

    @property
    def tolerances(self) -> dict[str, float]:
        return TOLERANCES[self.config.dtype]

    def to_json(self) -> dict[str, Any]:
        def figure(f: ErrorFigure | None) -> dict[str, float] | None:
            return None if f is None else {"max_abs": f.max_abs, "rel": f.rel}

        return {
            "passed": self.passed,
            "config": asdict(self.config),
            "tolerances": self.tolerances,
            "torch_version": self.torch_version,
            "autograd_skipped": self.torch_version is None,
            "seconds": round(self.seconds, 3),
            "rows": [
                {
                    "flavor": r.flavor,
                    "variant": r.variant,
                    "tensor": r.tensor,
                    "shape": list(r.shape),
                    "autograd": figure(r.autograd),
                    "finite_diff": figure(r.finite_diff),
                    "passed": r.passed,
                    "oracle": r.oracle,
                    "exact_zero": r.exact_zero,
                }
                for r in self.rows
            ],
            "backend": [asdict(r) for r in self.backend_rows],
            "backend_skipped": self.backend_skipped,
        }


def _torch_oracle() -> Any:
    """The torch_oracle module, or None when PyTorch is not installed."""
    try:
        from . import torch_oracle
    except ImportError:
        return None
    return torch_oracle


def check_case(case: Case, oracle: Any = None, *, finite_differences: bool = True) -> list[Row]:
    """Judge every tensor of one case. `oracle` is the torch_oracle module or None."""
    dtype = np.dtype(case.config.dtype)
    tol = TOLERANCES[case.config.dtype]
    rng = np.random.default_rng([case.config.seed, 7919])
    ours_inputs = {name: value.astype(dtype) for name, value in case.inputs.items()}
    out = case.forward(ours_inputs)
    dout = rng.standard_normal(out.shape)
    out, grads = case.gradients(ours_inputs, dout.astype(dtype))

    ref_out = ref_grads = None
    oracle_name = None
    if oracle is not None:
        ref_out, ref_grads = oracle.torch_gradients(case, case.inputs, dout)
        oracle_name = oracle.oracle_name(case)
    fd_grads = finite_difference_gradients(case.forward, case.inputs, dout) if finite_differences else {}

    # scale of this case's gradients, the yardstick for a gradient that is exactly zero
    truth = ref_grads if ref_grads is not None else fd_grads
    scale = max((float(np.max(np.abs(g))) for g in truth.values() if g.size), default=0.0)

    rows = []
    out_fig = None if ref_out is None else error_figure(out, ref_out)
    rows.append(Row(case.flavor, case.variant, "out", out.shape, out_fig, None, within(out_fig, tol["autograd"]), oracle_name))
    for name, grad in grads.items():
        zero = name in case.exact_zeros
        floor = scale if zero else 0.0
        auto = None if ref_grads is None else error_figure(grad, ref_grads[name], floor=floor)
        fd = error_figure(grad, fd_grads[name], floor=floor) if name in fd_grads else None
        ok = within(auto, tol["autograd"]) and within(fd, tol["finite_diff"]) and bool(np.isfinite(grad).all())
        rows.append(Row(case.flavor, case.variant, name, grad.shape, auto, fd, ok, oracle_name, zero))
    return rows


def _torch_backend() -> tuple[Any, str | None]:
    """(the torch_backend module, None), or (None, why attngrad.torch cannot be checked)."""
    try:
        from . import torch_backend
    except ImportError as err:
        return None, f"PyTorch is not installed ({err.name})"
    return torch_backend, None


def run_check(
    config: CheckConfig,
    flavors: tuple[str, ...] = FLAVORS,
    variants: tuple[str, ...] | None = None,
    *,
    use_torch: bool = True,
    finite_differences: bool = True,
    progress: Callable[[Case, int, int], None] | None = None,
    reference: bool = True,
    backend: bool = True,
) -> CheckReport:
    """Check every (flavor, variant) asked for: attngrad's reference (`reference`), and
    attngrad.torch in float64 (`backend`, when PyTorch is installed and `use_torch`).
    `progress(case, i, n)` is called before each case."""
    start = time.perf_counter()
    oracle = _torch_oracle() if use_torch and reference else None
    report = CheckReport(config, torch_version=None if oracle is None else oracle.torch.__version__)
    module, why = _torch_backend() if use_torch else (None, "--no-torch")
    if backend and module is None:
        report.backend_skipped = why
    cases = all_cases(config, flavors, variants)
    for i, case in enumerate(cases):
        if progress is not None:
            progress(case, i, len(cases))
        if reference:
            report.rows.extend(check_case(case, oracle, finite_differences=finite_differences))
        if backend and module is not None:
            report.backend_rows.extend(module.check_backend(case, TOLERANCES["float64"]["autograd"]))
    report.seconds = time.perf_counter() - start
    return report
