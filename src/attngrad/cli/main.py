"""Entry point of the `attngrad` command: one subcommand per job."""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from . import bench_cmd, check_cmd, formulas_cmd, generate_cmd, train_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attngrad",
        description="The gradient of Transformer attention, in closed form, proved.",
    )
    parser.add_argument("--version", action="version", version=f"attngrad {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    check = commands.add_parser(
        "check",
        help="prove every attention gradient against PyTorch autograd and finite differences",
        description="Check every gradient of every attention flavor and option against PyTorch "
        "autograd (float64) and central finite differences, with random inputs and a random "
        "upstream gradient. Exit status 1 if any check fails.",
    )
    check_cmd.add_arguments(check)
    check.set_defaults(run=check_cmd.run)
    show = commands.add_parser(
        "formulas",
        help="print the gradient formulas of each attention flavor",
        description="Print, for each flavor, the forward lines and the backward lines that differentiate them.",
    )
    formulas_cmd.add_arguments(show)
    show.set_defaults(run=formulas_cmd.run)
    bench = commands.add_parser(
        "bench",
        help="time attngrad's attention beside PyTorch's (fwd+bwd, float32) and measure peak memory",
        description="Forward+backward of attngrad.torch.scaled_dot_product_attention beside PyTorch's default "
        "and math backends, on identical inputs in one process, alternating runs; peak memory per case in a "
        "fresh process. Writes a table, results.md, results.json and results.png.",
    )
    bench_cmd.add_arguments(bench)
    bench.set_defaults(run=bench_cmd.run)
    training = commands.add_parser(
        "train",
        help="train a NumPy Transformer by hand-derived gradients (reverse, copy, sort, lm)",
        description="Train the Transformer of 'Attention Is All You Need', written in NumPy with every backward "
        "pass derived by hand, on a toy task or a text. Progress bar with loss, accuracy and tokens per second; "
        "writes model.npz, history.json and curves.png.",
    )
    train_cmd.add_arguments(training)
    training.set_defaults(run=train_cmd.run)
    generate = commands.add_parser(
        "generate",
        help="decode with a trained checkpoint: reverse/copy/sort digits, or sample text",
        description="Greedy-decode a digit sequence with a toy-task checkpoint, or sample text after a prompt "
        "with a language-model checkpoint.",
    )
    generate_cmd.add_arguments(generate)
    generate.set_defaults(run=generate_cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
