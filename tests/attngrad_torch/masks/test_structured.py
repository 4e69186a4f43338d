"""Structured masks (key padding, sliding windows, packed documents) and soft-capping
against PyTorch given the same mask written out densely, on both implementations, in every
derivative: the output, the gradients of q, k, v and the bias, the JVP, the double backward
and forward-over-reverse Hessian-vector products.

The dense masks here are built from the definitions, coordinate by coordinate, not by
`structured`; PyTorch's math kernel takes them as a float mask with -inf, and gives 0 (and
zero derivatives) on a row with no key left, as attngrad does. A soft-capped call is checked
against autograd of its formula, S = c tanh(scale Q K^T / c) + bias, masked the same way.
"""

import math
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from attngrad.torch import attention, forget_masks, list_backends, use_backend  # noqa: E402
from attngrad.torch.backends.cpu_tiles import native  # noqa: E402
from attngrad.torch.backends.torch_ops import first_order  # noqa: E402
from attngrad.torch.masks import version_cache as kept  # noqa: E402
from attngrad.torch.masks.structured import _structure, structure  # noqa: E402

from ...conftest import assert_all_close  # noqa: E402
from ..conftest import make_call  # noqa: E402

B, H, HKV, L, D, DV = 2, 4, 2, 23, 8, 6
DOUBLE = torch.float64


@pytest.fixture(autouse=True)
def small_tiles(many_blocks, monkeypatch, tuned):
    """`many_blocks`'s small tiles, narrower still, in both backends, so that bands
    and documents cross many tile boundaries and whole tiles are skipped."""
    tuned(first_order.TILING, higher_min_rows=3)
    tuned(native.TILING, block_keys=8, narrow_block_keys=4, narrow_band=6, double_tile=24)


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DOUBLE)


def transposed(b, h, length, e, seed):
    """(B, H, L, E) as models lay it out: (B, L, H, E) storage, transposed."""
    return randn(b, length, h, e, seed=seed).transpose(1, 2)


def dense_keep(batch, len_q, len_k, *, causal=None, key_padding=None, window=None, document_ids=None, cu_seqlens=None):
    """(B, 1, Lq, Lk) boolean: which keys each query sees, entry by entry from the definitions."""
    keep = torch.ones(batch, 1, len_q, len_k, dtype=torch.bool)
    offset = 0 if causal in (None, False, True, "top_left") else len_k - len_q
    for b in range(batch):
        for i in range(len_q):
            for j in range(len_k):
                ok = True
                if causal:
                    ok &= j <= i + offset
                if key_padding is not None:
                    if key_padding.dtype == torch.bool:
                        ok &= not bool(key_padding[b if key_padding.dim() > 1 else 0, j])
                    else:
                        ok &= j < int(key_padding.reshape(-1)[b if key_padding.numel() > 1 else 0])
                if window is not None:
                    left, right = window
                    ok &= (left is None or j >= i + offset - left) and (right is None or j <= i + offset + right)
                if document_ids is not None:
                    ids = document_ids[b if document_ids.dim() > 1 and document_ids.shape[0] > 1 else 0].reshape(-1)
                    ok &= bool(ids[i] == ids[j])
                if cu_seqlens is not None:
                    doc = [int((cu_seqlens <= x).sum()) for x in (i, j)]
                    ok &= doc[0] == doc[1]
                keep[b, 0, i, j] = ok
    return keep


