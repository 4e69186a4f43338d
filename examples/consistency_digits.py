"""One-step generation of handwritten digits: a small DiT trained with the MeanFlow objective
(Geng et al. 2025, "Mean Flows for One-step Generative Modeling"), every training step of
which takes a `torch.func.jvp` through the whole network, attention included, on attngrad.

    python examples/consistency_digits.py [--steps 1000] [--batch 64] [--out consistency_digits_out] [--compile]

About four minutes on 2 CPU cores (225 ms a step, peak RSS 954 MB: Intel Xeon, 2026-11-28). The data are the 1797 8x8 digits that ship with
scikit-learn (no download). The DiT makes each pixel a token (64 tokens), conditions its
blocks on (t, t - r) and the digit's class through adaLN-zero, and calls
`torch.nn.functional.scaled_dot_product_attention` itself, as diffusers' models do. PyTorch's
default CPU kernel has no forward-mode derivative (its O(L^2) "math" path has one); inside
`attngrad.torch.replace_sdpa()` every such call runs attngrad's exact O(L)-memory attention,
which has one.

MeanFlow: z_t = (1 - t) x + t e with e ~ N(0, I), and v = e - x. The network u(z, r, t)
predicts the average velocity over [r, t]. Its target is u_tgt = v - (t - r) du/dt, where
du/dt is the JVP of u at (z_t, r, t) along (v, 0, 1), and the target is held constant
(stop-gradient). Sampling takes one step, x = e - u(e, 0, 1), or a few. The example writes
the loss curve (loss.png) and generated digits (samples.png, one row per class, one panel
for 1 step and one for --sample-steps steps) into --out. It then times the same training
step on PyTorch's math path beside attngrad's, and reads the peak memory of one step of each.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from functools import partial
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import attngrad.torch as attngrad_torch  # noqa: E402
from attngrad.bench.memory import peak_rss_bytes, reset_peak  # noqa: E402

SIDE, CLASSES = 8, 10  # 8x8 images of the digits 0-9
# The fastest frequency of the time embeddings, in radians per unit of t. du/dt goes through
# it: at 30 the targets' du/dt grew steep and the loss spiked 10-fold; at 10 training runs smoothly.
TIME_FREQUENCY = 10.0


def load_images() -> tuple[Tensor, Tensor]:
    """scikit-learn's digits as (N, 1, 8, 8) floats in [-1, 1], and their (N,) labels."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 8 - 1  # pixels are 0..16
    return images, torch.tensor(digits.target)


def time_features(t: Tensor, dim: int) -> Tensor:
    """(B,) -> (B, dim): cosines and sines of t at geometric frequencies from 1 to TIME_FREQUENCY."""
    freqs = torch.exp(math.log(TIME_FREQUENCY) * torch.arange(dim // 2) / max(1, dim // 2 - 1))
    angles = t[:, None] * freqs  # (B, dim / 2)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def grid_positions(side: int, width: int) -> Tensor:
    """DiT's fixed 2D sin-cos position code, (1, side * side, width): half the channels tell the
    row, half the column, at wavelengths from 2 pixels to 2 * side."""
    rows, columns = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    freqs = math.pi * torch.exp(-math.log(side) * torch.arange(width // 4) / (width // 4))
    angles = [position.reshape(-1, 1) * freqs for position in (rows, columns)]  # each (L, C / 4)
    return torch.cat([f(a) for a in angles for f in (torch.sin, torch.cos)], dim=-1)[None]


class TimeEmbedding(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, t: Tensor) -> Tensor:  # (B,) -> (B, C)
        return self.mlp(time_features(t, self.mlp[0].in_features))


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        B, L, C = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)  # each (B, H, L, D)
        y = F.scaled_dot_product_attention(q, k, v)  # (B, H, L, D): the call replace_sdpa() hands to attngrad
        return self.proj(y.transpose(1, 2).reshape(B, L, C))


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]  # (B, L, C) by (B, C)


def zero_linear(inputs: int, outputs: int) -> nn.Linear:
    """adaLN-zero: modulations that start at zero, so that every block starts as the identity."""
    linear = nn.Linear(inputs, outputs)
    nn.init.zeros_(linear.weight)
    nn.init.zeros_(linear.bias)
    return linear


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False)  # the modulation is the affine part
        self.attn = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))
        self.ada = nn.Sequential(nn.SiLU(), zero_linear(width, 6 * width))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:  # (B, L, C), (B, C)
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c).chunk(6, dim=-1)  # each (B, C)
        x = x + gate1[:, None] * self.attn(modulate(self.norm1(x), shift1, scale1))
        return x + gate2[:, None] * self.mlp(modulate(self.norm2(x), shift2, scale2))


