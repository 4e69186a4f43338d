"""What each rank runs in the DTensor and context-parallel tests (importable by spawned
processes): attngrad's passes on DTensors sharded along the sequence, and PyTorch's
`context_parallel()` with `replace_sdpa()` around a model, each compared on every rank with
one process on the whole sequence. Each case returns the largest relative error over its
tensors (max |ours - theirs| / max |theirs|), or the message it raised."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from attngrad.torch import attention, replace_sdpa, scaled_dot_product_attention
from attngrad.torch.distributed import ring_attention

B, H, E = 2, 2, 4


def _relative(ours: Tensor, theirs: Tensor) -> float:
    """inf where either holds a NaN: none of these cases makes one, and max() would drop it."""
    ours = ours.full_tensor() if isinstance(ours, DTensor) else ours
    if ours.isnan().any() or theirs.isnan().any():
        return float("inf")
    scale = theirs.abs().max().item()
    return (ours.detach() - theirs.detach()).abs().max().item() / (scale if scale > 0 else 1.0)


def _differentiate(run, leaves: list, dout) -> list:
    """[out, the gradients of <out, dout>, the gradients of the squared gradients' sum]: the
    first and second derivatives, as a gradient penalty takes them."""
    out = run(*leaves)
    grads = torch.autograd.grad(out, leaves, dout, create_graph=True)
    penalty = sum((g * g).sum() for g in grads)
    return [out, *grads, *torch.autograd.grad(penalty, leaves[:3])]


def derivatives(rank: int, world: int) -> dict:
    """Every reverse-mode derivative on DTensors sharded along the sequence (Shard(2)), with a
    bias or a mask as this rank's rows, a bias every row shares (its gradient Partial), and
    every DTensor replicated, against one process: out, the gradients of q, k, v and the
    bias, and the double backward's."""
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    length = 6 * world

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v, dout = randn(B, H, length, E), randn(B, H, length, E), randn(B, H, length, E + 1), randn(B, H, length, E + 1)
    rows_bias, shared_bias = randn(B, H, length, length), randn(1, H, 1, length)
    keep = torch.rand(B, 1, length, length, generator=g) > 0.3
    keep[..., 0] = True
    cases = {"plain": {}, "causal": dict(is_causal=True), "rows-bias": dict(attn_bias=rows_bias),
             "causal-shared-bias": dict(is_causal=True, attn_bias=shared_bias), "rows-mask": dict(attn_mask=keep),
             "replicated-causal-bias": dict(is_causal=True, attn_bias=rows_bias),
             "causal-window": dict(is_causal=True, window=(3, None)),
             "padding-documents": dict(key_padding=torch.tensor([length - 3, length // 2 + 1]),
                                       document_ids=torch.arange(length) // 5),
             "padding-holes-bias": dict(key_padding=keep[:, 0, 0] ^ True, attn_bias=rows_bias)}
    errors = {}
    for name, options in cases.items():
        bias = options.get("attn_bias")
        leaves = [t.clone().requires_grad_() for t in (q, k, v, *([] if bias is None else [bias]))]
        whole = _differentiate(lambda *x: attention(*x[:3], **{**options, **({"attn_bias": x[3]} if len(x) > 3 else {})}),
                               leaves, dout)
        placement = [Replicate()] if name.startswith("replicated") else [Shard(2)]

        def place(t: Tensor, shared: bool = False) -> DTensor:
            return distribute_tensor(t, mesh, [Replicate()] if shared else placement)

        dleaves = [place(t).requires_grad_() for t in (q, k, v)]
        if bias is not None:
            dleaves.append(place(bias, shared=bias is shared_bias).requires_grad_())
        doptions = dict(options, attn_mask=None if "attn_mask" not in options else place(keep))
        doptions.pop("attn_bias", None)
        ours = _differentiate(lambda *x: attention(*x[:3], **doptions, **({"attn_bias": x[3]} if len(x) > 3 else {})),
                              dleaves, place(dout))
        errors[name] = max(_relative(a, b) for a, b in zip(ours, whole))
        errors[f"{name}-each"] = [_relative(a, b) for a, b in zip(ours, whole)]
        errors[f"{name}-placements"] = str(ours[0].placements)
    return errors


def refusals(rank: int, world: int) -> dict:
    """What each placement the passes do not take raises."""
    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(B, H, 4 * world, E, dtype=torch.float64)
    cases = {"heads": ([Shard(1)],) * 3, "mixed": ([Shard(2)], [Replicate()], [Shard(2)])}
    said = {}
    for name, placements in cases.items():
        q, k, v = (distribute_tensor(x, mesh, p) for p in placements)
        try:
            attention(q, k, v)
            said[name] = "no error"
        except NotImplementedError as e:
            said[name] = str(e)
    return said


class Layer(nn.Module):
    """Self-attention through torch.nn.functional.scaled_dot_product_attention, as a model
    written for PyTorch's own context parallelism calls it, then an MLP."""

    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.attend = None  # another function of (q, k, v, is_causal) than PyTorch's, where set
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: Tensor, causal: bool) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = (self.attend or F.scaled_dot_product_attention)(q, k, v, is_causal=causal)
        x = x + self.proj(a.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(x)


class BiasedLayer(Layer):
    """`Layer` with ALiBi-like learned slopes: a bias -slope_h |i - j| made from the query
    rows' positions (a buffer context_parallel() shards, as it shards the tokens) against the
    whole sequence's keys, passed to SDPA as its float attn_mask; its gradient reaches the
    slopes."""

    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__(width, heads)
        self.slopes = nn.Parameter(torch.linspace(0.1, 0.5, heads, dtype=torch.float64))

    def forward(self, x: Tensor, positions: Tensor, whole: int, causal: bool) -> Tensor:
        batch, length, width = x.shape  # length: this rank's tokens, of `whole`
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        keys = torch.arange(whole, dtype=torch.float64)  # the whole sequence's, in order
        distance = (positions[:, None].to(torch.float64) - keys[None, :]).abs()
        bias = -self.slopes[:, None, None] * distance  # (H, this rank's rows, L)
        if causal:  # the causal mask in the bias, as models with a learned bias must pass it
            bias = bias.masked_fill(keys[None, :] > positions[:, None], float("-inf"))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None].expand(batch, -1, -1, -1))
        x = x + self.proj(a.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(x)


def context_parallel_model(rank: int, world: int, layers: tuple[str, ...] = ("plain", "bias")) -> dict:
    """Layers under `context_parallel()` (their sequences sharded in PyTorch's head-tail
    order) and `replace_sdpa(strict=True)`: the output and every parameter's gradient equal
    one process's, causal and not, with a learned bias (`BiasedLayer`: its slopes' gradient),
    and a gradient penalty's double backward; every call on attngrad."""
    import torch.distributed as dist
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    length = 8 * world
    layers = {name: layer for name, layer in (("plain", Layer().double()), ("bias", BiasedLayer().double()))
              if name in layers}
    x = torch.randn(2, length, 8, dtype=torch.float64)
    weights = torch.randn(2, length, 8, dtype=torch.float64)
    result = {}
    for name, layer in layers.items():
        for causal in (False, True):
            for penalty in (False, True):
                def loss(inputs: Tensor, positions: Tensor, w: Tensor) -> Tensor:
                    out = layer(inputs, causal) if name == "plain" else layer(inputs, positions, length, causal)
                    value = (out * w).sum()
                    if penalty:  # a gradient penalty: the backward of a backward
                        (g,) = torch.autograd.grad(value, inputs, create_graph=True)
                        value = value + (g * g).sum()
                    return out, value

                layer.zero_grad()
                with replace_sdpa(strict=True):  # one process on attngrad too: PyTorch's CPU kernel has no double backward
                    whole, value = loss(x.clone().requires_grad_(), torch.arange(length), weights)
                value.backward()
                expected = [p.grad.clone() for p in layer.parameters()]
                layer.zero_grad()
                xs, ws, ps = x.clone(), weights.clone(), torch.arange(length)
                with context_parallel(mesh, buffers=[xs, ws, ps], buffer_seq_dims=[1, 1, 0]):
                    with replace_sdpa(strict=True) as calls:
                        out, value = loss(xs.clone().requires_grad_(), ps, ws)  # the buffer itself is restored
                    value.backward()
                    (gathered,) = context_parallel_unshard(mesh, [out.detach()], [1])
                grads = [p.grad.clone() for p in layer.parameters()]
                for grad in grads:  # each rank's tokens' part of the loss
                    dist.all_reduce(grad)
                case = f"{name} causal={causal} penalty={penalty}"
                result[case] = max([_relative(gathered, whole)] + [_relative(a, b) for a, b in zip(grads, expected)])
                result[f"{case} calls"] = (calls.attngrad, dict(calls.pytorch))
    return result


def meanflow_step(rank: int, world: int) -> dict:
    """A MeanFlow-style step inside `context_parallel()`: u and du/dt by torch.func.jvp
    through attention, then a loss on both and its backward. PyTorch's `context_parallel()`
    SDPA cannot carry a tangent (its DTensor.from_local has no forward-mode rule), so the
    layer calls attngrad's `ring_attention` on the same head-tail shards (layout "zigzag");
    the JVP and every parameter's gradient equal one process's. Also what PyTorch's path
    raises."""
    import torch.distributed as dist
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    mesh = init_device_mesh("cpu", (world,))
    group = mesh.get_group()
    torch.manual_seed(1)
    layer = Layer().double()
    x, t = torch.randn(2, 8 * world, 8, dtype=torch.float64), torch.randn(2, 8 * world, 8, dtype=torch.float64)

    def ring(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor:
        return ring_attention(q, k, v, group=group, layout="zigzag", is_causal=is_causal)

    def step(inputs: Tensor, tangents: Tensor, attend: object) -> tuple:
        layer.zero_grad()
        layer.attend = attend
        u, du = torch.func.jvp(lambda a: layer(a, True), (inputs,), (tangents,))
        layer.attend = None
        ((u - du.detach()).square().sum() + du.square().sum()).backward()
        return u, du, [p.grad.clone() for p in layer.parameters()]

    u, du, expected = step(x, t, scaled_dot_product_attention)
    xs, ts = x.clone(), t.clone()
    result = {}
    with context_parallel(mesh, buffers=[xs, ts], buffer_seq_dims=[1, 1]):
        try:
            with replace_sdpa(strict=True):
                torch.func.jvp(lambda a: layer(a, True), (xs,), (ts,))
            result["pytorch-cp"] = "no error"
        except RuntimeError as e:
            result["pytorch-cp"] = str(e)
        su, sdu, grads = step(xs, ts, ring)
        gathered = context_parallel_unshard(mesh, [su.detach(), sdu.detach()], [1, 1])
    for grad in grads:
        dist.all_reduce(grad)
    result["error"] = max([_relative(gathered[0], u), _relative(gathered[1], du)] +
                          [_relative(a, b) for a, b in zip(grads, expected)])
    return result


def pass_ops(rank: int, world: int) -> dict:
    """Every pass op called on DTensors sharded along the sequence, forward mode's too (no
    transform reaches those on DTensors: `forward_ad.make_dual` takes none), causal with a
    bias as the query's rows, against the same op on the whole tensors: each pass's
    largest relative error over its results."""
    from attngrad.torch.arguments import build_call
    from attngrad.torch.op import ops

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(11)
    length = 6 * world

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v = randn(B, H, length, E), randn(B, H, length, E), randn(B, H, length, E + 1)
    bias = randn(B, H, length, length)
    call, _ = build_call(q, k, v, is_causal=True, attn_bias=bias)
    out, row_max, inv_sum = ops.run_op("forward", call)
    like = dict(q=q, k=k, v=v, out=out, bias=bias)
    inputs = dict(dout=randn(*out.shape), out=out, row_max=row_max, inv_sum=inv_sum, bias_grad=True, dout_grad=True,
                  tsinks=None, gsinks=None, **{f"{kind}{name}": randn(*like[name].shape) for kind in "tg"
                                              for name in ("q", "k", "v", "bias")}, tdout=randn(*out.shape))
    whole = {**call.fields(), **inputs}

    def place(value):
        return distribute_tensor(value, mesh, [Shard(2)]) if isinstance(value, Tensor) and value.dim() >= 3 else value

    sharded = {name: place(value) for name, value in whole.items()}
    errors = {}
    for pass_name, op in ops.OPS.items():
        theirs = op(*(whole[name] for name in ops.ARGUMENTS[pass_name]))
        ours = op(*(sharded[name] for name in ops.ARGUMENTS[pass_name]))
        pairs = [(ours, theirs)] if isinstance(theirs, Tensor) else list(zip(ours, theirs))
        errors[pass_name] = max(_relative(a, b) for a, b in pairs if b.numel())
    return errors


def fsdp_by_context_parallel(rank: int, world: int) -> dict:
    """Three SGD steps on a 2 x 2 mesh (4 ranks): FSDP2 shards the layer over "data" and
    replicates it over "context" (HSDP: its gradients averaged over all four ranks), PyTorch's
    context_parallel() shards each data rank's sequences over "context" with replace_sdpa():
    the parameters after every step equal one process's on the whole batch."""
    import copy

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("context", "data"))
    torch.manual_seed(2)
    reference = Layer().double()
    model = copy.deepcopy(reference)
    fully_shard(model, mesh=mesh)  # sharded over "data", replicated over "context"
    batch, length = 4, 16
    x, weights = torch.randn(batch, length, 8, dtype=torch.float64), torch.randn(batch, length, 8, dtype=torch.float64)
    optimizers = [torch.optim.SGD(reference.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)]
    rows = slice(2 * mesh["data"].get_local_rank(), 2 * mesh["data"].get_local_rank() + 2)
    errors = []
    for _ in range(3):
        ((reference(x, True) * weights).sum() / (batch * length)).backward()
        xs, ws = x[rows].clone(), weights[rows].clone()
        with context_parallel(mesh["context"], buffers=[xs, ws], buffer_seq_dims=[1, 1]):
            with replace_sdpa(strict=True):
                out = model(xs, True)
            # this rank's tokens' part of the mean, times the 4 ranks FSDP averages over
            (4 * (out * ws).sum() / (batch * length)).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        errors.append(max(_relative(p.full_tensor(), r) for p, r in zip(model.parameters(), reference.parameters())))
    return dict(steps=errors)


def data_parallel(rank: int, world: int) -> dict:
    """Two SGD steps of `BiasedLayer` under `replace_sdpa()`, its batch split over the ranks,
    with DistributedDataParallel and with FSDP2 (`fully_shard`): the parameters equal one
    process's on the whole batch."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(3)
    reference = BiasedLayer().double()
    batch, length = 2 * world, 12
    x, weights = torch.randn(batch, length, 8, dtype=torch.float64), torch.randn(batch, length, 8, dtype=torch.float64)
    rows = slice(2 * rank, 2 * rank + 2)
    positions = torch.arange(length)
    models = {"ddp": DistributedDataParallel(copy.deepcopy(reference)), "fsdp2": copy.deepcopy(reference)}
    fully_shard(models["fsdp2"], mesh=mesh)
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.1) for name, model in models.items()}
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    errors = {name: [] for name in models}
    for _ in range(2):
        with replace_sdpa(strict=True):
            ((reference(x, positions, length, True) * weights).mean()).backward()
            for model in models.values():
                ((model(x[rows], positions, length, True) * weights[rows]).mean()).backward()  # averaged over ranks
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        for name, model in models.items():
            optimizers[name].step()
            optimizers[name].zero_grad()
            params = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
            errors[name].append(max(_relative(p, r) for p, r in zip(params, reference.parameters())))
    dist.barrier()
    return errors


def all_to_all(rank: int, world: int) -> dict:
    """`derivatives`, `pass_ops` and `context_parallel_model` again under PyTorch's
    `set_rotate_method("alltoall")`: attngrad's passes trade the sequence for heads
    (`dtensor_all_to_all`) where the heads split over the ranks (H = 2: on 2 ranks); and
    which passes took the trade."""
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    from attngrad.torch.distributed import dtensor_all_to_all

    traded, run = [], dtensor_all_to_all.run
    dtensor_all_to_all.run = lambda pass_name, *rest: traded.append(pass_name) or run(pass_name, *rest)
    set_rotate_method("alltoall")
    try:
        return dict(derivatives=derivatives(rank, world), pass_ops=pass_ops(rank, world),
                    # the biased layer alone: its bias of the rank's rows is the trade's harder part
                    context_parallel=context_parallel_model(rank, world, ("bias",)), traded=sorted(set(traded)))
    finally:
        set_rotate_method("allgather")  # PyTorch's default
        dtensor_all_to_all.run = run


class FlexLayer(nn.Module):
    """Attention by attngrad with a FlexAttention block mask, as a module PyTorch's
    `_ContextParallel(attention_type=FLEX)` wraps: its hook hands it this rank's queries
    and every rank's keys and values (all-gathered), and the block mask is PyTorch's for this
    rank's queries (`_create_cp_block_mask`)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, block_mask: object) -> Tensor:
        return attention(q, k, v, block_mask=block_mask)


def flex_context_parallel(rank: int, world: int) -> dict:
    """A sliding-window causal mask_mod through PyTorch's FlexAttention context parallelism
    (head-tail load balancing, L = 128 per rank as its block masks need), with attngrad
    attending: the output and the gradients of q, k and v (PyTorch's all-gather gives each
    rank its keys' part) against one process, and what a double backward or a JVP through
    PyTorch's all-gather does."""
    import torch.distributed.tensor.experimental._context_parallel._attention as cp
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import create_block_mask

    mesh = init_device_mesh("cpu", (world,))
    length = 128 * world
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(B, H, length, E, generator=g, dtype=torch.float64) for _ in range(4))

    def window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 100)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    whole = attention(*leaves, block_mask=create_block_mask(window, B, H, length, length, device="cpu"))
    expected = [whole, *torch.autograd.grad(whole, leaves, dout)]
    layer = parallelize_module(FlexLayer(), mesh, cp._ContextParallel(
        seq_dim=2, attention_type=cp._ContextParallel.AttentionType.FLEX))
    balancer = _HeadTailLoadBalancer(length, world, torch.device("cpu"))
    order = balancer._generate_indices(restore=False)[0]
    cp._compiled_create_block_mask = create_block_mask  # eager: torch.compile would take 13 s a rank here
    block_mask = cp._create_cp_block_mask(window, B, H, length, length, mesh, load_balancer=balancer)

    def shard(t: Tensor) -> Tensor:
        return t[:, :, order].chunk(world, dim=2)[rank].contiguous()

    mine = [shard(t).requires_grad_() for t in (q, k, v)]
    out = layer(*mine, block_mask=block_mask)
    ours = [out, *torch.autograd.grad(out, mine, shard(dout), create_graph=True)]
    result = {"error": max(_relative(a, shard(b)) for a, b in zip(ours, expected))}
    try:  # a gradient penalty: the backward of PyTorch's all-gather differentiated again
        torch.autograd.grad(sum((d * d).sum() for d in ours[1:]), mine)
        result["double backward"] = "ran"  # not compared: PyTorch 2.13 raises (test_dtensor)
    except Exception as error:  # noqa: BLE001 (what PyTorch's op says is the finding)
        result["double backward"] = f"{type(error).__name__}: {error}"
    return result


SOAK_WARM_UP, SOAK_STEPS = 3, 16


def soak(rank: int, world: int) -> dict:
    """Training steps under `context_parallel()` and `replace_sdpa()` through the DTensor
    handlers, every autograd path they serve (a learned bias's gradient, a gradient
    penalty's double backward): this rank's reachable tensors after the warm-up and at the
    end, and its resident memory's growth (MiB) between them."""
    import gc
    import os

    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    length = 8 * world
    layer = BiasedLayer().double()
    x, weights = (torch.randn(2, length, 8, dtype=torch.float64) for _ in range(2))

    def tensors() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, Tensor))

    def resident() -> float:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    counts, start = [], 0.0
    for step in range(SOAK_WARM_UP + SOAK_STEPS):
        xs, ws, ps = x.clone(), weights.clone(), torch.arange(length)
        with context_parallel(mesh, buffers=[xs, ws, ps], buffer_seq_dims=[1, 1, 0]):
            with replace_sdpa(strict=True):
                inputs = xs.clone().requires_grad_()
                value = (layer(inputs, ps, length, causal=True) * ws).sum()
                (g,) = torch.autograd.grad(value, inputs, create_graph=True)
                (value + (g * g).sum()).backward()
        layer.zero_grad(set_to_none=True)
        if step + 1 in (SOAK_WARM_UP, SOAK_WARM_UP + SOAK_STEPS):
            counts.append(tensors())
            if step + 1 == SOAK_WARM_UP:
                start = resident()
    return dict(tensors=counts, growth=resident() - start)


def all_cases(rank: int, world: int) -> dict:
    return dict(derivatives=derivatives(rank, world), refusals=refusals(rank, world), pass_ops=pass_ops(rank, world),
                data_parallel=data_parallel(rank, world),
                context_parallel=context_parallel_model(rank, world), meanflow=meanflow_step(rank, world),
                soak=soak(rank, world), all_to_all=all_to_all(rank, world),
                flex=flex_context_parallel(rank, world))
