"""What each rank runs in the distributed tests (importable by spawned processes): random
configurations of ring and all-to-all attention, each compared on every rank with
one-process attngrad on the whole sequence, for every derivative. Each case returns the
largest relative error (max |ours - theirs| / max |theirs|) over its tensors."""

from __future__ import annotations

import importlib.util
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from attngrad.torch import attention
from attngrad.torch.distributed import all_to_all_attention, gather_sequence, ring_attention, shard_sequence

NAMES = ("q", "k", "v", "bias", "sinks")  # the differentiated inputs, in the functions' order


@dataclass
class Config:
    name: str
    seed: int
    method: str = "ring"  # or "all_to_all"
    layout: str = "contiguous"
    causal: bool = False
    bias: bool = False
    gqa: bool = False
    mask: bool = False
    dropout_p: float = 0.0
    structured: dict = field(default_factory=dict)
    softcap: Optional[float] = None
    sinks: bool = False  # GPT-OSS's per-head sink logits, differentiated as the other inputs are
    length_per_rank: int = 12
    derivatives: tuple = ("forward", "backward", "jvp", "double_backward", "hvp", "reverse_over_forward")
    dtype: torch.dtype = torch.float64


def configs(world: int) -> list[Config]:
    """Random configurations for a world size: every option in turn, and mixtures (six random
    ones on 2 processes, three on 3: each spawn of 3 shares 2 cores, about 0.6 s a
    configuration)."""
    rng = random.Random(1000 + world)
    out = []
    for n in range(6 if world == 2 else 3):
        layout = ("contiguous", "zigzag")[n % 2]
        out.append(Config(f"random{n}-{layout}", seed=rng.randrange(10**6), layout=layout, causal=rng.random() < 0.6,
                          bias=rng.random() < 0.6, gqa=rng.random() < 0.5, mask=rng.random() < 0.5,
                          dropout_p=rng.choice((0.0, 0.0, 0.3))))
    out += [
        Config("causal-zigzag-bias-dropout", 1, layout="zigzag", causal=True, bias=True, dropout_p=0.25),
        Config("masked-rows", 2, layout="zigzag", mask=True, bias=True),
        Config("window", 3, causal=True, structured=dict(window=(5, None)), layout="zigzag"),
        Config("documents-softcap", 4, structured=dict(documents=True), softcap=2.0),
        Config("padding-lengths", 5, structured=dict(lengths=True), causal=True, layout="zigzag"),
        Config("all-to-all", 6, method="all_to_all", causal=True, bias=True, dropout_p=0.2, gqa=True, layout="zigzag"),
        Config("sinks-window", 7, causal=True, bias=True, sinks=True, structured=dict(window=(6, None)), layout="zigzag"),
        Config("all-to-all-sinks", 8, method="all_to_all", causal=True, sinks=True, dropout_p=0.2),
        Config("sinks-gqa-mask", 9, gqa=True, mask=True, sinks=True),
    ]
    return out


