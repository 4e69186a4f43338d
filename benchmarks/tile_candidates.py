"""Tile candidates for the Triton backend's table, checked without a GPU: each candidate
(rows x keys, warps, stages, head-width slice, registers, split walks) takes the place of a
`config._TABLE` entry in turn, and the pass's kernels are compiled for sm_80 and sm_90 in
every feature set of `attngrad gpu-report`; a candidate is kept where none spills. What it
keeps is what a GPU then times (`gpu_tiles.py`), and the first kept of each entry is the
one to take where no GPU has timed them.

    python benchmarks/tile_candidates.py --entry backward float32 64 --entry forward half 64

The candidates of an entry, in order: the entry with 255 registers where ptxas chose its
own; its walks in one loop (`Blocks.split` off); one pipeline stage; then smaller tiles
(half the rows, then half the keys) and narrower slices of the head width, each with the
same changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import sys
import warnings
from typing import Optional

ARCHS = (80, 90)
KINDS = {"half": ("bfloat16", "float16"), "float32": ("float32",), "tf32": ("float32-tf32",), "float64": ("float64",)}


def _candidates(entry) -> list:
    """The entry's candidates, in the order tried (`__doc__`)."""
    tiles = [entry]
    if entry.rows > 16:
        tiles.append(dataclasses.replace(entry, rows=entry.rows // 2))
    if entry.keys > 16:
        tiles.append(dataclasses.replace(entry, keys=entry.keys // 2))
    if entry.slice == 0 or entry.slice > 16:
        tiles.append(dataclasses.replace(entry, slice=32 if entry.slice in (0, 64) else 16))
    out = []
    for tile in tiles:
        for change in (dict(), dict(registers=255), dict(registers=255, split=False),
                       dict(registers=255, stages=1), dict(registers=255, stages=1, split=False)):
            candidate = dataclasses.replace(tile, **change)
            if candidate not in out:
                out.append(candidate)
    return out


def check(key: tuple, candidate) -> tuple[int, str]:
    """(spill bytes, where) of one candidate of one entry: its pass (and the passes that take
    its tiles) compiled in every feature set for every target, stopping at the first variant
    that spills or fails (0, "" if none)."""
    from attngrad.torch.backends.triton import compile_report, config

    pass_name, kind, width = key
    config._TABLE[key] = candidate
    passes = (pass_name,)
    if pass_name == "jvp" and ("forward_jvp", kind, width) not in config._TABLE:  # it takes the JVP's tiles
        passes += ("forward_jvp",)
    for dtype in KINDS[kind]:
        for features in ("all", "broadcast-bias", "light", "plain"):  # the heaviest first
            for arch in ARCHS:
                try:
                    records = compile_report.record_launches(compile_report.DTYPES[dtype], width, features,
                                                             products=compile_report.PRODUCTS.get(dtype, "ieee"),
                                                             passes=passes,
                                                             arch=arch)
                    for record in records:
                        _, spills, _ = compile_report.compile_launch(record, arch)
                        if spills:
                            return spills, f"{record.kernel.__name__} {features} sm_{arch}"
                except Exception as error:  # noqa: BLE001
                    return -1, f"{features} sm_{arch}: {type(error).__name__}: {str(error)[:120]}"
    return 0, ""


def first_clean(job: tuple) -> tuple:
    """(key, lines, the first candidate that compiles clean or None), trying the entry's
    candidates in order (all of them with `every`)."""
    warnings.filterwarnings("ignore")
    from attngrad.torch.backends.triton import config

    key, every = job
    lines, first = [], None
    for candidate in _candidates(config._TABLE[key]):
        spills, where = check(key, candidate)
        verdict = "clean" if spills == 0 else f"spills {spills} B ({where})" if spills > 0 else f"error ({where})"
        lines.append(f"{key[0]:15s} {key[1]:7s} {key[2]:3d}  {label(candidate):30s} {verdict}")
        if spills == 0 and first is None:
            first = candidate
            if not every:
                break
    return key, lines, first


def label(b) -> str:
    return (f"{b.rows}x{b.keys} w{b.warps} s{b.stages}" + (f" /{b.slice}" if b.slice else "")
            + (f" r{b.registers}" if b.registers else "") + ("" if b.split else " whole"))


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entry", nargs=3, action="append", required=True, metavar=("PASS", "KIND", "WIDTH"),
                        help="an entry of config._TABLE (kind: half, float32, tf32), as `gpu-report` names a spill")
    parser.add_argument("--every", action="store_true", help="every candidate, not only up to the first clean one")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args(argv)
    from attngrad.torch.backends.triton import config

    keys = [(p, k, int(w)) for p, k, w in args.entry]
    firsts = {}
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        for key, lines, first in pool.imap_unordered(first_clean, [(key, args.every) for key in keys]):
            print("\n".join(lines), flush=True)
            firsts[key] = first
    print("\nfirst clean candidate per entry:")
    for key in keys:
        first = firsts[key]
        print(f"  {key}: {'none' if first is None else label(first)}  (was {label(config._TABLE[key])})"
              + ("" if first is None else f"  {first!r}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
