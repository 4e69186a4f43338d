"""attngrad.torch.distributed: exact attention over a sequence sharded across processes,
with every derivative of the one-process op (backward, a bias's gradient, JVP, double
backward, Hessian-vector products) and dropout masks equal to the one-process call's.

    shard_sequence / gather_sequence   a whole sequence to this rank's shard and back
                                       ("contiguous" or "zigzag" chunks)
    ring_attention                     key/value blocks travel round the ring (`ring_passes`)
    all_to_all_attention               sequence shards traded for head groups (Ulysses)

One code path for gloo (CPU) and NCCL (GPU): point-to-point by batch_isend_irecv, and
all_to_all_single. A rank that dies or stalls makes the others raise after the process
group's timeout.

DTensors sharded along the sequence (PyTorch's `context_parallel()`, or a model's own) run
the same ring from attngrad's ordinary entry points (`dtensor_passes`, registered here).
"""

from . import dtensor_passes
from .ring import ring_attention
from .sharding import gather_sequence, shard_sequence
from .ulysses import all_to_all_attention

dtensor_passes.register()

__all__ = ["all_to_all_attention", "gather_sequence", "ring_attention", "shard_sequence"]