def _inputs(config: Config, world: int) -> dict:
    g = torch.Generator().manual_seed(config.seed)
    batch, heads, kv_heads, width = 2, 2 * world, (world if config.gqa else 2 * world), 4
    length = config.length_per_rank * world

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x = dict(q=randn(batch, heads, length, width), k=randn(batch, kv_heads, length, width),
             v=randn(batch, kv_heads, length, width + 1), dout=randn(batch, heads, length, width + 1))
    x["bias"] = randn(batch, heads, length, length) if config.bias else None
    if config.mask:
        keep = torch.rand(batch, 1, length, length, generator=g) > 0.3
        keep[:, :, 1:4, : length // world] = False  # rows that see no key of the first block
        keep[:, :, 5] = False  # a row that sees no key at all
        x["mask"] = keep
    else:
        x["mask"] = None
    structured = {}
    if "window" in config.structured:
        structured["window"] = config.structured["window"]
    if config.structured.get("documents"):
        cuts = sorted(random.Random(config.seed).sample(range(1, length), 3))
        ids = torch.zeros(length, dtype=torch.int64)
        for c in cuts:
            ids[c:] += 1
        structured["document_ids"] = ids
    if config.structured.get("lengths"):
        structured["key_padding"] = torch.tensor([length - 3, length // 2 + 1])
    x["structured"] = structured
    # logits well below the scores: each row's sink share is small, so that a gradient summed
    # over the bias's terms instead of taken in closed form would cancel (issue 58)
    x["sinks"] = randn(heads) - 10.0 if config.sinks else None
    x["tangents"] = {name: randn(*x[name].shape) for name in NAMES if x[name] is not None}
    x["cotangents"] = {name: randn(*x[name].shape) for name in NAMES if x[name] is not None}
    return x


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """inf where either holds a NaN (max() over the errors would drop a NaN)."""
    if ours.isnan().any() or theirs.isnan().any():
        return float("inf")
    scale = theirs.abs().max().item()
    return (ours - theirs).abs().max().item() / (scale if scale > 0 else 1.0)


def _functions(config: Config, x: dict, world: int) -> tuple[Callable, Callable, Callable]:
    """(sharded, whole, shard): attention on this rank's shards, on the whole sequence, and
    this rank's shard of a whole (..., L, .) tensor (bias rows too)."""
    method = ring_attention if config.method == "ring" else all_to_all_attention
    options = dict(is_causal=config.causal, dropout_p=config.dropout_p, enable_gqa=config.gqa, softcap=config.softcap,
                   **x["structured"])
    names = [n for n in NAMES if x[n] is not None]

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, layout=config.layout, dim=2)

    mask = x["mask"]

    def sharded(*primals):
        p = dict(zip(names, primals))
        torch.manual_seed(config.seed)  # both draw the dropout seed the same way
        return method(p["q"], p["k"], p["v"], attn_bias=p.get("bias"), sinks=p.get("sinks"),
                      attn_mask=None if mask is None else shard(mask), layout=config.layout, **options)

    def whole(*primals):
        p = dict(zip(names, primals))
        torch.manual_seed(config.seed)
        return attention(p["q"], p["k"], p["v"], attn_bias=p.get("bias"), sinks=p.get("sinks"), attn_mask=mask,
                         **options)

    return sharded, whole, shard


def _grad_of(fn: Callable, dout: torch.Tensor) -> Callable:
    """(q, k, v, bias...) -> the gradients of <fn(...), dout>, as a function torch.func can
    differentiate again."""
    def grads(*primals):
        return torch.func.grad(lambda *p: (fn(*p) * dout).sum(), argnums=tuple(range(len(primals))))(*primals)
    return grads


def run_case(config: Config, world: int) -> dict[str, float]:
    x = _inputs(config, world)
    sharded, whole, shard_rows = _functions(config, x, world)
    names = [n for n in NAMES if x[n] is not None]

    def shards(tensors):  # the sinks are every rank's, whole
        return [t if n == "sinks" else shard_rows(t) for n, t in zip(names, tensors)]

    def errors_of(ours, theirs, kinds=names):
        # a rank's gradient of the sinks is its rows' part: the ranks' sum is the whole's
        errors = []
        for kind, a, b in zip(kinds, ours, theirs):
            if kind == "sinks":
                a = a.clone()
                dist.all_reduce(a)
                errors.append(_relative(a, b))
            else:
                errors.append(_relative(a, shard_rows(b)))
        return max(errors)

    shard = shard_rows
    primals_whole = [x[n] for n in names]
    primals_shard = shards(primals_whole)
    tangents_whole = [x["tangents"][n] for n in names]
    tangents_shard = shards(tangents_whole)
    dout_whole, dout_shard = x["dout"], shard(x["dout"])
    errors = {}
    if "forward" in config.derivatives:
        errors["forward"] = _relative(sharded(*primals_shard), shard(whole(*primals_whole)))
    if "backward" in config.derivatives:
        ours = torch.func.grad(lambda *p: (sharded(*p) * dout_shard).sum(), argnums=tuple(range(len(names))))(*primals_shard)
        theirs = torch.func.grad(lambda *p: (whole(*p) * dout_whole).sum(), argnums=tuple(range(len(names))))(*primals_whole)
        errors["backward"] = errors_of(ours, theirs)
    if "jvp" in config.derivatives:
        ours = torch.func.jvp(sharded, tuple(primals_shard), tuple(tangents_shard))[1]
        theirs = torch.func.jvp(whole, tuple(primals_whole), tuple(tangents_whole))[1]
        errors["jvp"] = _relative(ours, shard(theirs))
    if "double_backward" in config.derivatives:  # reverse over reverse: the gradient of <grads, w>
        cot_whole = [x["cotangents"][n] for n in names]
        cot_shard = shards(cot_whole)

        def penalty(fn, dout, cot):
            grads = _grad_of(fn, dout)
            return lambda *p: sum((g * w).sum() for g, w in zip(grads(*p), cot))

        ours = torch.func.grad(penalty(sharded, dout_shard, cot_shard), argnums=tuple(range(len(names))))(*primals_shard)
        theirs = torch.func.grad(penalty(whole, dout_whole, cot_whole), argnums=tuple(range(len(names))))(*primals_whole)
        errors["double_backward"] = errors_of(ours, theirs)
    if "hvp" in config.derivatives:  # forward over reverse
        ours = torch.func.jvp(_grad_of(sharded, dout_shard), tuple(primals_shard), tuple(tangents_shard))[1]
        theirs = torch.func.jvp(_grad_of(whole, dout_whole), tuple(primals_whole), tuple(tangents_whole))[1]
        errors["hvp"] = errors_of(ours, theirs)
    if "reverse_over_forward" in config.derivatives:  # the gradient of <c, J t> for the primals and the tangents
        def through_jvp(fn, cotangent):
            n = len(names)
            return lambda *x: (torch.func.jvp(fn, x[:n], x[n:])[1] * cotangent).sum()

        argnums = tuple(range(2 * len(names)))
        ours = torch.func.grad(through_jvp(sharded, dout_shard), argnums=argnums)(*primals_shard, *tangents_shard)
        theirs = torch.func.grad(through_jvp(whole, dout_whole), argnums=argnums)(*primals_whole, *tangents_whole)
        errors["reverse_over_forward"] = errors_of(ours, theirs, names + names)
    return errors


def float32_errors(world: int) -> dict[str, float]:
    """Errors of float32 against the float64 truth: ring at this world size, and one
    process on the whole sequence (causal, zigzag, a bias; output and gradients)."""
    config = Config("float32", 7, layout="zigzag", causal=True, bias=True, length_per_rank=64)
    x = _inputs(config, world)
    sharded, whole, shard = _functions(config, x, world)
    names = ["q", "k", "v", "bias"]

    def out_and_grads(fn, primals, dout):
        primals = [p.detach().requires_grad_() for p in primals]
        out = fn(*primals)
        grads = torch.autograd.grad((out * dout).sum(), primals)
        return [out.detach(), *grads]

    truth = out_and_grads(whole, [x[n] for n in names], x["dout"])
    single = out_and_grads(whole, [x[n].float() for n in names], x["dout"].float())
    ring = out_and_grads(sharded, [shard(x[n]).float() for n in names], shard(x["dout"]).float())
    return dict(ring=max(_relative(a.double(), shard(t)) for a, t in zip(ring, truth)),
                single=max(_relative(shard(a).double(), shard(t)) for a, t in zip(single, truth)))


def all_cases(rank: int, world: int) -> dict:
    """Every configuration for this world size, on one rank: {name: {derivative: error}}."""
    results = {config.name: run_case(config, world) for config in configs(world)}
    whole = torch.arange(2 * 3 * world * 4, dtype=torch.float64).view(2, 3 * world * 4)
    for layout in ("contiguous", "zigzag"):
        back = gather_sequence(shard_sequence(whole, layout=layout), layout=layout)
        results[f"shard-gather-{layout}"] = {"roundtrip": float((back != whole).sum())}
    if world == 3:
        results["float32"] = float32_errors(world)
    if world == 2:
        results["counting-backend"] = on_a_counting_backend(world)
        results["disagreeing-shapes"] = disagreeing_shapes(rank, world)
        results["example"] = example_losses(rank, world)
    return results


def on_a_counting_backend(world: int) -> dict:
    """Ring and all-to-all attention with only the tests' own backend allowed: every
    derivative's error, and how many of its calls were a ring step's, per pass."""
    from ...counting_backend import registered_counting_backend

    chosen = {c.name: c for c in configs(world)}
    with registered_counting_backend() as counting:
        errors = {name: run_case(chosen[name], world) for name in ("causal-zigzag-bias-dropout", "all-to-all")}
    passes = ("forward", "backward", "jvp", "backward_jvp", "double_backward", "double_backward_row_sums")
    return dict(errors=errors, ring_steps={p: counting.count(p, ring_step=True) for p in passes})


def example_losses(rank: int, world: int) -> dict:
    """The context-parallel example's first steps here, through attngrad's ring_attention and
    through PyTorch's context_parallel(), and in one process (on this rank, without the
    group): their largest loss differences."""
    path = Path(__file__).resolve().parents[3] / "examples" / "context_parallel_lm.py"
    spec = importlib.util.spec_from_file_location("context_parallel_lm", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    small = dict(steps=6, context=32, batch=2, width=32, heads=2, layers=2)
    sharded = example.train(**small, group=dist.group.WORLD)
    pytorch = example.train(**small, group=dist.group.WORLD, api="pytorch")
    one = example.train(**small)
    return dict(difference=max(abs(a - b) for a, b in zip(sharded, one)), first=one[0], last=one[-1],
                pytorch_difference=max(abs(a - b) for a, b in zip(pytorch, one)))


def disagreeing_shapes(rank: int, world: int) -> str:
    """Rank 1 passes a longer shard: every rank must raise before any exchange."""
    q = torch.randn(1, 2, 8 + (rank == 1), 4)
    try:
        ring_attention(q, q, q)
    except ValueError as e:
        return str(e)
    return "no error"


def failing_rank(rank: int, world: int, how: str) -> Optional[tuple[str, float]]:
    """Rank 1 dies ("killed") or stops calling ("stalled") before a ring exchange; rank 0
    must raise within the group's timeout: (what it raised, after how many seconds)."""
    q = torch.randn(1, 2, 64, 8)
    ring_attention(q, q, q)  # a first call, so that both ranks are connected
    dist.barrier()
    if rank == 1:
        if how == "killed":
            os._exit(3)
        time.sleep(30)  # longer than the group's timeout: the parent ends this process
        return None
    start = time.monotonic()
    try:
        for _ in range(100):
            ring_attention(q, q, q)
    except Exception as e:  # noqa: BLE001 - whatever torch.distributed raises
        return type(e).__name__, time.monotonic() - start
    return "no error", time.monotonic() - start
