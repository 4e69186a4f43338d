"""Training by hand-derived gradients: the loop, evaluation, decoding, checkpoints, curves.

One step: forward with fresh dropout masks, smoothed cross-entropy, `transformer.backward`,
clip the global gradient norm, Adam with the paper's warm-up. Every `eval_every` steps the
toy tasks greedy-decode their held-out sequences and count exact matches (the language
model reports held-out loss and next-character accuracy instead).

A checkpoint is one .npz: every parameter under its name, the optimizer state, and the
model and training configurations as JSON text. It is read with allow_pickle=False, and a
file whose arrays do not match its configuration is refused.
"""

from __future__ import annotations

import json
import time
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .layers import Dropout
from .loss import cross_entropy_backward, cross_entropy_forward
from .optim import Adam, clip_grad_norm, warmup_lr
from .tasks import DIGITS_VOCAB, TOY_TASKS, Batch, TextData, ToyData, digits_to_tokens, read_text, tokens_to_digits
from .transformer import (
    BOS,
    EOS,
    PAD,
    TransformerConfig,
    backward,
    decode,
    encode,
    forward,
    init_params,
    parameter_shapes,
)

DTYPES = {"float32": np.float32, "float64": np.float64}


@dataclass(frozen=True)
class TrainConfig:
    task: str = "reverse"
    steps: int = 3000
    batch_size: int = 64
    min_len: int = 3  # toy tasks: source lengths
    max_len: int = 10
    window: int = 64  # lm: characters per training window
    warmup: int = 400
    lr_factor: float = 1.0
    clip: float = 1.0
    smoothing: float = 0.1
    seed: int = 0
    dtype: str = "float32"
    eval_every: int = 250
    held_out: int = 500
    stop_at: float | None = 0.995  # stop once held-out exact match reaches this (toy tasks)
    text: str | None = None  # lm: path of the text; None = the one that ships with attngrad

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}; got {self.dtype!r}")
        if min(self.steps, self.batch_size, self.warmup, self.eval_every, self.held_out, self.window) < 1:
            raise ValueError(f"steps, batch_size, warmup, eval_every, held_out and window must be positive: {self}")


@dataclass
class History:
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)  # training loss, mean since the last record
    eval_steps: list[int] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)  # held-out exact match (lm: next-char accuracy)


# --- decoding -------------------------------------------------------------------------------


def greedy_decode(params: dict[str, np.ndarray], config: TransformerConfig, src: np.ndarray, max_new: int) -> np.ndarray:
    """Encoder-decoder greedy decoding: (B, S) sources -> (B, <= max_new) tokens, EOS and PAD after."""
    memory, enc_cache = encode(params, config, src)
    out = np.full((src.shape[0], 1), BOS, dtype=np.int64)
    done = np.zeros(src.shape[0], dtype=bool)
    for _ in range(max_new):
        logits, _ = decode(params, config, out, memory, enc_cache[3])
        nxt = logits[:, -1].argmax(axis=-1)
        nxt[done] = PAD
        out = np.concatenate([out, nxt[:, None]], axis=1)
        done |= nxt == EOS
        if done.all():
            break
    return out[:, 1:]


def sample_text(params: dict[str, np.ndarray], config: TransformerConfig, prompt: list[int], length: int,
                rng: np.random.Generator, temperature: float = 1.0, context: int | None = None) -> list[int]:
    """Decoder-only sampling of `length` tokens after `prompt` (greedy at temperature 0), each
    from the last `context` tokens (the training window: later positions were never trained)."""
    tokens = [BOS] + list(prompt)
    context = min(context or config.max_len, config.max_len)
    for _ in range(length):
        window = np.array([tokens[-context:]], dtype=np.int64)
        logits, _ = forward(params, config, None, window)
        last = logits[0, -1].astype(np.float64)
        last[:EOS + 1] = -np.inf  # never PAD, BOS or EOS in running text
        if temperature <= 0:
            choice = int(last.argmax())
        else:
            p = np.exp((last - last.max()) / temperature)
            choice = int(rng.choice(len(p), p=p / p.sum()))
        tokens.append(choice)
    return tokens[1 + len(prompt):]


def exact_match(params: dict[str, np.ndarray], config: TransformerConfig, task: str, sources: list[list[int]]) -> float:
    """Fraction of `sources` whose greedy decoding is exactly the task's target."""
    from .tasks import pad_rows, transform

    hits = 0
    for start in range(0, len(sources), 256):
        chunk = sources[start:start + 256]
        decoded = greedy_decode(params, config, pad_rows([digits_to_tokens(s) for s in chunk]), max(len(s) for s in chunk) + 1)
        hits += sum(tokens_to_digits(list(row)) == transform(task, s) for row, s in zip(decoded, chunk))
    return hits / len(sources)


