"""Masks given as functions against the same structure given as attngrad's own arguments,
side by side in one process, interleaved (B=1, H=8, d=64, float32, fwd+bwd at --length; the
median of --repeats runs of each):

    bounds      is_causal / window / cu_seqlens
    block_mask  FlexAttention's BlockMask of the same mask_mod, made once (its evaluation is
                kept with it, so calls after the first pay nothing for it)
    mask_mod    the mask function itself on every call (evaluated on the first and kept
                while what it reads stays the same: `attngrad.torch.masks.memo`)

for a causal mask, a causal sliding window of --window keys and 8 packed causal documents;
then masks no interval per row describes (random 128 x 128 blocks, a causal mask dilated by
3), kept per block, against the same mask written out as attn_mask, with the bytes each
form holds. The bar: block_mask and mask_mod <= 1.2x bounds (or the dense mask). "evaluation"
is what the first call, or a call after what the function reads has changed, pays on top.

Prints one line per mask and the machine; `--quick` shrinks the length for a smoke run.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch
from structured_masks import _inputs, _interleaved, _train  # the sibling benchmark's helpers
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from attngrad.bench.runner import cpu_name
from attngrad.torch import attention
from attngrad.torch import create_block_mask as attngrad_block_mask


def _compare(name: str, length: int, mask_mod, bounds: dict, repeats: int) -> str:
    q, k, v, dout = _inputs(1, length)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block_mask = create_block_mask(mask_mod, None, None, length, length, device="cpu")
    t = _interleaved({
        "bounds": _train(lambda q, k, v: attention(q, k, v, **bounds), q, k, v, dout),
        "block_mask": _train(lambda q, k, v: attention(q, k, v, block_mask=block_mask), q, k, v, dout),
        "mask_mod": _train(lambda q, k, v: attention(q, k, v, mask_mod=mask_mod), q, k, v, dout),
    }, repeats)
    start = time.perf_counter()
    attngrad_block_mask(mask_mod, 1, q.shape[1], length, length)
    evaluation = time.perf_counter() - start
    return (f"{name:<22} bounds {t['bounds'] * 1e3:6.0f} ms   block_mask {t['block_mask'] / t['bounds']:.2f}x   "
            f"mask_mod {t['mask_mod'] / t['bounds']:.2f}x   (bar <= 1.2x)   evaluation {evaluation * 1e3:.0f} ms")


def _no_interval(name: str, length: int, mask_mod, repeats: int) -> str:
    """A mask no interval per row describes, kept per block (`attngrad.torch.masks.blocks`),
    against the same mask written out whole as attn_mask; and the bytes of each form."""
    q, k, v, dout = _inputs(1, length)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block_mask = create_block_mask(mask_mod, None, None, length, length, device="cpu")
    dense = create_mask(mask_mod, None, None, length, length, device="cpu")
    t = _interleaved({
        "dense": _train(lambda q, k, v: attention(q, k, v, attn_mask=dense), q, k, v, dout),
        "block_mask": _train(lambda q, k, v: attention(q, k, v, block_mask=block_mask), q, k, v, dout),
        "mask_mod": _train(lambda q, k, v: attention(q, k, v, mask_mod=mask_mod), q, k, v, dout),
    }, repeats)
    kept = attngrad_block_mask(mask_mod, None, None, length, length).blocks
    return (f"{name:<22} dense  {t['dense'] * 1e3:6.0f} ms   block_mask {t['block_mask'] / t['dense']:.2f}x   "
            f"mask_mod {t['mask_mod'] / t['dense']:.2f}x   kept per block: {len(kept.tiles)} tiles, "
            f"{kept.nbytes() / 1024:.0f} KiB (dense {dense.numel() / 2**20:.1f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a short length, one repeat: a smoke run")
    parser.add_argument("--docs", type=Path, help="also write the lines as this run's section of this page")
    args = parser.parse_args()
    if args.quick:
        args.length, args.repeats = 512, 1
    length, window = args.length, args.window
    documents = torch.arange(length) // (length // 8)
    cuts = torch.arange(0, length + 1, length // 8)
    lines = [f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, L={length}"]
    print(lines[-1])
    cases = [
        ("causal", lambda b, h, q, kv: q >= kv, dict(is_causal=True)),
        (f"sliding window {window}", lambda b, h, q, kv: (q >= kv) & (q - kv < window),
         dict(is_causal=True, window=(window - 1, None))),
        ("8 causal documents", lambda b, h, q, kv: (q >= kv) & (documents[q] == documents[kv]),
         dict(is_causal=True, cu_seqlens=cuts)),
    ]
    for name, mask_mod, bounds in cases:
        lines.append(_compare(name, length, mask_mod, bounds, args.repeats))
        print(lines[-1])
    blocks = torch.rand(length // 128, length // 128, generator=torch.Generator().manual_seed(1)) > 0.5
    no_interval = [
        ("random blocks", lambda b, h, q, kv: blocks[q // 128, kv // 128] | (q == kv)),
        ("dilated by 3, causal", lambda b, h, q, kv: (q >= kv) & ((q - kv) % 3 == 0)),
    ]
    for name, mask_mod in no_interval:
        lines.append(_no_interval(name, length, mask_mod, args.repeats))
        print(lines[-1])
    if args.docs:
        from attngrad.docs_page import write_section

        command = f"python benchmarks/mask_functions.py --length {length} --window {window} --repeats {args.repeats}"
        body = f"`{command}`\n\nB=1, H=8, d=64, float32, forward and backward; medians of interleaved runs.\n\n```\n"
        write_section(args.docs, "benchmarks/mask_functions.py", body + "\n".join(lines) + "\n```", "Benchmarks")
        print(f"wrote {args.docs}")

if __name__ == "__main__":
    main()
