"""The backend registry: which backend runs a pass of a call, decided in one place, seen and
chosen by the user.

A backend is a module that registers a `Backend`: its name, why it cannot run on this
machine (if it cannot), which calls it refuses, and its passes (`call.PASSES`: forward,
backward, jvp, forward_jvp, backward_jvp, backward_with_jvp, double_backward), each
`pass(call, **inputs)` with the pass's inputs by name; the fused passes forward_jvp and
backward_with_jvp are optional (`OPTIONAL_PASSES`: where no backend has one, the ops run its
two passes in turn). The ops hand every pass to `run`, which takes
the first registered backend that is allowed, available and takes the call. The ring's
steps come through `run` too; their higher passes carry the whole rows' sums
(`inputs["row_sums"]`, a `call.RingSums`), as a Hessian-vector product's fused passes carry
the sums one leaves the other (a `call.HvpSums`): only a backend with `row_sums=True` is
handed them, and its `refuses` says which it takes. Registered today, in order of
preference:

    "tiles"      the compiled C++ tiles (`backends.cpu_tiles`): CPU, every pass, fast
    "triton"     the Triton kernels (`backends.triton`): CUDA tensors where triton is
                 installed; CPU tensors in Triton's interpreter when chosen alone
    "torch-ops"  PyTorch operators over score tiles (`backends.torch_ops`): every call,
                 on any device; the portable one

`use_backend(...)`, in the manner of `torch.nn.attention.sdpa_kernel`, restricts the
choice while it is active; a call that none of the allowed backends takes raises, naming
each one's reason, instead of silently taking another. `ran` counts what ran, per pass and
backend (`attngrad bench` records it); `list_backends()` lists the registered backends and
whether each runs here.

    with use_backend("torch-ops"):
        out = scaled_dot_product_attention(q, k, v)
    ran.most_common()  # [(('forward', 'torch-ops'), 1)]
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

from .. import tuning
from .call import PASSES, AttentionCall

# A pass only the ring runs: one walk for the double backward's whole-row sums.
RING_PASSES = ("double_backward_row_sums",)
# The passes a backend may leave out: two others fused, which the ops run in turn instead.
OPTIONAL_PASSES = ("forward_jvp", "backward_with_jvp")
# Why a backend refuses a pass of a call (None: it takes it).
Refusal = Callable[[AttentionCall, str, dict], Optional[str]]
# A pass prepared for every call like the one given (`plan`), or None where it has no such.
Planner = Callable[[AttentionCall], Optional[Callable[..., Any]]]


@dataclass(frozen=True)
class Backend:
    """A backend: `passes` maps pass names to `fn(call, **inputs)`; `unavailable()` is None
    where it runs on this machine, else why not (asked at every call, so it may build
    lazily); `refuses(call, pass_name, inputs)` is None where it takes the call, else why
    not; `row_sums`: it may be handed rows' sums (a ring step's higher passes, on a part
    of each row's keys; a Hessian-vector product's, `hvp_fusion.ForwardSums`), and its
    `refuses` says which it takes. `plans` maps pass names to planners (`plan`). What its
    plans depend on beyond the call (the tiles' block sizes) is `Tuning` values, which
    `state()` names."""

    name: str
    passes: dict[str, Callable[..., Any]]
    unavailable: Callable[[], Optional[str]] = lambda: None
    refuses: Refusal = lambda call, pass_name, inputs: None
    row_sums: bool = False
    description: str = ""
    plans: dict[str, Planner] = field(default_factory=dict)


class BackendStatus(NamedTuple):
    name: str
    available: bool
    reason: Optional[str]  # why it does not run here
    description: str


_registry: dict[str, Backend] = {}
_generation = 0  # bumped by every change of the registry: a plan made before it is stale
_allowed: Optional[tuple[str, ...]] = None  # None: every registered backend
ran: collections.Counter = collections.Counter()  # (pass, backend) -> calls


def register(backend: Backend, *, before: Optional[str] = None) -> Backend:
    """Add `backend` to the registry: last in preference, just before the backend `before`,
    or, for a name registered already, in that one's place."""
    unknown = [p for p in backend.passes if p not in PASSES and p not in RING_PASSES]
    if unknown:
        raise ValueError(f"backend {backend.name!r} registers unknown passes {unknown}; the passes are {tuple(PASSES)}")
    if before is not None and before not in _registry:
        raise ValueError(f"no backend {before!r} is registered; the backends are {registered()}")
    names = list(_registry)
    if before is not None:
        names = [n for n in names if n != backend.name]
        names.insert(names.index(before), backend.name)
    elif backend.name not in names:
        names.append(backend.name)
    global _generation
    _generation += 1
    entries = {**_registry, backend.name: backend}
    _registry.clear()
    _registry.update((n, entries[n]) for n in names)
    return backend


def unregister(name: str) -> None:
    """Remove the backend `name` (a test's own, say)."""
    global _generation
    _generation += 1
    _registry.pop(name, None)


def registered() -> tuple[str, ...]:
    """The backends' names, in order of preference."""
    return tuple(_registry)


def list_backends() -> list[BackendStatus]:
    """Every registered backend, whether it runs on this machine, and why not where it does not."""
    statuses = []
    for backend in _registry.values():
        reason = backend.unavailable()
        statuses.append(BackendStatus(backend.name, reason is None, reason, backend.description))
    return statuses


@contextmanager
def use_backend(*names: str) -> Iterator[None]:
    """Allow only the backends `names` ("tiles", "torch-ops", ...) inside the block. Like
    PyTorch's `sdpa_kernel`, the choice is global (autograd's backward runs the passes later,
    and may run them on another thread), so it also governs backward passes run inside the
    block."""
    global _allowed
    unknown = [name for name in names if name not in _registry]
    if unknown or not names:
        raise ValueError(f"use_backend takes one or more of {registered()}; got {names}")
    previous, _allowed = _allowed, tuple(names)
    try:
        yield
    finally:
        _allowed = previous


def use_implementation(*names: str) -> contextlib.AbstractContextManager[None]:
    """`use_backend`'s old name, deprecated: "backend" is the word everywhere else."""
    warnings.warn("attngrad.torch.use_implementation is deprecated; use attngrad.torch.use_backend, which takes the "
                  "same names", FutureWarning, stacklevel=2)
    return use_backend(*names)


def allowed() -> tuple[str, ...]:
    """The backends a call may take now."""
    return registered() if _allowed is None else tuple(n for n in _allowed if n in _registry)


def _refusal(backend: Backend, call: AttentionCall, pass_name: str, inputs: dict) -> Optional[str]:
    if pass_name not in backend.passes:
        return f"it has no {pass_name} pass"
    if inputs.get("row_sums") is not None and not backend.row_sums:
        return "it takes no rows' sums (a ring step's higher passes on a part of each row's keys)"
    reason = backend.unavailable()
    if reason is not None:
        return f"it is unavailable ({reason})"
    return backend.refuses(call, pass_name, inputs)


def choose(pass_name: str, call: AttentionCall, inputs: Optional[dict] = None) -> Backend:
    """The backend that runs this pass of this call."""
    inputs = inputs or {}
    reasons = []
    for name in allowed():
        backend = _registry[name]
        reason = _refusal(backend, call, pass_name, inputs)
        if reason is None:
            return backend
        reasons.append(f"{name}: {reason}")
    raise RuntimeError(f"attngrad: no allowed backend runs this {pass_name} call ({call.q.dtype} on {call.q.device}); "
                       f"allowed: {allowed()}; " + "; ".join(reasons))


def offered(pass_name: str, call: AttentionCall, inputs: Optional[dict] = None) -> bool:
    """Whether an allowed backend runs this pass of this call (a fused pass that the ops
    compose from two others where none does)."""
    inputs = inputs or {}
    return any(_refusal(_registry[name], call, pass_name, inputs) is None for name in allowed())


def run(pass_name: str, call: AttentionCall, **inputs: Any) -> Any:
    """Run pass `pass_name` of `call` on the first backend that takes it, counted in `ran`."""
    backend = choose(pass_name, call, inputs)
    ran[(pass_name, backend.name)] += 1
    return backend.passes[pass_name](call, **inputs)


_states: dict[tuple, int] = {}


def state() -> int:
    """What the backends' choice and their plans depend on beyond a call, as an int: the
    registry, the backends allowed, and every backend's settings, which are `Tuning` values
    (the tiles' block sizes), named together by `tuning.in_force()`. One int, so that a
    plan's key is cheap to make and to compare (in C++ too: `eager_plans.unmasked`)."""
    key = (_generation, _allowed, tuning.in_force())
    serial = _states.get(key)
    if serial is None:
        serial = _states[key] = len(_states)
    return serial


def plan(pass_name: str, call: AttentionCall) -> Optional[Callable[..., Any]]:
    """Pass `pass_name` prepared, by the backend `choose` takes, for every call that differs
    from `call` only in its tensors' values (the same sizes, strides, dtypes and options, the
    same `state()`): prepared(q, k, v) runs it, counted in `ran`. None where that backend
    has no plan for it. An eager caller keeps one per signature (`eager_plans`). A prepared
    pass may also offer `publish(query, key, value, *arguments)`: it puts itself in its
    backend's fast entry, keyed by the public call's own arguments, and returns the entry,
    whose forward(query, key, value, *arguments) runs it for every such call and returns
    None for one not in the entry (`eager_plans.unmasked`), and whose clear() forgets what
    was published; here the entry's forward is returned, counted, with its clear."""
    backend = choose(pass_name, call)
    planner = backend.plans.get(pass_name)
    prepared = planner(call) if planner is not None else None
    if prepared is None:
        return None
    counted = (pass_name, backend.name)

    def run(*tensors: Any) -> Any:
        ran[counted] += 1
        return prepared(*tensors)

    publish = getattr(prepared, "publish", None)
    if publish is not None:
        def published(*arguments: Any) -> Callable[..., Optional[Any]]:
            entry = publish(*arguments)
            forward = entry.forward

            def counted_forward(*call: Any) -> Optional[Any]:
                out = forward(*call)
                if out is not None:
                    ran[counted] += 1
                return out

            counted_forward.clear = entry.clear
            return counted_forward

        run.publish = published
    return run
