"""The seed notebook's and the blog check's defects, each as a small runnable demonstration.

Each function rebuilds the defect in a few lines of PyTorch (the seeds use it), measures
what goes wrong, and returns the figures beside those of the correct construction.
PyTorch is imported when a function runs, so this module imports without it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SharedHeads:
    layers_in_list: int  # length of the list of per-head layers
    distinct_layers: int  # how many different Linear objects it holds
    heads_identical: bool  # every head computes the same projection
    registered_parameters: int  # parameters a module holding the plain list exposes to an optimizer
    fixed_distinct_layers: int
    fixed_registered_parameters: int


def shared_heads(num_heads: int = 4, d_model: int = 8, seed: int = 0) -> SharedHeads:
    """`[nn.Linear(d_model, d_k)] * num_heads` repeats ONE layer: every head is the same head.

    And as a plain list attribute it is not registered, so module.parameters() (what an
    optimizer is given) misses it. The fix: nn.ModuleList of num_heads separate layers.
    """
    import torch
    from torch import nn

    torch.manual_seed(seed)
    d_k = d_model // num_heads

    class Buggy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w_q = [nn.Linear(d_model, d_k)] * num_heads  # the notebook's construction

    class Fixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w_q = nn.ModuleList(nn.Linear(d_model, d_k) for _ in range(num_heads))

    buggy, fixed = Buggy(), Fixed()
    x = torch.randn(2, 5, d_model)
    heads = [layer(x) for layer in buggy.w_q]
    return SharedHeads(
        layers_in_list=len(buggy.w_q),
        distinct_layers=len({id(layer) for layer in buggy.w_q}),
        heads_identical=all(torch.equal(heads[0], h) for h in heads),
        registered_parameters=sum(p.numel() for p in buggy.parameters()),
        fixed_distinct_layers=len({id(layer) for layer in fixed.w_q}),
        fixed_registered_parameters=sum(p.numel() for p in fixed.parameters()),
    )


@dataclass(frozen=True)
class MultiplicativeMask:
    future_weight: float  # largest attention weight a query puts on a later position
    output_change_from_future: float  # max |change| of position 0's output when later tokens change
    fixed_future_weight: float
    fixed_output_change_from_future: float


def multiplicative_mask(length: int = 6, d: int = 4, seed: int = 0) -> MultiplicativeMask:
    """Scores multiplied by -1e-9 at future positions become ~0, not -inf: exp(0) = 1, so the
    future keeps a full share of attention and information leaks backwards. The fix:
    scores.masked_fill(~causal, -inf), after which future weights are exactly 0."""
    import torch

    torch.manual_seed(seed)
    q, k, v = torch.randn(3, 1, length, d, dtype=torch.float64)
    causal = torch.ones(length, length, dtype=torch.bool).tril()

    def attend(values: torch.Tensor, fixed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        scores = q @ k.transpose(-1, -2) / d**0.5
        if fixed:
            scores = scores.masked_fill(~causal, float("-inf"))
        else:
            scores = scores * torch.where(causal, 1.0, -1e-9)  # the notebook's mask
        weights = scores.softmax(-1)
        return weights, weights @ values

    changed = v.clone()
    changed[:, 1:] += 1.0  # change every position after the first
    figures = []
    for fixed in (False, True):
        weights, out = attend(v, fixed)
        _, out_changed = attend(changed, fixed)
        figures.append(float(weights.masked_select(~causal).max()))
        figures.append(float((out_changed[:, 0] - out[:, 0]).abs().max()))
    return MultiplicativeMask(*figures)


@dataclass(frozen=True)
class SharedAttentionModule:
    same_object: bool  # self- and cross-attention are one module
    parameters: int
    fixed_parameters: int
    grad_is_sum_of_both_uses: bool  # the shared weights get self-path + cross-path gradients


def shared_attention_module(d_model: int = 8, heads: int = 2, seed: int = 0) -> SharedAttentionModule:
    """A decoder block that calls one MHA module for masked self-attention and for
    encoder-decoder attention ties their weights: one set of W^Q, W^K, W^V, W^O must serve
    two different jobs, and its gradient is the sum of both. The paper has two modules."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    attn = nn.MultiheadAttention(d_model, heads, batch_first=True)
    buggy = {"self_attn": attn, "cross_attn": attn}  # the notebook's decoder block
    fixed = {"self_attn": nn.MultiheadAttention(d_model, heads, batch_first=True),
             "cross_attn": nn.MultiheadAttention(d_model, heads, batch_first=True)}
    x, memory = torch.randn(2, 4, d_model), torch.randn(2, 6, d_model)
    causal = ~torch.ones(4, 4, dtype=torch.bool).tril()

    def grad_of(use: str) -> torch.Tensor:
        attn.zero_grad()
        if use in ("self", "both"):
            buggy["self_attn"](x, x, x, attn_mask=causal)[0].sum().backward()
        if use in ("cross", "both"):
            buggy["cross_attn"](x, memory, memory)[0].sum().backward()
        return attn.in_proj_weight.grad.clone()

    summed = grad_of("self") + grad_of("cross")
    count = lambda modules: sum(p.numel() for m in {id(m): m for m in modules.values()}.values() for p in m.parameters())  # noqa: E731
    return SharedAttentionModule(
        same_object=buggy["self_attn"] is buggy["cross_attn"],
        parameters=count(buggy),
        fixed_parameters=count(fixed),
        grad_is_sum_of_both_uses=bool(torch.allclose(grad_of("both"), summed, rtol=1e-6, atol=1e-7)),
    )


@dataclass(frozen=True)
class Int16Check:
    int16_printed_max: int  # what the blog's check prints for a wrong gradient
    relative_error: float  # the error figure attngrad uses, for the same wrong gradient


def int16_check(wrong_by: float = 0.5, seed: int = 0) -> Int16Check:
    """The blog compares its formula with autograd through `(w_q - w_q_true).short()`: the
    cast to int16 truncates every difference below 1 to 0, and gradients of out.mean() are
    ~1e-4, so the check prints zeros for any formula at all. Here the 'theory' is wrong by
    50% and the check still prints 0; max|ours - ref| / max|ref| says 0.5."""
    import torch

    torch.manual_seed(seed)
    x = torch.rand(1, 5, 10)
    w_q = torch.randn(10, 10, requires_grad=True)
    scores = (x @ w_q) @ (x @ w_q).transpose(-1, -2) / 10**0.5
    out = scores.softmax(-1) @ x
    out.mean().backward()
    w_q_true = w_q.grad
    w_q_theory = w_q_true * (1 + wrong_by)  # a formula that is wrong by 50%
    printed = (w_q_theory - w_q_true).short()  # the blog's check
    relative = float((w_q_theory - w_q_true).abs().max() / w_q_true.abs().max())
    return Int16Check(int16_printed_max=int(printed.abs().max()), relative_error=relative)
