"""`replace_sdpa()`: every call of PyTorch's `scaled_dot_product_attention` runs attngrad.

Models that call `torch.nn.functional.scaled_dot_product_attention` themselves (diffusers'
transformers and U-Nets, `nn.MultiheadAttention` with need_weights=False,
`nn.TransformerEncoderLayer`, ViTs) are reached by a `TorchFunctionMode`: PyTorch hands the
mode every torch function call made while it is active, and the mode sends SDPA's to
`functional.scaled_dot_product_attention` (same signature, same semantics). It works at the
Python level, above autograd and the functorch transforms, so `torch.func.jvp`, `vmap`,
double backward and `torch.compile` see attngrad's op as if the model had called it.

Inside `torch.utils.checkpoint` (either kind, selective checkpointing, the gradient
checkpointing of diffusers, timm and transformers), the mode follows the forward into its
recomputation in the backward (`recomputation`), which then takes the same backend.

DTensors are taken (`context_parallel()`'s sharded sequences: `distributed.dtensor_passes`).
A call attngrad does not take (another tensor subclass, a strided nested tensor,
arguments attngrad refuses and PyTorch accepts) goes to PyTorch's own function: counted
in the `SDPACalls` the context yields and reported once per reason, never silently
different. `strict=True` raises instead.

    with replace_sdpa() as calls:
        out, tangent = torch.func.jvp(model, (x,), (dx,))
    calls.attngrad, calls.pytorch  # 12, {}
"""

from __future__ import annotations

import threading
import types
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from . import recomputation, regime
from .functional import scaled_dot_product_attention as attngrad_sdpa
from .nested import is_jagged

PYTORCH_SDPA = torch.nn.functional.scaled_dot_product_attention
PYTORCH_MHA = torch.nn.functional.multi_head_attention_forward
_reported: set[str] = set()  # reasons already warned about, once per process
_inside_mha = threading.local()  # .mode: the mode whose multi_head_attention_forward runs now


def _sdpa_of_mha(*args: Any, **kwargs: Any) -> Any:
    return _inside_mha.mode.sdpa(args, kwargs)


def _mha_calling(sdpa: Any) -> types.FunctionType:
    """PyTorch's multi_head_attention_forward with its SDPA call going to `sdpa`. A mode
    cannot reach that call: PyTorch disables the mode while it handles the outer function,
    and running that function with the mode on would hand the mode the outer call again."""
    function = PYTORCH_MHA
    names = {**function.__globals__, "scaled_dot_product_attention": sdpa}
    copy = types.FunctionType(function.__code__, names, function.__name__, function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


_MHA = _mha_calling(_sdpa_of_mha)


@dataclass
class SDPACalls:
    """What a `replace_sdpa()` block did with the SDPA calls it saw: `attngrad` counts those
    attngrad ran, `pytorch` those sent to PyTorch's own function, by reason."""

    attngrad: int = 0
    pytorch: dict[str, int] = field(default_factory=dict)  # a dict, not a Counter: Dynamo makes dicts


def _arguments(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
               is_causal: bool = False, *, scale: Optional[float] = None, enable_gqa: bool = False) -> dict:
    """PyTorch's signature, to name the arguments of a call made either way."""
    return dict(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=scale, enable_gqa=enable_gqa)


def _is_dtensor(t: Tensor) -> bool:
    """DTensors are taken: their passes have DTensor handlers (`distributed.dtensor_passes`)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _not_taken(arguments: dict) -> Optional[str]:
    """Why attngrad does not take this call (None: it does)."""
    for name in ("query", "key", "value", "attn_mask"):
        t = arguments[name]
        if not isinstance(t, Tensor) or is_jagged(t):
            continue
        if t.is_nested:
            return f"{name} is a strided nested tensor (attngrad takes layout=torch.jagged)"
        if regime.is_wrapper_subclass(t) and not _is_dtensor(t):
            return f"{name} is a {type(t).__name__}, a tensor subclass attngrad's op has no rule for"
    return None  # anything else attngrad's own checks judge, naming the arguments


class _SDPAMode(TorchFunctionMode):
    def __init__(self, calls: SDPACalls, strict: bool) -> None:
        super().__init__()
        self.calls, self.strict = calls, strict

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is PYTORCH_SDPA:
            return self.sdpa(args, kwargs)
        if func is PYTORCH_MHA:  # nn.MultiheadAttention, nn.Transformer*Layer
            outer, _inside_mha.mode = getattr(_inside_mha, "mode", None), self
            try:
                return _MHA(*args, **kwargs)
            finally:
                _inside_mha.mode = outer
        return func(*args, **kwargs)

    def sdpa(self, args: tuple, kwargs: dict) -> Any:
        func = PYTORCH_SDPA
        arguments = _arguments(*args, **kwargs)
        reason = _not_taken(arguments)
        if reason is None:
            if torch.compiler.is_compiling():  # a graph cannot catch; the checks above hold there
                self.calls.attngrad += 1
                return attngrad_sdpa(**arguments)
            if not recomputation.follow(self):
                reason = "it runs inside torch.utils.checkpoint, whose recomputation attngrad cannot reach here"
        if reason is None:
            try:
                out = attngrad_sdpa(**arguments)
            except (TypeError, ValueError) as refusal:  # argument checks: nothing has run yet
                try:
                    out = func(*args, **kwargs)
                except Exception:  # bad input to both: attngrad's error names the arguments
                    raise refusal from None
                reason = f"attngrad refused it: {refusal}"
            else:
                self.calls.attngrad += 1
                return out
        else:
            out = None
        if self.strict:
            raise RuntimeError(f"replace_sdpa(strict=True): attngrad does not take this scaled_dot_product_attention "
                               f"call: {reason}")
        self.calls.pytorch[reason] = self.calls.pytorch.get(reason, 0) + 1
        if reason not in _reported:
            _reported.add(reason)
            warnings.warn(f"attngrad.torch.replace_sdpa: a scaled_dot_product_attention call ran on PyTorch's own "
                          f"function because {reason}; such calls are counted in the SDPACalls the block yields",
                          stacklevel=3)
        return func(*args, **kwargs) if out is None else out


@contextmanager
def replace_sdpa(*, strict: bool = False) -> Iterator[SDPACalls]:
    """Run every `torch.nn.functional.scaled_dot_product_attention` call inside the block
    on attngrad; a context manager (yielding the block's `SDPACalls`) or a decorator. With
    `strict`, a call attngrad does not take raises instead of going to PyTorch's own."""
    calls = SDPACalls()
    with _SDPAMode(calls, strict):
        yield calls
