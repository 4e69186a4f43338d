"""The tiles of `config._TABLE` timed on a heavy call: for each entry named, its candidates
(`tile_candidates.py`'s, those that compile without spills for sm_80 and sm_90) each take the
entry's place in turn, and one step of the entry's pass runs on a call with an (H, L, L)
bias and the causal diagonal (B = 1, H = 16, L = 2048), in rounds, interleaved. A program
for a lent GPU: it prints each candidate's median, fastest first, the table's own marked.
`gpu_tiles.py` does the same for light calls' `_HOPPER_LIGHT`.

    python benchmarks/gpu_table_tiles.py --entry backward half 128 --entry forward half 64 --out DIR
    python benchmarks/gpu_table_tiles.py --interpret --no-check --entry forward half 64   # a dry run

The pass's step: forward (no gradient), backward (forward and backward, the bias's gradient
with them), jvp (forward + JVP), backward_jvp (a forward-over-reverse HVP) or double_backward.
Kinds: half (bfloat16), float32 (IEEE), tf32 (float32 with allow_tf32).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from typing import Optional

from gpu_check import mode_step
from tile_candidates import _candidates, check, label

MODES = {"forward": "forward", "backward": "train", "jvp": "jvp", "forward_jvp": "jvp", "backward_jvp": "hvp",
         "double_backward": "double"}


def _compiled_kernels() -> None:
    """A checking worker's initializer: the compile check needs Triton's compiled kernels, not
    the interpreter's (a dry run's workers inherit TRITON_INTERPRET=1)."""
    os.environ["TRITON_INTERPRET"] = "0"


def _compiles_clean(job: tuple) -> tuple:
    import warnings

    warnings.filterwarnings("ignore")
    key, candidate = job
    spills, where = check(key, candidate)
    return key, candidate, spills, where


def _step(key: tuple, candidate, device: str, small: bool):
    """One step of the entry's pass on the heavy call, with `candidate` as the entry."""
    import torch

    from attngrad.torch import attention, use_backend
    from attngrad.torch.backends.triton import config

    pass_name, kind, width = key
    dtype = torch.bfloat16 if kind == "half" else torch.float32
    batch, heads, length = (1, 2, 64) if small else (1, 16, 2048)
    g = torch.Generator(device=device).manual_seed(7)
    make = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype)  # noqa: E731
    q, k, v, dout = (make(batch, heads, length, width) for _ in range(4))
    tangents = tuple(make(batch, heads, length, width) for _ in range(3))
    bias = make(heads, length, length).requires_grad_(pass_name == "backward")

    def sdpa(q, k, v):
        with use_backend("triton"):
            return attention(q, k, v, attn_bias=bias, is_causal=True)

    step = mode_step(MODES[pass_name], sdpa, (q, k, v), dout, tangents)

    def run() -> None:
        config._TABLE[key] = candidate
        torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
        try:
            step()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False
    return run


def _time(run, device: str) -> float:
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(run, warmup=5, rep=30, return_mode="median")
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1e3


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entry", nargs=3, action="append", required=True, metavar=("PASS", "KIND", "WIDTH"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--no-check", action="store_true", help="time every candidate, spilling or not")
    parser.add_argument("--interpret", action="store_true", help="CPU tensors in Triton's interpreter (no GPU)")
    parser.add_argument("--out", default=None, help="a folder for table_tiles.jsonl")
    args = parser.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
        args.rounds = 1
    from attngrad.torch.backends.triton import config, launch

    if args.interpret:  # the table's tiles, as on an sm_90 GPU
        table = launch.blocks_for
        launch.blocks_for = lambda name, dtype, width, interpreted, tf32=False, arch=0, light=False: table(
            name, dtype, width, False, tf32, 90, light)
    device = "cpu" if args.interpret else "cuda"
    keys = [(p, k, int(w)) for p, k, w in args.entry]
    entries = {key: config._TABLE[key] for key in keys}
    jobs = [(key, c) for key in keys for c in _candidates(entries[key])]
    if not args.no_check:
        with multiprocessing.get_context("spawn").Pool(args.workers, initializer=_compiled_kernels) as pool:
            checked = pool.map(_compiles_clean, jobs)
        for key, candidate, spills, where in checked:
            if spills:
                why = f"spills {spills} B" if spills > 0 else "does not compile"
                print(f"left out {key} {label(candidate)}: {why} ({where})", flush=True)
        jobs = [(key, c) for key, c, spills, _ in checked if spills == 0]
    runs, times = {}, {job: [] for job in jobs}
    for job in jobs:
        runs[job] = _step(*job, device, args.interpret)
        runs[job]()  # compile and warm
    for _ in range(args.rounds):
        for job, run in runs.items():
            times[job].append(_time(run, device))
    for key, entry in entries.items():
        config._TABLE[key] = entry
    results = []
    for (key, candidate), ts in times.items():
        ms = sorted(ts)[len(ts) // 2]
        results.append(dict(entry=list(key), tile=label(candidate), table=candidate == entries[key], ms=ms, rounds=ts))
    results.sort(key=lambda r: (r["entry"], r["ms"]))
    where = "CPU, Triton's interpreter (a dry run)" if args.interpret else __import__("torch").cuda.get_device_name()
    print(f"\n{where}: an (H, L, L) bias, causal; median of {args.rounds} interleaved rounds")
    for r in results:
        print(f"{' '.join(map(str, r['entry'])):24s} {r['tile']:30s} {r['ms']:9.3f} ms{'  (table)' if r['table'] else ''}",
              flush=True)
    if args.out:
        with open(os.path.join(args.out, "table_tiles.jsonl"), "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
