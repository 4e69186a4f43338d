"""Where a call runs, read once: the one place that asks PyTorch's private state.

Every choice of a call's path is made from one `Regime`, read at the call's start:

    DYNAMO   Dynamo is tracing this Python (torch.compile, torch.export): the call becomes
             the one operator `attngrad::attention` (`op.traced_op`), a leaf of the graph,
             which AOTAutograd later differentiates through its autograd and torch.func
             kernels, every transform and forward-mode level included.
    TRACING  code that runs while a graph is made but is not traced by Dynamo: those
             kernels on fake tensors (AOTAutograd, make_fx). Always the Functions, never a
             shortcut that reads a tensor's storage, since the tensors have none.
    EAGER    anything else: the shortcuts are allowed (`eager_plans`, `ops.run_op`'s direct
             call, `hvp_fusion.Deferred`'s fused passes).

Beyond the mode, a `Regime` says which torch.func transforms are active (innermost last),
which forward-mode level is open, and whether grad mode is on. The eager fast paths ask
`unseen` alone, without building one: every call asks it.

The private torch APIs attngrad.torch reads are all read here, as torch 2.13 (the version
tested, constraints.txt) has them; `tests/attngrad_torch/test_regime.py` checks each, so a
torch that moves one fails there first:

    torch._C._are_functorch_transforms_active, torch._functorch.pyfunctorch's interpreters
    torch._C._functorch.is_functorch_wrapped_tensor, get_unwrapped; unwrap_dead_wrappers
    torch._functorch.autograd_function.custom_function_call (PyTorch's apply under a transform)
    torch.autograd.forward_ad._current_level (a Python global: eager levels only), and
    torch._VF._unpack_dual at a given level (a compiled graph opens its levels in C++ alone)
    torch._C._len_torch_dispatch_stack, _is_torch_function_mode_enabled, _is_tracing
    torch._C._AutoDispatchBelowAutograd, _DisableFuncTorch
    torch._C._storage_Use_Count (optional: the tiles' buffer cache keeps nothing without it)
    torch.utils._python_dispatch.is_traceable_wrapper_subclass
    torch._dynamo._trace_wrapped_higher_order_op.TransformGetItemToIndex (mask functions)
    torch.fx.GraphModule's generated forward as an operator's caller (`sys._getframe`): where
        a compiled graph runs op by op (`called_by_a_graph_run_op_by_op`)
    torch._C._autograd._top_saved_tensors_default_hooks; torch.utils.checkpoint's
        _CheckpointFrame and CheckpointFunction (`recomputation`)
    DTensor._op_dispatcher._custom_op_handlers (DTensor's op handlers), and
        torch.distributed.tensor.experimental._context_parallel._attention._cp_options
        (whether context_parallel() balances its shards, and its rotate method:
        `distributed.dtensor_passes`)
"""

from __future__ import annotations

import enum
import operator
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.autograd.forward_ad as forward_ad
import torch.utils._python_dispatch
from torch import Tensor
from torch._functorch.pyfunctorch import TransformType, retrieve_all_functorch_interpreters

try:  # private: where a torch version moves it, PyTorch's own Function.apply runs instead
    from torch._functorch.autograd_function import custom_function_call
except ImportError:  # pragma: no cover
    custom_function_call = None

_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
transforms_active = _transforms_active = torch._C._are_functorch_transforms_active
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode = torch._C._is_torch_function_mode_enabled
_jit_tracing = torch._C._is_tracing  # torch.jit.trace recording
below_autograd = torch._C._AutoDispatchBelowAutograd  # a kernel's redispatch past autograd
storage_use_count = getattr(torch._C, "_storage_Use_Count", None)  # a storage's references (the tiles' buffers)
is_wrapper_subclass = torch.utils._python_dispatch.is_traceable_wrapper_subclass  # DTensor and its kind
functorch_disabled = torch._C._DisableFuncTorch  # plain tensors' work inside a transform
unwrap_dead_wrappers = torch._functorch.utils.unwrap_dead_wrappers
_unpack_dual = torch._VF._unpack_dual  # at a given level, with or without forward_ad's global


class Mode(enum.Enum):
    EAGER = "eager"
    DYNAMO = "dynamo"
    TRACING = "tracing"


def mode() -> Mode:
    """Whether Dynamo traces this Python, a graph is being made without it, or neither."""
    if not torch.compiler.is_compiling():
        return Mode.EAGER
    # Dynamo folds is_dynamo_compiling() to True in what it traces; code it runs (a kernel's
    # fake propagation, AOTAutograd's tracing) sees False while is_compiling() holds, and
    # runs under a fake-tensor or proxy mode. Without one it is real work that the compile
    # session's flag outlived (a frame Dynamo falls back on under a torch.func transform)
    if torch.compiler.is_dynamo_compiling():
        return Mode.DYNAMO
    return Mode.TRACING if _dispatch_modes() else Mode.EAGER


