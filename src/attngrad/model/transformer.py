"""The Transformer of "Attention Is All You Need" in NumPy, every backward written by hand.

Shape legend: B batch, S source length, T target length, D d_model, V vocabulary.

Encoder-decoder (config.decoder_only False):
    x = drop(E_src[src] sqrt(D) + PE)                      # (B, S, D)
    N x: x = sub(x, self-attention, padding masked);  x = sub(x, feed-forward)
    memory = x  (pre-LN: LN(x))
    y = drop(E_tgt[tgt] sqrt(D) + PE)                      # (B, T, D)
    N x: y = sub(y, causal self-attention);  y = sub(y, attention to memory);  y = sub(y, feed-forward)
    (pre-LN: y = LN(y))
    logits = y W_out^T + b_out, W_out = E_tgt when tied    # (B, T, V)
Decoder-only (a causal language model): the decoder stack without attention to memory.

    sub(x, f) = LN(x + drop(f(x)))       post-LN, the paper's
    sub(x, f) = x + drop(f(LN(x)))       pre-LN
Attention is `attngrad.reference`'s multi-head attention, its dropout on the weights.
`forward` returns (logits, cache); `backward(dlogits, cache)` returns the gradient of every
parameter, keyed like the parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..reference.flavors import (
    encoder_decoder_attention_backward,
    encoder_decoder_attention_forward,
    self_attention_backward,
    self_attention_forward,
)
from ..reference.linear import linear_backward, linear_forward
from ..reference.params import MHAParams
from .layers import (
    NO_DROPOUT,
    Dropout,
    embedding_backward,
    embedding_forward,
    feed_forward_backward,
    feed_forward_forward,
    layer_norm_backward,
    layer_norm_forward,
    positional_encoding,
)

PAD, BOS, EOS = 0, 1, 2  # reserved token ids of every vocabulary
ATTENTION_KEYS = ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int
    d_model: int = 64
    heads: int = 4
    d_ff: int = 256
    layers: int = 2  # N, for the encoder and for the decoder
    dropout: float = 0.1
    pre_ln: bool = False
    tie_output: bool = True  # W_out = E_tgt
    decoder_only: bool = False
    max_len: int = 256

    def __post_init__(self) -> None:
        if self.vocab_size <= EOS:
            raise ValueError(f"vocab_size must exceed the {EOS + 1} reserved tokens; got {self.vocab_size}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by heads={self.heads}")
        if min(self.d_model, self.heads, self.d_ff, self.layers, self.max_len) < 1:
            raise ValueError(f"sizes must be positive: {self}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1); got {self.dropout}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parameter_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape."""
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {}

    def attention(prefix: str) -> None:
        for name in ATTENTION_KEYS:
            shapes[f"{prefix}.{name}"] = (d, d) if name.startswith("w") else (d,)

    def norm(prefix: str) -> None:
        shapes[f"{prefix}.gamma"] = shapes[f"{prefix}.beta"] = (d,)

    def feed_forward(prefix: str) -> None:
        shapes.update({f"{prefix}.w1": (f, d), f"{prefix}.b1": (f,), f"{prefix}.w2": (d, f), f"{prefix}.b2": (d,)})

    if not config.decoder_only:
        shapes["src_embed"] = (v, d)
        for i in range(config.layers):
            attention(f"enc.{i}.attn")
            norm(f"enc.{i}.ln1")
            feed_forward(f"enc.{i}.ffn")
            norm(f"enc.{i}.ln2")
        if config.pre_ln:
            norm("enc.ln")
    shapes["tgt_embed"] = (v, d)
    for i in range(config.layers):
        attention(f"dec.{i}.self")
        norm(f"dec.{i}.ln1")
        if not config.decoder_only:
            attention(f"dec.{i}.cross")
            norm(f"dec.{i}.ln2")
        feed_forward(f"dec.{i}.ffn")
        norm(f"dec.{i}.ln3")
    if config.pre_ln:
        norm("dec.ln")
    if not config.tie_output:
        shapes["out.w"] = (v, d)
    shapes["out.b"] = (v,)
    return shapes