class Case:
    """One call as two functions of (q, k, v[, bias]): attngrad with the structured masks,
    and the math kernel with the same mask written out."""

    def __init__(self, len_q=L, len_k=L, gqa=False, bias_shape=None, mask=False, is_causal=False, softcap=None,
                 **structured):
        kv = HKV if gqa else H
        self.q, self.k, self.v = (transposed(B, h, n, e, seed=s) for s, (h, n, e) in
                                  enumerate(((H, len_q, D), (kv, len_k, D), (kv, len_k, DV))))
        self.bias = None if bias_shape is None else randn(*bias_shape, seed=9)
        self.mask = (torch.rand(B, 1, len_q, len_k, generator=torch.Generator().manual_seed(3)) > 0.2) if mask else None
        self.is_causal, self.gqa, self.structured, self.softcap = is_causal, gqa, structured, softcap
        keep = dense_keep(B, len_q, len_k, causal=is_causal, **structured)
        self.keep = keep if self.mask is None else keep & self.mask

    @property
    def primals(self):
        return (self.q, self.k, self.v) + (() if self.bias is None else (self.bias,))

    def ours(self, q, k, v, bias=None):
        return attention(q, k, v, attn_mask=self.mask, attn_bias=bias, is_causal=self.is_causal, enable_gqa=self.gqa,
                         softcap=self.softcap, **self.structured)

    def theirs(self, q, k, v, bias=None):
        if self.softcap is not None:
            return self.capped_formula(q, k, v, bias)
        additive = (bias if bias is not None else q.new_zeros(())).masked_fill(~self.keep, -math.inf)
        with sdpa_kernel(SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=additive, enable_gqa=self.gqa)


    def capped_formula(self, q, k, v, bias):
        """softmax(c tanh(scale Q K^T / c) + bias, masked) V by autograd's own ops; a row with
        no key left gives 0."""
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        a = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        s = self.softcap * torch.tanh(a / self.softcap) + (bias if bias is not None else 0.0)
        empty = ~self.keep.any(dim=-1, keepdim=True)
        s = s.masked_fill(~self.keep, -math.inf).masked_fill(empty, 0.0)
        return torch.softmax(s, dim=-1).masked_fill(empty, 0.0) @ v


def _ids(*runs):
    """(len(runs), L) document ids from run lengths per batch entry."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)) * 7 % 5, torch.tensor(r)) for r in runs])


CASES = {
    "lengths": dict(len_q=17, key_padding=torch.tensor([L, 9])),
    "right-padding": dict(len_q=17, key_padding=torch.arange(L)[None, :] >= torch.tensor([[20], [5]])),
    "left-padding": dict(key_padding=torch.arange(L)[None, :] < torch.tensor([[3], [11]]), bias_shape=(H, L, L)),
    "padding-with-holes": dict(key_padding=torch.rand(B, L, generator=torch.Generator().manual_seed(4)) > 0.6,
                               mask=True),
    "no-key-left": dict(len_q=17, key_padding=torch.tensor([0, 4]), is_causal=True, bias_shape=(B, 1, 17, L)),
    "causal-window": dict(window=(4, None), is_causal=True, bias_shape=(H, L, L)),
    "bottom-right-window": dict(len_q=9, window=(3, None), is_causal="bottom_right", gqa=True),
    "symmetric-window": dict(len_q=17, window=(3, 2), bias_shape=(1, H, 1, L)),
    "documents": dict(document_ids=_ids([5, 9, 1, 8], [12, 11]), bias_shape=(H, L, L)),
    "cu-seqlens": dict(cu_seqlens=torch.tensor([0, 6, 7, 15, L]), is_causal=True, gqa=True),
    "everything": dict(key_padding=torch.tensor([19, L]), window=(6, None), document_ids=_ids([10, 13], [4, 19]),
                       mask=True, is_causal=True, gqa=True, bias_shape=(B, 1, L, L)),
    "softcap": dict(len_q=17, softcap=0.8, bias_shape=(H, 17, L)),
    "softcap-everything": dict(softcap=1.5, key_padding=torch.tensor([19, L]), window=(6, None), mask=True,
                               document_ids=_ids([10, 13], [4, 19]), is_causal=True, gqa=True, bias_shape=(B, 1, L, L)),
}


def gradients(fn, primals, dout):
    leaves = [p.detach().clone().requires_grad_() for p in primals]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, dout))


NAMES = ("out", "q", "k", "v", "bias")


@pytest.mark.parametrize("name", CASES)
def test_output_and_gradients_match_the_math_kernel(backend, name):
    case = Case(**CASES[name])
    dout = randn(*case.q.shape[:-1], DV, seed=5)
    ours, theirs = gradients(case.ours, case.primals, dout), gradients(case.theirs, case.primals, dout)
    assert not any(t.isnan().any() for t in ours)
    assert_all_close(dict(zip(NAMES, ours)), dict(zip(NAMES, theirs)))


@pytest.mark.parametrize("name", ["no-key-left", "causal-window", "documents", "everything", "softcap",
                                  "softcap-everything"])
def test_jvp_matches_the_math_kernel(backend, name):
    case = Case(**CASES[name])
    tangents = tuple(randn(*p.shape, seed=20 + i) for i, p in enumerate(case.primals))
    out, out_t = torch.func.jvp(case.ours, case.primals, tangents)
    ref, ref_t = torch.func.jvp(case.theirs, case.primals, tangents)
    assert_all_close(dict(out=out, tangent=out_t), dict(out=ref, tangent=ref_t))


def double_backward(fn, primals, dout, cotangents):
    leaves = [p.detach().clone().requires_grad_() for p in primals]
    dout = dout.clone().requires_grad_()
    grads = torch.autograd.grad(fn(*leaves), leaves, dout, create_graph=True)
    inner = sum((g * c).sum() for g, c in zip(grads, cotangents))
    return torch.autograd.grad(inner, leaves + [dout])


@pytest.mark.parametrize("name", ["no-key-left", "symmetric-window", "documents", "everything", "softcap",
                                  "softcap-everything"])
def test_double_backward_matches_the_math_kernel(backend, name):
    case = Case(**CASES[name])
    dout = randn(*case.q.shape[:-1], DV, seed=30)
    cotangents = tuple(randn(*p.shape, seed=40 + i) for i, p in enumerate(case.primals))
    ours, theirs = (double_backward(fn, case.primals, dout, cotangents) for fn in (case.ours, case.theirs))
    names = [*NAMES[1:1 + len(case.primals)], "dout"]
    assert_all_close(dict(zip(names, ours)), dict(zip(names, theirs)))


@pytest.mark.parametrize("name", ["lengths", "bottom-right-window", "cu-seqlens", "everything", "softcap",
                                  "softcap-everything"])
def test_hessian_vector_products_match_the_math_kernel(backend, name):
    """Forward over reverse: the JVP of the gradient, through the backward's JVP."""
    case = Case(**CASES[name])
    ours, theirs = (hessian_vector_products(fn, case.primals) for fn in (case.ours, case.theirs))
    names = NAMES[1:1 + len(case.primals)]
    assert_all_close(dict(zip(names, ours)), dict(zip(names, theirs)))


