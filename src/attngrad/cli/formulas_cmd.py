"""`attngrad formulas`: the gradient formulas of a flavor, readable in the terminal."""

from __future__ import annotations

import argparse
import sys

from ..derivation import formulas


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--flavor", action="append", choices=tuple(formulas.FLAVORS),
                        help="print this flavor (repeatable; default all)")


def run(args: argparse.Namespace) -> int:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print("[bold]Notation[/bold]  (docs/derivation.md defines every symbol and derives every line)")
    for line in formulas.NOTATION:
        console.print(f"  {line}", highlight=False)
    for flavor in args.flavor or formulas.FLAVORS:
        title, inputs, options = formulas.FLAVORS[flavor]
        table = Table(box=box.SIMPLE_HEAD, title=f"{title} ({flavor})", caption=inputs, show_lines=True,
                      title_justify="left", caption_justify="left")
        table.add_column("forward, top to bottom", no_wrap=True)
        table.add_column("backward, bottom to top: the gradients", overflow="fold")
        for step in formulas.steps(flavor):
            table.add_row(step.forward, "\n".join(step.backward))
        console.print()
        console.print(table, highlight=False)
        for option in options:
            console.print(f"  · {formulas.OPTIONS[option]}", highlight=False)
    return 0
