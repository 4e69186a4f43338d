"""Parameters of multi-head attention, in the layout of `torch.nn.MultiheadAttention`.

Shape legend: E embed_dim (query width and output width), kdim/vdim key/value input widths,
Ekv = Hkv * dh the projected key/value width (E unless grouped-query heads).

    W^Q (E, E)     W^K (Ekv, kdim)    W^V (Ekv, vdim)    W^O (E, E)
    b^Q (E,)       b^K (Ekv,)         b^V (Ekv,)         b^O (E,)

A projection is y = x W^T + b, as in torch. `from_state_dict` reads a torch module's
state_dict (`in_proj_weight` stacked [W^Q; W^K; W^V] when kdim == vdim == E, else
`q_proj_weight`, `k_proj_weight`, `v_proj_weight`; `in_proj_bias`; `out_proj.weight`,
`out_proj.bias`), and `state_dict` writes the same keys back.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from .validate import as_float_array

WEIGHT_NAMES = ("w_q", "w_k", "w_v", "w_o")
BIAS_NAMES = ("b_q", "b_k", "b_v", "b_o")


@dataclass
class MHAParams:
    """Weights and biases of one multi-head attention layer (or their gradients)."""

    w_q: np.ndarray  # (E, E)
    w_k: np.ndarray  # (Ekv, kdim)
    w_v: np.ndarray  # (Ekv, vdim)
    w_o: np.ndarray  # (E, E)
    b_q: np.ndarray | None = None  # (E,)
    b_k: np.ndarray | None = None  # (Ekv,)
    b_v: np.ndarray | None = None  # (Ekv,)
    b_o: np.ndarray | None = None  # (E,)

    @property
    def embed_dim(self) -> int:
        return self.w_q.shape[0]

    @property
    def kdim(self) -> int:
        return self.w_k.shape[1]

    @property
    def vdim(self) -> int:
        return self.w_v.shape[1]

    @property
    def has_bias(self) -> bool:
        return self.b_q is not None

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """(name, array) for every parameter that is present, weights first."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                yield f.name, value

    @classmethod
    def random(
        cls,
        embed_dim: int,
        num_heads: int,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        num_kv_heads: int | None = None,
        bias: bool = True,
        rng: np.random.Generator | int | None = None,
        dtype: Any = np.float64,
    ) -> MHAParams:
        """Random parameters: uniform weights of torch's Xavier scale, nonzero random biases.

        The biases are random (torch initialises them to 0) so that tests exercise them.
        """
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        gen = np.random.default_rng(rng)
        kv_width = num_kv_heads * (embed_dim // num_heads)
        kdim, vdim = kdim or embed_dim, vdim or embed_dim

        def uniform(*shape: int) -> np.ndarray:
            bound = np.sqrt(6.0 / (shape[0] + shape[-1]))
            return gen.uniform(-bound, bound, size=shape).astype(dtype)

        widths = {"w_q": (embed_dim, embed_dim), "w_k": (kv_width, kdim), "w_v": (kv_width, vdim), "w_o": (embed_dim, embed_dim)}
        weights = {name: uniform(*shape) for name, shape in widths.items()}
        biases = {}
        if bias:
            biases = {b: uniform(widths[w][0]) * 0.5 for w, b in zip(WEIGHT_NAMES, BIAS_NAMES)}
        return cls(**weights, **biases)

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Any]) -> MHAParams:
        """Read `torch.nn.MultiheadAttention.state_dict()` (tensors or arrays)."""
        sd = {name: as_float_array(f"state_dict[{name!r}]", value) for name, value in state_dict.items()}
        unsupported = {"bias_k", "bias_v"} & sd.keys()
        if unsupported:
            raise ValueError(f"add_bias_kv is not supported (state_dict has {sorted(unsupported)})")
        if "in_proj_weight" in sd:
            w_q, w_k, w_v = np.split(sd.pop("in_proj_weight"), 3, axis=0)
        else:
            try:
                w_q, w_k, w_v = (sd.pop(f"{n}_proj_weight") for n in "qkv")
            except KeyError as missing:
                raise ValueError(f"state_dict has neither 'in_proj_weight' nor {missing}") from None
        if "out_proj.weight" not in sd:
            raise ValueError(f"state_dict has no 'out_proj.weight'; keys: {sorted(state_dict)}")
        w_o = sd.pop("out_proj.weight")
        b_q = b_k = b_v = b_o = None
        if "in_proj_bias" in sd:
            in_bias = sd.pop("in_proj_bias")
            b_q, b_k, b_v = np.split(in_bias, np.cumsum([w_q.shape[0], w_k.shape[0]]))
            if "out_proj.bias" not in sd:
                raise ValueError("state_dict has 'in_proj_bias' but no 'out_proj.bias'")
            b_o = sd.pop("out_proj.bias")
        if sd:
            raise ValueError(f"unexpected state_dict keys: {sorted(sd)}")
        return cls(w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o)

    def state_dict(self) -> dict[str, np.ndarray]:
        """The same arrays under torch's state_dict keys (loadable with torch.as_tensor)."""
        biases = [getattr(self, b) for b in BIAS_NAMES]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            raise ValueError("torch's layout has all four biases or none; this MHAParams has some")
        same_width = self.w_q.shape == self.w_k.shape == self.w_v.shape
        if same_width:
            sd = {"in_proj_weight": np.concatenate([self.w_q, self.w_k, self.w_v])}
        else:
            sd = {"q_proj_weight": self.w_q, "k_proj_weight": self.w_k, "v_proj_weight": self.w_v}
        if self.has_bias:
            sd["in_proj_bias"] = np.concatenate([self.b_q, self.b_k, self.b_v])
        sd["out_proj.weight"] = self.w_o
        if self.has_bias:
            sd["out_proj.bias"] = self.b_o
        return sd
