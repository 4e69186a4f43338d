"""What the Triton backend's tests share: the shapes, float64 inputs (`randn`), the math path
written out in PyTorch operators (`math_attention`, which autograd differentiates to any
order), the feature sets (`CASES`, each a `Case`), and where the tests run.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1,
which tests/conftest.py sets before anything imports triton; `interpreted` marks the tests
that need it); on a machine with CUDA, `TRITON_INTERPRET=0 pytest -m gpu` runs the tests
over `DEVICES` compiled, on the GPU.
"""

import math

import pytest

torch = pytest.importorskip("torch")

from attngrad.torch import attention  # noqa: E402
from attngrad.torch.backends import triton as triton_backend  # noqa: E402
from attngrad.torch.op import dropout  # noqa: E402

from ...conftest import op_attention  # noqa: E402

B, H, HKV, LQ, LK, D, DV = 2, 2, 1, 19, 23, 16, 8
DOUBLE = torch.float64
INTERPRETED = triton_backend.interpreting()
# the tests are float64, which Triton compiles for a GPU from 3.9 on (the backend refuses it before)
DEVICES = (["cpu"] if INTERPRETED else []) + ([pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    triton_backend._old_triton(), reason="float64 on a GPU needs Triton 3.9 or later")])]
    if torch.cuda.is_available() and not INTERPRETED else [])
# the tests on CPU tensors: they need the interpreter
interpreted = pytest.mark.skipif(not INTERPRETED, reason="the Triton kernels are compiled (TRITON_INTERPRET=0)")