def init_params(config: TransformerConfig, rng: np.random.Generator, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Xavier-uniform matrices, zero biases, LayerNorm at identity, embeddings N(0, 1/D)
    (so that E[t] sqrt(D) has unit scale)."""
    params = {}
    for name, shape in parameter_shapes(config).items():
        if name.endswith("embed"):
            value = rng.standard_normal(shape) / math.sqrt(config.d_model)
        elif name.endswith("gamma"):
            value = np.ones(shape)
        elif len(shape) == 2:
            bound = math.sqrt(6.0 / (shape[0] + shape[1]))
            value = rng.uniform(-bound, bound, size=shape)
        else:
            value = np.zeros(shape)
        params[name] = value.astype(dtype)
    return params


def _mha(params: dict[str, np.ndarray], prefix: str) -> MHAParams:
    return MHAParams(**{name: params[f"{prefix}.{name}"] for name in ATTENTION_KEYS})


def _norm(params: dict[str, np.ndarray], prefix: str) -> tuple[np.ndarray, np.ndarray]:
    return params[f"{prefix}.gamma"], params[f"{prefix}.beta"]


# --- one residual sublayer: sub(x, f), post-LN or pre-LN ------------------------------------


def _sublayer_forward(
    x: np.ndarray, body: Callable[[np.ndarray], tuple[np.ndarray, Any]], norm: tuple[np.ndarray, np.ndarray],
    pre_ln: bool, dropout: Dropout, name: str,
) -> tuple[np.ndarray, tuple]:
    if pre_ln:  # y = x + drop(f(LN(x)))
        h, norm_cache = layer_norm_forward(x, *norm)
        out, body_cache = body(h)
        out, keep = dropout.apply(name, out)
        return x + out, (pre_ln, norm_cache, body_cache, keep)
    out, body_cache = body(x)  # y = LN(x + drop(f(x)))
    out, keep = dropout.apply(name, out)
    y, norm_cache = layer_norm_forward(x + out, *norm)
    return y, (pre_ln, norm_cache, body_cache, keep)


def _stack_forward(
    params: dict[str, np.ndarray], config: TransformerConfig, dropout: Dropout, x: np.ndarray, side: str,
    sublayers: Callable[[str], list[tuple[str, Callable | None]]],
) -> tuple[np.ndarray, list[tuple], Any]:
    """x through the `config.layers` layers of `side` ("enc" or "dec"), then its final norm
    under pre-LN: (x, each layer's sublayer caches, the final norm's cache). `sublayers(prefix)`
    lists a layer's sublayers in order as (name, body); the k-th is normed by ln{k + 1}, and a
    body of None (a decoder without memory has no cross attention) is skipped, its cache None."""
    layers = []
    for i in range(config.layers):
        caches = []
        for k, (name, body) in enumerate(sublayers(f"{side}.{i}")):
            cache = None
            if body is not None:
                x, cache = _sublayer_forward(x, body, _norm(params, f"{side}.{i}.ln{k + 1}"), config.pre_ln, dropout,
                                             f"{side}.{i}.{name}")
            caches.append(cache)
        layers.append(tuple(caches))
    final = None
    if config.pre_ln:
        x, final = layer_norm_forward(x, *_norm(params, f"{side}.ln"))
    return x, layers, final


def _sublayer_backward(
    dy: np.ndarray, cache: tuple, body_backward: Callable[[np.ndarray, Any], tuple[np.ndarray, Any]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, Any]:
    """(dx, dgamma, dbeta, what body_backward returned beside its input gradient)."""
    pre_ln, norm_cache, body_cache, keep = cache
    if pre_ln:
        # forward: y = x + drop(f(h)), h = LN(x)
        dout = dy if keep is None else dy * keep
        dh, extra = body_backward(dout, body_cache)
        dx_norm, dgamma, dbeta = layer_norm_backward(dh, norm_cache)
        return dy + dx_norm, dgamma, dbeta, extra
    # forward: y = LN(z), z = x + drop(f(x))
    dz, dgamma, dbeta = layer_norm_backward(dy, norm_cache)
    dout = dz if keep is None else dz * keep
    dx_body, extra = body_backward(dout, body_cache)
    return dz + dx_body, dgamma, dbeta, extra


def _store_norm(grads: dict[str, np.ndarray], prefix: str, dgamma: np.ndarray, dbeta: np.ndarray) -> None:
    grads[f"{prefix}.gamma"], grads[f"{prefix}.beta"] = dgamma, dbeta


def _store_attention(grads: dict[str, np.ndarray], prefix: str, params: MHAParams) -> None:
    for name, value in params.items():
        grads[f"{prefix}.{name}"] = value


def _store_feed_forward(grads: dict[str, np.ndarray], prefix: str, ffn: dict[str, np.ndarray]) -> None:
    for name, value in ffn.items():
        grads[f"{prefix}.{name}"] = value


# --- the bodies of the three kinds of sublayer -----------------------------------------------


def _self_attention(params, prefix, config, dropout, *, causal: bool, padding: np.ndarray | None):
    mha = _mha(params, prefix)

    def body(h: np.ndarray):
        keep = dropout.keep(f"{prefix}.weights", (h.shape[0], config.heads, h.shape[1], h.shape[1]))
        return self_attention_forward(
            h, mha, config.heads, is_causal=causal, key_padding_mask=padding,
            dropout_p=dropout.p if keep is not None else 0.0, keep_mask=keep,
        )

    return body


def _cross_attention(params, prefix, config, dropout, memory: np.ndarray, padding: np.ndarray | None):
    mha = _mha(params, prefix)

    def body(h: np.ndarray):
        keep = dropout.keep(f"{prefix}.weights", (h.shape[0], config.heads, h.shape[1], memory.shape[1]))
        return encoder_decoder_attention_forward(
            h, memory, mha, config.heads, memory_key_padding_mask=padding,
            dropout_p=dropout.p if keep is not None else 0.0, keep_mask=keep,
        )

    return body


def _feed_forward(params, prefix):
    def body(h: np.ndarray):
        return feed_forward_forward(h, params[f"{prefix}.w1"], params[f"{prefix}.b1"], params[f"{prefix}.w2"], params[f"{prefix}.b2"])

    return body


def _self_attention_backward(dout, cache):
    g = self_attention_backward(dout, cache)
    return g.dx, g.params


def _cross_attention_backward(dout, cache):
    g = encoder_decoder_attention_backward(dout, cache)
    return g.dx, (g.params, g.dmemory)


# --- the model -----------------------------------------------------------------------------


def _embed(tokens: np.ndarray, table: np.ndarray, dropout: Dropout, name: str) -> tuple[np.ndarray, tuple]:
    """drop(E[tokens] sqrt(D) + PE), (B, L, D); the tokens are checked by `check_tokens`."""
    x, cache = embedding_forward(tokens, table)
    x = x + positional_encoding(tokens.shape[1], table.shape[1], table.dtype)
    x, keep = dropout.apply(name, x)
    return x, (cache, keep)


def _embed_backward(dx: np.ndarray, cache: tuple) -> np.ndarray:
    embedding_cache, keep = cache
    return embedding_backward(dx if keep is None else dx * keep, embedding_cache)


def check_tokens(name: str, tokens: Any, config: TransformerConfig) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{name} must be a (B, L) integer array; got dtype {tokens.dtype} shape {tokens.shape}")
    if tokens.shape[1] > config.max_len:
        raise ValueError(f"{name} has length {tokens.shape[1]} > max_len={config.max_len}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= config.vocab_size):
        raise ValueError(f"{name} holds ids outside [0, {config.vocab_size}): min {tokens.min()}, max {tokens.max()}")
    return tokens


def encode(params: dict[str, np.ndarray], config: TransformerConfig, src: np.ndarray, dropout: Dropout = NO_DROPOUT):
    """The encoder: src (B, S) -> (memory (B, S, D), cache)."""
    padding = src == PAD  # (B, S), True = padding, as torch's key_padding_mask
    x, embed_cache = _embed(src, params["src_embed"], dropout, "src_embed")
    x, layers, final = _stack_forward(params, config, dropout, x, "enc", lambda p: [
        ("attn", _self_attention(params, f"{p}.attn", config, dropout, causal=False, padding=padding)),
        ("ffn", _feed_forward(params, f"{p}.ffn")),
    ])
    return x, (embed_cache, layers, final, padding)


def decode(params: dict[str, np.ndarray], config: TransformerConfig, tgt: np.ndarray, memory: np.ndarray | None,
           src_padding: np.ndarray | None, dropout: Dropout = NO_DROPOUT):
    """The decoder and the output projection: tgt (B, T) -> (logits (B, T, V), cache)."""
    y, embed_cache = _embed(tgt, params["tgt_embed"], dropout, "tgt_embed")
    y, layers, final = _stack_forward(params, config, dropout, y, "dec", lambda p: [
        ("self", _self_attention(params, f"{p}.self", config, dropout, causal=True, padding=None)),
        ("cross", None if memory is None else _cross_attention(params, f"{p}.cross", config, dropout, memory, src_padding)),
        ("ffn", _feed_forward(params, f"{p}.ffn")),
    ])
    weight = params["tgt_embed"] if config.tie_output else params["out.w"]
    logits, out_cache = linear_forward(y, weight, params["out.b"])  # (B, T, V)
    return logits, (embed_cache, layers, final, out_cache)


def forward(params: dict[str, np.ndarray], config: TransformerConfig, src: np.ndarray | None, tgt: np.ndarray,
            dropout: Dropout = NO_DROPOUT) -> tuple[np.ndarray, tuple]:
    """Logits (B, T, V) for target inputs tgt (B, T) (and source src (B, S) unless decoder-only)."""
    tgt = check_tokens("tgt", tgt, config)
    if config.decoder_only:
        if src is not None:
            raise ValueError("a decoder-only model takes no src")
        logits, dec_cache = decode(params, config, tgt, None, None, dropout)
        return logits, (config, None, dec_cache)
    if src is None:
        raise ValueError("an encoder-decoder model needs src")
    src = check_tokens("src", src, config)
    if src.shape[0] != tgt.shape[0]:
        raise ValueError(f"src and tgt must share the batch size; got {src.shape} and {tgt.shape}")
    memory, enc_cache = encode(params, config, src, dropout)
    logits, dec_cache = decode(params, config, tgt, memory, enc_cache[3], dropout)
    return logits, (config, enc_cache, dec_cache)


def backward(dlogits: np.ndarray, cache: tuple) -> dict[str, np.ndarray]:
    """The gradient of sum(logits * dlogits) with respect to every parameter."""
    config, enc_cache, dec_cache = cache
    grads: dict[str, np.ndarray] = {}
    embed_cache, layers, final, out_cache = dec_cache
    # forward: logits = y W_out^T + b_out
    g = linear_backward(dlogits, out_cache)
    grads["out.b"] = g.db
    dy = g.dx
    if config.pre_ln:
        dy, dgamma, dbeta = layer_norm_backward(dy, final)
        _store_norm(grads, "dec.ln", dgamma, dbeta)
    dmemory = None
    for i in reversed(range(config.layers)):
        p = f"dec.{i}"
        c1, c2, c3 = layers[i]
        dy, dgamma, dbeta, ffn = _sublayer_backward(dy, c3, feed_forward_backward)
        _store_norm(grads, f"{p}.ln3", dgamma, dbeta)
        _store_feed_forward(grads, f"{p}.ffn", ffn)
        if c2 is not None:
            dy, dgamma, dbeta, (cross, dmem) = _sublayer_backward(dy, c2, _cross_attention_backward)
            _store_norm(grads, f"{p}.ln2", dgamma, dbeta)
            _store_attention(grads, f"{p}.cross", cross)
            dmemory = dmem if dmemory is None else dmemory + dmem  # every layer reads the memory
        dy, dgamma, dbeta, attn = _sublayer_backward(dy, c1, _self_attention_backward)
        _store_norm(grads, f"{p}.ln1", dgamma, dbeta)
        _store_attention(grads, f"{p}.self", attn)
    dtgt_embed = _embed_backward(dy, embed_cache)
    if config.tie_output:
        dtgt_embed = dtgt_embed + g.dw  # the embedding is also the output weight
    else:
        grads["out.w"] = g.dw
    grads["tgt_embed"] = dtgt_embed
    if enc_cache is not None:
        embed_cache, layers, final, _ = enc_cache
        dx = dmemory
        if config.pre_ln:
            dx, dgamma, dbeta = layer_norm_backward(dx, final)
            _store_norm(grads, "enc.ln", dgamma, dbeta)
        for i in reversed(range(config.layers)):
            p = f"enc.{i}"
            c1, c2 = layers[i]
            dx, dgamma, dbeta, ffn = _sublayer_backward(dx, c2, feed_forward_backward)
            _store_norm(grads, f"{p}.ln2", dgamma, dbeta)
            _store_feed_forward(grads, f"{p}.ffn", ffn)
            dx, dgamma, dbeta, attn = _sublayer_backward(dx, c1, _self_attention_backward)
            _store_norm(grads, f"{p}.ln1", dgamma, dbeta)
            _store_attention(grads, f"{p}.attn", attn)
        grads["src_embed"] = _embed_backward(dx, embed_cache)
    return grads
