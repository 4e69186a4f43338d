"""The training data: three sequence tasks on digits, and a character-level text.

Token ids: 0 PAD, 1 BOS, 2 EOS, then the symbols. A toy example is a source of digits and
its target (reversed, copied or sorted); the decoder reads BOS + target and predicts
target + EOS. A text is cut into windows for the decoder-only language model.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from .transformer import BOS, EOS, PAD

TOY_TASKS = ("reverse", "copy", "sort")
TASKS = TOY_TASKS + ("lm",)
DIGIT_BASE = EOS + 1  # digit d is token d + 3
DIGITS_VOCAB = DIGIT_BASE + 10


def transform(task: str, digits: list[int]) -> list[int]:
    """The target of a toy task for a list of digits."""
    if task == "reverse":
        return digits[::-1]
    if task == "copy":
        return list(digits)
    if task == "sort":
        return sorted(digits)
    raise ValueError(f"unknown task {task!r}; choose from {TOY_TASKS}")


def digits_to_tokens(digits: list[int]) -> list[int]:
    return [d + DIGIT_BASE for d in digits]


def tokens_to_digits(tokens: list[int]) -> list[int]:
    """Digits of a decoded sequence, up to its EOS (special tokens dropped)."""
    out = []
    for t in tokens:
        if t == EOS:
            break
        if t >= DIGIT_BASE:
            out.append(int(t) - DIGIT_BASE)
    return out


def parse_digits(text: str) -> list[int]:
    """'3 1 4 1 5' (or '31415') -> [3, 1, 4, 1, 5]."""
    pieces = text.split() if " " in text.strip() else list(text.strip())
    try:
        digits = [int(p) for p in pieces]
    except ValueError:
        raise ValueError(f"expected digits separated by spaces, like '3 1 4 1 5'; got {text!r}") from None
    if not digits or any(not 0 <= d <= 9 for d in digits):
        raise ValueError(f"expected one or more digits 0-9; got {text!r}")
    return digits


def pad_rows(rows: list[list[int]]) -> np.ndarray:
    """(B, max length) int64, PAD-filled."""
    out = np.full((len(rows), max(len(r) for r in rows)), PAD, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


@dataclass(frozen=True)
class Batch:
    src: np.ndarray | None  # (B, S), None for the language model
    tgt_in: np.ndarray  # (B, T): BOS + target
    tgt_out: np.ndarray  # (B, T): target + EOS, PAD where tgt_in is padding

    @property
    def tokens(self) -> int:
        """Target tokens that count in the loss."""
        return int((self.tgt_out != PAD).sum())


def toy_batch(task: str, sources: list[list[int]]) -> Batch:
    targets = [transform(task, s) for s in sources]
    return Batch(
        pad_rows([digits_to_tokens(s) for s in sources]),
        pad_rows([[BOS] + digits_to_tokens(t) for t in targets]),
        pad_rows([digits_to_tokens(t) + [EOS] for t in targets]),
    )


class ToyData:
    """Random digit sequences with lengths in [min_len, max_len]; the held-out set is drawn
    first from its own seed, and training never draws one of its sequences."""

    def __init__(self, task: str, min_len: int, max_len: int, seed: int, held_out: int = 500):
        if task not in TOY_TASKS:
            raise ValueError(f"unknown task {task!r}; choose from {TOY_TASKS}")
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len; got {min_len}, {max_len}")
        self.task, self.min_len, self.max_len = task, min_len, max_len
        self.rng = np.random.default_rng(seed)
        held = np.random.default_rng(seed + 1_000_003)
        self.held_out = [self._draw(held) for _ in range(held_out)]
        self._held = {tuple(s) for s in self.held_out}

    def _draw(self, rng: np.random.Generator) -> list[int]:
        length = int(rng.integers(self.min_len, self.max_len + 1))
        return [int(d) for d in rng.integers(0, 10, size=length)]

    def batch(self, size: int) -> Batch:
        sources = []
        while len(sources) < size:
            s = self._draw(self.rng)
            if tuple(s) not in self._held or len(self._held) >= 10**self.max_len:
                sources.append(s)
        return toy_batch(self.task, sources)


DEFAULT_TEXT = "attention_notes.txt"


def read_text(path: str | Path | None) -> str:
    """The text at `path`, or the short text that ships with attngrad."""
    if path is None:
        return resources.files("attngrad.model").joinpath("texts", DEFAULT_TEXT).read_text(encoding="utf-8")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte {error.start} is {error.object[error.start]:#04x})") from None
    if len(text) < 64:
        raise ValueError(f"{path} holds {len(text)} characters; a language model needs a few thousand")
    return text


class CharVocab:
    """Characters as token ids DIGIT_BASE, DIGIT_BASE + 1, ... (after PAD, BOS, EOS)."""

    def __init__(self, chars: str):
        self.chars = chars
        self.index = {c: i + DIGIT_BASE for i, c in enumerate(chars)}

    @property
    def size(self) -> int:
        return DIGIT_BASE + len(self.chars)

    def encode(self, text: str) -> list[int]:
        missing = sorted(set(text) - set(self.index))
        if missing:
            raise ValueError(f"characters outside the model's vocabulary: {missing[:10]}")
        return [self.index[c] for c in text]

    def decode(self, tokens: list[int]) -> str:
        return "".join(self.chars[t - DIGIT_BASE] for t in tokens if DIGIT_BASE <= t < self.size)


class TextData:
    """Character-level windows of a text: 90% for training, the last 10% held out."""

    def __init__(self, text: str, window: int, seed: int, chars: str | None = None):
        self.vocab = CharVocab(chars if chars is not None else "".join(sorted(set(text))))
        self.chars = self.vocab.chars
        ids = np.array(self.vocab.encode(text), dtype=np.int64)
        split = int(len(ids) * 0.9)
        self.train, self.held_out = ids[:split], ids[split:]
        if len(self.held_out) <= window or len(self.train) <= window:
            raise ValueError(f"the text ({len(text)} characters) is too short for windows of {window}")
        self.window = window
        self.rng = np.random.default_rng(seed)

    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    def _windows(self, ids: np.ndarray, starts: np.ndarray) -> Batch:
        rows = np.stack([ids[s : s + self.window + 1] for s in starts])  # (B, window + 1)
        return Batch(None, rows[:, :-1], rows[:, 1:])

    def batch(self, size: int) -> Batch:
        return self._windows(self.train, self.rng.integers(0, len(self.train) - self.window - 1, size=size))

    def held_out_batch(self, size: int) -> Batch:
        starts = np.linspace(0, len(self.held_out) - self.window - 2, num=size).astype(int)
        return self._windows(self.held_out, starts)
