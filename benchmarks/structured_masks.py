"""The structured-mask bars, side by side in one process, interleaved (B=1, H=8, d=64,
float32, fwd+bwd; the median of --repeats runs of each):

    window      causal sliding window of --window keys at --window-length, against full
                causal attention at that length (attngrad both)
    documents   8 packed documents of L/8 at --documents-length, against 8 separate calls
                on the documents (attngrad both)
    lengths     padding given as lengths (the last quarter of the keys), against the same
                padding as a dense (B, 1, L, L) boolean mask, as transformers builds it
                (attngrad both; B=4 here, so that the lengths differ per entry)

Prints one line per comparison and the machine; `--quick` shrinks the lengths for a smoke run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from attngrad.bench.runner import cpu_name
from attngrad.torch import attention

HEADS, DIM = 8, 64


def _inputs(batch: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, HEADS, length, DIM, generator=g) for _ in range(4)]  # q, k, v, dout


def _train(fn: Callable[..., torch.Tensor], q, k, v, dout) -> Callable[[], None]:
    def run() -> None:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        fn(*leaves).backward(dout)
    return run


def _interleaved(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds of each step, the steps taking turns (after one warm-up each)."""
    for run in steps.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, run in steps.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def window(length: int, keys: int, repeats: int) -> str:
    q, k, v, dout = _inputs(1, length)
    t = _interleaved({
        "window": _train(lambda q, k, v: attention(q, k, v, is_causal=True, window=(keys - 1, None)), q, k, v, dout),
        "causal": _train(lambda q, k, v: attention(q, k, v, is_causal=True), q, k, v, dout),
    }, repeats)
    return (f"causal window of {keys} at L={length}: {t['window'] * 1e3:.0f} ms against full causal "
            f"{t['causal'] * 1e3:.0f} ms: {t['causal'] / t['window']:.1f}x faster (bar >= 8x)")


def documents(length: int, repeats: int) -> str:
    q, k, v, dout = _inputs(1, length)
    cuts = torch.arange(0, length + 1, length // 8)

    def separate(q, k, v):
        return torch.cat([attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]) for a, b in zip(cuts[:-1], cuts[1:])], dim=2)

    t = _interleaved({
        "packed": _train(lambda q, k, v: attention(q, k, v, cu_seqlens=cuts), q, k, v, dout),
        "separate": _train(separate, q, k, v, dout),
    }, repeats)
    return (f"8 packed documents at L={length}: {t['packed'] * 1e3:.0f} ms against 8 separate calls "
            f"{t['separate'] * 1e3:.0f} ms: {t['packed'] / t['separate']:.2f}x their time (bar <= 1.3x)")


def lengths(length: int, repeats: int, batch: int = 4) -> str:
    q, k, v, dout = _inputs(batch, length)
    kept = torch.tensor([length - length // 4 + i for i in range(batch)])  # a quarter padded, give or take
    dense = (torch.arange(length)[None, :] < kept[:, None])[:, None, None, :].expand(batch, 1, length, length)
    dense = dense.contiguous()  # what transformers hands over: (B, 1, L, L)
    t = _interleaved({
        "lengths": _train(lambda q, k, v: attention(q, k, v, key_padding=kept), q, k, v, dout),
        "dense": _train(lambda q, k, v: attention(q, k, v, attn_mask=dense), q, k, v, dout),
    }, repeats)
    return (f"padding as lengths at B={batch}, L={length}: {t['lengths'] * 1e3:.0f} ms against a dense "
            f"(B, 1, L, L) mask {t['dense'] * 1e3:.0f} ms: {t['lengths'] / t['dense']:.2f}x its time (bar <= 1.0x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window-length", type=int, default=16384)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--documents-length", type=int, default=8192)
    parser.add_argument("--padding-length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="short lengths, one repeat: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.window_length, args.documents_length, args.padding_length, args.repeats = 1024, 512, 256, 1
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(window(args.window_length, args.window, args.repeats))
    print(documents(args.documents_length, args.repeats))
    print(lengths(args.padding_length, args.repeats))


if __name__ == "__main__":
    main()
