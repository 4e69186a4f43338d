"""bfloat16 causal fwd+bwd on each route of the tiles' bfloat16 products, beside PyTorch's
default kernel, in one process, interleaved (B=1, H=8, d=64):

    MKL             MKL's bfloat16 GEMM for every product (brgemm_path(0))
    brgemm          oneDNN's brgemm on the products whose B is K, V or their tangents, MKL's
                    GEMM on the rest: on the matrix units (AMX-BF16) or on AVX512-BF16's dot
                    products, whichever this CPU and oneDNN's ISA allow (brgemm_path(1))
    torch           PyTorch's scaled_dot_product_attention, its default CPU kernel

Prints the CPU, what the brgemm route runs on, and each route's time and ratio to PyTorch's.

    python benchmarks/bf16_routes.py                      # L = 1024 and 4096
    python benchmarks/bf16_routes.py --lengths 1024 --repeats 3

On a CPU with AMX, AMX stands aside for a stand-in of one without it (an AMD Zen 4) by
holding oneDNN and MKL below it; what PyTorch's kernel does is held alike:

    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 MKL_ENABLE_INSTRUCTIONS=AVX512_E3 python benchmarks/bf16_routes.py

MKL dispatches by vendor as well as by ISA, so that stand-in times MKL as an Intel CPU runs it,
not as an AMD one does.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from attngrad.bench.programs import interleaved_medians
from attngrad.machine import cpu_name
from attngrad.torch import scaled_dot_product_attention
from attngrad.torch.backends.cpu_tiles import build, native


def step(attend, inputs: dict[str, torch.Tensor]):
    """One causal fwd+bwd of `attend` on fresh leaves of the inputs."""
    def run() -> None:
        leaves = [inputs[name].clone().requires_grad_() for name in ("q", "k", "v")]
        attend(*leaves, is_causal=True).backward(inputs["dout"])

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if build.library() is None:
        raise SystemExit("the compiled tiles are unavailable here: nothing to time")
    ops = torch.ops.attngrad_tiles
    brgemm = ops.brgemm_path(-1) != 0
    ops.brgemm_path(1 if brgemm else 0)
    route = native.bf16_products()
    limits = {name: os.environ[name] for name in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS") if name in os.environ}
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; brgemm route: "
          f"{route if brgemm else 'none here'}" + (f"; {limits}" if limits else ""))
    print(f"{'L':>6} {'MKL ms':>9} {'brgemm ms':>10} {'torch ms':>9} {'MKL/torch':>10} {'brgemm/torch':>13}")
    routes = {"MKL": 0, "brgemm": 1} if brgemm else {"MKL": 0}
    try:
        for length in args.lengths:
            g = torch.Generator().manual_seed(length)
            inputs = {name: torch.randn(1, 8, length, 64, generator=g).bfloat16() for name in ("q", "k", "v", "dout")}
            runs = {name: step(scaled_dot_product_attention, inputs) for name in routes}
            runs["torch"] = step(F.scaled_dot_product_attention, inputs)

            def run(name: str) -> None:
                if name in routes:
                    ops.brgemm_path(routes[name])
                runs[name]()

            ms = {name: 1e3 * s for name, s in interleaved_medians(run, list(runs), args.repeats).items()}
            brgemm_ms = f"{ms['brgemm']:>10.1f}" if brgemm else f"{'-':>10}"
            brgemm_ratio = f"{ms['brgemm'] / ms['torch']:>12.2f}x" if brgemm else f"{'-':>13}"
            print(f"{length:>6} {ms['MKL']:>9.1f} {brgemm_ms} {ms['torch']:>9.1f} {ms['MKL'] / ms['torch']:>9.2f}x "
                  f"{brgemm_ratio}")
    finally:
        ops.brgemm_path(1 if brgemm else 0)


if __name__ == "__main__":
    main()