def next_token_accuracy(params: dict[str, np.ndarray], config: TransformerConfig, batch: Batch) -> tuple[float, float]:
    """(loss, accuracy) of next-token prediction on a held-out batch."""
    logits, _ = forward(params, config, batch.src, batch.tgt_in)
    loss, _ = cross_entropy_forward(logits, batch.tgt_out, pad=PAD)
    real = batch.tgt_out != PAD
    return loss, float(((logits.argmax(-1) == batch.tgt_out) & real).sum() / real.sum())


# --- checkpoints ----------------------------------------------------------------------------


def save_checkpoint(path: str | Path, params: dict[str, np.ndarray], model: TransformerConfig, train: TrainConfig,
                    optimizer: Adam | None = None, history: History | None = None, chars: str | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": "attngrad-transformer-1", "model": model.as_dict(), "train": asdict(train),
            "history": asdict(history) if history else None, "chars": chars}
    arrays = {f"param.{n}": a for n, a in params.items()}
    if optimizer is not None:
        arrays.update(optimizer.state())
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)
    return path


@dataclass
class Checkpoint:
    params: dict[str, np.ndarray]
    model: TransformerConfig
    train: TrainConfig
    history: History
    optimizer_state: dict[str, np.ndarray]
    chars: str | None


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint written by `save_checkpoint`; refuse pickled objects and arrays that
    do not match the configuration, with a message that says what is wrong."""
    path = Path(path)
    if not zipfile.is_zipfile(path):  # also refuses a bare pickle, which np.load would try to read
        raise ValueError(f"{path}: not a readable .npz checkpoint")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except ValueError as error:  # numpy's refusal of object arrays
        raise ValueError(f"{path}: refused, it holds pickled Python objects ({error})") from None
    except (OSError, EOFError) as error:
        raise ValueError(f"{path}: not a readable .npz checkpoint ({error})") from None
    if "meta" not in arrays:
        raise ValueError(f"{path}: not an attngrad checkpoint (no 'meta' entry)")
    try:
        meta = json.loads(str(arrays.pop("meta")))
        if meta.get("format") != "attngrad-transformer-1":
            raise ValueError(f"unknown checkpoint format {meta.get('format')!r}")
        model = TransformerConfig(**meta["model"])
        train_config = TrainConfig(**meta["train"])
        history = History(**meta["history"]) if meta.get("history") else History()
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"{path}: its configuration cannot be read ({error})") from None
    params = {n[len("param."):]: a for n, a in arrays.items() if n.startswith("param.")}
    expected = parameter_shapes(model)
    if params.keys() != expected.keys():
        diff = sorted(set(params) ^ set(expected))
        raise ValueError(f"{path}: parameters do not match the configuration; differing names: {diff[:6]}")
    for name, shape in expected.items():
        if params[name].shape != shape:
            raise ValueError(f"{path}: parameter {name} has shape {params[name].shape}, the configuration says {shape}")
        if params[name].dtype not in (np.float32, np.float64):
            raise ValueError(f"{path}: parameter {name} has dtype {params[name].dtype}; expected float32 or float64")
    optimizer_state = {n: a for n, a in arrays.items() if n.startswith("adam.")}
    if optimizer_state:
        for name, shape in expected.items():
            for moment in ("m", "v"):
                key = f"adam.{moment}.{name}"
                if key not in optimizer_state or optimizer_state[key].shape != shape:
                    raise ValueError(f"{path}: the optimizer state {key} is missing or not of shape {shape}")
    return Checkpoint(params, model, train_config, history, optimizer_state, meta.get("chars"))


# --- the loop -------------------------------------------------------------------------------


@dataclass
class TrainResult:
    params: dict[str, np.ndarray]
    model: TransformerConfig
    history: History
    accuracy: float
    seconds: float
    steps: int
    checkpoint: Path | None


def train(
    train_config: TrainConfig,
    model_config: TransformerConfig | None = None,
    *,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    report: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Train a model on `train_config.task`; write out/model.npz (and out/curves.png with
    matplotlib) when `out` is given. `report` gets a dict after every step (for a progress bar)."""
    dtype = DTYPES[train_config.dtype]
    text_data = toy = None
    if train_config.task == "lm":
        text_data = TextData(read_text(train_config.text), train_config.window, train_config.seed)
        vocab = text_data.vocab_size
    elif train_config.task in TOY_TASKS:
        toy = ToyData(train_config.task, train_config.min_len, train_config.max_len, train_config.seed, train_config.held_out)
        vocab = DIGITS_VOCAB
    else:
        raise ValueError(f"unknown task {train_config.task!r}; choose from {TOY_TASKS + ('lm',)}")
    history = History()
    start_step = 0
    if resume is not None:
        ckpt = load_checkpoint(resume)
        if ckpt.train.task != train_config.task:
            raise ValueError(f"{resume} was trained on {ckpt.train.task!r}, not {train_config.task!r}")
        model_config, params, history = ckpt.model, {n: a.astype(dtype) for n, a in ckpt.params.items()}, ckpt.history
        if text_data is not None and ckpt.chars is not None:
            text_data = TextData(read_text(train_config.text), train_config.window, train_config.seed, chars=ckpt.chars)
    else:
        base = model_config or TransformerConfig(vocab_size=vocab)
        model_config = replace(base, vocab_size=vocab, decoder_only=train_config.task == "lm",
                               max_len=max(base.max_len, train_config.window + 1, train_config.max_len + 2))
        params = init_params(model_config, np.random.default_rng(train_config.seed), dtype)
    optimizer = Adam(params)
    if resume is not None and ckpt.optimizer_state:
        optimizer.load_state(ckpt.optimizer_state)
        start_step = optimizer.step_count
    rng = np.random.default_rng(train_config.seed + 7 + start_step)
    accuracy = history.accuracy[-1] if history.accuracy else None  # None until the first evaluation
    began = time.perf_counter()
    running, running_n, tokens_seen = 0.0, 0, 0
    step = start_step
    for step in range(start_step + 1, train_config.steps + 1):
        batch = (text_data or toy).batch(train_config.batch_size)
        logits, cache = forward(params, model_config, batch.src, batch.tgt_in, Dropout(model_config.dropout, rng))
        loss, loss_cache = cross_entropy_forward(logits, batch.tgt_out, pad=PAD, smoothing=train_config.smoothing)
        grads = backward(cross_entropy_backward(loss_cache).reshape(logits.shape), cache)
        norm = clip_grad_norm(grads, train_config.clip)
        lr = warmup_lr(step, model_config.d_model, train_config.warmup, train_config.lr_factor)
        optimizer.step(grads, lr)
        running, running_n, tokens_seen = running + loss, running_n + 1, tokens_seen + batch.tokens
        evaluate = step % train_config.eval_every == 0 or step == train_config.steps
        if evaluate:
            history.steps.append(step)
            history.loss.append(running / running_n)
            running, running_n = 0.0, 0
            if toy is not None:
                accuracy = exact_match(params, model_config, toy.task, toy.held_out)
            else:
                accuracy = next_token_accuracy(params, model_config, text_data.held_out_batch(64))[1]
            history.eval_steps.append(step)
            history.accuracy.append(accuracy)
        if report is not None:
            elapsed = time.perf_counter() - began
            report({"step": step, "steps": train_config.steps, "loss": loss, "accuracy": accuracy, "lr": lr,
                    "grad_norm": norm, "tokens_per_second": tokens_seen / max(elapsed, 1e-9), "evaluated": evaluate})
        if evaluate and toy is not None and train_config.stop_at is not None and accuracy >= train_config.stop_at:
            break
    seconds = time.perf_counter() - began
    checkpoint = None
    if out is not None:
        out = Path(out)
        final_config = replace(train_config, steps=max(train_config.steps, step))
        checkpoint = save_checkpoint(out / "model.npz", params, model_config, final_config, optimizer, history,
                                     text_data.chars if text_data else None)
        (out / "history.json").write_text(json.dumps(asdict(history), indent=1) + "\n", encoding="utf-8")
        try:
            plot_history(history, out / "curves.png", train_config.task)
        except ImportError:
            pass  # matplotlib is optional
    return TrainResult(params, model_config, history, 0.0 if accuracy is None else accuracy, seconds, step, checkpoint)


def plot_history(history: History, path: Path, task: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    left.plot(history.steps, history.loss, color="#1f4e9c")
    left.set_xlabel("step")
    left.set_ylabel("training loss (smoothed cross-entropy)")
    left.set_yscale("log")
    left.grid(True, alpha=0.3)
    right.plot(history.eval_steps, history.accuracy, color="#c0392b", marker="o", markersize=3)
    right.set_xlabel("step")
    right.set_ylabel("held-out exact match" if task != "lm" else "held-out next-character accuracy")
    right.set_ylim(0, 1.02)
    right.grid(True, alpha=0.3)
    fig.suptitle(f"attngrad train --task {task}: NumPy, hand-derived gradients")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

