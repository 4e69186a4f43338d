"""The "triton" backend: every pass of attention as fused Triton kernels in O(L) memory, for
GPUs (`config`, `launch`, `kernels`, `tiles`). It takes CUDA tensors by default where triton is
installed. CPU tensors it takes only when chosen (`use_backend("triton")`) and under
Triton's interpreter (TRITON_INTERPRET=1 before triton is first imported), which runs the
same kernels on NumPy: how its numbers are tested without a GPU. `attngrad gpu-report` compiles every kernel variant for sm_80 and
sm_90 ahead of time (`compile_report`).

triton is imported on the first call, not with attngrad.torch.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from typing import Optional

import torch

from ... import regime
from ...op import dispatch
from ...op.call import HVP_SUMS, AttentionCall, HvpSums
from ...precision import FLOATS


@functools.lru_cache(maxsize=1)
def _triton_missing() -> Optional[str]:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    return None


@functools.lru_cache(maxsize=1)
def _triton_version() -> str:
    import triton

    return triton.__version__


def _old_triton() -> bool:
    """Whether the installed Triton is older than 3.9, whose compiler takes the float64
    products this backend's kernels use (3.6's asserts on them; seen on an H100)."""
    major, minor = (int(part) for part in _triton_version().split(".")[:2])
    return (major, minor) < (3, 9)


def _float64_needs_newer_triton(dtype: torch.dtype) -> Optional[str]:
    """Why a float64 call cannot be compiled for a GPU by the installed Triton, or None."""
    if dtype == torch.float64 and _old_triton():
        return (f"float64 on a GPU needs Triton 3.9 or later (Triton {_triton_version()}'s compiler stops on the "
                "kernels' float64 matrix products)")
    return None


def interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter: TRITON_INTERPRET=1 where they were
    first imported (the kernels are made interpreted or compiled then), or now if not yet."""
    module = sys.modules.get(f"{__name__}.kernels")
    if module is not None:
        return module.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _late_interpreter() -> bool:
    """Whether TRITON_INTERPRET=1 came after triton was imported: triton's own library
    (tl.sum, tl.cdiv, ...) was then made for compiling, and an interpreted kernel cannot
    call it."""
    if "triton" not in sys.modules:
        return False
    import triton.language as tl

    return type(tl.standard.sum).__name__ != "InterpretedFunction"


def _unavailable() -> Optional[str]:
    missing = _triton_missing()
    if missing is not None:
        return missing
    if not interpreting() and not torch.cuda.is_available():
        return "no CUDA device (CPU tensors run in Triton's interpreter with TRITON_INTERPRET=1)"
    return None


def _refuses(call: AttentionCall, pass_name: str, inputs: dict) -> Optional[str]:
    device = call.q.device
    if any(t.device != device for t in call.tensors()):
        return "its tensors are on more than one device"
    if device.type == "cpu":
        if "torch-ops" in dispatch.allowed():  # the interpreter is for tests: only when chosen
            return "it takes CPU tensors only when chosen without torch-ops (use_backend('triton'))"
        if not interpreting():
            return "it runs CPU tensors only in Triton's interpreter (set TRITON_INTERPRET=1 before the first call)"
        if _late_interpreter():
            return ("TRITON_INTERPRET=1 was set after triton was imported (PyTorch may import it): set it before "
                    "anything imports triton")
    elif device.type != "cuda":
        return f"it runs on CUDA devices (and CPU tensors in Triton's interpreter); the call is on {device}"
    too_far = [name for name, t in call.fields().items() if isinstance(t, torch.Tensor) and _last_offset(t) >= 2**31]
    if too_far:
        return f"its kernels index with 32-bit offsets; {', '.join(too_far)} reach 2^31 elements or more"
    if call.q.dtype not in FLOATS:
        return f"it takes float16, bfloat16, float32 or float64 tensors; got {call.q.dtype}"
    if device.type == "cuda":
        too_old = _float64_needs_newer_triton(call.q.dtype)
        if too_old:
            return too_old
    if min(call.q.shape) == 0 or min(call.k.shape) == 0 or min(call.v.shape) == 0:
        return "it takes no empty dimension"
    from .config import MAX_WIDTH

    if max(call.q.shape[-1], call.v.shape[-1]) > MAX_WIDTH:
        return f"it takes head widths up to {MAX_WIDTH}; got d={call.q.shape[-1]}, dv={call.v.shape[-1]}"
    return _refuses_sums(call, pass_name, inputs.get("row_sums"))


def _refuses_sums(call: AttentionCall, pass_name: str, row_sums: Optional[dict]) -> Optional[str]:
    """A Hessian-vector product's sums it takes; a ring step's (a part of each row's keys) it
    leaves to torch-ops."""
    if row_sums is None:
        return None
    if not isinstance(row_sums, HvpSums) or call.partial_rows:
        return f"it takes an HVP's rows' sums (HvpSums) alone, not a {type(row_sums).__name__} (a ring step's)"
    # "results": what forward_jvp writes its primal results into (the backward's are the backward pass's)
    if set(row_sums) - {"results"} != HVP_SUMS.get(pass_name):
        return f"it takes no rows' sums {sorted(row_sums)} in its {pass_name} pass"
    if any(regime.is_wrapped(t) for t in (*row_sums.values(), *(row_sums.get("results") or ()))):
        return "it reads plain tensors; these rows' sums are a torch.func transform's"
    return None


def _last_offset(t: torch.Tensor) -> int:
    """The offset of a tensor's last element from its first, in elements."""
    return sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()) if size > 0)


def _pass(name: str):
    def run(call: AttentionCall, **inputs):
        from . import launch

        return getattr(launch, name)(call, **inputs)

    run.__name__ = name
    return run


BACKEND = dispatch.register(dispatch.Backend(
    name="triton",
    passes={name: _pass(name) for name in ("forward", "backward", "jvp", "forward_jvp", "backward_jvp",
                                          "double_backward")},
    unavailable=_unavailable,
    refuses=_refuses,
    row_sums=True,  # a Hessian-vector product's (`_refuses_sums`), not a ring step's
    description="fused Triton kernels: CUDA, every pass (CPU tensors in Triton's interpreter)",
), before="torch-ops" if "torch-ops" in dispatch.registered() else None)
