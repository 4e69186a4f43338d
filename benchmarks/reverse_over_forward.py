"""The gradient through a JVP (reverse over forward): torch.func.grad of <c, J t>, J the
Jacobian of causal attention at (q, k, v) and t random tangents, with respect to q, k, v and
the tangents. Sliced score matching, Jacobian penalties and consistency losses that keep
du/dt's gradient take it every step. B=1, H=8, d=64, float32, causal.

    attngrad  `attngrad.torch.attention`: forward + JVP in one pass, then one backward_with_jvp
              pass for the cotangent, O(L) memory
    math      PyTorch's math path (`sdpa_kernel(SDPBackend.MATH)`), which writes out every
              L x L matrix; its default CPU kernel has no forward mode

Time: the median of --repeats runs of each, interleaved in one process. Memory: a fresh
process per case, its peak resident memory growth over one step beyond the six gradients
it returns. The bar at L=4096: attngrad's memory <= 1/10 of the math path's, its time
<= 0.5x.

    python benchmarks/reverse_over_forward.py [--lengths 1024 4096] [--repeats 3] [--docs docs/bench.md]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attngrad.bench.programs import extra_mib_in_fresh_process, interleaved_medians, report

BATCH, HEADS, DIM = 1, 8, 64
IMPLEMENTATIONS = ("attngrad", "math")


def _step(length: int) -> Callable[[str], tuple[torch.Tensor, ...]]:
    """Inputs of one length; returns run(implementation) -> the six gradients."""
    from attngrad.torch import attention

    generator = torch.Generator().manual_seed(0)
    primals = [torch.randn(BATCH, HEADS, length, DIM, generator=generator) for _ in range(3)]  # (B, H, L, d)
    tangents = [torch.randn(BATCH, HEADS, length, DIM, generator=generator) for _ in range(3)]
    cotangent = torch.randn(BATCH, HEADS, length, DIM, generator=generator)

    def math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    functions = {"attngrad": lambda q, k, v: attention(q, k, v, is_causal=True), "math": math}

    def run(implementation: str) -> tuple[torch.Tensor, ...]:
        fn = functions[implementation]

        def through_jvp(q, k, v, tq, tk, tv):
            return (torch.func.jvp(fn, (q, k, v), (tq, tk, tv))[1] * cotangent).sum()

        return torch.func.grad(through_jvp, argnums=tuple(range(6)))(*primals, *tangents)

    return run


def memory_of(implementation: str, length: int) -> dict:
    """In this process (a fresh one): peak growth of one step beyond its six gradients."""
    from attngrad.bench.memory import peak_rss_bytes, reset_peak

    run = _step(length)
    _step(64)(implementation)  # loads every library and kernel before the baseline
    baseline = reset_peak()
    grads = run(implementation)
    growth = peak_rss_bytes() - baseline
    required = sum(g.nbytes for g in grads)
    return {"extra_mib": max(0, growth - required) / 2**20, "required_mib": required / 2**20}


def times_of(length: int, repeats: int) -> dict[str, float]:
    """Median seconds per step of each implementation, interleaved, after one warm-up each."""
    return interleaved_medians(_step(length), IMPLEMENTATIONS, repeats)


def agreement(length: int) -> float:
    """The largest relative error of attngrad's six gradients against the math path's (float32)."""
    run = _step(length)
    ours, theirs = run("attngrad"), run("math")
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours, theirs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-of", nargs=2, metavar=("IMPLEMENTATION", "LENGTH"), help=argparse.SUPPRESS)
    parser.add_argument("--docs", type=Path, help="also write the table as this run's section of this page")
    args = parser.parse_args()
    if args.memory_of:
        print(json.dumps(memory_of(args.memory_of[0], int(args.memory_of[1]))))
        return
    from attngrad.machine import cpu_name

    rows = []
    for length in args.lengths:
        seconds = times_of(length, args.repeats)
        memory = {}
        for implementation in IMPLEMENTATIONS:
            memory[implementation] = extra_mib_in_fresh_process(__file__, implementation, str(length))
        row = (f"| {length} | {seconds['attngrad'] * 1e3:.0f} | {seconds['math'] * 1e3:.0f} | "
               f"{seconds['attngrad'] / seconds['math']:.2f}x | {memory['attngrad']:.0f} | {memory['math']:.0f} | "
               f"{memory['attngrad'] / max(memory['math'], 1e-9):.3f} | {agreement(min(length, 1024)):.1e} |")
        print(row, flush=True)
        rows.append(row)
    lines = [f"The gradient through a JVP of causal attention (`torch.func.grad` of `torch.func.jvp`, for q, k, v "
             f"and their tangents), B={BATCH}, H={HEADS}, d={DIM}, float32; {cpu_name()}, {torch.get_num_threads()} "
             f"threads, {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}. Time: median of {args.repeats}, "
             "interleaved. Memory: peak RSS growth of a fresh process beyond the six gradients. The bar at L=4096: "
             "<= 0.5x the math path's time, <= 1/10 of its memory. Agreement: float32 attngrad against float32 math "
             "(at L <= 1024).", "",
             "| L | attngrad (ms) | math (ms) | time ratio | attngrad extra (MiB) | math extra (MiB) | memory ratio "
             "| agreement |", "|---|---|---|---|---|---|---|---|", *rows]
    report(lines, args.docs, "benchmarks/reverse_over_forward.py", args.lengths)


if __name__ == "__main__":
    main()