def hessian_vector_products(fn, primals):
    """The JVP of <dO, fn>'s gradient, for fixed random dO and tangents."""
    dout = randn(*primals[0].shape[:-1], DV, seed=50)
    tangents = tuple(randn(*p.shape, seed=60 + i) for i, p in enumerate(primals))
    return torch.func.jvp(lambda *p: torch.func.vjp(fn, *p)[1](dout), primals, tangents)[1]


@pytest.mark.skipif(not native.available(), reason="the compiled tiles do not run here")
@pytest.mark.parametrize("name", ["bottom-right-window", "everything"])
def test_second_order_with_the_key_side_in_place(monkeypatch, name, tuned):
    """The whole-row passes' other layout, the key side read and written in place (beyond
    `Tiling.transposed_keys`; csrc/whole_rows.h, KeySide), on key ranges that start past key 0:
    the double backward and the Hessian-vector products."""
    tuned(native.TILING, transposed_keys=0)
    case = Case(**CASES[name])
    dout = randn(*case.q.shape[:-1], DV, seed=30)
    cotangents = tuple(randn(*p.shape, seed=40 + i) for i, p in enumerate(case.primals))
    with use_backend("tiles"):
        ours = (*double_backward(case.ours, case.primals, dout, cotangents),
                *hessian_vector_products(case.ours, case.primals))
    theirs = (*double_backward(case.theirs, case.primals, dout, cotangents),
              *hessian_vector_products(case.theirs, case.primals))
    names = [f"{n} {kind}" for kind in ("double backward", "hvp")
             for n in (*NAMES[1:1 + len(case.primals)], "dout")[: len(case.primals) + (kind != "hvp")]]
    assert_all_close(dict(zip(names, ours)), dict(zip(names, theirs)))