@dataclass(frozen=True)
class Regime:
    """The state a call's path is decided from (see the module)."""

    mode: Mode
    transforms: tuple  # the active torch.func transforms' kinds, outermost first (None: unnamed)
    level: int  # the open forward-mode level the call's tangents live at, or -1
    grad: bool  # grad mode

    @classmethod
    def now(cls, probe: tuple = (), in_kernel: bool = False) -> Regime:
        """The state now. `probe`: tensors to ask for a tangent at level 0 where no Python
        level is open: a compiled graph opens its dual levels in C++ alone, and hands the
        operator's kernel dual tensors that forward_ad's global does not know of.
        `in_kernel`: read in an operator's kernel, which Dynamo never traces: a DYNAMO
        reading there is Dynamo's flag outliving its trace (a frame it runs eagerly under a
        torch.func transform), so the mode is read as a kernel's."""
        current = mode()
        if current is Mode.DYNAMO and in_kernel:
            current = Mode.TRACING if _dispatch_modes() else Mode.EAGER
        if current is Mode.DYNAMO:  # the graph's operator decides later; Dynamo reads nothing else
            return cls(current, (), -1, torch.is_grad_enabled())
        transforms = ()
        if _transforms_active():
            # (while Dynamo propagates fake tensors under an outer transform, functorch's C++
            # flag holds where the Python list of interpreters is empty: active, unnamed)
            transforms = tuple(interpreter.key() for interpreter in retrieve_all_functorch_interpreters()) or (None,)
        level = forward_ad._current_level
        # (under a transform, forward mode is torch.func.jvp's, whose level the global holds;
        # and a batched tensor has no rule to unpack)
        if level < 0 and not transforms and any(t is not None and _unpack_dual(t, 0).tangent is not None
                                                for t in probe):
            level = 0
        return cls(current, transforms, level, torch.is_grad_enabled())

    @property
    def forward_level(self) -> bool:
        """A forward-mode level is open (forward_ad.dual_level, torch.func.jvp)."""
        return self.level >= 0

    @property
    def eager(self) -> bool:
        return self.mode is Mode.EAGER

    def tracks(self, tensors: Any) -> bool:
        """Whether reverse mode tracks any of `tensors` now."""
        return self.grad and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)

    def untracked(self, tensors: Any) -> bool:
        """Whether nothing can differentiate results computed from `tensors`: eager, no
        transform or forward-mode level, and reverse mode tracking none of them. (While a
        graph is made, forward mode may be open where no Python global says so: never.)"""
        if not self.eager or self.transforms or self.forward_level:
            return False
        return not self.tracks(tensors)

    def defers(self) -> bool:
        """Whether a Function applied now may leave its results to its jvp's fused pass
        (`hvp_fusion.Deferred`): eager, a dual level open or torch.func.jvp among the
        transforms, and no vmap (whose generated rule runs the forward on its own)."""
        if not self.eager:
            return False
        if self.transforms:
            return TransformType.Jvp in self.transforms and all(
                kind in (TransformType.Jvp, TransformType.Grad) for kind in self.transforms)
        return self.forward_level

    def forward_mode_innermost(self) -> bool:
        """Eager, a forward-mode level open, and torch.func.jvp the innermost transform with
        only vmaps outside it (or no transform): forward mode alone may see the call."""
        if not self.eager or not self.forward_level:
            return False
        if not self.transforms:
            return True
        *outer, inner = self.transforms
        return inner == TransformType.Jvp and all(kind == TransformType.Vmap for kind in outer)


def is_wrapped(t: Any) -> bool:
    """A torch.func transform's tensor (a live or a dead transform's)."""
    return isinstance(t, Tensor) and _wrapped(t)


def unwrapped(t: Tensor) -> Tensor:
    """The plain tensor under torch.func's wrappers: where outer autograd tracks it."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


def plain_tensors(*groups: Any) -> bool:
    """Whether every tensor among the groups is a plain, unwrapped `torch.Tensor`."""
    for group in groups:
        for a in group:
            if isinstance(a, Tensor) and (type(a) is not Tensor or _wrapped(a)):
                return False
    return True


def unseen(*groups: Any) -> bool:
    """Whether nothing but autograd and forward_ad would see an op called now on the
    tensors among `groups`: eager (no compile, no torch.func transform, no function or
    dispatch mode) and every tensor plain. There the dispatcher would only route the call
    back to the op's own work. Asked without building a `Regime`: every call asks it."""
    if torch.compiler.is_compiling() or _transforms_active() or _dispatch_modes() or _function_mode():
        return False
    return plain_tensors(*groups)


