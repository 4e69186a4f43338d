"""PyTorch autograd as the oracle: the same inputs and weights through PyTorch's own ops.

- sdpa: `torch.nn.functional.scaled_dot_product_attention` on the math backend, in the
  dtype asked for (float64 for the exactness bar). With dropout, PyTorch's math kernel
  itself (`torch._scaled_dot_product_attention_math`), which accepts the keep-mask to use.
- encoder / decoder / cross: `torch.nn.MultiheadAttention` loaded with the same state_dict.
  It has no grouped-query heads and no way to pass a dropout keep-mask, so the gqa and
  dropout variants use the same computation spelled in torch ops: `F.linear` projections
  around the math SDPA kernel.

Every oracle runs `out.backward(dout)` with the case's random dout and returns
(out, {name: gradient}) under the names the case uses.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import reference as ref
from .cases import PARAM_LABELS, Case


def _tensors(inputs: Mapping[str, np.ndarray], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(value, dtype=dtype, requires_grad=True) for name, value in inputs.items()}


class AttendOptions(NamedTuple):
    """What an `attend(q, k, v, options)` function takes beside q, k, v (B, H, L, E)."""

    allowed: Optional[torch.Tensor]  # boolean, True = take part
    bias: Optional[torch.Tensor]  # added to the scores
    is_causal: bool
    enable_gqa: bool
    dropout_p: float
    keep_mask: Any  # the dropout's keep-mask (NumPy, broadcastable to the scores), or None


def _math_sdpa(q, k, v, options: AttendOptions):
    """PyTorch's math SDPA with an optional boolean mask and float bias combined as torch wants."""
    allowed, bias, is_causal, enable_gqa, dropout_p, keep_mask = options
    attn_mask = None
    if bias is not None:
        attn_mask = bias if allowed is None else bias.masked_fill(~allowed, float("-inf"))
    elif allowed is not None:
        attn_mask = allowed
    if is_causal and attn_mask is not None:  # torch refuses both: spell the causal mask out
        tri = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        attn_mask = attn_mask & tri if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~tri, float("-inf"))
        is_causal = False
    if dropout_p > 0.0:
        keep = torch.as_tensor(np.broadcast_to(keep_mask, q.shape[:-1] + (k.shape[-2],)).copy())
        # The kernel warns once that a given keep-mask is for testing, which is this use. Its
        # torch.* binding raises the warning as a Python warning, which is silenced here alone
        # (torch.ops.aten's logs it straight to stderr, past any filter).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Dropout mask should only be used for testing", UserWarning)
            out, _ = torch._scaled_dot_product_attention_math(
                q, k, v, attn_mask, dropout_p, is_causal, keep, enable_gqa=enable_gqa
            )
        return out
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa
        )


def _sdpa_oracle(case: Case, t: dict[str, torch.Tensor], attend=_math_sdpa) -> torch.Tensor:
    f = case.fixed
    return attend(t["query"], t["key"], t["value"], AttendOptions(
        allowed=None if f.get("mask") is None else torch.as_tensor(f["mask"]),
        bias=t.get("bias"), is_causal=f.get("is_causal", False), enable_gqa=f.get("enable_gqa", False),
        dropout_p=f.get("dropout_p", 0.0), keep_mask=f.get("keep_mask"),
    ))


def _composed_mha(case: Case, t: dict[str, torch.Tensor], attend=_math_sdpa) -> torch.Tensor:
    """Multi-head attention spelled in torch ops: F.linear projections around `attend`
    (PyTorch's math SDPA by default; `torch_backend` passes attngrad's)."""
    c, f = case.config, case.fixed
    x = t["x"]
    memory = t["memory"] if case.flavor == "cross" else x  # the same tensor: autograd sums the paths
    batch, len_q, head_dim = x.shape[0], x.shape[1], c.embed_dim // c.heads

    def heads(y: torch.Tensor) -> torch.Tensor:  # (B, L, h*dh) -> (B, h, L, dh)
        return y.unflatten(-1, (-1, head_dim)).transpose(1, 2)

    q = heads(F.linear(x, t["W^Q"], t.get("b^Q")))
    k = heads(F.linear(memory, t["W^K"], t.get("b^K")))
    v = heads(F.linear(memory, t["W^V"], t.get("b^V")))
    kpm = f.get("key_padding_mask")
    allowed = None if kpm is None else ~torch.as_tensor(kpm)[:, None, None, :]
    attn = attend(q, k, v, AttendOptions(
        allowed=allowed, bias=t.get("attn_bias"), is_causal=case.flavor == "decoder",
        enable_gqa=k.shape[1] != c.heads, dropout_p=f.get("dropout_p", 0.0), keep_mask=f.get("keep_mask"),
    ))
    return F.linear(attn.transpose(1, 2).reshape(batch, len_q, c.embed_dim), t["W^O"], t.get("b^O"))


