"""Passing tensors round a ring of ranks: each sends to the next and receives from the
previous, by `batch_isend_irecv` (gloo on CPU, NCCL on GPU alike), while the caller works.

`waited` adds up the seconds spent waiting on communication: transfers not yet done,
and the blocking collectives (`attngrad bench` reports it as a share of the time).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

waited = [0.0]  # seconds this process spent waiting on communication (transfers, all-to-alls, checks)


class Transfer:
    """Tensors on their way from the previous rank; `wait()` returns them when they are here."""

    def __init__(self, requests: list, received: list[Tensor]) -> None:
        self.requests, self.received = requests, received

    def wait(self) -> list[Tensor]:
        start = time.perf_counter()
        for request in self.requests:
            request.wait()  # raises after the group's timeout if a peer is gone
        waited[0] += time.perf_counter() - start
        return self.received


class Ring:
    """The ranks of `group` in a ring: rank r sends to r + 1 and receives from r - 1."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def owner(self, step: int) -> int:
        """Whose block a rank holds at step `step`: its own at 0, then its predecessors'."""
        return (self.rank - step) % self.size

    def pass_on(self, tensors: Sequence[Tensor]) -> Transfer:
        """Send `tensors` to the next rank and receive the same shapes from the previous."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        requests = dist.batch_isend_irecv(ops) if ops else []
        return Transfer(requests, received)


FACT_WIDTH = 8  # integers per fact: a shape of up to 7 dimensions and its rank


def agree(group: dist.ProcessGroup, what: str, facts: dict[str, Sequence[int]], seed: Optional[int] = None) -> int:
    """Check, before any exchange, that every rank of `group` calls with the same `facts`
    (shapes and options, as integers; the same names on every rank); raise on every rank,
    naming the first rank that differs and what it and rank 0 sent. Returns rank 0's `seed`,
    so that every rank draws the same dropout masks."""
    rows = []
    for fact in facts.values():
        fact = list(fact)[: FACT_WIDTH - 1]
        rows.append([len(fact), *fact, *([-1] * (FACT_WIDTH - 1 - len(fact)))])
    mine = torch.tensor([x for row in rows for x in row] + [0 if seed is None else seed], dtype=torch.int64)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    everyone = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=torch.int64, device=device)
    start = time.perf_counter()
    dist.all_gather_single(everyone, mine.to(device), group=group)
    waited[0] += time.perf_counter() - start
    everyone = everyone.cpu().view(-1, mine.numel())

    def said(rank: int) -> str:
        table = everyone[rank, :-1].view(len(rows), FACT_WIDTH).tolist()
        return ", ".join(f"{name} {tuple(row[1:1 + row[0]])}" for name, row in zip(facts, table))

    differ = [r for r in range(everyone.shape[0]) if not torch.equal(everyone[r, :-1], everyone[0, :-1])]
    if differ:
        raise ValueError(f"{what}: the ranks disagree: rank {differ[0]} has {said(differ[0])}; rank 0 has {said(0)} "
                         f"(this is rank {dist.get_rank(group)})")
    return int(everyone[0, -1])
