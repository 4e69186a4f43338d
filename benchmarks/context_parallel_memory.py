"""Peak memory that attention adds per rank under context parallelism: one forward and
backward of causal attention on DTensors sharded along the sequence (attngrad's passes
round the ring, `distributed.dtensor_passes`) on P gloo ranks, beside the same call on the
whole sequence in one process; each measured as the growth of the process's peak resident
memory over the step, less what the step must allocate anyway (the output and the
gradients of q, k and v: `bench.memory`'s convention), in a fresh process.

    python benchmarks/context_parallel_memory.py [--length 8192] [--world 2] [--rotate alltoall]

--rotate alltoall sets PyTorch's `set_rotate_method("alltoall")`: each pass trades the
sequence for heads (`distributed.dtensor_all_to_all`) instead of going round the ring.
Prints one line per rank and one for the single process, with the scores' size for
comparison: an O(L^2 / P) algorithm would add B H L^2 / P numbers per rank.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

B, H, E = 1, 4, 64
DTYPE = torch.float32


def _required(length: int) -> int:
    """The output and the three gradients: what any algorithm allocates."""
    return 4 * B * H * length * E * DTYPE.itemsize


def _step(q, k, v, dout) -> None:
    from attngrad.torch import attention

    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, is_causal=True)
    torch.autograd.grad(out, leaves, dout)


def _inputs(length: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, length, E, generator=g, dtype=DTYPE) for _ in range(4)]


def ring_rank(rank: int, world: int, length: int, rotate: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    from attngrad.bench.memory import peak_rss_bytes, reset_peak

    set_rotate_method(rotate)
    mesh = init_device_mesh("cpu", (world,))
    _step(*(distribute_tensor(t, mesh, [Shard(2)]) for t in _inputs(64 * world)))  # warm: every kernel loaded
    inputs = [distribute_tensor(t, mesh, [Shard(2)]) for t in _inputs(length)]
    baseline = reset_peak()
    _step(*inputs)
    return dict(growth=peak_rss_bytes() - baseline, required=_required(length // world))


def single(length: int) -> dict:
    from attngrad.bench.memory import peak_rss_bytes, reset_peak

    _step(*_inputs(64))
    inputs = _inputs(length)
    baseline = reset_peak()
    _step(*inputs)
    return dict(growth=peak_rss_bytes() - baseline, required=_required(length))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rotate", choices=("allgather", "alltoall"), default="allgather",
                        help="PyTorch's set_rotate_method (allgather, its default: attngrad's ring)")
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)  # the fresh process's part
    args = parser.parse_args()
    if args.single:
        print(json.dumps(single(args.length)))
        return
    from attngrad.torch.distributed.launch import spawn

    mib = 2.0**20
    scores = B * H * args.length * args.length * DTYPE.itemsize
    print(f"causal attention, B={B} H={H} E={E} L={args.length} float32; the scores: {scores / mib:.0f} MiB, "
          f"{scores / args.world / mib:.0f} MiB per rank of {args.world}; set_rotate_method({args.rotate!r})")
    for rank, r in enumerate(spawn(args.world, ring_rank, args.length, args.rotate, timeout=600,
                                   collective_timeout=300)):
        print(f"rank {rank} of {args.world}: {max(0, r['growth'] - r['required']) / mib:6.1f} MiB beyond the "
              f"{r['required'] / mib:.0f} MiB of output and gradients")
    done = subprocess.run([sys.executable, __file__, "--single", "--length", str(args.length)], check=True,
                          capture_output=True, text=True)
    r = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"one process:     {max(0, r['growth'] - r['required']) / mib:6.1f} MiB beyond the "
          f"{r['required'] / mib:.0f} MiB of output and gradients")


if __name__ == "__main__":
    main()
