"""A small causal language model whose sequence is split over the processes of a
torch.distributed group (context parallelism with attngrad's ring attention), trained
beside the same model in one process: the losses agree to float32 rounding.

    python examples/context_parallel_lm.py --out one.json
    torchrun --nproc-per-node 2 examples/context_parallel_lm.py --out two.json --compare one.json
    torchrun --nproc-per-node 2 examples/context_parallel_lm.py --api pytorch --compare one.json

Each rank holds a zigzag shard of every sequence (its tokens, positions and targets);
everything but attention works token by token. With `--api attngrad` (the default)
attention is `ring_attention` on the shards; with `--api pytorch` the model calls
`F.scaled_dot_product_attention` as any PyTorch model does, and PyTorch's own
`context_parallel()` shards the batch (in its head-tail order, attngrad's zigzag) while
`replace_sdpa()` sends each call to attngrad's passes on DTensors, which run the same ring.
Either way the dropout masks are the one-process call's. Each rank's loss is its tokens'
part of the mean, so the parameter gradients are summed over the ranks (one all_reduce per
step).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.resources
import json
import os
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from attngrad.torch import attention, replace_sdpa
from attngrad.torch.distributed import ring_attention, shard_sequence

LAYOUT = "zigzag"


class Block(nn.Module):
    """Pre-norm Transformer block: causal self-attention, then an MLP."""

    def __init__(self, width: int, heads: int, dropout: float, group: Optional[dist.ProcessGroup],
                 api: str = "attngrad") -> None:
        super().__init__()
        self.heads, self.dropout, self.group, self.api = heads, dropout, group, api
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape  # length: this rank's tokens
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in self.qkv(self.norm1(x)).chunk(3, -1))
        dropout = self.dropout if self.training else 0.0
        if self.api == "pytorch":  # inside context_parallel(): PyTorch makes DTensors of q, k, v
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        elif self.group is None:
            a = attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:
            a = ring_attention(q, k, v, group=self.group, is_causal=True, dropout_p=dropout, layout=LAYOUT)
        x = x + self.proj(a.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class LanguageModel(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, layers: int, context: int, dropout: float,
                 group: Optional[dist.ProcessGroup], api: str = "attngrad") -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout, group, api) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def text_ids() -> tuple[torch.Tensor, int]:
    text = importlib.resources.files("attngrad.model").joinpath("texts/attention_notes.txt").read_text()
    vocab = sorted(set(text))
    return torch.tensor([vocab.index(c) for c in text]), len(vocab)


def train(steps: int = 300, context: int = 256, batch: int = 4, width: int = 64, heads: int = 4, layers: int = 2,
          dropout: float = 0.1, lr: float = 3e-3, seed: int = 0, group: Optional[dist.ProcessGroup] = None,
          log_every: int = 0, api: str = "attngrad") -> list[float]:
    """The training loss at each step; with `group`, each rank trains on its shard of
    every sequence (the same losses on every rank), through attngrad's `ring_attention`
    (`api="attngrad"`) or PyTorch's `context_parallel()` with `replace_sdpa()` ("pytorch")."""
    ids, vocab = text_ids()
    torch.manual_seed(seed)  # the same initial model, and dropout seeds, on every rank
    model = LanguageModel(vocab, width, heads, layers, context, dropout, group, api)
    mesh = None
    if group is not None and api == "pytorch":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(group),))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(seed + 1)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        offsets = torch.randint(0, len(ids) - context - 1, (batch,), generator=data)
        window = torch.stack([ids[o:o + context + 1] for o in offsets.tolist()])
        inputs, targets = window[:, :-1], window[:, 1:]
        positions = torch.arange(context).expand(batch, context).contiguous()
        sharded = contextlib.nullcontext()
        if mesh is not None:  # PyTorch shards the buffers in place, in its head-tail order, inside the block
            from torch.distributed.tensor.experimental import context_parallel

            inputs, targets = inputs.contiguous(), targets.contiguous()
            sharded = context_parallel(mesh, buffers=[inputs, targets, positions], buffer_seq_dims=[1, 1, 1])
        elif group is not None:  # this rank's tokens of every sequence
            inputs, targets, positions = (shard_sequence(t, group=group, layout=LAYOUT, dim=1)
                                          for t in (inputs, targets, positions))
        with sharded, replace_sdpa(strict=True):
            logits = model(inputs, positions)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / (batch * context)
            loss.backward()
        loss = loss.detach()
        if group is not None:  # the mean over every rank's tokens, and its gradient
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.flatten() for g in grads] + [loss.view(1)])
            dist.all_reduce(flat, group=group)
            for g, part in zip(grads, flat[:-1].split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
            loss = flat[-1]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  ({time.perf_counter() - start:.1f} s)", flush=True)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, help="write the losses here (JSON)")
    parser.add_argument("--compare", type=Path, help="a losses JSON to compare with (the one-process run)")
    parser.add_argument("--api", choices=("attngrad", "pytorch"), default="attngrad",
                        help="attngrad's ring_attention, or PyTorch's context_parallel() with replace_sdpa()")
    args = parser.parse_args()
    group = None
    if "WORLD_SIZE" in os.environ:  # under torchrun: gloo on CPU (NCCL would take CUDA tensors)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        group = dist.group.WORLD
    rank = 0 if group is None else dist.get_rank()
    losses = train(args.steps, group=group, log_every=50 if rank == 0 else 0, api=args.api)
    if rank == 0:
        if args.out:
            args.out.write_text(json.dumps(losses) + "\n")
        if args.compare:
            other = json.loads(args.compare.read_text())
            diff = max(abs(a - b) for a, b in zip(losses, other))
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, other))
            print(f"largest difference from {args.compare} over {min(len(losses), len(other))} steps: "
                  f"{diff:.3g} ({worst:.3g} relative)")
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
