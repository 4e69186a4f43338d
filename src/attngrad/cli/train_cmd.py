"""`attngrad train`: train the NumPy Transformer by hand-derived gradients, with progress."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..model.tasks import TASKS

DEFAULTS = {  # TrainConfig and TransformerConfig defaults, as the command shows them
    "steps": 3000, "batch_size": 64, "d_model": 64, "heads": 4, "d_ff": 256, "layers": 2, "dropout": 0.1,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", choices=TASKS, default="reverse",
                        help="reverse, copy or sort digit sequences (encoder-decoder), or lm: a character "
                        "language model (decoder-only) on --text (default %(default)s)")
    parser.add_argument("--text", type=Path, help="lm: the text to learn (default: a short text shipped with attngrad)")
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="training steps (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"], help="sequences per step (default %(default)s)")
    parser.add_argument("--d-model", type=int, default=DEFAULTS["d_model"], help="model width (default %(default)s)")
    parser.add_argument("--heads", type=int, default=DEFAULTS["heads"], help="attention heads (default %(default)s)")
    parser.add_argument("--d-ff", type=int, default=DEFAULTS["d_ff"], help="feed-forward width (default %(default)s)")
    parser.add_argument("--layers", type=int, default=DEFAULTS["layers"], help="N, layers per stack (default %(default)s)")
    parser.add_argument("--dropout", type=float, default=DEFAULTS["dropout"], help="dropout rate (default %(default)s)")
    parser.add_argument("--pre-ln", action="store_true", help="pre-LN sublayers (default: post-LN, as in the paper)")
    parser.add_argument("--untied", action="store_true", help="an output projection of its own (default: tied to the target embedding)")
    parser.add_argument("--min-len", type=int, default=3, help="toy tasks: shortest source (default %(default)s)")
    parser.add_argument("--max-len", type=int, default=10, help="toy tasks: longest source (default %(default)s)")
    parser.add_argument("--window", type=int, default=64, help="lm: characters per training window (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=400, help="warm-up steps of the learning rate (default %(default)s)")
    parser.add_argument("--lr-factor", type=float, default=1.0, help="multiplies the paper's learning rate (default %(default)s)")
    parser.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip, 0 = off (default %(default)s)")
    parser.add_argument("--smoothing", type=float, default=0.1, help="label smoothing (default %(default)s)")
    parser.add_argument("--stop-at", type=float, default=0.995,
                        help="toy tasks: stop once held-out exact match reaches this; 0 = never (default %(default)s)")
    parser.add_argument("--eval-every", type=int, default=250, help="steps between held-out evaluations (default %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="(default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default %(default)s)")
    parser.add_argument("--resume", type=Path, metavar="CHECKPOINT", help="continue from a checkpoint (its model, optimizer state and step count), up to --steps in all")
    parser.add_argument("--out", type=Path, default=Path("runs/latest"),
                        help="folder for model.npz, history.json, curves.png (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..model.training import TrainConfig, train
    from ..model.transformer import TransformerConfig

    err = Console(stderr=True)
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
        err.print(f"attngrad train: error: {error}", highlight=False)
        return 2
    metric = "exact match" if args.task != "lm" else "next-char acc"
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                  TimeElapsedColumn(), console=err) as progress:
        bar = progress.add_task(f"train {args.task}", total=args.steps, status="")

        def report(state: dict) -> None:
            status = (f"loss {state['loss']:.3f}  {metric} {state['accuracy']:.3f}  "
                      f"{state['tokens_per_second']:.0f} tok/s  lr {state['lr']:.2e}")
            progress.update(bar, completed=state["step"], status=status)

        try:
            result = train(train_config, model_config, out=args.out, resume=args.resume, report=report)
        except (ValueError, FileNotFoundError) as error:
            progress.stop()
            err.print(f"attngrad train: error: {error}", highlight=False)
            return 2
    out = Console()
    out.print(f"{args.task}: held-out {metric} {result.accuracy:.4f} after {result.steps} steps "
              f"in {result.seconds:.0f} s", highlight=False)
    for path in sorted(args.out.iterdir()):
        out.print(f"wrote {path}", highlight=False)
    return 0


