"""A Hugging Face transformers model trained with attn_implementation="attngrad", beside the
same model, same weights and same batches on PyTorch's "sdpa". The first step's losses and
gradients agree to rounding; after that the two runs drift apart as rounding compounds
through the optimizer (as any two kernels' runs do), so the example reports when the loss
curves first differ by more than 1e-3, and where each ends.

    python examples/train_transformers.py [--steps 300] [--dtype float64] [--docs docs/train.md]

The model is a small Llama (2 layers, width 128, 4 query heads over 2 key/value heads)
learning the characters of the short text shipped with attngrad; every batch packs two
pieces of text per row, told apart by position ids, so that attngrad runs them as packed
documents (transformers gives SDPA the same mask as a dense (B, 1, L, L) tensor).
"""

from __future__ import annotations

import argparse
import resource
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers

from attngrad.docs_page import write_section
from attngrad.integrations.transformers import register
from attngrad.machine import cpu_name
from attngrad.model.tasks import read_text

PIECE, WIDTH = 128, 128


def batches(text: str, steps: int, batch: int, seed: int):
    """(input ids, position ids, labels) per step: two random pieces of PIECE characters per
    row, each with positions from 0, and labels that never cross from one piece to the next."""
    codes = torch.tensor([min(ord(c), 127) for c in text])
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(PIECE).repeat(2)[None].expand(batch, -1)
    for _ in range(steps):
        starts = torch.randint(0, len(codes) - PIECE - 1, (batch, 2), generator=g)
        ids = torch.stack([torch.cat([codes[s:s + PIECE] for s in row]) for row in starts])
        labels = ids.clone()
        labels[:, PIECE] = -100  # no target across the pieces' boundary: shift_labels drops the first of each
        yield ids, positions, labels


def train(implementation: str, steps: int, batch: int, seed: int, dtype: torch.dtype) -> dict:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=WIDTH, intermediate_size=4 * WIDTH,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=2 * PIECE)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=implementation, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, first_grads, start = [], None, time.perf_counter()
    for ids, positions, labels in batches(read_text(None), steps, batch, seed):
        loss = model(input_ids=ids, position_ids=positions, labels=labels, use_cache=False).loss
        optimizer.zero_grad()
        loss.backward()
        if first_grads is None:
            first_grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        losses.append(loss.item())
    return dict(losses=losses, first_grads=first_grads, seconds=time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--docs", type=Path, help="write this run's section of this page (docs/train.md)")
    args = parser.parse_args()
    register()
    runs = {}
    for implementation in ("attngrad", "sdpa"):
        runs[implementation] = train(implementation, args.steps, args.batch, args.seed, getattr(torch, args.dtype))
        print(f"{implementation}: loss {runs[implementation]['losses'][0]:.3f} -> "
              f"{runs[implementation]['losses'][-1]:.3f} in {runs[implementation]['seconds']:.1f} s")
    ours, theirs = runs["attngrad"]["losses"], runs["sdpa"]["losses"]
    grad_gap = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                   for a, b in zip(runs["attngrad"]["first_grads"], runs["sdpa"]["first_grads"]))
    apart = next((step for step, (a, b) in enumerate(zip(ours, theirs), 1) if abs(a - b) > 1e-3), None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    drift = (f"first differ by more than 1e-3 at step {apart}, as rounding compounds through the optimizer"
             if apart else f"stay within 1e-3 of each other for all {args.steps} steps")
    summary = (f"A Llama of 2 layers (width {WIDTH}, 4 query heads over 2 key/value heads) on the text shipped with "
               f"attngrad, {args.steps} steps of AdamW, batch {args.batch} rows of two packed {PIECE}-character pieces, "
               f"{args.dtype}: attngrad's loss went from {ours[0]:.3f} to {ours[-1]:.3f} in "
               f"{runs['attngrad']['seconds']:.1f} s (sdpa: to {theirs[-1]:.3f} in {runs['sdpa']['seconds']:.1f} s). "
               f"The first step's losses differ by {abs(ours[0] - theirs[0]):.1e} and its parameter gradients by at "
               f"most {grad_gap:.1e} relative (per tensor); the loss curves {drift}. Peak memory of the process "
               f"{peak:.0f} MiB; {cpu_name()}, {torch.get_num_threads()} threads, "
               f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}.")
    print(summary)
    if args.docs:
        command = (f"python examples/train_transformers.py --steps {args.steps} --batch {args.batch} --seed {args.seed} "
                   f"--dtype {args.dtype}")
        write_section(args.docs, f"examples/train_transformers.py ({args.dtype})", f"`{command}`\n\n{summary}",
                      "Training runs")
        print(f"wrote {args.docs}")


if __name__ == "__main__":
    main()
