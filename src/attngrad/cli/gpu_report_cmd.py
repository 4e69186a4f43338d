"""`attngrad gpu-report`: every Triton kernel variant compiled for sm_80 and sm_90 without a
GPU, with registers, spills and shared memory per variant (`compile_report`)."""

from __future__ import annotations

import argparse
import os

from .arg_types import positive_int

# compile_report's choices, spelled here so that `attngrad --help` imports neither torch
# nor triton (a test checks that the two agree)
DTYPES = ("float16", "bfloat16", "float32", "float32-tf32", "float32-tf32x3", "float32-bf16x6", "float64")
DEFAULT_DTYPES = ("float16", "bfloat16", "float32", "float32-tf32", "float64")
WIDTHS = (64, 128, 256)
ARCHS = (80, 90)
FEATURES = ("plain", "all", "broadcast-bias", "light")
PASSES = ("forward", "backward", "jvp", "forward_jvp", "backward_jvp", "double_backward")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DEFAULT_DTYPES), metavar="DTYPE",
                        help=f"input dtypes: {', '.join(DTYPES)} (float32-tf32: float32 with TF32 products; "
                        "-tf32x3 and -bf16x6: split products, `Options.float32_products`, opt-in, their spills "
                        "allowed) "
                        f"(default: {' '.join(DEFAULT_DTYPES)})")
    parser.add_argument("--widths", nargs="+", type=positive_int, default=list(WIDTHS), metavar="D",
                        help=f"head widths (default: {' '.join(map(str, WIDTHS))})")
    parser.add_argument("--archs", nargs="+", type=int, choices=ARCHS, default=list(ARCHS), metavar="SM",
                        help="compute capabilities to compile for: 80 (A100), 90 (H100) (default: both)")
    parser.add_argument("--features", nargs="+", choices=FEATURES, default=list(FEATURES), metavar="SET",
                        help="plain (no option), all (every option, a bias of the scores' shape), broadcast-bias "
                        "(every option, a (1, H, 1, Lk) bias), light (causal, key bounds and GQA alone, which take "
                        "sm_90's own tiles in half precision) (default: all four)")
    parser.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES), metavar="PASS",
                        help=f"passes whose kernels to compile: {', '.join(PASSES)} (default: all)")
    parser.add_argument("--tensor-descriptors", action="store_true",
                        help="the walks' loads through tensor descriptors (TMA) where the backend would take them "
                        "with `Options.tensor_descriptors` on: sm_90, products over the whole head width")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown (docs/gpu.md's)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        console.print("attngrad gpu-report compiles the kernels; unset TRITON_INTERPRET (it makes them interpreted)")
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        console.print("attngrad gpu-report needs triton: pip install triton")
        return 2
    from ..torch.backends.triton.compile_report import NO_SPILL_DTYPES, NO_SPILL_WIDTH, compile_report

    with console.status("compiling") as status:
        rows = compile_report(args.dtypes, args.widths, args.archs, args.features, args.passes,
                              progress=lambda r: status.update(f"compiled {r.kernel} ({r.pass_name}) {r.dtype} "
                                                               f"d={r.width} sm_{r.arch}"),
                              tensor_descriptors=args.tensor_descriptors)
    headers = ("kernel", "pass", "features", "dtype", "d", "sm", "tile", "regs", "spill B",
               "smem KiB", "s")
    cells = [(r.kernel, r.pass_name, r.features, r.dtype, str(r.width), str(r.arch), r.block,
              "-" if r.error else str(r.registers), r.error or str(r.spill_bytes),
              "-" if r.error else f"{r.shared_bytes / 1024:.0f}", f"{r.seconds:.1f}") for r in rows]
    if args.markdown:
        print("| " + " | ".join(headers) + " |")
        print("|" + "---|" * len(headers))
        for row in cells:
            print("| " + " | ".join(row) + " |")
    else:
        table = Table(*headers)
        for row, r in zip(cells, rows):
            table.add_row(*row, style="red" if r.failed else None)
        console.print(table)
    failed = [r for r in rows if r.failed]
    spilled = [r for r in rows if r.spill_bytes and not r.failed]
    console.print(f"{len(rows)} variants compiled for sm_{', sm_'.join(map(str, args.archs))}: {len(failed)} failed "
                  f"(a compile error, or a spill at d <= {NO_SPILL_WIDTH} in {', '.join(NO_SPILL_DTYPES)}); "
                  f"{len(spilled)} spill where it is allowed", highlight=False)
    return 1 if failed else 0
