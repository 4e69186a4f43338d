"""attngrad's passes on DTensors (`torch.distributed.tensor`): what PyTorch's context
parallelism hands attention, and what a model written with DTensors passes it.

Each pass op (`ops.OPS`: forward, backward, JVP, the fused ones, double backward) gets a
DTensor op handler, DTensor's own mechanism for operators that no sharding rule describes
(PyTorch's ring SDPA registers the same way). autograd and forward mode stay above, at
DTensor level, in the one-process Functions; each pass they call runs here on the local
shards:

    q, k, v sharded along the sequence, Shard(2) of (B, H, L, E), on one mesh dimension
        (Replicate or Shard(0), the batch, on any other): the pass round the ring of that
        dimension's group (`ring_passes`), its results sharded as its inputs
    every DTensor replicated: the one-process pass on the local tensors, replicated

A mask or bias is this rank's query rows, Shard(2) of (B, H, L, L) with the keys whole, or
replicated (a mask also a plain tensor) and the same for every row (size 1 along the rows); the
gradient of a replicated bias is each rank's part of it (Partial: summed where it is used).
The structured masks (key_padding, window, document_ids, cu_seqlens) are given over the
whole sequence, as in one process. Any other placement, sink logits, a block mask or a
causal diagonal other than the whole sequence's raises NotImplementedError naming it.

The sequence's order: inside `context_parallel()` with load balancing (PyTorch's head-tail
order, a rank holding chunks r and 2P - 1 - r) the ring takes attngrad's "zigzag" layout,
which is that order; otherwise "contiguous".

Where PyTorch's context parallelism is set to rotate by all-to-all
(`set_rotate_method("alltoall")`), a pass trades the sequence for heads instead
(`dtensor_all_to_all`: Ulysses), the same numbers with other communication, wherever the
heads split over the ranks and there is no dropout; elsewhere the ring runs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .. import regime
from ..op import ops
from ..op.call import FIELDS, PASSES, AttentionCall, ScoreMasks
from . import dtensor_all_to_all
from .ring_comm import Ring, agree
from .ring_passes import ring_backward, ring_backward_jvp, ring_double_backward, ring_forward, ring_jvp
from .ring_plan import RingPlan
from .sharding import Sharding

SEQUENCE = 2  # the sequence axis of q, k, v, out and the row statistics (B, H, L, .), and a mask's rows


def _placements(t: Any) -> Optional[tuple]:
    return tuple(t.placements) if isinstance(t, DTensor) else None


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def _describe(call: AttentionCall) -> str:
    return (f"query {_placements(call.q)}, key {_placements(call.k)}, value {_placements(call.v)}"
            + "".join(f", {name} {_placements(t)}" for name, t in (("mask", call.mask), ("bias", call.bias))
                      if t is not None))


def _ring_dimension(call: AttentionCall) -> Optional[int]:
    """The mesh dimension q, k and v are sharded along the sequence on (None: replicated
    everywhere); a NotImplementedError for any placement the passes cannot take."""
    placements = {_placements(t) for t in (call.q, call.k, call.v)}
    if len(placements) != 1 or None in placements:
        raise NotImplementedError(f"attngrad attention on DTensors takes query, key and value as DTensors of one "
                                  f"placement; got {_describe(call)}")
    (placement,) = placements
    ring = [d for d, p in enumerate(placement) if p == Shard(SEQUENCE)]
    others = [p for p in placement if p != Shard(SEQUENCE) and p not in (Replicate(), Shard(0))]
    if len(ring) > 1 or others:
        raise NotImplementedError(f"attngrad attention on DTensors takes query, key and value sharded along the "
                                  f"sequence (Shard({SEQUENCE}) of (B, H, L, E)) on one mesh dimension, replicated "
                                  f"or sharded along the batch (Shard(0)) on the others; got {_describe(call)}")
    meshes = {t.device_mesh for t in (call.q, call.k, call.v)}
    if len(meshes) != 1:
        raise NotImplementedError(f"attngrad attention on DTensors takes query, key and value on one device mesh; "
                                  f"got {len(meshes)}")
    return ring[0] if ring else None


def _check_score_tensors(call: AttentionCall, dimension: Optional[int]) -> None:
    """A mask or bias as the module says; the structured masks' key bounds (plain tensors of
    the whole sequence's rows); no sinks or block mask."""
    for name, value in (("sinks", call.sinks), ("a block mask", call.blocks)):
        if value is not None:
            raise NotImplementedError(f"attngrad attention on DTensors takes no {name} yet")
    if isinstance(call.bounds, DTensor):
        raise NotImplementedError("attngrad attention on DTensors takes the structured masks' inputs (key_padding, "
                                  "document_ids, cu_seqlens) as plain tensors of the whole sequence")
    for name, t in (("mask", call.mask), ("bias", call.bias)):
        if t is None:
            continue
        placement = _placements(t)
        if placement != _placements(call.q):
            # the same for every row: replicated, or a plain tensor (a padding mask made from key_padding)
            plain = placement is None and name == "mask"
            rows_alike = t.shape[-2] == 1 and (plain or placement is not None and all(p == Replicate() for p in placement))
            if dimension is None and placement is not None or not rows_alike:
                raise NotImplementedError(
                    f"attngrad attention on DTensors takes a {name} as this rank's query rows (placed as the query) "
                    f"or replicated and the same for every row; got {_describe(call)}")
    if dimension is not None and call.causal not in (None, 0):
        raise NotImplementedError(f"attngrad attention on DTensors runs the whole sequence's causal mask alone; got the "
                                  f"diagonal {call.causal}")


