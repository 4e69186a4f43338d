"""Entry point of the `attngrad` command: one subcommand per job."""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from . import bench_cmd, build_cmd, check_cmd, formulas_cmd, generate_cmd, gpu_report_cmd, train_cmd

COMMANDS = (  # (name, module, one-line help, description)
    ("check", check_cmd,
     "prove every attention gradient against PyTorch autograd and finite differences",
     "Check every gradient of every attention flavor and option against PyTorch autograd (float64) and central "
     "finite differences, with random inputs and a random upstream gradient. Exit status 1 if any check fails."),
    ("formulas", formulas_cmd,
     "print the gradient formulas of each attention flavor",
     "Print, for each flavor, the forward lines and the backward lines that differentiate them."),
    ("bench", bench_cmd,
     "time attngrad's attention beside PyTorch's (fwd+bwd, jvp, double backward) and measure peak memory",
     "attngrad.torch beside PyTorch's default and math backends, on identical inputs in one process, alternating "
     "runs: forward+backward, forward-mode JVP, double backward; peak memory per case in a fresh process. Writes "
     "a table, results.md, results.json and results.png."),
    ("train", train_cmd,
     "train a NumPy Transformer by hand-derived gradients (reverse, copy, sort, lm)",
     "Train the Transformer of 'Attention Is All You Need', written in NumPy with every backward pass derived by "
     "hand, on a toy task or a text. Progress bar with loss, accuracy and tokens per second; writes model.npz, "
     "history.json and curves.png."),
    ("gpu-report", gpu_report_cmd,
     "compile every Triton kernel variant for sm_80 and sm_90, without a GPU: registers, spills, shared memory",
     "Compile the Triton backend's kernels ahead of time for A100 (sm_80) and H100 (sm_90) with the tiles each "
     "pass uses, and report registers, spilled bytes and shared memory per variant (ptxas -v). Exit status 1 "
     "if a variant does not compile, or spills at a head width up to 128 in float16, bfloat16 or float32."),
    ("build", build_cmd,
     "compile the CPU tiles ahead of time (a container image, a cluster's set-up), into the cache or --cache",
     "Compile attngrad.torch's CPU tiles into the cache folder (ATTNGRAD_CACHE, or --cache), or find them built "
     "there, and print where and how long it took. Exit status 1 where they cannot be built (no compiler, "
     "ATTNGRAD_NATIVE=0): attngrad.torch then runs its torch-ops fallback."),
    ("generate", generate_cmd,
     "decode with a trained checkpoint: reverse/copy/sort digits, or sample text",
     "Greedy-decode a digit sequence with a toy-task checkpoint, or sample text after a prompt with a "
     "language-model checkpoint."),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attngrad",
        description="The gradient of Transformer attention, in closed form, proved.",
    )
    parser.add_argument("--version", action="version", version=f"attngrad {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module, summary, description in COMMANDS:
        command = commands.add_parser(name, help=summary, description=description)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except BrokenPipeError:  # the reader left (`attngrad check --json | head`): no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python flushes stdout at exit: let that go nowhere
        return 1


if __name__ == "__main__":
    sys.exit(main())
