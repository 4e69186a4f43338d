"""`attngrad generate`: decode with a trained checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arg_types import nonnegative_float, nonnegative_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="toy tasks: digits such as '3 1 4 1 5'; lm: the text to continue")
    parser.add_argument("--checkpoint", type=Path, required=True, help="a model.npz written by attngrad train")
    parser.add_argument("--length", type=nonnegative_int, default=200, help="lm: characters to sample (default %(default)s)")
    parser.add_argument("--temperature", type=nonnegative_float, default=0.8,
                        help="lm: sampling temperature, 0 = greedy (default %(default)s)")
    parser.add_argument("--seed", type=nonnegative_int, default=0, help="lm: sampling seed (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    import sys

    import numpy as np

    from ..model.tasks import CharVocab, digits_to_tokens, parse_digits, tokens_to_digits
    from ..model.training import greedy_decode, load_checkpoint, sample_text

    try:
        ckpt = load_checkpoint(args.checkpoint)
        if ckpt.model.decoder_only:
            if not ckpt.chars:
                raise ValueError(f"{args.checkpoint} is a language model without its character table")
            vocab = CharVocab(ckpt.chars)
            if len(args.prompt) > ckpt.train.window:
                print(f"attngrad generate: warning: the prompt has {len(args.prompt)} characters; the model sees "
                      f"only the last {ckpt.train.window} (its training window)", file=sys.stderr)
            rng = np.random.default_rng(args.seed)
            sampled = sample_text(ckpt.params, ckpt.model, vocab.encode(args.prompt), args.length, rng, args.temperature,
                                  context=ckpt.train.window)
            print(args.prompt + vocab.decode(sampled))
            return 0
        digits = parse_digits(args.prompt)
        if len(digits) + 2 > ckpt.model.max_len:
            raise ValueError(f"the prompt has {len(digits)} digits; this model takes at most {ckpt.model.max_len - 2}")
        if not ckpt.train.min_len <= len(digits) <= ckpt.train.max_len:
            print(f"attngrad generate: warning: the prompt has {len(digits)} digits, but this model was trained on "
                  f"{ckpt.train.min_len} to {ckpt.train.max_len}; expect a poor answer", file=sys.stderr)
        decoded = greedy_decode(ckpt.params, ckpt.model, np.array([digits_to_tokens(digits)]), len(digits) + 1)
        print(" ".join(str(d) for d in tokens_to_digits(list(decoded[0]))))
        return 0
    except (ValueError, FileNotFoundError) as error:
        print(f"attngrad generate: error: {error}", file=sys.stderr)
        return 2