def _layout() -> str:
    """zigzag inside `context_parallel()` with load balancing (its head-tail order), else
    contiguous."""
    return "zigzag" if regime.context_parallel_load_balanced() else "contiguous"


def _placed_as_its_input(call: AttentionCall, name: str, value: Any) -> Any:
    """A pass input placed as the call's tensor it is shaped like (`FIELDS`' like): a
    cotangent autograd hands back Partial (that of a shared bias's gradient) summed first."""
    if not isinstance(value, DTensor):
        return value
    source = {"q": call.q, "out": call.q, "rows": call.q, "k": call.k, "v": call.v, "bias": call.bias}.get(
        FIELDS[name].like)
    if not isinstance(source, DTensor) or tuple(value.placements) == tuple(source.placements):
        return value
    return value.redistribute(source.device_mesh, source.placements)


def _ring_plan(pass_name: str, call: AttentionCall, local: AttentionCall, dimension: int) -> RingPlan:
    mesh = call.q.device_mesh
    ring = Ring(mesh.get_group(dimension))
    if call.seed.dim() != 0:
        raise NotImplementedError("attngrad attention on DTensors takes a whole call's dropout seed, not a ring step's")
    facts = dict(query=tuple(local.q.shape), key=tuple(local.k.shape), value=tuple(local.v.shape))
    # every rank draws with rank 0's seed, and the ranks' calls must agree (one collective)
    seed = agree(ring.group, f"attngrad attention_{pass_name} on DTensors", facts, int(local.seed))
    sharding = Sharding(_layout(), ring.size, local.q.shape[SEQUENCE] * ring.size)
    bounds = local.bounds  # the whole sequence's rows: this rank's, which the ring takes
    if bounds is not None:
        bounds = bounds[:, sharding.positions(ring.rank, bounds.device)]
    masks = ScoreMasks(mask=local.mask, bias=local.bias, bounds=bounds, causal=local.causal, softcap=local.softcap,
                       sink=local.sink)
    return RingPlan(ring, sharding, masks, seed, local.scale, local.dropout_p)


