"""`attngrad bench`: attngrad's attention beside PyTorch's: fwd+bwd, jvp, double backward and hvp,
time and memory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..bench.cases import FAMILIES
from . import pip_install
from .arg_types import positive_int

# The terminal shows the report's columns as two tables, times and memory, so that each
# fits 100 columns; results.md keeps them in one.
TIME_COLUMNS = (0, 1, 2, 3, 4, 5, 6, 7, 9)
MEMORY_COLUMNS = (0, 1, 10, 11, 12, 13)
QUICK_LENGTHS, QUICK_REPEATS = (128, 256), 3
QUICK_GEMM_SIZE = 512  # a smoke run's GEMM in every round: 2048^3 took half of its time
DEFAULT_LENGTHS, DISTRIBUTED_LENGTH = (1024, 2048, 4096), 8192
DOCS_PAGE = Path("docs/bench.md")
DOCS_TITLE = "Benchmarks"
DOCS_PREAMBLE = """Every section below was written by the command at its top (`--docs`), with the
table, plot and losses of that run; run it again to replace the section. Times are
medians of runs interleaved in one process, so that a ratio compares like with like; the
machine, its thread count and the date head each table."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=None, metavar="L",
                        help=f"sequence lengths (default: {' '.join(map(str, DEFAULT_LENGTHS))}; "
                        f"{DISTRIBUTED_LENGTH} with --distributed)")
    parser.add_argument("--modes", nargs="+", choices=FAMILIES, default=["train"], metavar="MODE",
                        help=f"what to time: {', '.join(FAMILIES)} (fwd+bwd with every mask; forward mode; backward "
                        "of a backward; forward over reverse; bfloat16 and float16 causal fwd+bwd; fwd+bwd at B=4; "
                        "one query row against L keys at B=4, no gradient) (default: train)")
    parser.add_argument("--cases", nargs="+", default=None, metavar="NAME",
                        help="only these cases of --modes, by the names the table shows (for example causal+window "
                        "or double-backward+full); each is still timed beside its plain call (default: every case)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs per implementation, median taken (default %(default)s)")
    parser.add_argument("--max-math-length", type=int, default=4096,
                        help="skip PyTorch's O(L^2) math backend above this length (default %(default)s)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-case peak-memory subprocesses")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: L={QUICK_LENGTHS[0]} and {QUICK_LENGTHS[1]}, {QUICK_REPEATS} repeats after the "
                        "warm-up; it shows that every case runs, not figures to quote")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="folder for results.json, results.md, results.png (default %(default)s)")
    parser.add_argument("--distributed", action="store_true",
                        help="context parallelism instead: ring (contiguous, zigzag) and all-to-all attention on "
                        "--worlds local processes of one thread each, beside one process doing the same work; causal "
                        "fwd+bwd at --lengths; writes distributed.md and distributed.json")
    parser.add_argument("--worlds", type=positive_int, nargs="+", default=[2, 4], metavar="P",
                        help="world sizes of --distributed (default: %(default)s)")
    parser.add_argument("--docs", type=Path, nargs="?", const=DOCS_PAGE, default=None, metavar="PAGE",
                        help=f"also write this run's section of PAGE (default {DOCS_PAGE}): the command, the table, "
                        "the plot (in img/ beside the page) and the cases where attngrad loses")


