"""What `attngrad bench` measures: the cases, the implementations, the FLOP convention.

Five modes, each one step of an attention call on (B, H, L, d) q, k, v (float32 unless a
case names bf16 or fp16):
    train            forward + backward
    jvp              forward + the tangent of the output (torch.func.jvp), tangents of q, k, v
    double-backward  forward, backward with create_graph=True, then the backward of the
                     gradients (dq, dk, dv) at random cotangents c: what a gradient penalty
                     or MAML runs
    hvp              forward over reverse: torch.func.jvp of the VJP of out at dO (the
                     gradient of <dO, out>), the Hessian-vector product for tangents of q, k, v
    decode           the forward of one query row against L keys, without gradient (a
                     generation step over a cache of L)
Every mode takes its cotangents as the train mode does, handed to the backward
(out.backward(dO)), not through a scalar loss <dO, out>: under torch.func the loss's product,
sum and their derivatives are elementwise passes over (B, H, L, d) that time no attention
(4 ms of a causal HVP at L=1024, B=1, H=8, d=64: 0.2x of the train step, Intel Xeon).
PyTorch's default CPU backend refuses jvp, double backward and hvp; the runner records
its error in the table instead of a time. `--modes` picks families of cases (FAMILIES):
the modes, and "half" (bfloat16 and float16 causal fwd+bwd), "small" (fwd+bwd at B=4,
for short L) and "decode" (B=4).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

IMPLEMENTATIONS = ("attngrad", "torch-default", "torch-math")
# Masks: "padding", boolean (B, 1, 1, L), the last quarter of the keys excluded; "float-mask",
# the same as a (B, 1, L, L) float mask, -inf there, without gradient; "padding-lengths", the
# same padding given to attngrad as lengths; "window", a causal sliding window of WINDOW keys;
# "documents", DOCUMENTS packed documents of L / DOCUMENTS each. PyTorch gets the last three
# as the dense boolean mask it needs: (B, 1, 1, L) for the padding, (L, L) for the others.
MASKS = ("", "padding", "float-mask", "padding-lengths", "window", "documents")
WINDOW = 256
DOCUMENTS = 8
MODES = ("train", "jvp", "double-backward", "hvp", "decode")
FAMILIES = ("train", "jvp", "double-backward", "hvp", "half", "small", "decode")  # what --modes picks
DTYPES = {"float32": "", "bfloat16": "bf16", "float16": "fp16"}  # the dtype's prefix in a case's name
# GEMM work of each mode in units of one forward's 4 B H L^2 d (FlashAttention's convention
# counts the backward as 2.5 forwards). jvp: the forward, then S' (2 products), P' V~ and
# P V~': 1 + 2. double backward: 1 + 2.5, then S, T (2 products), dP, dO gV^T, g_V, two
# each for g_Q and g_K: 5 more (dO is a constant here, so g_dO's two products are not run).
# hvp: the jvp's 3 and the backward's 2.5, then the tangents' own products: S' (two), dP' and
# dV' (one each: dO is a constant), dQ' and dK' (two each): 4 more.
WORK = {"train": 3.5, "jvp": 3.0, "double-backward": 8.5, "hvp": 9.5, "decode": 1.0}


@dataclass(frozen=True)
class BenchCase:
    """One step of one attention call: (B, H, L, d) q, k, v ((B, H, 1, d) q in decode)."""

    length: int
    causal: bool = False
    bias_grad: bool = False  # a float (H, L, L) attention bias that requires grad
    mask: str = ""  # one of MASKS
    dropout: float = 0.0
    softcap: float = 0.0  # c tanh(S / c) (Gemma 2's 50): PyTorch's SDPA has none, so its math is spelled out
    batch: int = 1
    heads: int = 8
    dim: int = 64
    mode: str = "train"
    dtype: str = "float32"  # one of DTYPES

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose from {MODES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from {tuple(DTYPES)}")
        if self.mask not in MASKS:
            raise ValueError(f"unknown mask {self.mask!r}; choose from {MASKS}")
        if self.mask == "window" and not self.causal:
            raise ValueError("the window case is a causal sliding window: pass causal=True")

    @property
    def name(self) -> str:
        parts = [] if self.mode == "train" else [self.mode]
        parts += [DTYPES[self.dtype]] if DTYPES[self.dtype] else []
        parts.append("causal" if self.causal else "full")
        if self.batch != 1:
            parts.append(f"b{self.batch}")
        if self.bias_grad:
            parts.append("bias-grad")
        if self.mask:
            parts.append(self.mask)
        if self.dropout:
            parts.append(f"dropout{self.dropout:g}")
        if self.softcap:
            parts.append(f"softcap{self.softcap:g}")
        return "+".join(parts)

    @property
    def flops(self) -> float:
        """FlashAttention's convention: forward 4 B H L^2 d, backward 2.5x that; causal halves it.
        The other modes count their GEMMs in the same units (WORK). A mask counts the scores
        it admits, in place of L^2 (or L^2 / 2): three quarters for the padding masks."""
        length = self.length
        if self.mask in ("padding", "float-mask", "padding-lengths"):
            scores = length * (length - length // 4)
        elif self.mask == "window":
            window = min(WINDOW, length)
            scores = length * window - window * (window - 1) / 2
        elif self.mask == "documents":
            scores = length * length / DOCUMENTS
        else:
            scores = length * length / (2.0 if self.causal else 1.0)
        if self.mode == "decode":  # one query row sees every key
            scores = length
        return WORK[self.mode] * 4.0 * self.batch * self.heads * scores * self.dim

    @property
    def reference(self) -> BenchCase | None:
        """attngrad's plain call this case is timed against ('over plain'): fwd+bwd with no
        mask, bias, dropout or cap, at the same L, causality, dtype and batch; None for the
        plain call itself and for decode."""
        if self.mode == "decode":
            return None
        plain = BenchCase(self.length, causal=self.causal, batch=self.batch, heads=self.heads, dim=self.dim,
                          dtype=self.dtype)
        return None if plain == self else plain

    @property
    def outputs(self) -> int:
        """How many (B, H, L, d) tensors the step must return: its memory floor."""
        # out + dq, dk, dv / out, out' / + the 3 second-order results / dq, dk, dv and their tangents
        return {"train": 4, "jvp": 2, "double-backward": 7, "hvp": 6, "decode": 0}[self.mode]

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "name": self.name}


def default_cases(lengths: tuple[int, ...], modes: tuple[str, ...] = ("train",)) -> list[BenchCase]:
    cases = []
    for mode in modes:
        for length in lengths:
            if mode == "train":
                cases += [
                    BenchCase(length),
                    BenchCase(length, causal=True),
                    BenchCase(length, bias_grad=True),
                    BenchCase(length, causal=True, bias_grad=True),
                    BenchCase(length, mask="padding"),
                    BenchCase(length, mask="float-mask"),
                    BenchCase(length, dropout=0.1),
                    BenchCase(length, mask="padding-lengths"),
                    BenchCase(length, causal=True, mask="window"),
                    BenchCase(length, mask="documents"),
                    BenchCase(length, causal=True, softcap=50.0),
                ]
            elif mode == "half":
                cases += [BenchCase(length, causal=True, dtype="bfloat16"), BenchCase(length, causal=True, dtype="float16")]
            elif mode == "small":
                cases += [BenchCase(length, causal=True, batch=4), BenchCase(length, batch=4)]
            elif mode == "decode":
                cases += [BenchCase(length, batch=4, mode="decode")]
            else:
                cases += [BenchCase(length, mode=mode), BenchCase(length, causal=True, mode=mode)]
    return cases


def select_cases(cases: list[BenchCase], names: list[str]) -> list[BenchCase]:
    """The cases whose name (the table's, e.g. causal+window) is one of `names`, in their
    order; a name that no case has raises ValueError listing the names there are."""
    known = list(dict.fromkeys(case.name for case in cases))
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"no case named {', '.join(unknown)} among these modes' cases: {', '.join(known)}")
    return [case for case in cases if case.name in names]


def make_inputs(case: BenchCase, seed: int = 0) -> dict[str, Any]:
    """Identical float32 inputs for every implementation (and a random upstream gradient)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (case.batch, case.heads, case.length, case.dim)
    names = {"train": ("q", "k", "v", "dout"), "jvp": ("q", "k", "v", "tq", "tk", "tv"),
             "double-backward": ("q", "k", "v", "dout", "cq", "ck", "cv"),
             "hvp": ("q", "k", "v", "dout", "tq", "tk", "tv"), "decode": ("q", "k", "v")}[case.mode]
    dtype = getattr(torch, case.dtype)
    tensors = {name: torch.randn(shape, generator=g).to(dtype) for name in names}
    if case.mode == "decode":  # one query row
        tensors["q"] = tensors["q"][:, :, -1:].contiguous()
    if case.bias_grad:
        tensors["bias"] = torch.randn(case.heads, case.length, case.length, generator=g)
    if case.mask:
        keep = torch.ones(case.batch, 1, 1, case.length, dtype=torch.bool)
        keep[..., case.length - case.length // 4:] = False
        position = torch.arange(case.length)
        if case.mask == "float-mask":
            keep = torch.zeros(case.batch, 1, case.length, case.length).masked_fill(~keep, float("-inf"))
        elif case.mask == "window":
            offset = position[None, :] - position[:, None]  # j - i
            keep = (offset <= 0) & (offset > -WINDOW)
        elif case.mask == "documents":
            document = position // -(-case.length // DOCUMENTS)
            keep = document[:, None] == document[None, :]
        tensors["mask"] = keep
    return tensors


def structured(case: BenchCase) -> dict[str, Any]:
    """The case's mask as attngrad's structured-mask keywords (none for the others)."""
    import torch

    if case.mask == "padding-lengths":
        return dict(key_padding=torch.full((case.batch,), case.length - case.length // 4))
    if case.mask == "window":
        return dict(window=(WINDOW - 1, None))
    if case.mask == "documents":
        step = -(-case.length // DOCUMENTS)  # as make_inputs cuts them
        return dict(cu_seqlens=torch.cat([torch.arange(0, case.length, step), torch.tensor([case.length])]))
    return {}


def _attention(implementation: str, case: BenchCase) -> Callable[..., Any]:
    """(q, k, v, bias) -> out for `implementation`, with the case's mask and dropout."""
    import torch

    from ..torch import attention
    from ..torch import scaled_dot_product_attention as ours

    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r}; choose from {IMPLEMENTATIONS}")
    keywords = structured(case)  # made once, as PyTorch's dense mask is (make_inputs), for every step

    def forward(q: Any, k: Any, v: Any, bias: Any = None) -> Any:
        if case.softcap:
            if implementation == "attngrad":
                return attention(q, k, v, is_causal=case.causal, softcap=case.softcap, dropout_p=case.dropout)
            return _capped_in_pytorch(implementation, case, q, k, v)
        if implementation == "attngrad" and keywords:  # no dense mask: the structure alone
            return attention(q, k, v, is_causal=case.causal, dropout_p=case.dropout, **keywords)
        if case.mask in ("window", "documents"):  # the causal band is spelled into PyTorch's mask
            return _pytorch(implementation, q, k, v, dict(attn_mask=bias, dropout_p=case.dropout))
        # a bias with gradient, or a mask without (no case has both)
        kwargs = dict(attn_mask=bias, is_causal=case.causal, dropout_p=case.dropout)
        if case.causal and bias is not None:
            if implementation == "attngrad":  # its own entry point takes both, and skips the causal half
                return attention(q, k, v, attn_bias=bias, is_causal=True, dropout_p=case.dropout)
            # PyTorch's function refuses both: the causal mask is spelled into the bias
            tri = torch.ones(case.length, case.length, dtype=torch.bool).tril()
            kwargs.update(attn_mask=bias.masked_fill(~tri, float("-inf")), is_causal=False)
        if implementation == "attngrad":
            return ours(q, k, v, **kwargs)
        return _pytorch(implementation, q, k, v, kwargs)

    return forward


def _capped_in_pytorch(implementation: str, case: BenchCase, q: Any, k: Any, v: Any) -> Any:
    """Soft-capped attention as transformers' eager Gemma 2 code spells it in PyTorch ops (the
    math path: PyTorch's SDPA has no softcap, so its default backend refuses the case)."""
    import torch

    if implementation == "torch-default":
        raise NotImplementedError("PyTorch's scaled_dot_product_attention has no softcap")
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    scores = torch.tanh(scores / case.softcap) * case.softcap
    if case.causal:
        future = torch.ones(case.length, case.length, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = torch.nn.functional.dropout(torch.softmax(scores, dim=-1), case.dropout)
    return probs @ v


def _pytorch(implementation: str, q: Any, k: Any, v: Any, kwargs: dict[str, Any]) -> Any:
    """PyTorch's function on its default backends, or on its math backend alone."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if implementation == "torch-default":
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def step(implementation: str, case: BenchCase) -> Callable[[dict[str, Any]], None]:
    """One step of `implementation` in the case's mode, on the case's inputs."""
    import torch

    forward = _attention(implementation, case)

    def run(inputs: dict[str, Any]) -> None:
        primals, tangents = tuple(inputs[n] for n in ("q", "k", "v")), tuple(inputs.get(n) for n in ("tq", "tk", "tv"))
        if case.mode == "decode":
            with torch.no_grad():
                forward(*primals)
            return
        if case.mode == "jvp":
            torch.func.jvp(forward, primals, tangents)
            return
        if case.mode == "hvp":
            def gradient(q: Any, k: Any, v: Any) -> Any:  # the gradient of <dO, out>
                return torch.func.vjp(forward, q, k, v)[1](inputs["dout"])

            torch.func.jvp(gradient, primals, tangents)
            return
        leaves = [inputs[n].detach().requires_grad_() for n in ("q", "k", "v")]
        bias = inputs["bias"].detach().requires_grad_() if case.bias_grad else inputs.get("mask")
        out = forward(*leaves, bias)
        if case.mode == "train":
            out.backward(inputs["dout"])
            return
        grads = torch.autograd.grad(out, leaves, inputs["dout"], create_graph=True)
        torch.autograd.backward(grads, [inputs[c] for c in ("cq", "ck", "cv")])  # of <c, grads>

    return run