def _ring_pass(pass_name: str, plan: RingPlan, call: AttentionCall, inputs: dict) -> tuple:
    """The pass round the ring, its results as the op's (`PASSES`; None where absent)."""
    q, k, v = call.q, call.k, call.v
    if pass_name == "forward":
        return ring_forward(plan, q, k, v)
    if pass_name in ("jvp", "forward_jvp"):
        out, row_max, inv_sum = ring_forward(plan, q, k, v)  # the ring's JVP centres each row on O
        out_t = ring_jvp(plan, q, k, v, **{**inputs, "out": out, "row_max": row_max, "inv_sum": inv_sum})[0]
        return (out_t,) if pass_name == "jvp" else (out, row_max, inv_sum, out_t)
    grads = (*ring_backward(plan, q, k, v, **inputs), None) if pass_name in ("backward", "backward_with_jvp") else ()
    if pass_name == "backward":
        return grads
    if pass_name in ("backward_jvp", "backward_with_jvp"):
        return (*grads, *ring_backward_jvp(plan, q, k, v, **inputs)[:4], None)
    return ring_double_backward(plan, q, k, v, **inputs)[:5] + (None,)


def _wrap(pass_name: str, call: AttentionCall, results: Any, dimension: Optional[int]) -> Any:
    """The local results as DTensors placed as the inputs they are shaped like; an absent one
    (None or empty) an empty replicated DTensor, as the op returns an empty tensor."""
    mesh = call.q.device_mesh
    single = len(PASSES[pass_name].outputs) == 1  # the op returns the tensor itself
    wrapped = []
    for output, r in zip(PASSES[pass_name].outputs, (results,) if isinstance(results, Tensor) else results):
        if r is None or r.numel() == 0 and output.like != "out":
            local = call.q.to_local().new_empty(0)
            wrapped.append(DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False))
            continue
        source = {"q": call.q, "out": call.q, "rows": call.q, "k": call.k, "v": call.v, "bias": call.bias}[output.like]
        placements = list(source.placements)
        if output.like == "bias" and dimension is not None and placements[dimension] == Replicate():
            placements[dimension] = Partial()  # a bias every rank shares: each rank's rows' part of its gradient
        wrapped.append(DTensor.from_local(r.contiguous(), mesh, placements, run_check=False))
    return wrapped[0] if single else tuple(wrapped)


def _handler(pass_name: str):
    def handle(op_call: Any, args: tuple, kwargs: dict) -> Any:
        call, inputs = ops.split_fields(pass_name, args, kwargs)
        dimension = _ring_dimension(call)
        _check_score_tensors(call, dimension)
        local = call.with_tensors([_local(t) for t in call.tensor_slots()])
        local_inputs = {name: _local(_placed_as_its_input(call, name, value)) for name, value in inputs.items()}
        if dimension is None:  # replicated: every rank runs the whole call
            return _wrap(pass_name, call, ops.run_pass(pass_name, local, local_inputs), None)
        lowered = {name: value for name, value in local_inputs.items() if name not in ("tsinks", "gsinks")}
        group = call.q.device_mesh.get_group(dimension)
        if regime.context_parallel_all_to_all() and dtensor_all_to_all.takes(local, dist.get_world_size(group)):
            facts = dict(query=tuple(local.q.shape), key=tuple(local.k.shape), value=tuple(local.v.shape))
            agree(group, f"attngrad attention_{pass_name} on DTensors", facts)
            return _wrap(pass_name, call, dtensor_all_to_all.run(pass_name, local, lowered, group, _layout()), dimension)
        plan = _ring_plan(pass_name, call, local, dimension)
        return _wrap(pass_name, call, _ring_pass(pass_name, plan, local, lowered), dimension)

    return handle


def register() -> None:
    """Hand DTensor's dispatcher a handler for each pass op. The handlers go into the dict
    DTensor reads, in place: PyTorch's context parallelism keeps that dict and restores it
    when its context ends, so handlers added to it outlive the context."""
    handlers = regime.dtensor_op_handlers()
    for pass_name, op in ops.OPS.items():
        handlers[op._opoverload] = _handler(pass_name)
