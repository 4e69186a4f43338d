"""A `replace_sdpa()` block carried into the recomputation of `torch.utils.checkpoint`.

Activation checkpointing runs a block's forward twice: once under the user's context, and
again in the backward, where autograd recomputes what it did not keep. A TorchFunctionMode
is not part of what checkpoint restores for the recomputation (it restores the RNG state,
autocast and the device context), so a second forward outside the `with` block would run
PyTorch's own kernel: another number of saved tensors (checkpoint's CheckpointError), or a
backward on another kernel than the forward's.

So where the mode takes an SDPA call inside a checkpointed forward, it makes that
checkpoint's recomputation run under the same mode (`follow`):

    non-reentrant (use_reentrant=False, the default; selective checkpointing, diffusers',
        timm's and transformers' gradient checkpointing): the innermost saved-tensor hooks
        are checkpoint's, whose pack hook holds its `_CheckpointFrame`; its `recompute_fn`
        is wrapped.
    reentrant (use_reentrant=True): the forward runs inside `CheckpointFunction.forward`,
        under no_grad; its ctx's `run_function` is wrapped.

Private torch structures read here (torch 2.1 - 2.13, listed with the rest in `regime`): the
closure of checkpoint's pack hook holding a `torch.utils.checkpoint._CheckpointFrame` with
`recompute_fn`, and `CheckpointFunction.forward`'s `ctx.run_function`. Where they are not as
expected, `follow` returns False and the caller says so (`replace_sdpa`'s strict mode raises).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as checkpoint
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from . import regime

_FRAME = getattr(checkpoint, "_CheckpointFrame", None)
_REENTRANT_FORWARD = checkpoint.CheckpointFunction.forward.__code__
_MARK = "_attngrad_sdpa_mode"  # set on what was wrapped: once per checkpoint
_DEPTH = 96  # frames searched for a reentrant checkpoint's forward (a no_grad call's cost: ~3 us)


def _under(mode: TorchFunctionMode, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run with `mode` in force, unless it already is (a backward inside the block)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if any(m is mode for m in _get_current_function_mode_stack()):
            return fn(*args, **kwargs)
        with mode:
            return fn(*args, **kwargs)

    return run


def _non_reentrant_frame() -> Any:
    """The innermost non-reentrant checkpoint's frame whose forward is running, or None."""
    hooks = regime.innermost_saved_tensor_hooks()
    if not hooks or _FRAME is None:
        return None
    for cell in getattr(hooks[0], "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(contents, _FRAME):
            return contents
    return None


def _reentrant_ctx() -> Any:
    """The ctx of the innermost reentrant checkpoint whose forward is running, or None."""
    frame = sys._getframe(2)
    for _ in range(_DEPTH):
        if frame is None:
            return None
        if frame.f_code is _REENTRANT_FORWARD:
            return frame.f_locals.get("ctx")
        frame = frame.f_back
    return None


def inside_checkpoint() -> bool:
    """Whether a checkpointed forward is running (either kind)."""
    return _non_reentrant_frame() is not None or (not torch.is_grad_enabled() and _reentrant_ctx() is not None)


def follow(mode: TorchFunctionMode) -> bool:
    """Make the recomputation of the checkpoint whose forward runs now (if any) run under
    `mode`. False where a checkpointed forward runs but its recomputation cannot be reached."""
    frame = _non_reentrant_frame()
    if frame is not None:
        if getattr(frame, _MARK, None) is not mode:
            frame.recompute_fn = _under(mode, frame.recompute_fn)
            setattr(frame, _MARK, mode)
        return True
    if torch.is_grad_enabled():  # a reentrant checkpoint's forward runs under no_grad
        return True
    ctx = _reentrant_ctx()
    if ctx is None:
        return True
    if not hasattr(ctx, "run_function"):
        return False
    if getattr(ctx, _MARK, None) is not mode:
        ctx.run_function = _under(mode, ctx.run_function)
        setattr(ctx, _MARK, mode)
    return True
