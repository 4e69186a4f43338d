"""`attngrad train`: train the NumPy Transformer by hand-derived gradients, with progress."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..model.tasks import TASKS
from . import pip_install
from .arg_types import fraction, nonnegative_float, nonnegative_int, positive_int, probability

DEFAULTS = {  # TrainConfig and TransformerConfig defaults, as the command shows them
    "steps": 3000, "batch_size": 64, "d_model": 64, "heads": 4, "d_ff": 256, "layers": 2, "dropout": 0.1,
}


DOCS_PAGE = Path("docs/train.md")
DOCS_TITLE = "Training runs"
DOCS_PREAMBLE = """Runs of `attngrad train`: a Transformer in NumPy whose every gradient is written by
hand (attention's from `attngrad.reference`). Each section was written by the command at
its top with `--docs`; run it again to replace the section."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", choices=TASKS, default="reverse",
                        help="reverse, copy or sort digit sequences (encoder-decoder), or lm: a character "
                        "language model (decoder-only) on --text (default %(default)s)")
    parser.add_argument("--text", type=Path, help="lm: the text to learn (default: a short text shipped with attngrad)")
    parser.add_argument("--steps", type=positive_int, default=DEFAULTS["steps"], help="training steps (default %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=DEFAULTS["batch_size"], help="sequences per step (default %(default)s)")
    parser.add_argument("--d-model", type=positive_int, default=DEFAULTS["d_model"], help="model width (default %(default)s)")
    parser.add_argument("--heads", type=positive_int, default=DEFAULTS["heads"], help="attention heads (default %(default)s)")
    parser.add_argument("--d-ff", type=positive_int, default=DEFAULTS["d_ff"], help="feed-forward width (default %(default)s)")
    parser.add_argument("--layers", type=positive_int, default=DEFAULTS["layers"], help="N, layers per stack (default %(default)s)")
    parser.add_argument("--dropout", type=probability, default=DEFAULTS["dropout"], help="dropout rate (default %(default)s)")
    parser.add_argument("--pre-ln", action="store_true", help="pre-LN sublayers (default: post-LN, as in the paper)")
    parser.add_argument("--untied", action="store_true", help="an output projection of its own (default: tied to the target embedding)")
    parser.add_argument("--min-len", type=positive_int, default=3, help="toy tasks: shortest source (default %(default)s)")
    parser.add_argument("--max-len", type=positive_int, default=10, help="toy tasks: longest source (default %(default)s)")
    parser.add_argument("--window", type=positive_int, default=64, help="lm: characters per training window (default %(default)s)")
    parser.add_argument("--warmup", type=positive_int, default=400, help="warm-up steps of the learning rate (default %(default)s)")
    parser.add_argument("--lr-factor", type=nonnegative_float, default=1.0, help="multiplies the paper's learning rate (default %(default)s)")
    parser.add_argument("--clip", type=nonnegative_float, default=1.0, help="global gradient-norm clip, 0 = off (default %(default)s)")
    parser.add_argument("--smoothing", type=probability, default=0.1, help="label smoothing (default %(default)s)")
    parser.add_argument("--stop-at", type=fraction, default=0.995,
                        help="toy tasks: stop once held-out exact match reaches this; 0 = never (default %(default)s)")
    parser.add_argument("--eval-every", type=positive_int, default=250, help="steps between held-out evaluations (default %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="(default %(default)s)")
    parser.add_argument("--seed", type=nonnegative_int, default=0, help="(default %(default)s)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="BLAS threads: the model's matrices are small, and one thread is as fast as two on an "
                        "idle machine and 2.4x faster beside a busy process (default %(default)s)")
    parser.add_argument("--resume", type=Path, metavar="CHECKPOINT", help="continue from a checkpoint (its model, optimizer state and step count), up to --steps in all")
    parser.add_argument("--out", type=Path, default=Path("runs/latest"),
                        help="folder for model.npz, history.json, curves.png (default %(default)s)")
    parser.add_argument("--docs", type=Path, nargs="?", const=DOCS_PAGE, default=None, metavar="PAGE",
                        help=f"also write this run's section of PAGE (default {DOCS_PAGE}): the command, the result, "
                        "time and memory, and the curves (in img/ beside the page)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from threadpoolctl import threadpool_limits

    from ..model.tasks import read_text
    from ..model.training import TrainConfig, train
    from ..model.transformer import TransformerConfig

    err = Console(stderr=True)
    if args.d_model % args.heads or args.min_len > args.max_len:
        problem = (f"--d-model {args.d_model} is not divisible by --heads {args.heads}" if args.d_model % args.heads
                   else f"--min-len {args.min_len} exceeds --max-len {args.max_len}")
        err.print(f"attngrad train: error: {problem}", highlight=False, markup=False)
        return 2
    if args.text is not None:  # read it now: a bad file is an error before any bar is drawn
        try:
            read_text(args.text)
        except (OSError, ValueError) as error:
            err.print(f"attngrad train: error: --text {args.text}: {error}", highlight=False, markup=False)
            return 2
    try:
        train_config = TrainConfig(
            task=args.task, steps=args.steps, batch_size=args.batch_size, min_len=args.min_len, max_len=args.max_len,
            window=args.window, warmup=args.warmup, lr_factor=args.lr_factor, clip=args.clip, smoothing=args.smoothing,
            seed=args.seed, dtype=args.dtype, eval_every=args.eval_every,
            stop_at=args.stop_at if args.stop_at > 0 else None, text=None if args.text is None else str(args.text),
        )
        model_config = TransformerConfig(
            vocab_size=4, d_model=args.d_model, heads=args.heads, d_ff=args.d_ff, layers=args.layers,
            dropout=args.dropout, pre_ln=args.pre_ln, tie_output=not args.untied,
        )  # vocab_size is a placeholder: train() sets the task's own
    except ValueError as error:
        err.print(f"attngrad train: error: {error}", highlight=False, markup=False)
        return 2
    metric = "exact match" if args.task != "lm" else "next-char acc"
    with threadpool_limits(limits=args.threads, user_api="blas"), \
            Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                     TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TextColumn("left"),
                     TimeRemainingColumn(), console=err) as progress:
        bar = progress.add_task(f"train {args.task}", total=args.steps, status="")

        def report(state: dict) -> None:
            accuracy = "-" if state["accuracy"] is None else f"{state['accuracy']:.3f}"  # "-": not evaluated yet
            status = (f"loss {state['loss']:.3f}  {metric} {accuracy}  "
                      f"{state['tokens_per_second']:.0f} tok/s  lr {state['lr']:.2e}")
            progress.update(bar, completed=state["step"], status=status)

        try:
            result = train(train_config, model_config, out=args.out, resume=args.resume, report=report)
        except (ValueError, FileNotFoundError) as error:
            progress.stop()
            err.print(f"attngrad train: error: {error}", highlight=False, markup=False)
            return 2
    out = Console()
    out.print(f"{args.task}: held-out {metric} {result.accuracy:.4f} after {result.steps} steps "
              f"in {result.seconds:.0f} s", highlight=False)
    for path in sorted(args.out.iterdir()):
        out.print(f"wrote {path}", highlight=False)
    if not (args.out / "curves.png").exists():
        out.print(f"no curves.png: matplotlib is not installed: {pip_install('docs')}", highlight=False, markup=False)
    if args.docs is not None:
        for path in _write_docs(args, result, metric):
            out.print(f"wrote {path}", highlight=False)
    return 0


def _command(args: argparse.Namespace) -> str:
    """The command line that repeats this run, every option that shapes it spelled out."""
    options = dict(task=args.task, steps=args.steps, batch_size=args.batch_size, d_model=args.d_model, heads=args.heads,
                   d_ff=args.d_ff, layers=args.layers, dropout=args.dropout, warmup=args.warmup, seed=args.seed,
                   stop_at=args.stop_at, dtype=args.dtype, threads=args.threads)
    words = [f"--{name.replace('_', '-')} {value}" for name, value in options.items()]
    words += [flag for flag, on in (("--pre-ln", args.pre_ln), ("--untied", args.untied)) if on]
    if args.resume:
        words.append(f"--resume {args.resume}")
    return "attngrad train " + " ".join(words)


def _write_docs(args: argparse.Namespace, result, metric: str) -> list[Path]:
    """This run's section of the docs page (keyed by its task) and its curves."""
    import resource
    import shutil
    from datetime import datetime, timezone

    from ..docs_page import write_section
    from ..machine import cpu_name

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    lines = [f"`{_command(args)}`", "",
             f"Held-out {metric} {result.accuracy:.4f} after {result.steps} steps, in {result.seconds:.0f} s wall time "
             f"and {peak:.0f} MiB peak memory; {cpu_name()}, {args.threads} BLAS thread(s), "
             f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}."]
    written = []
    curves = args.out / "curves.png"
    if curves.exists():
        image = args.docs.parent / "img" / f"train-{args.task}.png"
        image.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(curves, image)
        lines += ["", f"![attngrad train --task {args.task}](img/{image.name})"]
        written.append(image)
    page = write_section(args.docs, f"attngrad train ({args.task})", "\n".join(lines), DOCS_TITLE, DOCS_PREAMBLE)
    return [page] + written


