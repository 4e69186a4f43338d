"""`MultiheadAttention`: torch.nn.MultiheadAttention's interface over attngrad's exact O(L) attention.

Same constructor arguments, parameter names and state_dict keys as the torch module, so
`load_state_dict` from one works as it is. forward takes the same arguments; the
differences, all on purpose:
    - is_causal=True applies the causal mask (torch takes it only as a hint about attn_mask);
    - a float attn_mask gets its gradient, and so can be a learned bias;
    - attention weights are computed only when need_weights=True (torch's default, kept for
      compatibility): that costs O(Lq Lk) memory, so pass need_weights=False to keep O(L).
      As torch's, they are after dropout, with the very keep-mask the output used.
add_bias_kv appends the learned keys bias_k and values bias_v, add_zero_attn a zero key and
value, to every sequence, as torch's module does. Nested jagged (N, j, E) inputs (batch_first)
train too, each sequence attending to its own keys (torch's module takes them only in its
inference fast path).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import regime
from .arguments import build_call
from .functional import JIT_TRACE
from .functional import attention as attention_function
from .nested import is_jagged
from .op import dropout as dropout_masks
from .op.autograd import differentiable_attention
from .precision import compute_dtype


class MultiheadAttention(nn.Module):
    """Drop-in for torch.nn.MultiheadAttention (see the module docstring for the differences)."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be positive; got {embed_dim} and {num_heads}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.dropout, self.batch_first = embed_dim, num_heads, dropout, batch_first
        self.head_dim = embed_dim // num_heads
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch's initialisation: Xavier-uniform projections, zero biases."""
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for weight in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def _projection_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        if self._qkv_same_embed_dim:
            return self.in_proj_weight.chunk(3)
        return self.q_proj_weight, self.k_proj_weight, self.v_proj_weight

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Optional[Tensor]]:
        """query (L, N, E) or (N, L, E) with batch_first, key (S, N, kdim), value (S, N, vdim);
        unbatched (L, E) inputs too. Returns (attn_output, attn_weights or None)."""
        if regime.jit_tracing():
            raise NotImplementedError(JIT_TRACE.format("MultiheadAttention"))
        if is_jagged(query):
            return self._forward_jagged(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal), None
        unbatched = query.dim() == 2
        if unbatched:  # (L, E): a batch of one, handled batch-first
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise ValueError(f"query, key and value must be 3-D (or all 2-D); got {query.shape}, {key.shape}, {value.shape}")
        seq_first = not self.batch_first and not unbatched
        if seq_first:  # (L, N, E) -> (N, L, E)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        batch, len_q, _ = query.shape
        len_k = key.shape[1]
        if query.shape[-1] != self.embed_dim or key.shape[-1] != self.kdim or value.shape[-1] != self.vdim:
            raise ValueError(
                f"expected widths E={self.embed_dim}, kdim={self.kdim}, vdim={self.vdim}; got query "
                f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
            )
        w_q, w_k, w_v = self._projection_weights()
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)

        def heads(x: Tensor) -> Tensor:  # (N, L, E) -> (N, H, L, dh)
            return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

        k_proj, v_proj = F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)  # (N, S, E)
        extra = []  # keys appended to every sequence: bias_k / bias_v, then a zero key / value
        if self.bias_k is not None:
            extra.append((self.bias_k.expand(batch, 1, -1), self.bias_v.expand(batch, 1, -1)))
        if self.add_zero_attn:
            extra.append((k_proj.new_zeros(batch, 1, self.embed_dim), v_proj.new_zeros(batch, 1, self.embed_dim)))
        if extra:
            k_proj = torch.cat([k_proj, *(pair[0] for pair in extra)], dim=1)
            v_proj = torch.cat([v_proj, *(pair[1] for pair in extra)], dim=1)
            # the appended keys take part for every query: a False (boolean) or 0 (float) column each
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, len(extra)))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, len(extra)))
            len_k += len(extra)
        q, k, v = heads(F.linear(query, w_q, b_q)), heads(k_proj), heads(v_proj)
        mask, bias = self._merge_masks(key_padding_mask, attn_mask, batch, len_q, len_k, query.dtype)
        dropout_p = self.dropout if self.training else 0.0
        seed = torch.randint(0, 2**62, (), dtype=torch.int64) if dropout_p > 0.0 else torch.zeros((), dtype=torch.int64)
        call, layout = build_call(q, k, v, attn_mask=mask, attn_bias=bias, dropout_p=dropout_p, is_causal=is_causal,
                                  seed=seed)
        attn = layout.unfold(differentiable_attention(call))
        out = self.out_proj(attn.transpose(1, 2).reshape(batch, len_q, self.embed_dim))  # (N, L, E)

        weights = None
        if need_weights:
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # (N, H, L, S): O(L S) by request
            if bias is not None:
                scores = scores + bias
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            if is_causal:
                scores = scores.masked_fill(~torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).tril(), float("-inf"))
            weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key: 0
            if dropout_p > 0.0:  # the keep-mask the attention above drew
                buffer = torch.empty(weights.shape, dtype=compute_dtype(weights.dtype), device=weights.device)
                keep = dropout_masks.keep_scale_into(buffer, int(seed), 0, dropout_p)
                weights = weights * keep.to(weights.dtype)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        if seq_first:
            out = out.transpose(0, 1)
        if unbatched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    def _forward_jagged(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor],
                        need_weights: bool, attn_mask: Optional[Tensor], is_causal: bool) -> Tensor:
        """Nested jagged (N, j, E) query, key and value (batch-first): each sequence attends to
        its own keys (`nested`), no padding; the output is jagged on query's sequences."""
        if not self.batch_first:
            raise ValueError("nested jagged inputs are batch-first (N, j, E): build the module with batch_first=True")
        refused = dict(key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        given = [name for name, t in refused.items() if t is not None]
        if need_weights:
            given.append("need_weights=True (sequences of different lengths have no one weights tensor)")
        if self.bias_k is not None or self.add_zero_attn:
            given.append("add_bias_kv or add_zero_attn")
        if given:
            raise ValueError(f"with nested jagged inputs each sequence is its own mask; not taken: {', '.join(given)}")
        w_q, w_k, w_v = self._projection_weights()
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)

        def heads(x: Tensor) -> Tensor:  # (N, j, E) -> (N, H, j, dh), jagged
            return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

        q, k, v = heads(F.linear(query, w_q, b_q)), heads(F.linear(key, w_k, b_k)), heads(F.linear(value, w_v, b_v))
        attn = attention_function(q, k, v, is_causal=is_causal, dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(attn.transpose(1, 2).flatten(-2))  # (N, j, E)

    def _merge_masks(self, key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor], batch: int,
                     len_q: int, len_k: int, dtype: torch.dtype) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """torch's mask conventions (boolean True = NOT allowed; float = added) as attngrad's
        (boolean mask, True = attend; float bias), each broadcastable to (N, H, L, S)."""
        mask = bias = None
        for name, given in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
            if given is not None and given.dtype != torch.bool and not given.is_floating_point():
                # as torch: an integer mask is neither (a uint8 padding mask would be added, not masked)
                raise TypeError(f"{name} must be boolean (True = not allowed) or floating (added); got {given.dtype}")
        if attn_mask is not None:
            if attn_mask.dim() == 3:
                if attn_mask.shape != (batch * self.num_heads, len_q, len_k):
                    raise ValueError(f"a 3-D attn_mask must be (N*H, L, S) = {(batch * self.num_heads, len_q, len_k)}; got {tuple(attn_mask.shape)}")
                attn_mask = attn_mask.view(batch, self.num_heads, len_q, len_k)
            elif attn_mask.shape != (len_q, len_k):
                raise ValueError(f"a 2-D attn_mask must be (L, S) = {(len_q, len_k)}; got {tuple(attn_mask.shape)}")
            if attn_mask.dtype == torch.bool:
                mask = ~attn_mask
            else:
                bias = attn_mask.to(dtype)
        if key_padding_mask is not None:
            if key_padding_mask.shape != (batch, len_k):
                raise ValueError(f"key_padding_mask must be (N, S) = {(batch, len_k)}; got {tuple(key_padding_mask.shape)}")
            if key_padding_mask.dtype == torch.bool:
                keep = ~key_padding_mask[:, None, None, :]  # (N, 1, 1, S)
                mask = keep if mask is None else mask & keep
            else:  # a float key_padding_mask is added, as torch does
                pad = key_padding_mask.to(dtype)[:, None, None, :]
                bias = pad if bias is None else bias + pad
        return mask, bias