class DiT(nn.Module):
    """u(z, r, t | label): the average velocity over [r, t], an image like z."""

    def __init__(self, width: int, depth: int, heads: int, patch: int) -> None:
        super().__init__()
        self.patch = patch
        self.embed = nn.Linear(patch * patch, width)
        self.register_buffer("position", grid_positions(SIDE // patch, width), persistent=False)  # (1, L, C)
        self.t_embed, self.h_embed = TimeEmbedding(width), TimeEmbedding(width)
        self.label_embed = nn.Embedding(CLASSES, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width, elementwise_affine=False)
        self.ada = nn.Sequential(nn.SiLU(), zero_linear(width, 2 * width))
        self.out = zero_linear(width, patch * patch)  # u starts at 0

    def forward(self, z: Tensor, r: Tensor, t: Tensor, label: Tensor) -> Tensor:
        B, p, n = z.shape[0], self.patch, SIDE // self.patch
        patches = z.view(B, n, p, n, p).permute(0, 1, 3, 2, 4).reshape(B, n * n, p * p)  # (B, L, p*p)
        x = self.embed(patches) + self.position  # (B, L, C)
        c = self.t_embed(t) + self.h_embed(t - r) + self.label_embed(label)  # (B, C): MeanFlow's (t, t - r)
        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.ada(c).chunk(2, dim=-1)
        x = self.out(modulate(self.norm(x), shift, scale))  # (B, L, p*p)
        return x.view(B, n, n, p, p).permute(0, 1, 3, 2, 4).reshape(B, 1, SIDE, SIDE)


def sample_times(batch: int, equal: float, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(r, t), each (B,), with 0 <= r <= t <= 1 uniform, and r = t in a fraction `equal` of the
    batch (there the target is flow matching's plain velocity). Uniform rather than the paper's
    logit-normal: that one seldom draws t near 1, where the one-step sampler starts, and here its
    one-step samples came out as nearly the same digit for every noise."""
    pair = torch.rand(2, batch, generator=generator)
    r, t = pair.min(dim=0).values, pair.max(dim=0).values
    r = torch.where(torch.rand(batch, generator=generator) < equal, t, r)
    return r, t


def average_velocity(model: nn.Module, z: Tensor, r: Tensor, t: Tensor, v: Tensor, label: Tensor) -> tuple[Tensor, Tensor]:
    """u(z, r, t) and du/dt along (dz, dr, dt) = (v, 0, 1), held constant (stop-gradient): the
    parameters' gradient reaches the loss through u, the primal. With --compile this whole
    function is one graph, the JVP inside it. (du/dt is detached inside the graph: a graph
    output whose gradient is unused gets a ZeroTensor one, which inductor's backward in torch
    2.13 reuses as a buffer and fails on, with PyTorch's own attention too.)"""
    u, dudt = torch.func.jvp(lambda z, r, t: model(z, r, t, label), (z, r, t),
                             (v, torch.zeros_like(r), torch.ones_like(t)))
    return u, dudt.detach()


def meanflow_loss(model: nn.Module, x: Tensor, label: Tensor, equal: float, generator: torch.Generator,
                  velocity=average_velocity) -> tuple[Tensor, Tensor]:
    """(the adaptively weighted loss to minimise, its plain mean square error per pixel)."""
    r, t = sample_times(x.shape[0], equal, generator)
    e = torch.randn(x.shape, generator=generator)
    z = (1 - t[:, None, None, None]) * x + t[:, None, None, None] * e  # (B, 1, 8, 8)
    v = e - x
    u, dudt = velocity(model, z, r, t, v, label)
    target = v - (t - r)[:, None, None, None] * dudt  # stop-gradient: no backward through the JVP
    square = (u - target).pow(2).flatten(1).sum(dim=1)  # (B,)
    weight = 1 / (square.detach() + 1e-3)  # the paper's adaptive weight with p = 1: outliers pull less
    return (weight * square).mean(), square.mean() / (SIDE * SIDE)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, label: Tensor, equal: float,
               generator: torch.Generator, velocity=average_velocity) -> float:
    loss, mse = meanflow_loss(model, x, label, equal, generator, velocity)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return mse.item()


@torch.no_grad()
def update_ema(ema: nn.Module, model: nn.Module, decay: float) -> None:
    for average, p in zip(ema.parameters(), model.parameters()):
        average.lerp_(p, 1 - decay)


@torch.no_grad()
def generate(model: nn.Module, label: Tensor, steps: int, generator: torch.Generator) -> Tensor:
    """Digits of `label` (B,) from noise in `steps` jumps of the average velocity: z_r = z_t - (t - r) u(z_t, r, t)."""
    z = torch.randn(label.shape[0], 1, SIDE, SIDE, generator=generator)  # (B, 1, 8, 8)
    times = torch.linspace(1, 0, steps + 1)
    for t, r in zip(times[:-1], times[1:]):
        z = z - (t - r) * model(z, r.expand(len(label)), t.expand(len(label)), label)
    return z.clamp(-1, 1)


def smoothed(losses: list[float]) -> tuple[float, float]:
    """The mean loss of the first and of the last tenth of training."""
    window = max(1, len(losses) // 10)
    return statistics.fmean(losses[:window]), statistics.fmean(losses[-window:])


def save_loss_curve(losses: list[float], path: Path) -> None:
    window = max(1, len(losses) // 50)
    running = [statistics.fmean(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot(losses, color="0.75", linewidth=0.6, label="per step")
    axes.plot(running, color="C0", label=f"mean of {window} steps")
    axes.set(xlabel="step", ylabel="mean square per pixel", yscale="log",
             title="MeanFlow loss: (u - stopgrad(u_tgt))^2")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def save_samples(panels: dict[str, Tensor], path: Path) -> None:
    """One panel per sampler, each of (10 * columns, 1, 8, 8) digits laid out a class per row."""
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.4), squeeze=False)
    for ax, (title, images) in zip(axes[0], panels.items()):
        tiles = F.pad(images.view(CLASSES, -1, SIDE, SIDE), (1, 1, 1, 1), value=-1)  # (10, columns, 10, 10)
        mosaic = tiles.permute(0, 2, 1, 3).reshape(CLASSES * (SIDE + 2), -1)  # rows of tiles side by side
        ax.imshow(mosaic.numpy(), cmap="gray_r", vmin=-1, vmax=1)
        ax.set_title(title)
        ax.axis("off")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def default_kernel_jvp() -> str:
    """What PyTorch's default CPU attention answers to a JVP (why replace_sdpa or the math path)."""
    q = torch.randn(1, 1, 4, 8)
    try:
        torch.func.jvp(lambda q: F.scaled_dot_product_attention(q, q, q), (q,), (q,))
    except (NotImplementedError, RuntimeError) as error:
        return str(error).splitlines()[0]
    return "it runs"


def compare_with_math(model: nn.Module, x: Tensor, label: Tensor, equal: float, repeats: int, seed: int) -> dict:
    """The same training step (copies of the trained model, one batch) on attngrad and on PyTorch's
    math path: the median seconds of `repeats` steps, timed in turn, and the growth of the process's
    peak resident memory over one step."""
    paths = {"attngrad": attngrad_torch.replace_sdpa, "pytorch math": partial(sdpa_kernel, SDPBackend.MATH)}
    models = {name: copy.deepcopy(model) for name in paths}
    optimizers = {name: torch.optim.AdamW(models[name].parameters(), lr=1e-5) for name in paths}

    def step(name: str) -> float:
        with paths[name]():
            start = time.perf_counter()
            train_step(models[name], optimizers[name], x, label, equal, torch.Generator().manual_seed(seed))
            return time.perf_counter() - start

    for name in paths:  # warm-up: the first step of each allocates its buffers
        step(name)
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name in paths:  # in turn, so that a busy machine slows both alike
            seconds[name].append(step(name))
    growth = {}
    for name in paths:
        baseline = reset_peak()  # after handing free pages back, so that the step's own show
        step(name)
        growth[name] = peak_rss_bytes() - baseline
    return {name: {"seconds": statistics.median(seconds[name]), "peak_growth_bytes": growth[name]} for name in paths}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--patch", type=int, default=1, help="pixels per token side: 1 makes 64 tokens, 2 makes 16")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--r-equals-t", type=float, default=0.5, help="fraction of the batch drawn with r = t")
    parser.add_argument("--sample-steps", type=int, default=2, help="the few-step sampler shown beside one step")
    parser.add_argument("--compare-steps", type=int, default=5,
                        help="steps timed on each attention path after training (0: no comparison)")
    parser.add_argument("--every", type=int, default=100, help="a progress line every this many steps")
    parser.add_argument("--out", type=Path, default=Path("consistency_digits_out"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: PyTorch's choice)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the network and its JVP (fullgraph): the same loss curve")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    images, labels = load_images()
    tokens = (SIDE // args.patch) ** 2
    model = DiT(args.width, args.depth, args.heads, args.patch)
    ema = copy.deepcopy(model).requires_grad_(False)  # the sampler: steadier than the last step's weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))
    print(f"MeanFlow DiT: {sum(p.numel() for p in model.parameters()):,} parameters (width {args.width}, depth "
          f"{args.depth}, {args.heads} heads, {tokens} tokens); {len(images)} digits, batch {args.batch}, "
          f"{args.steps} steps, {torch.get_num_threads()} threads")
    velocity = torch.compile(average_velocity, fullgraph=True) if args.compile else average_velocity
    ran_before = attngrad_torch.ran.copy()
    losses: list[float] = []
    start = lap = time.perf_counter()
    with attngrad_torch.replace_sdpa() as calls:  # every attention call of training, the JVP's included
        for step in range(1, args.steps + 1):
            index = torch.randint(len(images), (args.batch,), generator=generator)
            losses.append(train_step(model, optimizer, images[index], labels[index], args.r_equals_t, generator,
                                     velocity))
            warmup.step()
            update_ema(ema, model, decay=min(0.995, step / (step + 10)))
            if step % args.every == 0 or step == args.steps:
                recent = losses[-((step - 1) % args.every + 1):]  # the steps since the last line
                print(f"step {step:5d}/{args.steps}  loss {statistics.fmean(recent):.4f}  "
                      f"{1000 * (time.perf_counter() - lap) / len(recent):.0f} ms/step", flush=True)
                lap = time.perf_counter()
    train_seconds = time.perf_counter() - start
    ran = attngrad_torch.ran.copy()
    ran.subtract(ran_before)
    ran = +ran  # the passes training ran, by (pass, backend)
    backends = sorted({backend for _, backend in ran})
    fallback = f" {calls.pytorch}" if calls.pytorch else ""
    print(f"attention: attngrad ({', '.join(backends) or 'no'} backend), {calls.attngrad} calls, "
          f"{sum(calls.pytorch.values())} sent to PyTorch{fallback}; passes: "
          f"{', '.join(f'{p} on {b} x{n}' for (p, b), n in sorted(ran.items()))}")
    first, last = smoothed(losses)
    print(f"loss, mean of the first and of the last tenth of training: {first:.4f} -> {last:.4f}; "
          f"{train_seconds:.1f} s of training")

    label = torch.arange(CLASSES).repeat_interleave(10)  # ten of each digit, a row per class
    with attngrad_torch.replace_sdpa():
        panels = {f"{n} step{'s' * (n > 1)}": generate(ema, label, n, torch.Generator().manual_seed(args.seed))
                  for n in sorted({1, args.sample_steps})}
    args.out.mkdir(parents=True, exist_ok=True)
    loss_png, samples_png = args.out / "loss.png", args.out / "samples.png"
    save_loss_curve(losses, loss_png)
    save_samples(panels, samples_png)
    print(f"wrote {loss_png} and {samples_png} (a row per digit 0-9; {' and '.join(panels)})")

    comparison = {}
    if args.compare_steps:
        print(f"PyTorch's default CPU attention under torch.func.jvp: {default_kernel_jvp()}")
        index = torch.randint(len(images), (args.batch,), generator=generator)
        comparison = compare_with_math(model, images[index], labels[index], args.r_equals_t, args.compare_steps,
                                       args.seed)
        print(f"the same training step (batch {args.batch}, {tokens} tokens): median time of {args.compare_steps}, "
              f"and growth of the peak resident memory over one step")
        for name, figures in comparison.items():
            print(f"  {name:13s} {1000 * figures['seconds']:7.1f} ms  {figures['peak_growth_bytes'] / 2**20:7.1f} MiB")
        square = args.batch * args.heads * tokens * tokens * 4 / 2**20  # one float32 (B, H, L, L) tensor
        print(f"  at {tokens} tokens attention is a small part of the step, so the times are close; the math path "
              f"keeps (B, H, L, L) tensors ({square:.1f} MiB each here, several per layer: scores, weights, their "
              f"tangents), which grow as L^2 where attngrad's row statistics grow as L, so both gaps open with length")
    return {"losses": losses, "first_loss": first, "last_loss": last, "loss_png": loss_png,
            "samples_png": samples_png, "calls": calls, "ran": dict(ran), "comparison": comparison,
            "train_seconds": train_seconds}


if __name__ == "__main__":
    main()
