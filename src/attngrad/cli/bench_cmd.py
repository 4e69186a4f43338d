"""`attngrad bench`: attngrad's attention beside PyTorch's: fwd+bwd, jvp and double backward,
time and memory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..bench.cases import MODES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], metavar="L",
                        help="sequence lengths (default: %(default)s)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["train"], metavar="MODE",
                        help=f"what to time: {', '.join(MODES)} (fwd+bwd; forward-mode; backward of a backward) "
                        "(default: train)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per implementation, median taken (default %(default)s)")
    parser.add_argument("--max-math-length", type=int, default=4096,
                        help="skip PyTorch's O(L^2) math backend above this length (default %(default)s)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-case peak-memory subprocesses")
    parser.add_argument("--quick", action="store_true", help="a smoke run: L=128 and 256, 1 repeat")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="folder for results.json, results.md, results.png (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("attngrad bench: error: PyTorch is required: pip install 'attngrad[torch]'", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from ..bench.cases import default_cases
    from ..bench.report import COLUMNS, rows, write
    from ..bench.runner import run_bench

    lengths = (128, 256) if args.quick else tuple(args.lengths)
    repeats = 1 if args.quick else args.repeats
    if any(length < 1 for length in lengths) or repeats < 1:
        print("attngrad bench: error: lengths and --repeats must be positive", file=sys.stderr)
        return 2
    cases = default_cases(lengths, tuple(dict.fromkeys(args.modes)))
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("measuring the float32 GEMM peak")
        report = run_bench(cases, repeats=repeats, max_math_length=args.max_math_length, memory=not args.no_memory,
                           progress=lambda text: progress.update(task, description=text))
    console = Console(width=None if sys.stdout.isatty() else 160)
    table = Table(title=f"attngrad bench: float32, B=1 H=8 d=64; GEMM peak {report.gemm_peak_gflops:.0f} GFLOP/s")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "case" else "right", no_wrap=True)
    for row in rows(report):
        table.add_row(*row)
    console.print(table)
    console.print(f"attngrad: {report.machine['attngrad_tiles']}", highlight=False)
    written = write(report, args.out)
    for path in written:
        console.print(f"wrote {path}", highlight=False)
    if not any(path.suffix == ".png" for path in written):
        console.print("no results.png: matplotlib is not installed (pip install 'attngrad[docs]')", highlight=False)
    return 0
