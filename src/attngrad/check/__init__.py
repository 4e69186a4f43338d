"""attngrad.check: verification as a library.

`finite_difference_gradients` differentiates any function numerically against a random
upstream gradient; `error_figure` measures one tensor against a reference; `run_check`
proves every attention flavor and option against PyTorch autograd (when installed) and
finite differences, then (with PyTorch) runs every case through `attngrad.torch` as well
(`torch_backend`), and returns a `CheckReport`.
"""

from .cases import FLAVORS, VARIANTS, Case, CheckConfig, all_cases, make_case
from .compare import TOLERANCES, ErrorFigure, error_figure
from .finite_diff import finite_difference_gradients, finite_difference_jacobian
from .runner import CheckReport, Row, check_case, run_check

__all__ = [
    "FLAVORS",
    "TOLERANCES",
    "VARIANTS",
    "Case",
    "CheckConfig",
    "CheckReport",
    "ErrorFigure",
    "Row",
    "all_cases",
    "check_case",
    "error_figure",
    "finite_difference_gradients",
    "finite_difference_jacobian",
    "make_case",
    "run_check",
]
