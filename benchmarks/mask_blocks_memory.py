"""Peak memory of keeping a mask per block (`attngrad.torch.masks.blocks`) for a causal mask
dilated by 3 (holes inside every row: 2 + 1 + 3 distinct 128 x 128 tiles, but L / 128 (L / 128
+ 1) / 2 partial blocks), at each --length.

Each case runs in a fresh process under PyTorch's profiler with profile_memory: the peak of
the CPU allocator's bytes held (allocations less frees, in order), above what it held before.
"from_rows" reads the rows of the mask written out beforehand (not counted), as many at a
time as a mask function's evaluation does; "create_block_mask" evaluates the function too.

    python benchmarks/mask_blocks_memory.py [--length 4096 8192]
"""

from __future__ import annotations

import argparse
import subprocess
import sys


def dilated(b, h, q, kv):
    return (q >= kv) & ((q - kv) % 3 == 0)


def one_run(case: str, length: int) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from attngrad.torch import create_block_mask
    from attngrad.torch.masks import blocks as mask_blocks
    from attngrad.torch.masks.functions import ENTRIES

    if case == "from_rows":
        dense = torch.empty(1, 1, length, length, dtype=torch.bool)
        for start in range(0, length, 64):  # a few rows at a time: no peak of its own
            rows = torch.arange(start, min(length, start + 64))[:, None]
            dense[0, 0, start:start + 64] = dilated(0, 0, rows, torch.arange(length)[None])

        def run():
            return mask_blocks.from_rows(lambda start, stop: dense[:, :, start:stop], (1, 1), length, length,
                                         ENTRIES // length)
    else:
        create_block_mask(dilated, None, None, 256, 256)  # the first call's own costs, not counted

        def run():
            return create_block_mask(dilated, None, None, length, length).blocks

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        blocks = run()
    held = peak = 0
    for event in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    partial = int((blocks.index >= 2).sum())
    return (f"{case:<18} L = {length:5d}: peak {peak / 2**20:6.1f} MiB  ({partial} partial blocks, "
            f"{len(blocks.tiles)} tiles kept)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # case, length: one run, in this process
    args = parser.parse_args()
    if args.one:
        print(one_run(args.one[0], int(args.one[1])))
        return
    for case in ("from_rows", "create_block_mask"):
        for length in args.length:
            run = subprocess.run([sys.executable, __file__, "--one", case, str(length)], capture_output=True,
                                 text=True, check=True)
            print(run.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
