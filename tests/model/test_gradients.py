"""One step's gradients of every parameter of the NumPy Transformer against PyTorch autograd
on an equivalent torch model with the same weights and the same dropout masks (float64)."""

import math

import numpy as np
import pytest

from attngrad.model import PAD, TransformerConfig, backward, forward, init_params
from attngrad.model.layers import Dropout, positional_encoding
from attngrad.model.loss import cross_entropy_backward, cross_entropy_forward

from ..conftest import EXACT, assert_all_close

torch = pytest.importorskip("torch")
F = torch.nn.functional

# The issue asks for 1e-10 over a whole model's chain of float64 roundings; the project's
# 1e-12 holds too (the worst parameter is at about 5e-15).
BAR = EXACT


class TorchTransformer:
    """The same model written with torch ops, reading the NumPy model's names and masks."""

    def __init__(self, config: TransformerConfig, params: dict, masks: dict):
        self.c = config
        self.p = {n: torch.tensor(a, requires_grad=True) for n, a in params.items()}
        self.masks = {n: torch.tensor(m) for n, m in masks.items()}

    def drop(self, name, x):
        if name not in self.masks:
            return x
        return x * self.masks[name] / (1 - self.c.dropout)

    def embed(self, tokens, table, name):
        x = self.p[table][tokens] * math.sqrt(self.c.d_model)
        x = x + torch.tensor(positional_encoding(tokens.shape[1], self.c.d_model, np.float64))
        return self.drop(name, x)

    def attention(self, prefix, x, memory, *, causal=False, padding=None):
        p, h = self.p, self.c.heads
        b, lq, d = x.shape
        lk = memory.shape[1]
        split = lambda t, n: t.view(b, n, h, d // h).transpose(1, 2)  # noqa: E731
        q = split(F.linear(x, p[f"{prefix}.w_q"], p[f"{prefix}.b_q"]), lq)
        k = split(F.linear(memory, p[f"{prefix}.w_k"], p[f"{prefix}.b_k"]), lk)
        v = split(F.linear(memory, p[f"{prefix}.w_v"], p[f"{prefix}.b_v"]), lk)
        s = q @ k.transpose(-1, -2) / math.sqrt(d // h)
        if padding is not None:
            s = s.masked_fill(torch.tensor(padding)[:, None, None, :], float("-inf"))
        if causal:
            s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), float("-inf"))
        weights = self.drop(f"{prefix}.weights", torch.softmax(s, dim=-1))
        out = (weights @ v).transpose(1, 2).reshape(b, lq, d)
        return F.linear(out, p[f"{prefix}.w_o"], p[f"{prefix}.b_o"])

    def feed_forward(self, prefix, x):
        p = self.p
        return F.linear(torch.relu(F.linear(x, p[f"{prefix}.w1"], p[f"{prefix}.b1"])), p[f"{prefix}.w2"], p[f"{prefix}.b2"])

    def norm(self, prefix, x):
        return F.layer_norm(x, (self.c.d_model,), self.p[f"{prefix}.gamma"], self.p[f"{prefix}.beta"], eps=1e-5)

    def sublayer(self, x, body, norm, name):
        if self.c.pre_ln:
            return x + self.drop(name, body(self.norm(norm, x)))
        return self.norm(norm, x + self.drop(name, body(x)))

    def __call__(self, src, tgt):
        memory = padding = None
        if src is not None:
            padding = src == PAD
            x = self.embed(torch.tensor(src), "src_embed", "src_embed")
            for i in range(self.c.layers):
                x = self.sublayer(x, lambda h: self.attention(f"enc.{i}.attn", h, h, padding=padding), f"enc.{i}.ln1", f"enc.{i}.attn")
                x = self.sublayer(x, lambda h: self.feed_forward(f"enc.{i}.ffn", h), f"enc.{i}.ln2", f"enc.{i}.ffn")
            memory = self.norm("enc.ln", x) if self.c.pre_ln else x
        y = self.embed(torch.tensor(tgt), "tgt_embed", "tgt_embed")
        for i in range(self.c.layers):
            y = self.sublayer(y, lambda h: self.attention(f"dec.{i}.self", h, h, causal=True), f"dec.{i}.ln1", f"dec.{i}.self")
            if memory is not None:
                y = self.sublayer(y, lambda h: self.attention(f"dec.{i}.cross", h, memory, padding=padding), f"dec.{i}.ln2", f"dec.{i}.cross")
            y = self.sublayer(y, lambda h: self.feed_forward(f"dec.{i}.ffn", h), f"dec.{i}.ln3", f"dec.{i}.ffn")
        if self.c.pre_ln:
            y = self.norm("dec.ln", y)
        weight = self.p["tgt_embed"] if self.c.tie_output else self.p["out.w"]
        return F.linear(y, weight, self.p["out.b"])


def batch(rng, vocab, batch=3, src_len=6, tgt_len=5):
    src = rng.integers(3, vocab, size=(batch, src_len))
    src[0, 4:] = PAD  # padded source
    tgt = rng.integers(3, vocab, size=(batch, tgt_len + 1))
    tgt[1, 3:] = PAD  # padded target: ignored by the loss
    return src, tgt[:, :-1], tgt[:, 1:]


@pytest.mark.parametrize("pre_ln", [False, True])
@pytest.mark.parametrize("tie_output", [True, False])
@pytest.mark.parametrize("decoder_only", [False, True])
def test_one_step_gradients_equal_autograd(pre_ln, tie_output, decoder_only):
    rng = np.random.default_rng(7)
    config = TransformerConfig(vocab_size=11, d_model=12, heads=3, d_ff=20, layers=2, dropout=0.2,
                               pre_ln=pre_ln, tie_output=tie_output, decoder_only=decoder_only)
    params = init_params(config, rng, np.float64)
    for name in params:  # zero biases and unit gammas would hide their gradients' errors
        params[name] = params[name] + 0.1 * rng.standard_normal(params[name].shape)
    src, tgt_in, tgt_out = batch(rng, config.vocab_size)
    if decoder_only:
        src = None
    dropout = Dropout(config.dropout, np.random.default_rng(3))
    logits, cache = forward(params, config, src, tgt_in, dropout)
    loss, loss_cache = cross_entropy_forward(logits, tgt_out, pad=PAD, smoothing=0.1)
    grads = backward(cross_entropy_backward(loss_cache).reshape(logits.shape), cache)

    model = TorchTransformer(config, params, dropout.masks)
    ref_logits = model(src, tgt_in)
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, config.vocab_size), torch.tensor(tgt_out).reshape(-1),
                               ignore_index=PAD, label_smoothing=0.1)
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) <= BAR * abs(ref_loss.item())
    assert len(dropout.masks) == (7 if decoder_only else 18)  # dropout really was on, everywhere
    ref_grads = {n: t.grad for n, t in model.p.items()}
    assert grads.keys() == ref_grads.keys()
    # the key bias's gradient is 0 in exact arithmetic (softmax ignores a per-row shift)
    zeros = {n for n in grads if n.endswith(".b_k")}
    assert_all_close(grads, ref_grads, zeros=zeros, bar=BAR)
