"""The Triton backend's tiles, timed on a GPU: for the forward and the backward of a light
call (`config.is_light`) in bfloat16, each candidate (rows x keys, warps, pipeline stages,
head-width slice) takes the place of sm_90's entry in turn and is timed on one call, B=4,
L=4096, H = 2048 / d. A program for a lent GPU; it prints every candidate's time, best
first per pass, width and mask, to choose `config._HOPPER_LIGHT` from (each then checked
for spills by `attngrad gpu-report --features light plain`).

    python benchmarks/gpu_tiles.py --workers 12              # the sweep
    python benchmarks/gpu_tiles.py --final --out DIR         # the table now against the old one
    python benchmarks/gpu_tiles.py --split --out DIR         # walks split by masking against whole ones
    python benchmarks/gpu_tiles.py --fused --out DIR         # the fused backward against the split one
    python benchmarks/gpu_tiles.py --key-side --out DIR      # key_side_light against key_side
    python benchmarks/gpu_tiles.py --exp2 --out DIR          # scores in base 2 against natural
    python benchmarks/gpu_tiles.py --tma --out DIR           # tensor descriptors against pointer loads

`--split` times the walks that take the tiles needing no masking in a loop of their own
(`config.Options.interior_tiles`, the default) against walks that take every tile in the
masked loop, at the table's tiles and 1 to 3 stages, and a few other tiles at 2 and 3 stages. `--fused` times the backward split into query_side and
key_side (7 products per tile, `config.Options.fused_backward` False) against key_side fused with
dQ's ordered adds (5 products), at the table's tile and others. `--exp2` times the table's
tiles with log2(e) folded into the scale (`config.Options.exp2_dtypes`, the default) against
`tl.exp` of natural scores. `--tma` times the table's tiles with the walks' loads through
tensor descriptors (`config.Options.tensor_descriptors`) against pointer loads, at 1 to 3 stages.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import traceback
from typing import Optional

from gpu_light_call import B, L, inputs

# (rows, keys, warps, stages[, slice]); stages changed nothing while the walks' loops branched
# on the tile map (not pipelined), so the sweep takes 2 for the forward and 1 for the backward
FORWARD = [(r, k, w, 2) for r, k in ((64, 64), (128, 64), (128, 128), (64, 128)) for w in (4, 8)]
BACKWARD = [(r, k, w, 1) for r, k in ((32, 32), (64, 32), (32, 64), (64, 64), (128, 32), (32, 128), (128, 64),
                                      (64, 128)) for w in (4, 8)]
# `_TABLE`'s entries, which light calls on sm_90 took before `_HOPPER_LIGHT`
BEFORE = {("forward", 64): (128, 64, 8, 2), ("forward", 128): (64, 64, 8, 2), ("backward", 64): (64, 32, 8, 1),
          ("backward", 128): (64, 32, 8, 1, 16)}


def _setup(name: str, d: int, candidate: Optional[tuple], causal: bool, split: bool = True, way: str = "light",
           exp2: bool = True, tma: bool = False):
    """One call's step with `candidate` as sm_90's light tile of pass `name` (None: the
    table's own), its walks split by masking (`split`) or not, its backward's key
    side `way`: "light" (`kernels.key_side_light`), "split" (`kernels.key_side`) or "fused"
    (key_side with dQ's ordered adds), its scores in base 2 (`exp2`) or natural, its walks'
    loads through tensor descriptors (`tma`) or pointers."""
    import torch

    from attngrad.torch import scaled_dot_product_attention, use_backend
    from attngrad.torch.backends.triton import config, launch

    options = dict(interior_tiles=split, fused_backward=way == "fused", light_key_side=way == "light",
                   exp2_dtypes=(torch.float16, torch.bfloat16) if exp2 else (), tensor_descriptors=tma)
    if candidate is not None:
        config._HOPPER_LIGHT[(name, "half", d)] = launch.Blocks(*candidate)
    leaves, dout = inputs(d)

    def forward():
        with torch.no_grad(), use_backend("triton"), launch.TUNING.override(**options):
            return scaled_dot_product_attention(*leaves, is_causal=causal)

    if name == "forward":
        return forward
    with use_backend("triton"), launch.TUNING.override(**options):
        out = scaled_dot_product_attention(*leaves, is_causal=causal)

    def backward():
        with use_backend("triton"), launch.TUNING.override(**options):
            torch.autograd.grad(out, leaves, dout, retain_graph=True)

    return backward


def compile_one(job: tuple) -> str:
    try:
        _setup(*job)()
        return ""
    except Exception:  # noqa: BLE001
        return f"{job}: {traceback.format_exc(limit=2).splitlines()[-1]}"


def sweep_jobs(widths) -> list:
    return [(name, d, c, False) for d in widths for name, cands in (("forward", FORWARD), ("backward", BACKWARD))
            for c in cands]


def final_jobs(widths) -> list:
    """The table now (None) against the old entry, causal and not; and for the forward at
    d = 128 the spill-free alternatives."""
    jobs = []
    for (name, d), causal in itertools.product(BEFORE, (False, True)):
        if d in widths:
            jobs += [(name, d, None, causal), (name, d, BEFORE[(name, d)], causal)]
            if (name, d) == ("forward", 128):
                jobs += [(name, d, c, causal) for c in ((64, 128, 4, 2), (64, 64, 4, 2), (64, 128, 8, 2))]
    return jobs


def split_jobs(widths) -> list:
    """The table's tiles with whole walks (every tile masked), against split walks at 1 to 3
    stages, and other tiles split, causal and not."""
    from attngrad.torch.backends.triton import config

    more = {"forward": [(128, 64, 4), (128, 128, 4), (128, 128, 8)],
            "backward": [(64, 64, 4), (128, 64, 8), (64, 128, 4)]}
    jobs = []
    for name, d, causal in itertools.product(("forward", "backward"), widths, (False, True)):
        table = tuple(vars(config._HOPPER_LIGHT[(name, "half", d)]).values())[:4]
        jobs.append((name, d, None, causal, False))
        jobs += [(name, d, table[:3] + (stages,), causal, True) for stages in (1, 2, 3)]
        jobs += [(name, d, tile + (stages,), causal, True) for tile in more[name] if tile != table[:3]
                 for stages in (2, 3)]
    return jobs


def fused_jobs(widths) -> list:
    """The backward split (the table's tile) against fused, at the table's tile and others,
    causal and not."""

    # fused, without spills for sm_90 with Triton 3.9, but (128, 64, 8, 1) and (64, 64, 8, 1) at d = 128
    more = {64: [(64, 64, 8, 1), (128, 64, 8, 1), (32, 128, 8, 1), (32, 64, 4, 1), (64, 64, 4, 2), (64, 32, 4, 1)],
            128: [(32, 64, 8, 1), (64, 64, 8, 1, 64), (128, 32, 8, 1), (32, 32, 4, 1), (64, 64, 8, 1),
                  (32, 64, 8, 1, 64), (128, 64, 8, 1, 64)]}
    jobs = []
    for d, causal in itertools.product(widths, (False, True)):
        jobs.append(("backward", d, None, causal, True, "split"))
        jobs.append(("backward", d, None, causal, True, "fused"))
        jobs += [("backward", d, tile, causal, True, "fused") for tile in more.get(d, [])]
    return jobs


def key_side_jobs(widths) -> list:
    """The backward with key_side against key_side_light, at the backward's tiles and at key
    side tiles of its own (those that compile for sm_90 without spills with Triton 3.9, and
    at d = 128 a few that spill), causal and not."""
    more = {64: [(64, 128, 8, 1), (32, 128, 8, 1), (64, 64, 4, 2), (64, 128, 8, 2), (32, 64, 4, 1)],
            128: [(32, 128, 8, 1), (32, 64, 4, 1), (64, 64, 8, 1), (64, 128, 8, 1), (32, 128, 8, 2), (32, 64, 4, 2)]}
    jobs = []
    for d, causal in itertools.product(widths, (False, True)):
        jobs.append(("backward", d, None, causal, True, "split"))
        jobs.append(("key_side", d, None, causal, True, "light"))
        jobs += [("key_side", d, tile, causal, True, "light") for tile in more.get(d, [])]
    return jobs


def exp2_jobs(widths) -> list:
    """The table's tiles, the backward's key side split (the default), scores in base 2
    against natural, causal and not."""
    return [(name, d, None, causal, True, "split", exp2)
            for name, d, causal, exp2 in itertools.product(("forward", "backward"), widths, (False, True), (True, False))]


def tma_jobs(widths) -> list:
    """The table's tiles at 1 to 3 stages, the backward's key side split (the default), loads
    through tensor descriptors against pointers, causal and not."""
    from attngrad.torch.backends.triton import config

    jobs = []
    for name, d, causal in itertools.product(("forward", "backward"), widths, (False, True)):
        table = tuple(vars(config._HOPPER_LIGHT[(name, "half", d)]).values())[:3]
        jobs.append((name, d, None, causal, True, "split", True, False))
        jobs += [(name, d, table + (stages,), causal, True, "split", True, True) for stages in (1, 2, 3)]
    return jobs


def same_bits_through_descriptors(d: int, causal: bool) -> bool:
    """Whether the forward's output and the backward's gradients are bit for bit the same with
    the loads through tensor descriptors as through pointers (the same values loaded)."""
    import torch

    from attngrad.torch import scaled_dot_product_attention, use_backend
    from attngrad.torch.backends.triton import launch

    leaves, dout = inputs(d)
    results = []
    for tma in (False, True):
        with use_backend("triton"), launch.TUNING.override(tensor_descriptors=tma):
            out = scaled_dot_product_attention(*leaves, is_causal=causal)
            results.append((out, *torch.autograd.grad(out, leaves, dout)))
    return all(torch.equal(a, b) for a, b in zip(*results))


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--final", action="store_true", help="the table against the old entries")
    parser.add_argument("--split", action="store_true", help="walks split by masking against whole ones")
    parser.add_argument("--fused", action="store_true", help="the fused backward against the split one")
    parser.add_argument("--key-side", action="store_true", help="key_side_light against key_side")
    parser.add_argument("--exp2", action="store_true", help="scores in base 2 against natural")
    parser.add_argument("--tma", action="store_true", help="tensor descriptors against pointer loads")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each job (median)")
    parser.add_argument("--out", default=None, help="a folder for tiles.jsonl")
    args = parser.parse_args(argv)
    import torch
    import triton.testing

    from attngrad.torch.backends.triton import config

    todo = (tma_jobs(args.widths) if args.tma else exp2_jobs(args.widths) if args.exp2
            else key_side_jobs(args.widths) if args.key_side
            else fused_jobs(args.widths) if args.fused
            else split_jobs(args.widths) if args.split
            else final_jobs(args.widths) if args.final else sweep_jobs(args.widths))
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:  # compile in parallel
        for line in pool.imap_unordered(compile_one, todo):
            if line:
                print("compile failed", line, flush=True)
    if args.tma:
        for d, causal in itertools.product(args.widths, (False, True)):
            print(f"d={d} causal={causal}: same bits through descriptors: {same_bits_through_descriptors(d, causal)}",
                  flush=True)
    table = dict(config._HOPPER_LIGHT)
    times: dict = {job: [] for job in todo}
    for _ in range(args.rounds):
        for job in todo:
            config._HOPPER_LIGHT.clear()
            config._HOPPER_LIGHT.update(table)
            try:
                step = _setup(*job)
                step()
                times[job].append(triton.testing.do_bench(step, warmup=10, rep=40, return_mode="median"))
            except Exception:  # noqa: BLE001
                pass
            torch.cuda.empty_cache()
    config._HOPPER_LIGHT.update(table)
    print(f"\n{torch.cuda.get_device_name()}, triton {triton.__version__}, bfloat16, B={B}, L={L}, H=2048/d, "
          f"median of {args.rounds} interleaved rounds")
    results = []
    for job, ts in times.items():
        if not ts:
            continue
        name, d, candidate, causal, split, way, exp2, tma = (*job, *(True, "light", True, False)[len(job) - 4:])
        ms = sorted(ts)[len(ts) // 2]
        flops = 4 * B * (2048 // d) * L * L * d * (0.5 if causal else 1.0) * (1.0 if name == "forward" else 2.5)
        entry = table.get((name, "half", d)) or table[("backward", "half", d)]
        label = "table " + str(tuple(vars(entry).values())) if candidate is None else str(candidate)
        label += "" if split else " whole"
        label += "" if exp2 else " base-e"
        label += " tma" if tma else ""
        label += "" if name == "forward" else f" {way}"
        name = "forward" if name == "forward" else "backward"
        results.append(dict(name=name, d=d, causal=causal, tile=label, split=split, way=way, exp2=exp2, tma=tma, ms=ms,
                            tflops=flops / ms / 1e9, rounds=ts))
    results.sort(key=lambda r: (r["name"], r["d"], r["causal"], r["ms"]))
    for r in results:
        print(f"{r['name']:9s} d={r['d']:3d} causal={r['causal']!s:5s} {r['tile']:34s} {r['ms']:7.2f} ms "
              f"{r['tflops']:5.0f} TF/s", flush=True)
    if args.out:
        with open(os.path.join(args.out, "tiles.jsonl"), "w") as fh:
            for r in results:
                fh.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