def run(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        print(f"attngrad bench: error: PyTorch is required: {pip_install('torch')}", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    if args.cases and (args.distributed or args.docs is not None):
        why = "--distributed times its own cases" if args.distributed else "--docs writes its modes' whole section"
        print(f"attngrad bench: error: {why}; it cannot take --cases", file=sys.stderr)
        return 2
    if args.distributed:
        return _run_distributed(args)
    from ..bench.cases import default_cases, select_cases
    from ..bench.report import COLUMNS, rows, write
    from ..bench.runner import GEMM_SIZE, run_bench

    lengths = QUICK_LENGTHS if args.quick else tuple(args.lengths or DEFAULT_LENGTHS)
    repeats = QUICK_REPEATS if args.quick else args.repeats
    cases = default_cases(lengths, tuple(dict.fromkeys(args.modes)))
    if args.cases:
        try:
            cases = select_cases(cases, args.cases)
        except ValueError as e:
            print(f"attngrad bench: error: {e}", file=sys.stderr)
            return 2
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("measuring the float32 GEMM peak")
        report = run_bench(cases, repeats=repeats, max_math_length=args.max_math_length, memory=not args.no_memory,
                           progress=lambda text: progress.update(task, description=text),
                           gemm_size=QUICK_GEMM_SIZE if args.quick else GEMM_SIZE)
    console = Console(width=None if sys.stdout.isatty() else 100)
    table_rows = rows(report)
    title = (f"attngrad bench: float32 unless named bf16 or fp16, B=1 unless named b4, H=8 d=64; GEMM peak "
             f"{report.gemm_peak_gflops:.0f} GFLOP/s")
    tables = [(title, TIME_COLUMNS)]
    tables.append(("peak memory beyond inputs, outputs and gradients; the implementation that ran ours",
                   MEMORY_COLUMNS if not args.no_memory else (0, 1, 13)))
    for caption, columns in tables:
        table = Table(title=caption)
        for index in columns:  # a case name may wrap; the figures never do
            name = COLUMNS[index]
            table.add_column(name.replace(" ", "\n", 1) if index > 1 else name, justify="left" if index == 0 else "right",
                             no_wrap=index > 0, overflow="fold")
        for row in table_rows:
            table.add_row(*(row[index] for index in columns))
        console.print(table)
    console.print(f"attngrad: {report.machine['attngrad_tiles']}", highlight=False)
    if args.quick:
        console.print(f"a smoke run (--quick: L={QUICK_LENGTHS[0]} and {QUICK_LENGTHS[1]}, {QUICK_REPEATS} repeats): "
                      "every case runs; these are no figures to quote", highlight=False)
    if args.quick:
        report.machine["smoke_run"] = (f"a smoke run (attngrad bench --quick): L={QUICK_LENGTHS[0]} and "
                                       f"{QUICK_LENGTHS[1]}, {QUICK_REPEATS} repeats; no figures to quote")
    written = write(report, args.out)
    if args.docs is not None:
        written.extend(_write_docs(args, report, lengths, repeats))
    for path in written:
        console.print(f"wrote {path}", highlight=False)
    if not any(path.suffix == ".png" for path in written):
        console.print(f"no results.png: matplotlib is not installed: {pip_install('docs')}", highlight=False,
                      markup=False)  # "[docs]" is no markup
    return 0


def _command(args: argparse.Namespace, lengths: tuple, repeats: int) -> str:
    """The command line that repeats this run (what its section of the docs says it ran)."""
    if args.distributed:
        return (f"attngrad bench --distributed --worlds {' '.join(map(str, args.worlds))} "
                f"--lengths {' '.join(map(str, lengths))} --repeats {repeats}")
    return (f"attngrad bench --modes {' '.join(dict.fromkeys(args.modes))} --lengths {' '.join(map(str, lengths))} "
            f"--repeats {repeats}")


def _write_docs(args: argparse.Namespace, report, lengths: tuple, repeats: int) -> list[Path]:
    """This run's section of the docs page (keyed by its modes) and its plot."""
    from ..bench.report import docs_section, plot
    from ..docs_page import write_section

    key = "+".join(dict.fromkeys(args.modes))
    image = args.docs.parent / "img" / f"bench-{key}.png"
    image.parent.mkdir(parents=True, exist_ok=True)
    try:
        plot(report, image)
        relative = f"img/{image.name}"
    except ImportError:
        image, relative = None, None
    body = docs_section(report, _command(args, lengths, repeats), relative)
    page = write_section(args.docs, f"attngrad bench ({key})", body, DOCS_TITLE, DOCS_PREAMBLE)
    return [page] + ([image] if image else [])


def _run_distributed(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from ..bench.distributed import DistributedCase, run_distributed, write_distributed

    lengths = QUICK_LENGTHS if args.quick else tuple(args.lengths or (DISTRIBUTED_LENGTH,))
    rounds = QUICK_REPEATS if args.quick else args.repeats
    cases = [DistributedCase(world, length) for world in args.worlds for length in lengths]
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("starting")
        report = run_distributed(cases, rounds=rounds, progress=lambda text: progress.update(task, description=text))
    console = Console(width=None if sys.stdout.isatty() else 100)
    table = Table(title="attngrad bench --distributed: float32 causal fwd+bwd, B=1 H=8 d=64, one thread per rank")
    header, lines = report_rows(report)
    for name in header:
        table.add_column(name, justify="left" if name in ("case", "method") else "right", no_wrap=True)
    for line in lines:
        table.add_row(*line)
    console.print(table)
    if args.quick:
        console.print("a smoke run (--quick): every method runs; these are no figures to quote", highlight=False)
    written = write_distributed(report, args.out, header, lines)
    if args.docs is not None:
        from ..bench.distributed import docs_section
        from ..docs_page import write_section

        body = docs_section(report, _command(args, lengths, rounds), header, lines)
        written.append(write_section(args.docs, "attngrad bench (distributed)", body, DOCS_TITLE, DOCS_PREAMBLE))
    for path in written:
        console.print(f"wrote {path}", highlight=False)
    return 0


def report_rows(report: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = ["case", "method", "time s", "1 proc s", "effic.", "waiting", "MiB/rank", "1 proc MiB"]
    lines = [[r["name"], r["method"], f"{r['seconds']:.3f}", f"{r['one_process_seconds']:.3f}", f"{r['efficiency']:.0%}",
              f"{r['waiting']:.0%}", f"{r['memory_mib']:.1f}", f"{r['one_process_memory_mib']:.1f}"] for r in report]
    return header, lines