def randn(*shape, seed, dtype=DOUBLE, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(device)


def math_attention(q, k, v, *, allowed=None, bias=None, softcap=0.0, sinks=None, keep=None, dropout_p=0.0):
    """Softmax attention in PyTorch operators (differentiable to any order): GQA by repeating
    K and V, the cap before the bias, a sink as one more key of value 0, dropout's keep-mask."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[:, None, None].expand(*s.shape[:-1], 1)], -1)
    p = torch.softmax(s, -1)
    if sinks is not None:
        p = p[..., :-1]
    if keep is not None:
        p = p * keep / (1 - dropout_p)
    return p @ v


def _rows(lq, lk, device):
    return torch.arange(lq, device=device)[:, None], torch.arange(lk, device=device)[None, :]


class Case:
    """One configuration: primals (q, k, v and a learned bias or sinks), and the two functions."""

    def __init__(self, device, *, len_q=LQ, len_k=LK, causal=False, mask=False, bias=None, softcap=0.0, sinks=False,
                 window=None, documents=False, padding=False, dropout_p=0.0, d=D, dv=DV):
        self.device = device
        if documents:
            len_k = len_q
        self.q = randn(B, H, len_q, d, seed=1, device=device)
        self.k, self.v = randn(B, HKV, len_k, d, seed=2, device=device), randn(B, HKV, len_k, dv, seed=3, device=device)
        self.extra = None
        if bias is not None:
            self.extra = randn(*bias, seed=4, device=device)
        elif sinks:
            self.extra = randn(H, seed=4, device=device)
        self.options = dict(is_causal=causal, softcap=softcap or None, dropout_p=dropout_p, enable_gqa=True)
        self.softcap, self.dropout_p, self.bias_given, self.sinks = softcap, dropout_p, bias is not None, sinks
        i, j = _rows(len_q, len_k, device)
        allowed = torch.ones(B, 1, len_q, len_k, dtype=torch.bool, device=device)
        offset = 0 if causal in (False, True) else len_k - len_q
        if causal:
            allowed &= j <= i + offset
        if mask:
            self.mask = randn(B, 1, len_q, len_k, seed=5, device=device) > -0.7
            self.mask[..., 0] = True  # every row keeps a key
            if mask == "holes":  # kept whole but for a few tiles' entries: the others need no masking
                self.mask[:] = True
                self.mask[0, :, 3:12, 5:7] = False
                self.mask[:, :, 20:24, 20] = False
            self.options["attn_mask"] = self.mask
            allowed &= self.mask
        if window is not None:
            self.options["window"] = window
            allowed &= j >= i + offset - window[0]
        if documents:
            ids = torch.tensor([0] * 5 + [1] * 6 + [2] * (len_q - 11), device=device)
            self.options["document_ids"] = ids
            allowed &= ids[:, None] == ids[None, :]
        if padding:
            lengths = torch.tensor([len_k - 3, len_k - 6], device=device)  # every document keeps a key
            self.options["key_padding"] = lengths
            allowed &= (j < lengths[:, None, None, None])
        self.allowed = allowed
        self.keep = None
        if dropout_p:
            self.seed = 20261125
            self.keep = dropout.keep_scale_torch(torch.empty(B, H, len_q, len_k, dtype=DOUBLE), self.seed, 0,
                                                 dropout_p).to(device) > 0

    @property
    def primals(self):
        return (self.q, self.k, self.v) + (() if self.extra is None else (self.extra,))

    def ours(self, q, k, v, extra=None):
        options = dict(self.options)
        if self.bias_given:
            options["attn_bias"] = extra
        if self.sinks:
            options["sinks"] = extra
        if self.dropout_p:  # the op, whose seed is given
            causal = {False: None, True: 0, "bottom_right": k.shape[2] - q.shape[2]}[options["is_causal"]]
            return op_attention(q, k, v, bias=extra, causal=causal, seed=torch.tensor(self.seed),
                                dropout_p=self.dropout_p)
        return attention(q, k, v, **options)

    def theirs(self, q, k, v, extra=None):
        return math_attention(q, k, v, allowed=self.allowed, bias=extra if self.bias_given else None,
                              softcap=self.softcap, sinks=extra if self.sinks else None, keep=self.keep,
                              dropout_p=self.dropout_p)


# Each case puts several features together (the interpreter runs about 10^4 Triton
# operations a second). `blocks`: the interpreter's tile, 16 (several blocks per row and
# column, partly skipped) or 32 (one block: the fast cases); `slice`: the columns of the head
# width its products take at a time (0: all), here 16 of d = 24 and dv = 20 (padded to 32
# and 32), so every product over the width runs its loop of slices, the last one partial.
CASES = {
    "gqa": dict(blocks=32),
    "causal-mask-bias": dict(causal=True, mask=True, bias=(LQ, LK), blocks=16),
    "bottom-right-softcap-bias": dict(causal="bottom_right", len_q=11, softcap=2.0, bias=(B, H, 11, LK), blocks=32),
    "window-sinks": dict(causal=True, window=(5, None), len_q=LK, sinks=True, blocks=32),
    "documents-padding": dict(documents=True, padding=True, blocks=16),
    "dropout-per-key-bias": dict(dropout_p=0.3, causal=True, bias=(B, 1, 1, LK), blocks=32),
    "sliced-heads": dict(d=24, dv=20, causal="bottom_right", len_q=11, softcap=2.0, bias=(1, H, 1, LK), blocks=32,
                         slice=16),
    # tiles that need no masking (`block_map.unmasked_tiles`), walked in their own loop: of
    # the whole tiles (query blocks 0 and 1 of 3, key blocks 0 and 1 of 3), the diagonal (15)
    # and the mask's holes leave (1, 0) unmasked, (0, 0) in the second batch entry alone
    "interior-bias-softcap-holes": dict(causal="bottom_right", len_q=33, len_k=48, softcap=2.0, bias=(B, H, 33, 48),
                                        mask="holes", blocks=16),
}


def case_of(name, tiles_of, device="cpu"):
    options = dict(CASES[name])
    tiles_of(options.pop("blocks"), options.pop("slice", 0))
    return Case(device, **options)


def zero_gradients(name):
    """The derivatives that are 0 in exact arithmetic: a bias constant along the keys (softmax
    ignores a row's shift) has none; both sides hold rounding noise there."""
    return ("dextra", "gg_extra", "hvp_extra", "rof_extra", "rof_textra") if CASES[name].get("bias", (1,))[-1] == 1 \
        else ()