def _module_mha(case: Case, t: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.nn.MultiheadAttention]:
    """torch.nn.MultiheadAttention with the case's weights loaded through its state_dict."""
    c, f = case.config, case.fixed
    params = ref.MHAParams(**{name: t[label].detach().numpy() for name, label in PARAM_LABELS.items() if label in t})
    module = torch.nn.MultiheadAttention(c.embed_dim, c.heads, bias=params.has_bias, batch_first=True, dtype=dtype)
    module.load_state_dict({k: torch.as_tensor(v) for k, v in params.state_dict().items()})
    x = t["x"]
    memory = t["memory"] if case.flavor == "cross" else x
    attn_mask = t.get("attn_bias")
    # The module takes is_causal only as a hint that attn_mask *is* the causal mask (it may
    # then drop attn_mask), so the mask is always spelled out, and the hint given only when
    # the mask is nothing but causal.
    is_causal = case.flavor == "decoder" and attn_mask is None
    if case.flavor == "decoder":
        tri = torch.ones(x.shape[1], memory.shape[1], dtype=torch.bool).tril()
        attn_mask = ~tri if attn_mask is None else attn_mask.masked_fill(~tri, float("-inf"))
    kpm = f.get("key_padding_mask")
    out, _ = module(
        x, memory, memory,
        key_padding_mask=None if kpm is None else torch.as_tensor(kpm),
        attn_mask=attn_mask, need_weights=False, is_causal=is_causal,
    )
    return out, module


def oracle_name(case: Case) -> str:
    """Which PyTorch computation serves as the reference for `case`."""
    if case.flavor == "sdpa":
        return "aten._scaled_dot_product_attention_math" if "dropout_p" in case.fixed else "F.scaled_dot_product_attention (math)"
    if uses_module(case):
        return "torch.nn.MultiheadAttention"
    return "F.linear + SDPA math kernel"


def uses_module(case: Case) -> bool:
    return case.flavor != "sdpa" and "dropout_p" not in case.fixed and case.inputs["W^K"].shape[0] == case.config.embed_dim


def torch_gradients(
    case: Case, inputs: Mapping[str, np.ndarray], dout: np.ndarray, dtype: torch.dtype = torch.float64
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """PyTorch's (out, {name: gradient}) for the case, after out.backward(dout)."""
    t = _tensors(inputs, dtype)
    module = None
    if case.flavor == "sdpa":
        out = _sdpa_oracle(case, t)
    elif uses_module(case):
        out, module = _module_mha(case, t, dtype)
    else:
        out = _composed_mha(case, t)
    out.backward(torch.as_tensor(dout, dtype=dtype))
    grads = {name: tensor.grad.numpy() for name, tensor in t.items() if tensor.grad is not None}
    if module is not None:  # the weights' gradients live in the module, in its own layout
        params = ref.MHAParams.from_state_dict({name: p.grad for name, p in module.named_parameters()})
        grads.update({PARAM_LABELS[name]: grad for name, grad in params.items()})
    return out.detach().numpy(), grads


def computation(case: Case, attend=_math_sdpa):
    """The case as a function of its inputs' tensors, in the order of `case.inputs`, with
    attention `attend`: the computation spelled in torch ops (never the module)."""
    names = list(case.inputs)

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        t = dict(zip(names, tensors))
        return _sdpa_oracle(case, t, attend) if case.flavor == "sdpa" else _composed_mha(case, t, attend)

    return run