@st.composite
def structured_calls(draw):
    """A random call: lengths, a structured mask or two, causal or not, GQA or not, capped or not."""
    len_q = draw(st.integers(1, 19))
    documents = draw(st.booleans())
    len_k = len_q if documents else draw(st.integers(1, 19))
    options = dict(len_q=len_q, len_k=len_k, gqa=draw(st.booleans()),
                   is_causal=draw(st.sampled_from([False, True, "bottom_right"])))
    if draw(st.booleans()):
        lengths = draw(st.lists(st.integers(0, len_k), min_size=B, max_size=B))
        options["key_padding"] = torch.tensor(lengths)
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.integers(0, 6))
        options["window"] = (draw(side), draw(side))
    if documents:
        cuts = sorted(draw(st.lists(st.integers(1, len_q - 1), max_size=4, unique=True))) if len_q > 1 else []
        options["cu_seqlens"] = torch.tensor([0, *cuts, len_q])
    if draw(st.booleans()):
        options["bias_shape"] = draw(st.sampled_from([(H, len_q, len_k), (B, 1, 1, len_k), (len_q, 1)]))
    options["softcap"] = draw(st.sampled_from([None, 0.3, 2.0, 50.0]))
    return options


# the CPU backends: Triton's interpreter (seconds a call) has its structures in test_passes
@settings(max_examples=40, deadline=None)
@given(structured_calls(), st.sampled_from([b.name for b in list_backends() if b.available and b.name != "triton"]))
def test_random_structures_match_the_math_kernel(options, implementation_name):
    case = Case(**options)
    dout = randn(*case.q.shape[:-1], DV, seed=7)
    with use_backend(implementation_name):
        ours = gradients(case.ours, case.primals, dout)
        tangents = tuple(randn(*p.shape, seed=8 + i) for i, p in enumerate(case.primals))
        ours_t = torch.func.jvp(case.ours, case.primals, tangents)[1]
    theirs = gradients(case.theirs, case.primals, dout)
    theirs_t = torch.func.jvp(case.theirs, case.primals, tangents)[1]
    # a bias constant along the keys shifts whole rows, which softmax ignores: its gradient is
    # 0 in exact arithmetic, and both sides hold rounding noise
    zeros = {"bias"} if options.get("bias_shape", (1,))[-1] == 1 else set()
    assert_all_close(dict(zip(NAMES, ours), tangent=ours_t), dict(zip(NAMES, theirs), tangent=theirs_t),
                     zeros=zeros, floor_fraction=1e-3)


def test_bounds_are_the_intervals_of_the_dense_mask():
    """structure() against the dense definitions, where every row's keys are one interval."""
    for name in ("lengths", "right-padding", "left-padding", "causal-window", "symmetric-window", "documents",
                 "cu-seqlens", "everything"):
        spec = {k: v for k, v in CASES[name].items() if k not in ("gqa", "bias_shape", "mask")}
        len_q, is_causal = spec.pop("len_q", L), spec.pop("is_causal", False)
        causal = None if not is_causal else (0 if is_causal is True else L - len_q)
        bounds, keep = structure((B,), len_q, L, causal, torch.device("cpu"), **spec)
        assert keep is None and bounds.shape[1:] == (len_q, 2) and bounds.dtype == torch.int64
        dense = dense_keep(B, len_q, L, causal=is_causal, **spec)[:, 0]
        key = torch.arange(L)
        from_bounds = (key >= bounds[..., :1]) & (key < bounds[..., 1:])
        assert torch.equal(from_bounds.expand_as(dense), dense), name


def test_no_dense_mask_is_built(counting_backend):
    """Padding given as lengths, a window and documents reach the backend as bounds alone."""
    q = randn(B, H, L, D, seed=1)
    attention(q, q, q, key_padding=torch.tensor([5, L]), window=(3, None), cu_seqlens=torch.tensor([0, 10, L]),
              is_causal=True)
    [(pass_name, call, _)] = counting_backend.calls
    assert pass_name == "forward" and call.mask is None and call.bounds.shape == (B, L, 2)


