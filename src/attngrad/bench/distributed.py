"""`attngrad bench --distributed`: ring attention (both layouts) and all-to-all attention on
P local processes, beside one process doing the same total work.

Every rank runs one thread, so a world of P uses P cores and the comparison is
compute-normalised: efficiency = t_one / (min(P, cores) t_P), where t_one is one process
with one thread on the whole sequence. The one-process run happens inside the same world,
on rank 0 while the others wait at a barrier, interleaved round by round with the
distributed runs, so both see the same machine. Each step is a forward and backward of
float32 (B, H, L, d) attention with random upstream gradients.

Per rank: the time waiting for communication (transfers not yet done, all-to-alls, the
shape check), as a share of the step; and the peak memory of one step, measured as
`memory` does for one process (in a fresh world per method, after a small warm-up step:
the growth of the peak resident set less the step's own output and gradients).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

METHODS = ("ring-contiguous", "ring-zigzag", "all-to-all")


@dataclass(frozen=True)
class DistributedCase:
    world: int
    length: int  # the whole sequence
    causal: bool = True
    batch: int = 1
    heads: int = 8
    dim: int = 64

    @property
    def name(self) -> str:
        return f"P={self.world} L={self.length}" + ("" if self.causal else " full")


def _step(fn: Callable, inputs: list, dout: Any) -> None:
    import torch

    primals = [t.detach().requires_grad_() for t in inputs]
    out = fn(*primals)
    torch.autograd.backward(out, dout)


def _methods(case: DistributedCase, rank: int) -> tuple[dict[str, Callable], dict[str, list], list]:
    """Each method's function and this rank's (q, k, v, dout) shards; the whole (q, k, v, dout)."""
    import torch

    from ..torch import attention
    from ..torch.distributed import all_to_all_attention, ring_attention, shard_sequence

    g = torch.Generator().manual_seed(0)
    shape = (case.batch, case.heads, case.length, case.dim)
    whole = [torch.randn(*shape, generator=g) for _ in range(4)]
    methods: dict[str, Callable] = {"one-process": lambda a, b, c: attention(a, b, c, is_causal=case.causal)}
    shards: dict[str, list] = {"one-process": whole}
    for method in METHODS:
        layout = "zigzag" if method.endswith("zigzag") else "contiguous"
        shards[method] = [shard_sequence(t, layout=layout, dim=2).contiguous() for t in whole]
        if method.startswith("ring"):
            methods[method] = lambda a, b, c, layout=layout: ring_attention(a, b, c, is_causal=case.causal, layout=layout)
        else:
            methods[method] = lambda a, b, c: all_to_all_attention(a, b, c, is_causal=case.causal)
    return methods, shards, whole


def _rank_memory(rank: int, world: int, case: DistributedCase, method: str) -> float:
    """Peak memory of one step of `method` on this rank, in MiB, as `memory.measure_here`:
    the peak's growth less the step's output and gradients (4 shard-sized tensors)."""
    from dataclasses import replace

    from .memory import peak_rss_bytes, reset_peak

    warm = replace(case, length=case.world * 2 * 16)
    fns, shards, _ = _methods(warm, rank)
    _step(fns[method], *_split(shards[method]))
    fns, shards, _ = _methods(case, rank)
    inputs, dout = _split(shards[method])
    baseline = reset_peak()
    _step(fns[method], inputs, dout)
    return (peak_rss_bytes() - baseline - 4 * dout.numel() * dout.element_size()) / 2**20


def _split(shards: list) -> tuple[list, Any]:
    return shards[:3], shards[3]


def _rank_bench(rank: int, world: int, case: DistributedCase, rounds: int) -> dict:
    """On every rank: `rounds` rounds of each method and of the one-process run on rank 0."""
    import torch.distributed as dist

    from ..torch.distributed import ring_comm

    methods, shards, whole = _methods(case, rank)
    times: dict[str, list[float]] = {m: [] for m in ("one-process", *METHODS)}
    waits: dict[str, list[float]] = {m: [] for m in METHODS}
    for round_ in range(rounds + 1):  # the first round warms up (and compiles the tiles once)
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            _step(methods["one-process"], *_split(whole))
            elapsed = time.perf_counter() - start
            if round_:
                times["one-process"].append(elapsed)
        dist.barrier()
        for method in METHODS:
            inputs, d = _split(shards[method])
            dist.barrier()
            waited, start = ring_comm.waited[0], time.perf_counter()
            _step(methods[method], inputs, d)
            elapsed = time.perf_counter() - start
            if round_:
                times[method].append(elapsed)
                waits[method].append((ring_comm.waited[0] - waited) / elapsed)
    return dict(times={m: statistics.median(t) for m, t in times.items() if t},
                waits={m: statistics.median(w) for m, w in waits.items()})


def run_distributed(cases: list[DistributedCase], rounds: int = 3,
                    progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    """Each case's per-method time (the slowest rank's median), efficiency, waiting share
    and per-rank peak memory."""
    from ..torch.distributed.launch import spawn

    cores = os.cpu_count() or 1
    report = []
    for case in cases:
        if progress:
            progress(f"{case.name}: {case.world} processes, {rounds} rounds")
        ranks = spawn(case.world, _rank_bench, case, rounds, threads=1, timeout=3600, collective_timeout=1800)
        one = ranks[0]["times"]["one-process"]
        memory = {}
        for method in ("one-process", *METHODS):
            if progress:
                progress(f"{case.name}: peak memory of {method}")
            world = 1 if method == "one-process" else case.world
            memory[method] = max(spawn(world, _rank_memory, case, method, threads=1, timeout=3600, collective_timeout=1800))
        for method in METHODS:
            t = max(r["times"][method] for r in ranks)
            report.append(dict(case=asdict(case), name=case.name, method=method, seconds=t, one_process_seconds=one,
                               efficiency=one / (min(case.world, cores) * t),
                               waiting=max(r["waits"][method] for r in ranks),
                               memory_mib=memory[method], one_process_memory_mib=memory["one-process"]))
    return report


def write_distributed(report: list[dict], folder: Path, header: list[str], lines: list[list[str]]) -> list[Path]:
    """distributed.json (the figures and the machine) and distributed.md (the table)."""
    from .runner import machine_facts

    folder.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()
    json_path, md_path = folder / "distributed.json", folder / "distributed.md"
    json_path.write_text(json.dumps(dict(machine=facts, cases=report), indent=2) + "\n")
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    table += ["| " + " | ".join(line) + " |" for line in lines]
    md_path.write_text(f"{facts['processor']}, {os.cpu_count()} cores, torch {facts['torch']}, {facts['date']}\n\n"
                       + "\n".join(table) + "\n")
    return [json_path, md_path]


def docs_section(report: list[dict], command: str, header: list[str], lines: list[list[str]]) -> str:
    """The Markdown of one --distributed run for docs/bench.md: the command, the machine,
    the table, and where a method loses (efficiency below 75%, or waiting over a quarter
    of the step), computed from the run."""
    from .runner import machine_facts

    facts = machine_facts()
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    table += ["| " + " | ".join(line) + " |" for line in lines]
    losses = [f"- {r['name']} {r['method']}: efficiency {r['efficiency']:.0%}, waiting {r['waiting']:.0%} of the step."
              for r in report if r["efficiency"] < 0.75 or r["waiting"] > 0.25]
    parts = [f"`{command}`", "",
             f"{facts['processor']}, {os.cpu_count()} cores, torch {facts['torch']}, {facts['date']}; float32 causal "
             "fwd+bwd, B=1 H=8 d=64, one thread per rank. efficiency = one-process time / (min(P, cores) x distributed "
             "time); waiting = the share of the step spent waiting on communication; MiB/rank = peak memory per rank "
             "in fresh processes.", "", *table, ""]
    parts.append("Where we lose in this run (efficiency below 75%, or waiting over a quarter of the step):" if losses
                 else "Where we lose in this run: every method kept 75% efficiency or more.")
    return "\n".join(parts + ["", *losses])
