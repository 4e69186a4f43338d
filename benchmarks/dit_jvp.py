"""The JVP through a DiT block, as consistency-model (sCM) and MeanFlow training takes it every
step: `torch.func.jvp` of diffusers' DiT block (DiT-S/2's width: 384, 6 heads of 64,
adaLN-zero) at --lengths tokens, batch 1, float32, along a random input tangent, under
torch.no_grad (the tangent alone; the training step's gradient comes on top). Two
attentions, the model unchanged:

    attngrad  under `attngrad.torch.replace_sdpa()`: the fused O(L) JVP
    math      PyTorch's math path (`sdpa_kernel(SDPBackend.MATH)`): its default CPU kernel
              has no forward mode, the math path writes out every L x L matrix

Time: the median of --repeats runs of each, interleaved in one process. Memory: a fresh
process per case, its peak resident memory growth over one JVP less the output and its
tangent (what any implementation must hold); "none" there copies the query instead of
attending, so its figure is the block's own and the rest is attention's. The bar at 4096
tokens: attngrad >= 3x faster and <= 1/5 of the math path's memory.

    python benchmarks/dit_jvp.py [--lengths 1024 4096] [--repeats 5] [--docs docs/bench.md]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from attngrad.bench.programs import extra_mib_in_fresh_process, interleaved_medians, report

WIDTH, HEADS = 384, 6
IMPLEMENTATIONS = ("attngrad", "math")


class _NoAttention(torch.overrides.TorchFunctionMode):
    """SDPA's output replaced by a copy of the query: what the block holds without attention."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            return args[0].clone()
        return func(*args, **(kwargs or {}))


def _block_jvp(length: int) -> Callable[[str], tuple[torch.Tensor, torch.Tensor]]:
    """A DiT block and its inputs; returns run(implementation) -> (output, tangent)."""
    from diffusers.models.attention import BasicTransformerBlock

    from attngrad.torch import replace_sdpa

    torch.manual_seed(0)
    block = BasicTransformerBlock(WIDTH, HEADS, WIDTH // HEADS, norm_type="ada_norm_zero", num_embeds_ada_norm=1000)
    x, dx = torch.randn(1, length, WIDTH), torch.randn(1, length, WIDTH)  # (B, L, C)
    timestep, label = torch.tensor([500]), torch.tensor([7])

    def forward(x: torch.Tensor) -> torch.Tensor:
        return block(x, timestep=timestep, class_labels=label)

    def run(implementation: str) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            if implementation == "attngrad":
                with replace_sdpa(strict=True):
                    return torch.func.jvp(forward, (x,), (dx,))
            if implementation == "none":
                with _NoAttention():
                    return torch.func.jvp(forward, (x,), (dx,))
            with sdpa_kernel(SDPBackend.MATH):
                return torch.func.jvp(forward, (x,), (dx,))

    return run


def memory_of(implementation: str, length: int) -> dict:
    """In this process (a fresh one): peak growth of one JVP beyond its output and tangent."""
    from attngrad.bench.memory import peak_rss_bytes, reset_peak

    run = _block_jvp(length)
    _block_jvp(64)(implementation)  # loads every library and kernel before the baseline
    baseline = reset_peak()
    out, tangent = run(implementation)
    growth = peak_rss_bytes() - baseline
    required = out.nbytes + tangent.nbytes
    return {"extra_mib": max(0, growth - required) / 2**20, "required_mib": required / 2**20}


def times_of(length: int, repeats: int) -> dict[str, float]:
    """Median seconds per JVP of each implementation, interleaved, after one warm-up each."""
    return interleaved_medians(_block_jvp(length), IMPLEMENTATIONS, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
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
        for implementation in ("none", *IMPLEMENTATIONS):
            memory[implementation] = extra_mib_in_fresh_process(__file__, implementation, str(length))
        row = (f"| {length} | {seconds['attngrad'] * 1e3:.0f} | {seconds['math'] * 1e3:.0f} | "
               f"{seconds['math'] / seconds['attngrad']:.1f}x | {memory['attngrad']:.0f} | {memory['math']:.0f} | "
               f"{memory['attngrad'] / max(memory['math'], 1e-9):.3f} | {memory['none']:.0f} |")
        print(row, flush=True)
        rows.append(row)
    lines = [f"`torch.func.jvp` through a DiT block (diffusers' `BasicTransformerBlock`, adaLN-zero, width {WIDTH}, "
             f"{HEADS} heads of {WIDTH // HEADS}), batch 1, float32, no grad; {cpu_name()}, {torch.get_num_threads()} "
             f"threads, {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}. Time: median of {args.repeats}, "
             "interleaved. Memory: peak RSS growth of a fresh process beyond the output and its tangent. The bar at "
             "4096 tokens: >= 3x faster, <= 1/5 of the memory. \"block's own\": the same with attention replaced "
             "by a copy of the query.", "",
             "| tokens | attngrad (ms) | math (ms) | speed-up | attngrad extra (MiB) | math extra (MiB) | memory ratio "
             "| block's own (MiB) |", "|---|---|---|---|---|---|---|---|", *rows]
    report(lines, args.docs, "benchmarks/dit_jvp.py", args.lengths)


if __name__ == "__main__":
    main()