@pytest.mark.parametrize("kwargs,exc,fragment", [
    (dict(window=(3,)), ValueError, "window must be"),
    (dict(window=(-1, 2)), ValueError, "window must be"),
    (dict(key_padding=torch.tensor([3, 40])), ValueError, "lengths must lie in"),
    (dict(key_padding=torch.ones(3, L, dtype=torch.bool)), ValueError, "key_padding of shape"),
    (dict(key_padding=torch.ones(B, L)), TypeError, "key_padding must be boolean"),
    (dict(document_ids=torch.tensor([[0] * 5 + [1] * 5 + [0] * 13] * B)), ValueError, "contiguous"),
    (dict(document_ids=torch.zeros(B, L - 1, dtype=torch.int64)), ValueError, "document_ids of shape"),
    (dict(cu_seqlens=torch.tensor([0, 5, 4, L])), ValueError, "cu_seqlens must rise"),
    (dict(cu_seqlens=torch.tensor([0, 5])), ValueError, "cu_seqlens must rise"),
    (dict(cu_seqlens=torch.tensor([0, L]), document_ids=torch.zeros(B, L, dtype=torch.int64)), ValueError, "either"),
    (dict(softcap=0.0), ValueError, "softcap must be a positive"),
    (dict(softcap=float("inf")), ValueError, "softcap must be a positive"),
    (dict(softcap=True), ValueError, "softcap must be a positive"),
    (dict(key_padding=[3, 5]), TypeError, "key_padding must be a torch.Tensor"),
    (dict(document_ids=[[0] * L] * B), TypeError, "document_ids must be a torch.Tensor"),
    (dict(cu_seqlens=[0, L]), TypeError, "cu_seqlens must be a torch.Tensor"),
    (dict(attn_mask=[[True] * L] * L), TypeError, "attn_mask must be a torch.Tensor"),
    (dict(attn_bias=[[0.0] * L] * L), TypeError, "attn_bias must be a torch.Tensor"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p must be a number"),
    (dict(scale="x"), TypeError, "scale must be a number"),
])
def test_bad_structures_raise_clearly(kwargs, exc, fragment):
    q = randn(B, H, L, D, seed=1)
    with pytest.raises(exc, match=fragment):
        attention(q, q, q, **kwargs)


def test_options_take_any_real_number():
    """NumPy's float32 is a number too (it was refused as a cap while NumPy's float64, a
    float subclass, was taken)."""
    q = randn(B, H, L, D, seed=1)
    expected = attention(q, q, q, softcap=2.0, scale=0.5)
    assert torch.equal(attention(q, q, q, softcap=np.float32(2.0), scale=np.float32(0.5)), expected)


@pytest.mark.parametrize("implementation", ["tiles", "torch-ops"])
def test_sides_and_diagonals_past_every_key_are_the_open_ones(implementation):
    """A window side or a causal diagonal as large as int64 allows sees what None or no
    causal mask sees (the bounds are clamped before int64 arithmetic could wrap them);
    a diagonal below every row sees nothing."""
    q, k = randn(B, H, 9, D, seed=1), randn(B, H, 13, D, seed=2)
    huge = sys.maxsize
    with use_backend(implementation):
        for window, open_window in (((2, huge), (2, None)), ((huge, 1), (None, 1)), ((10**30, 0), (None, 0))):
            assert torch.equal(attention(q, k, k, window=window), attention(q, k, k, window=open_window)), window
        plain = dict(out=attention(q, k, k))  # a causal pass sums in its own order: equal to 1e-12
        assert_all_close(dict(out=attention(q, k, k, is_causal=huge)), plain)
        assert_all_close(dict(out=attention(q, k, k, is_causal=2**70)), plain)
        assert not attention(q, k, k, is_causal=-(2**70)).any()
        # the diagonal also aligns the window, unclamped: 10^20 - (10^20 - 1) leaves row i keys
        # i + 1 onwards, and 4 - 2 leaves a 3 x 2 call's rows none
        i, j = torch.arange(9)[:, None], torch.arange(13)[None]
        far = attention(q, k, k, is_causal=10**20, window=(10**20 - 1, None))
        assert_all_close(dict(out=far), dict(out=attention(q, k, k, attn_mask=j >= i + 1)))
        assert not attention(q[:, :, :3], k[:, :, :2], k[:, :, :2], is_causal=4, window=(2, None)).any()


@pytest.mark.parametrize("kwargs", [
    dict(window=(3, None), is_causal=True),
    dict(key_padding=torch.tensor([5, L], device="meta")),
    dict(key_padding=torch.zeros(B, L, dtype=torch.bool, device="meta")),
    dict(document_ids=torch.zeros(B, L, dtype=torch.int64, device="meta")),
    dict(cu_seqlens=torch.tensor([0, 10, L], device="meta")),
    dict(mask_mod=lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (h == 0)),
    dict(attn_mask=torch.ones(L, L, dtype=torch.bool, device="meta"), attn_bias=torch.zeros(L, L, device="meta")),
], ids=["window", "lengths", "padding", "documents", "cu_seqlens", "mask_mod", "mask-bias"])
def test_meta_tensors_take_every_mask_by_its_shapes(kwargs):
    """On the meta device (a model built without memory, shapes worked out) no value can be
    read: the masks' checks and choices that read values are the real call's, and the
    output and gradients come out with their shapes."""
    q = torch.empty(B, H, L, D, device="meta", requires_grad=True)
    kv = torch.empty(B, H, L, D, device="meta", requires_grad=True)
    out = attention(q, kv, kv, **kwargs)
    dq, dkv = torch.autograd.grad(out, (q, kv), torch.empty_like(out))
    assert out.device.type == dq.device.type == "meta" and out.shape == dq.shape == dkv.shape == (B, H, L, D)


def test_documents_need_as_many_queries_as_keys():
    q, k = randn(B, H, 5, D, seed=1), randn(B, H, 7, D, seed=2)
    with pytest.raises(ValueError, match="as many queries as keys"):
        attention(q, k, k, cu_seqlens=torch.tensor([0, 3, 7]))


def test_compiles_with_fullgraph():
    """Under torch.compile(fullgraph=True) the structures build their bounds without reading
    values (boolean padding becomes the mask), and the results are eager's, backward too."""
    q, k, v = (randn(B, H, L, D, seed=s).requires_grad_() for s in (1, 2, 3))
    padding = torch.arange(L)[None, :] >= torch.tensor([[20], [9]])

    def fn(q, k, v):
        return attention(q, k, v, key_padding=padding, window=(5, None), is_causal=True,
                         cu_seqlens=torch.tensor([0, 8, L]), softcap=1.5)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    dout = randn(B, H, L, D, seed=4)
    ours = (compiled(q, k, v), *torch.autograd.grad(compiled(q, k, v), (q, k, v), dout))
    eager = (fn(q, k, v), *torch.autograd.grad(fn(q, k, v), (q, k, v), dout))
    assert_all_close(dict(zip(NAMES, ours)), dict(zip(NAMES, eager)))


def test_vmap_folds_the_bounds_into_the_batch(backend):
    """torch.func.vmap (as in jacrev and hessian) over a call with per-entry bounds runs the
    op once on the folded batch: its results are the per-slice calls'."""
    q = randn(3, B, H, L, D, seed=1)
    k, v = randn(B, H, L, D, seed=2), randn(B, H, L, D, seed=3)
    lengths = torch.tensor([L, 9])

    def call(q):
        return attention(q, k, v, key_padding=lengths, window=(4, 2), softcap=2.0)

    batched = torch.func.vmap(call)(q)
    assert_all_close({"out": batched}, {"out": torch.stack([call(x) for x in q])})
    grads = torch.func.vmap(torch.func.grad(lambda q: call(q).square().sum()))(q)
    looped = torch.stack([torch.func.grad(lambda q: call(q).square().sum())(x) for x in q])
    assert_all_close({"dq": grads}, {"dq": looped})


def test_a_structure_is_kept_while_its_tensors_live_unchanged():
    """A model's layers share their masks: the second call with the same window, lengths or
    document ids gets the same bounds tensor (whose block maps the tiles keep), an in-place
    write to a source gets bounds of its new values, and so does a source of the same
    values in other memory."""
    cpu = torch.device("cpu")
    lengths = torch.tensor([L, 9])
    first, _ = structure((B,), L, L, 0, cpu, key_padding=lengths, window=(4, None))
    again, _ = structure((B,), L, L, 0, cpu, key_padding=lengths, window=[4, None])
    assert again is first
    assert structure((B,), L, L, 0, cpu, key_padding=lengths, window=(5, None))[0] is not first
    assert structure((B,), L, L, None, cpu, key_padding=lengths, window=(4, None))[0] is not first
    lengths[1] = 12  # in place: the version counter moves
    written, _ = structure((B,), L, L, 0, cpu, key_padding=lengths, window=(4, None))
    made = _structure((B,), L, L, 0, cpu, dict(key_padding=lengths, window=(4, None), document_ids=None,
                                                  cu_seqlens=None)).bounds
    assert written is not first and torch.equal(written, made) and not torch.equal(first, made)
    copied, _ = structure((B,), L, L, 0, cpu, key_padding=lengths.clone(), window=(4, None))
    assert copied is not written and torch.equal(copied, written)
    ids = torch.arange(L) // 5
    assert structure((1,), L, L, None, cpu, document_ids=ids)[0] is structure((1,), L, L, None, cpu,
                                                                              document_ids=ids)[0]
    entries = len(kept._VALUES)
    del ids  # freed: its entry goes with it
    assert len(kept._VALUES) == entries - 1


def test_forget_masks_sees_a_write_past_the_version_counter():
    """A write through .data (or to NumPy's shared memory) leaves the version counter, so
    the bounds made from the old lengths answer, as autograd too would not see it; after
    forget_masks() the call reads the new lengths."""
    q = randn(B, H, L, D, seed=1)
    lengths = torch.tensor([L, 9])
    before = attention(q, q, q, key_padding=lengths)
    lengths.data[1] = 4
    assert torch.equal(attention(q, q, q, key_padding=lengths), before)  # the documented limit
    forget_masks()
    after = attention(q, q, q, key_padding=lengths)
    assert torch.equal(after, attention(q, q, q, key_padding=torch.tensor([L, 4])))
    assert not torch.equal(after, before)
    # a mask function's evaluation (here one with holes, kept per block), kept while what it
    # reads keeps its version counter
    limit = torch.tensor(L)
    q4 = randn(1, H, L, D, seed=2)

    def even_keys_below_the_limit(b, h, q_idx, kv_idx):
        return (kv_idx % 2 == 0) & (kv_idx < limit)

    before = attention(q4, q4, q4, mask_mod=even_keys_below_the_limit)
    limit.data.fill_(6)
    forget_masks()
    after = attention(q4, q4, q4, mask_mod=even_keys_below_the_limit)
    keys = torch.arange(L)
    assert_all_close(dict(out=after), dict(out=attention(q4, q4, q4, attn_mask=(keys % 2 == 0) & (keys < 6))))
    assert not torch.equal(after, before)


def test_a_structure_made_where_it_cannot_serve_later_calls_is_not_kept():
    """Bounds made under inference mode would be inference tensors, which a later training
    call cannot save for its backward; under a fake-tensor mode, fakes: neither is kept, and
    training after them runs (and equals the math kernel's gradients)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cpu = torch.device("cpu")
    with torch.inference_mode():
        made = structure((1,), L, L, 0, cpu, window=(3, None))[0]
    assert made.is_inference() and structure((1,), L, L, 0, cpu, window=(3, None))[0] is not made
    with FakeTensorMode():
        fake = structure((1,), L, L, 0, cpu, window=(3, None))[0]
    assert structure((1,), L, L, 0, cpu, window=(3, None))[0] is not fake
    q, k, v = (randn(B, H, L, D, seed=s) for s in (1, 2, 3))
    with torch.inference_mode():  # inference tensors as bounds, masks and biases: made anew, never kept
        attention(q, k, v, is_causal=True, window=(3, None))
        mask, bias = torch.rand(L, L) > 0.3, torch.randn(L, L, dtype=DOUBLE)
        for _ in range(2):
            assert_all_close({"masked": attention(q, k, v, attn_mask=mask, attn_bias=bias)},
                             {"masked": first_order.attention_forward(make_call(q, k, v, mask, bias, scale=D ** -0.5))[0]})
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dout = randn(B, H, L, D, seed=4)
    grads = torch.autograd.grad(attention(*leaves, is_causal=True, window=(3, None)), leaves, dout)
    dense = torch.ones(L, L, dtype=torch.bool).tril().triu(-3)
    math_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        expected = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(
            *math_leaves, attn_mask=dense), math_leaves, dout)
    assert_all_close(dict(zip(("dq", "dk", "dv"), grads)), dict(zip(("dq", "dk", "dv"), expected)))
