"""`attngrad check`: prove every gradient and print the verdicts as one table."""

from __future__ import annotations

import argparse
import json
import sys

from ..check import FLAVORS, VARIANTS, CheckConfig, CheckReport, run_check
from ..check.compare import ErrorFigure
from . import pip_install
from .arg_types import nonnegative_int, positive_int

ALL_VARIANTS = tuple(dict.fromkeys(v for flavor in FLAVORS for v in VARIANTS[flavor]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = CheckConfig()
    size = parser.add_argument_group("sizes")
    size.add_argument("--batch", type=positive_int, default=defaults.batch, metavar="B", help="batch size (default %(default)s)")
    size.add_argument("--heads", type=positive_int, default=defaults.heads, metavar="H", help="query heads (default %(default)s); the gqa variants use H/2 key/value heads")
    size.add_argument("--len-q", type=positive_int, default=defaults.len_q, metavar="LQ", help="decoder/query length (default %(default)s)")
    size.add_argument("--len-k", type=positive_int, default=defaults.len_k, metavar="LK", help="encoder/key length (default %(default)s)")
    size.add_argument("--embed-dim", type=positive_int, default=defaults.embed_dim, metavar="E", help="model width, a multiple of H (default %(default)s)")
    parser.add_argument("--seed", type=nonnegative_int, default=defaults.seed, help="seed of the random inputs and upstream gradients (default %(default)s)")
    parser.add_argument("--dtype", choices=("float64", "float32"), default=defaults.dtype, help="dtype of attngrad's computation; the truth is always float64 (default %(default)s)")
    parser.add_argument("--flavor", action="append", choices=FLAVORS, help=f"run only this flavor (repeatable; default all: {', '.join(FLAVORS)})")
    parser.add_argument("--variant", action="append", choices=ALL_VARIANTS, help="run only this variant (repeatable; default all)")
    parser.add_argument("--backend", choices=("all", "reference", "torch"), default="all",
                        help="what to prove: attngrad's NumPy reference, attngrad.torch (both implementations, "
                        "gradient, JVP and double backward against PyTorch's math path, float64), or all (default; "
                        "attngrad.torch when PyTorch is installed)")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch autograd column")
    parser.add_argument("--no-finite-diff", action="store_true", help="skip the finite-difference column (it costs 2 forwards per input element)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")


def _fmt(figure: ErrorFigure | None, skipped: str) -> str:
    if figure is None:
        return skipped
    return f"{figure.rel:.1e}"


def render_table(report: CheckReport, console) -> None:  # console: rich.console.Console
    from rich import box
    from rich.table import Table

    tol = report.tolerances
    table = Table(
        box=box.SIMPLE_HEAD,
        title=f"attngrad check: {report.config.dtype}, relative error max|ours - ref| / max|ref|",
        caption=f"tolerances: autograd {tol['autograd']:.0e}, finite differences {tol['finite_diff']:.0e}",
    )
    # the errors never wrap; the names and shapes may, so that 80 columns keep every column
    for name, justify, wrap in (("flavor", "left", True), ("variant", "left", True), ("tensor", "left", True),
                                ("shape", "left", True), ("vs autograd", "right", False),
                                ("vs finite diff", "right", False), ("verdict", "center", False)):
        table.add_column(name, justify=justify, no_wrap=not wrap, overflow="fold")
    autograd_skip = "skipped" if report.torch_version is None else "-"
    previous = None
    for row in report.rows:
        first = (row.flavor, row.variant) != previous
        if first and previous is not None:
            table.add_section()
        previous = (row.flavor, row.variant)
        verdict = "[green]pass[/green]" if row.passed else "[bold red]FAIL[/bold red]"
        note = " (=0)" if row.exact_zero else ""
        table.add_row(
            row.flavor if first else "", row.variant if first else "", row.tensor + note, str(tuple(row.shape)),
            _fmt(row.autograd, autograd_skip), _fmt(row.finite_diff, "-"), verdict,
        )
    console.print(table)


def summary_lines(report: CheckReport) -> list[str]:
    rows = report.rows
    failed = [r for r in rows if not r.passed]
    cases = len({(r.flavor, r.variant) for r in rows})
    worst = {}
    for column in ("autograd", "finite_diff"):
        figures = [getattr(r, column).rel for r in rows if getattr(r, column) is not None]
        worst[column] = f"{max(figures):.1e}" if figures else "n/a"
    lines = [
        f"{len(rows)} tensors in {cases} cases, {report.seconds:.1f} s: "
        + ("all pass" if not failed else f"{len(failed)} FAIL")
        + f"; worst relative error {worst['autograd']} vs autograd, {worst['finite_diff']} vs finite differences."
    ]
    if report.torch_version is None:
        lines.append("PyTorch is not installed (or --no-torch): the autograd column was skipped; "
                     f"finite differences alone were checked. To add it: {pip_install('torch')}.")
    else:
        lines.append(f"autograd oracle: PyTorch {report.torch_version}, float64: torch.nn.MultiheadAttention; "
                     "gqa and dropout variants: F.linear + PyTorch's math SDPA kernel (the module has no "
                     "GQA and takes no dropout mask).")
    if any(r.exact_zero for r in rows):
        lines.append("(=0): zero in exact arithmetic, so every implementation returns rounding noise; judged against "
                     "the scale of the case's other gradients. b^K shifts each score row by a constant, which softmax "
                     "ignores; with at most one key per query row, nothing reaches the query and key side at all.")
    return lines


def render_backend_table(report: CheckReport, console) -> None:  # console: rich.console.Console
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, title="attngrad check: attngrad.torch, float64, relative error (worst tensor)",
                  caption="gradient: vs PyTorch's math path / vs attngrad's reference; jvp and double backward: "
                  "vs PyTorch's math path; bar 1e-12")
    for name in ("flavor", "variant", "implementation", "gradient", "jvp", "double bwd", "verdict"):
        table.add_column(name, justify="left" if name in ("flavor", "variant", "implementation") else "right",
                         no_wrap=name not in ("flavor", "variant"))
    by_case: dict = {}
    for row in report.backend_rows:
        by_case.setdefault((row.flavor, row.variant, row.implementation), {})[row.derivative] = row
    previous = None
    for (flavor, variant, implementation), rows in by_case.items():
        first = (flavor, variant) != previous
        if first and previous is not None:
            table.add_section()
        previous = (flavor, variant)
        gradient, jvp, double = rows["gradient"], rows["jvp"], rows["double backward"]
        passed = all(r.passed for r in rows.values())
        table.add_row(flavor if first else "", variant if first else "", implementation,
                      f"{gradient.vs_math:.1e} / {gradient.vs_reference:.1e}", f"{jvp.vs_math:.1e}",
                      f"{double.vs_math:.1e}", "[green]pass[/green]" if passed else "[bold red]FAIL[/bold red]")
    console.print(table)


def backend_lines(report: CheckReport) -> list[str]:
    if report.backend_skipped:
        return [f"attngrad.torch was not checked: {report.backend_skipped}."]
    rows = report.backend_rows
    if not rows:
        return []
    failed = [r for r in rows if not r.passed]
    worst = max(max(r.vs_math, r.vs_reference or 0.0) for r in rows)
    cases = len({(r.flavor, r.variant) for r in rows})
    return [f"attngrad.torch: {cases} cases x {len({r.implementation for r in rows})} implementations x "
            f"{len({r.derivative for r in rows})} derivatives: "
            + ("all pass" if not failed else f"{len(failed)} FAIL") + f"; worst relative error {worst:.1e}."]


def _no_case_message(flavors: tuple, variants: tuple | None) -> str:
    offered = "; ".join(f"{flavor}: {', '.join(VARIANTS[flavor])}" for flavor in flavors)
    return (f"no case matches --flavor {' '.join(flavors)} --variant {' '.join(variants or ())}; "
            f"the variants of each flavor are {offered}")


def run(args: argparse.Namespace) -> int:
    if args.backend == "torch" and args.no_torch:
        print("attngrad check: error: --backend torch needs PyTorch; --no-torch turns it off", file=sys.stderr)
        return 2
    if args.no_torch and args.no_finite_diff:
        print("attngrad check: error: --no-torch and --no-finite-diff together leave nothing to check against",
              file=sys.stderr)
        return 2
    flavors = tuple(args.flavor) if args.flavor else FLAVORS
    variants = tuple(args.variant) if args.variant else None
    if variants is not None and not any(v in VARIANTS[f] for f in flavors for v in variants):
        print(f"attngrad check: error: {_no_case_message(flavors, variants)}", file=sys.stderr)
        return 2
    try:
        config = CheckConfig(batch=args.batch, heads=args.heads, len_q=args.len_q, len_k=args.len_k,
                             embed_dim=args.embed_dim, seed=args.seed, dtype=args.dtype)
    except ValueError as err:
        print(f"attngrad check: error: {err}", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    err_console = Console(stderr=True)
    with Progress(TextColumn("checking {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=True) as progress:
        task = progress.add_task("", total=None)

        def on_case(case, i: int, n: int) -> None:
            progress.update(task, description=case.title, completed=i, total=n)

        report = run_check(config, flavors, variants, use_torch=not args.no_torch,
                           finite_differences=not args.no_finite_diff, progress=on_case,
                           reference=args.backend != "torch", backend=args.backend != "reference")
    if args.backend == "torch" and report.backend_skipped:
        print(f"attngrad check: error: --backend torch: {report.backend_skipped}", file=sys.stderr)
        return 2
    if not report.rows and not report.backend_rows:
        print(f"attngrad check: error: {_no_case_message(flavors, variants)}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=2)
        print()
    else:
        console = Console(width=None if sys.stdout.isatty() else 100)
        if report.rows:
            render_table(report, console)
            for line in summary_lines(report):
                console.print(line, highlight=False, markup=False)  # "attngrad[torch]" is no markup
        if report.backend_rows:
            render_backend_table(report, console)
        for line in backend_lines(report):
            console.print(line, highlight=False, markup=False)
    return 0 if report.passed else 1
