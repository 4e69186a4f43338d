"""Where the fused backward's time goes, on a GPU: the backward of a light bfloat16 call (B = 4,
L = 4096, H * d = 2048, causal and not) split (query_side and key_side, 7 products per tile)
against key_side fused with dQ (5 products) in three ways of adding dQ's parts:

    ordered   the backend's: each part waits for its turn (`kernels.add_in_order`)
    unordered the same loads and stores with no wait: a race, timed only, to price the waits
    atomic    float32 atomic adds, in a varying order: what FlashAttention-2 does, timed only

Each variant runs in its own process (the kernels compile with the variant in place of
`kernels.add_in_order`); times are medians of `triton.testing.do_bench`, three rounds per
variant, each variant's cases interleaved with the split backward in the same process.

    python benchmarks/gpu_fused_variants.py
"""

from __future__ import annotations

import multiprocessing
import sys

import triton
import triton.language as tl


@triton.jit
def _unordered(DQ, LOCKS, part, rows, offs_m, offs_d, Lq, D, lock, rank, WAIT: tl.constexpr):
    ptrs = DQ + (rows + offs_m)[:, None] * D + offs_d[None, :]
    inside = (offs_m[:, None] < Lq) & (offs_d[None, :] < D)
    tl.store(ptrs, tl.load(ptrs, mask=inside, other=0.0, cache_modifier=".cg") + part, mask=inside,
             cache_modifier=".cg")


@triton.jit
def _atomic(DQ, LOCKS, part, rows, offs_m, offs_d, Lq, D, lock, rank, WAIT: tl.constexpr):
    ptrs = DQ + (rows + offs_m)[:, None] * D + offs_d[None, :]
    inside = (offs_m[:, None] < Lq) & (offs_d[None, :] < D)
    tl.atomic_add(ptrs, part, mask=inside, sem="relaxed")


def _run(variant: str) -> list:
    import triton.testing
    from gpu_light_call import triton_backward

    from attngrad.torch.backends.triton import kernels, launch

    if variant != "ordered":
        kernels.add_in_order = {"unordered": _unordered, "atomic": _atomic}[variant]
    lines = []
    for d in (64, 128):
        for causal in (False, True):
            backward = triton_backward(d, causal)
            times: dict = {True: [], False: []}
            for _ in range(3):
                for fused in (True, False):
                    with launch.TUNING.override(fused_backward=fused):
                        times[fused].append(triton.testing.do_bench(backward, warmup=10, rep=50,
                                                                    return_mode="median"))
            ms = {f: sorted(t)[1] for f, t in times.items()}
            lines.append(f"{variant:9s} d={d:3d} causal={causal!s:5s} fused {ms[True]:6.2f} ms, split "
                         f"{ms[False]:6.2f} ms: {ms[True] / ms[False]:.2f}x")
    return lines


def main() -> int:
    import torch

    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    for variant in ("ordered", "unordered", "atomic"):  # one at a time, each in a fresh process
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            print("\n".join(pool.apply(_run, (variant,))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