def jit_tracing() -> bool:
    """Whether torch.jit.trace is recording (never while Dynamo traces: it cannot trace the
    question, and a compiled graph is not TorchScript)."""
    return not torch.compiler.is_compiling() and _jit_tracing()


def quiet() -> bool:
    """`unseen` without its tensors, and more: eager, no torch.func transform, no function or
    dispatch mode, no forward-mode level, no torch.jit.trace recording (it records what the
    dispatcher sees). A caller that asks this checks the tensors itself and skips the
    dispatcher (the tiles' fast entry, in C++)."""
    return not (torch.compiler.is_compiling() or _transforms_active() or _dispatch_modes() or _function_mode()
                or forward_ad._current_level >= 0 or _jit_tracing())


def forward_level_open() -> bool:
    return forward_ad._current_level >= 0


def outside_dynamo(fn: Any) -> Any:
    """`fn` and all it calls never traced by Dynamo: a Function's forward, backward and jvp,
    and a pass's own work. Under Dynamo a call is the operator (`traced_op`), so Dynamo never
    reaches them; but where torch.compile falls back to eager on a frame (a compiled function
    called under a torch.func transform) it still compiles each frame called from it, and
    would trace into a backend's kernels (Triton's interpreter among them). 0.4 us a call."""
    return torch.compiler.disable(fn)


def carries_tangent(t: Optional[Tensor]) -> bool:
    """Whether `t` is a dual tensor at the open forward-mode level (at level 0 where no
    Python level is open: a compiled graph's)."""
    if t is None:
        return False
    return _unpack_dual(t, max(forward_ad._current_level, 0)).tangent is not None


def called_by_a_graph_run_op_by_op() -> bool:
    """Whether the operator whose kernel asks was called straight from an fx GraphModule that
    holds nothing but operators (AOTAutograd's graph as `aot_eager` runs it). Each of those ran
    eagerly through its own forward-mode formula or raised, so the tangents that reach the
    call are whole. A fusing backend (inductor) calls from its own generated code, and a graph
    that calls modules or other callables may have fused kernels of its own: both are No.
    Reads the callers' frames: the kernel's, torch/_ops.py's `__call__`, then fx's `forward`
    (torch 2.13); a torch that adds a frame between them gives No, never a wrong Yes."""
    frame = sys._getframe(1).f_back  # the kernel's caller
    while frame is not None and frame.f_code.co_filename == _OPS_FILE:
        frame = frame.f_back
    if frame is None or frame.f_code.co_name != "forward":
        return False
    module = frame.f_locals.get("self")
    if not isinstance(module, torch.fx.GraphModule):
        return False
    verdict = _op_by_op.get(module)
    if verdict is None:
        verdict = _op_by_op[module] = all(_an_operator(node) for node in module.graph.nodes)
    return verdict


_OPS_FILE = torch._ops.__file__
_op_by_op: weakref.WeakKeyDictionary[torch.fx.GraphModule, bool] = weakref.WeakKeyDictionary()


def _an_operator(node: torch.fx.Node) -> bool:
    if node.op in ("placeholder", "output", "get_attr"):
        return True
    return node.op == "call_function" and (isinstance(node.target, torch._ops.OpOverload)
                                           or node.target is operator.getitem)


def dispatch_modes() -> bool:
    """Whether a TorchDispatchMode is in force (a fake tensor mode among them)."""
    return _dispatch_modes() > 0


def indexable_under_vmap() -> Any:
    """FlexAttention's context in which `tensor[q_idx]` with a 0-d index works under vmap."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    return TransformGetItemToIndex()


def innermost_saved_tensor_hooks() -> Any:
    """The innermost saved-tensor hooks in force, (pack, unpack), or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def dtensor_op_handlers() -> dict:
    """DTensor's own table of op handlers, by OpOverload (the dict itself, which
    `context_parallel()` copies and restores)."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher._custom_op_handlers


def context_parallel_load_balanced() -> bool:
    """Whether PyTorch's context parallelism is in force (its SDPA handlers installed) and
    shards the sequence in its load-balanced head-tail order."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as context_parallel

    active = torch.ops.aten._scaled_dot_product_flash_attention.default in dtensor_op_handlers()
    return active and context_parallel._cp_options.enable_load_balance


def context_parallel_all_to_all() -> bool:
    """Whether `set_rotate_method("alltoall")` is in force for PyTorch's context parallelism."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as context_parallel

    return context_parallel._cp_options.rotate_method == context_parallel._RotateMethod.ALL_TO_ALL
