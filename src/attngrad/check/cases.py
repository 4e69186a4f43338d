"""The cases `attngrad check` proves: every flavor under every option, with random data.

A case owns its random inputs (float64, named flat so finite differences can walk them),
its fixed data (masks, dropout keep-masks), and knows how to run attngrad's reference on
them. The PyTorch side of each case lives in `torch_oracle`.

Flavors: sdpa (scaled dot-product attention itself), encoder (self-attention), decoder
(masked self-attention), cross (encoder-decoder attention).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import reference as ref

FLAVORS = ("sdpa", "encoder", "decoder", "cross")
VARIANTS = {
    "sdpa": ("plain", "causal", "mask", "bias", "gqa", "dropout", "masked-row", "all"),
    "encoder": ("plain", "no-bias", "padding", "attn-bias", "gqa", "dropout", "masked-row", "all"),
}
VARIANTS["decoder"] = VARIANTS["encoder"]
VARIANTS["cross"] = VARIANTS["encoder"]

DROPOUT_P = 0.25
PARAM_LABELS = {"w_q": "W^Q", "w_k": "W^K", "w_v": "W^V", "w_o": "W^O", "b_q": "b^Q", "b_k": "b^K", "b_v": "b^V", "b_o": "b^O"}


@dataclass(frozen=True)
class CheckConfig:
    """Sizes and seed of one `attngrad check` run."""

    batch: int = 2
    heads: int = 4
    len_q: int = 5  # decoder / query length
    len_k: int = 7  # encoder / key length
    embed_dim: int = 16  # model width E; SDPA uses dk = dv = E / heads
    seed: int = 0
    dtype: str = "float64"

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "len_q", "len_k", "embed_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        if self.embed_dim % self.heads:
            raise ValueError(f"embed_dim={self.embed_dim} is not divisible by heads={self.heads}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64'; got {self.dtype!r}")

    @property
    def kv_heads(self) -> int:
        """Key/value heads in the GQA variants: half the query heads (1 if H is odd)."""
        return self.heads // 2 if self.heads % 2 == 0 else 1


@dataclass
class Case:
    """One flavor under one variant: inputs, fixed data and the reference computation."""

    flavor: str
    variant: str
    config: CheckConfig
    inputs: dict[str, np.ndarray]  # differentiable, float64, flat names (labels of the table)
    fixed: dict[str, Any] = field(default_factory=dict)  # masks, keep-mask, sizes

    @property
    def title(self) -> str:
        return f"{self.flavor}/{self.variant}"

    @property
    def exact_zeros(self) -> frozenset[str]:
        """Gradients that are zero in exact arithmetic, whatever the data; what any
        implementation returns for them is rounding noise, so they are judged against the
        scale of the case's other gradients.

        - b^K adds q_i . b^K to every score of row i, a shift that softmax ignores.
        - When no query row has more than one key to attend to, every row of P is constant
          (1 on its key, or all 0), so nothing flows back to the scores: the query side,
          the key side and the bias get 0 (the values still get their gradient).
        """
        zeros = {"b^K"}
        if self._max_keys_per_row() <= 1:
            zeros |= {"query", "key", "bias", "W^Q", "b^Q", "W^K", "attn_bias"}
            if self.flavor == "cross":
                zeros.add("x")  # the decoder stream feeds only the queries
        return frozenset(zeros & self.inputs.keys())

    def _max_keys_per_row(self) -> int:
        """The most keys any query row may attend to under this case's masks."""
        c, f = self.config, self.fixed
        len_q = c.len_k if self.flavor == "encoder" else c.len_q
        len_k = c.len_q if self.flavor == "decoder" else c.len_k
        allowed = np.ones((c.batch, 1, len_q, len_k), dtype=bool)
        if f.get("mask") is not None:
            allowed = allowed & f["mask"]
        if f.get("key_padding_mask") is not None:
            allowed = allowed & ~f["key_padding_mask"][:, None, None, :]
        if f.get("is_causal") or self.flavor == "decoder":
            allowed = allowed & ref.causal_mask(len_q, len_k)
        return int(allowed.sum(-1).max())

    def forward(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """attngrad's forward on `inputs` (used by finite differences)."""
        return self._run(inputs, dout=None)[0]

    def gradients(self, inputs: Mapping[str, np.ndarray], dout: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """attngrad's (out, {name: gradient}) on `inputs` for upstream gradient `dout`."""
        return self._run(inputs, dout)

    def _run(self, inputs: Mapping[str, np.ndarray], dout: np.ndarray | None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        if self.flavor == "sdpa":
            return _run_sdpa(self, inputs, dout)
        return _run_mha(self, inputs, dout)


def _run_sdpa(case: Case, inputs: Mapping[str, np.ndarray], dout: np.ndarray | None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    f = case.fixed
    out, cache = ref.sdpa_forward(
        inputs["query"], inputs["key"], inputs["value"],
        mask=f.get("mask"), bias=inputs.get("bias"), is_causal=f.get("is_causal", False),
        enable_gqa=f.get("enable_gqa", False), dropout_p=f.get("dropout_p", 0.0), keep_mask=f.get("keep_mask"),
    )
    if dout is None:
        return out, {}
    g = ref.sdpa_backward(dout, cache)
    grads = {"query": g.dq, "key": g.dk, "value": g.dv}
    if g.dbias is not None:
        grads["bias"] = g.dbias
    return out, grads


def _params_from(inputs: Mapping[str, np.ndarray]) -> ref.MHAParams:
    return ref.MHAParams(**{name: inputs[label] for name, label in PARAM_LABELS.items() if label in inputs})


def _run_mha(case: Case, inputs: Mapping[str, np.ndarray], dout: np.ndarray | None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    f = case.fixed
    params = _params_from(inputs)
    options = dict(attn_mask=inputs.get("attn_bias"), dropout_p=f.get("dropout_p", 0.0), keep_mask=f.get("keep_mask"))
    heads = case.config.heads
    if case.flavor == "cross":
        out, cache = ref.encoder_decoder_attention_forward(
            inputs["x"], inputs["memory"], params, heads, memory_key_padding_mask=f.get("key_padding_mask"), **options
        )
    else:
        forward = ref.decoder_self_attention_forward if case.flavor == "decoder" else ref.encoder_self_attention_forward
        out, cache = forward(inputs["x"], params, heads, key_padding_mask=f.get("key_padding_mask"), **options)
    if dout is None:
        return out, {}
    if case.flavor == "cross":
        g = ref.encoder_decoder_attention_backward(dout, cache)
        grads = {"x": g.dx, "memory": g.dmemory}
    else:
        g = ref.self_attention_backward(dout, cache)
        grads = {"x": g.dx}
    grads.update({PARAM_LABELS[name]: grad for name, grad in g.params.items()})
    if g.dattn_mask is not None:
        grads["attn_bias"] = g.dattn_mask
    return out, grads


def _padding_mask(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """(B, L) True = padding: each sequence keeps a random prefix of at least one token."""
    keep = rng.integers(1, length + 1, size=batch)
    keep[0] = max(1, length - 2)  # make sure some padding exists
    return np.arange(length)[None, :] >= keep[:, None]


def make_case(flavor: str, variant: str, config: CheckConfig) -> Case:
    """Build the random inputs and fixed data of one case. Deterministic in config.seed."""
    if flavor not in FLAVORS:
        raise ValueError(f"unknown flavor {flavor!r}; choose from {', '.join(FLAVORS)}")
    if variant not in VARIANTS[flavor]:
        raise ValueError(f"unknown variant {variant!r} for {flavor}; choose from {', '.join(VARIANTS[flavor])}")
    salt = FLAVORS.index(flavor) * 100 + VARIANTS[flavor].index(variant)
    rng = np.random.default_rng([config.seed, salt])
    c = config
    gqa = variant in ("gqa", "all")
    kv_heads = c.kv_heads if gqa else c.heads
    dropout = variant in ("dropout", "all")
    fixed: dict[str, Any] = {}

    if flavor == "sdpa":
        width = c.embed_dim // c.heads
        inputs = {
            "query": rng.standard_normal((c.batch, c.heads, c.len_q, width)),
            "key": rng.standard_normal((c.batch, kv_heads, c.len_k, width)),
            "value": rng.standard_normal((c.batch, kv_heads, c.len_k, width + 1)),  # dv != dk on purpose
        }
        full = (c.batch, c.heads, c.len_q, c.len_k)
        if variant in ("bias", "all"):
            inputs["bias"] = rng.standard_normal((1, c.heads, c.len_q, c.len_k))  # per-head, shared over batch
        if variant in ("mask", "all"):
            mask = rng.random((c.batch, 1, c.len_q, c.len_k)) > 0.3
            mask[..., 0] = True  # every row keeps a key, so only "masked-row" tests empty rows
            fixed["mask"] = mask
        if variant in ("causal", "all"):
            fixed["is_causal"] = True
        if variant == "masked-row":
            mask = np.ones((c.batch, c.heads, c.len_q, c.len_k), dtype=bool)
            mask[0, 0, c.len_q - 1, :] = False  # one query row sees no key at all
            mask[c.batch - 1, :, 0, :] = False
            fixed["mask"] = mask
        fixed["enable_gqa"] = gqa
    else:
        len_x = c.len_k if flavor == "encoder" else c.len_q
        len_kv = c.len_k if flavor == "cross" else len_x
        full = (c.batch, c.heads, len_x, len_kv)
        params = ref.MHAParams.random(
            c.embed_dim, c.heads, num_kv_heads=kv_heads, bias=variant != "no-bias", rng=rng
        )
        inputs = {"x": rng.standard_normal((c.batch, len_x, c.embed_dim))}
        if flavor == "cross":
            inputs["memory"] = rng.standard_normal((c.batch, len_kv, c.embed_dim))
        inputs.update({PARAM_LABELS[name]: value for name, value in params.items()})
        if variant in ("attn-bias", "all"):
            inputs["attn_bias"] = rng.standard_normal((len_x, len_kv))  # shared by batch and heads
        if variant in ("padding", "all"):
            fixed["key_padding_mask"] = _padding_mask(rng, c.batch, len_kv)
        if variant == "masked-row":
            kpm = np.zeros((c.batch, len_kv), dtype=bool)
            kpm[c.batch - 1] = True  # the last sequence's keys are all padding
            fixed["key_padding_mask"] = kpm
    if dropout:
        fixed["dropout_p"] = DROPOUT_P
        fixed["keep_mask"] = rng.random(full) >= DROPOUT_P
    return Case(flavor, variant, config, inputs, fixed)


def all_cases(config: CheckConfig, flavors: tuple[str, ...] = FLAVORS, variants: tuple[str, ...] | None = None) -> list[Case]:
    """Every (flavor, variant) asked for, in table order."""
    cases = []
    for flavor in flavors:
        for variant in VARIANTS[flavor]:
            if variants is None or variant in variants:
                cases.append(make_case(flavor, variant, config))
    return cases
