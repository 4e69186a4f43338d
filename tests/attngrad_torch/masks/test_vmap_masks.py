"""torch.func.vmap over the structured masks (key_padding, document_ids, cu_seqlens): a batch
of masks, with q, k, v batched beside them or not, gives what a Python loop over the batch
gives, bit for bit, in the output, the gradients (vjp and grad inside vmap) and the JVP.

Their bounds are made by ops of rows whose batching rule folds the vmapped axis into the
rows (`structured`, `layout.rows_rule`); before those, reading the masks' values under
vmap ended in PyTorch's data-dependent error.
"""

import functools

import pytest

torch = pytest.importorskip("torch")

from attngrad.torch import attention  # noqa: E402
from attngrad.torch.masks import structured  # noqa: E402

from ...conftest import assert_all_close  # noqa: E402

N, B, H, LQ, LK, D, DV = 3, 2, 4, 11, 17, 8, 6  # N: the vmapped axis
DOUBLE = torch.float64


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DOUBLE)


def padding_with_holes():
    """(N, B, Lk) True = padding: slice 0 pads the tail (an interval of kept keys), slices 1
    and 2 also pad single keys inside the rows, so the fold makes one keep-mask for all."""
    padding = torch.zeros(N, B, LK, dtype=torch.bool)
    padding[:, :, 13:] = True
    padding[1, 0, 4] = padding[2, 1, 7] = padding[2, 1, 9] = True
    return padding


def padding_runs():
    """(N, B, Lk): every row's kept keys one run, padded on the left, the right or both."""
    padding = torch.zeros(N, B, LK, dtype=torch.bool)
    padding[0, 0, 12:] = padding[1, 0, :5] = padding[2, 1, :3] = padding[2, 1, 10:] = True
    padding[1, 1] = True  # an entry with no key left: zeros
    return padding


def document_ids():
    """(N, B, L) packed documents, different in every slice and entry."""
    cuts = torch.randint(0, 4, (N, B, LK), generator=torch.Generator().manual_seed(7))
    return cuts.sort(dim=-1).values


# name: (the mask's keyword, its (N, ...) values, the other options, Lq)
CASES = {
    "padding-holes": ("key_padding", padding_with_holes, dict(window=(4, 2)), LQ),
    "padding-runs": ("key_padding", padding_runs, dict(is_causal="bottom_right"), LQ),
    "lengths": ("key_padding", lambda: torch.tensor([[LK, 9], [0, 5], [12, LK]]), dict(window=(3, None)), LQ),
    "document_ids": ("document_ids", document_ids, dict(is_causal=True), LK),
    "cu_seqlens": ("cu_seqlens", lambda: torch.tensor([[0, 5, 9, LK], [0, 1, 16, LK], [0, 8, LK, LK]]),
                   dict(window=(None, 2)), LK),
}


def inputs(len_q):
    """(N, B, H, L, E) q, k, v, an upstream gradient and tangents, all random."""
    q, k, v = randn(N, B, H, len_q, D, seed=1), randn(N, B, H, LK, D, seed=2), randn(N, B, H, LK, DV, seed=3)
    dout = randn(N, B, H, len_q, DV, seed=4)
    tangents = tuple(randn(*t.shape, seed=5 + i) for i, t in enumerate((q, k, v)))
    return q, k, v, dout, tangents


def folded(keyword, masks):
    """The N slices' masks as those of one call on the folded (N B) batch, as the rule hands
    them to the op; cu_seqlens, one row per call, as the document ids of the same bounds."""
    if keyword == "cu_seqlens":
        ids = torch.stack([torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff()) for cu in masks])
        return "document_ids", ids[:, None].expand(N, B, ids.shape[-1]).flatten(0, 1)
    return keyword, masks.flatten(0, 1)


def forward(q, k, v, mask, dout, *, keyword, options):
    return (attention(q, k, v, **{keyword: mask}, **options),)


def gradients(q, k, v, mask, dout, *, keyword, options):
    """vjp of q, k, v with a random upstream gradient."""
    return torch.func.vjp(lambda q, k, v: forward(q, k, v, mask, None, keyword=keyword, options=options)[0],
                          q, k, v)[1](dout)


def grad(q, k, v, mask, dout, *, keyword, options):
    def loss(q, k, v):
        return (forward(q, k, v, mask, None, keyword=keyword, options=options)[0] * dout).sum()

    return torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)


def jvp(q, k, v, mask, tq, tk, tv, *, keyword, options):
    """The output and its tangent for tangents of q, k, v."""
    return torch.func.jvp(lambda q, k, v: forward(q, k, v, mask, None, keyword=keyword, options=options)[0],
                          (q, k, v), (tq, tk, tv))


@pytest.mark.filterwarnings("error:There is a performance drop:UserWarning")  # vmap's slow per-slice fallback
@pytest.mark.parametrize("qkv", ["batched", "unbatched"])
@pytest.mark.parametrize("name", CASES)
def test_vmap_over_masks_is_a_loop(many_blocks, backend, name, qkv):
    """Forward, vjp with a random upstream gradient, grad, and jvp of q, k, v, each under
    vmap over a batch of masks (with q, k, v batched too, or one q, k, v for every mask):
    the same as a loop over the slices, and bit for bit one call on the folded (N B) batch.
    (The kernels tile by each call's bounds, so a loop's sums may round differently: as in
    any vmap that folds bounds into the batch, a loop is matched to 1e-12.)"""
    keyword, make_masks, options, len_q = CASES[name]
    masks = make_masks()
    q, k, v, dout, tangents = inputs(len_q)
    batched = qkv == "batched"
    if not batched:
        q, k, v = q[0], k[0], v[0]

    def fold(t):  # (N, B, ...), or (B, ...) shared by every slice -> (N B, ...)
        return (t if batched else t.expand(N, *t.shape)).flatten(0, 1)

    folded_keyword, folded_masks = folded(keyword, masks)
    for fn, extras in ((forward, (dout,)), (gradients, (dout,)), (grad, (dout,)), (jvp, tangents)):
        in_dims = (0 if batched else None,) * 3 + (0,) * (1 + len(extras))
        ours = torch.func.vmap(functools.partial(fn, keyword=keyword, options=options), in_dims=in_dims)(
            q, k, v, masks, *extras)
        slices = [fn(*((q[i], k[i], v[i]) if batched else (q, k, v)), masks[i], *(e[i] for e in extras),
                     keyword=keyword, options=options) for i in range(N)]
        looped = [torch.stack(parts) for parts in zip(*slices)]
        one_call = fn(fold(q), fold(k), fold(v), folded_masks, *(e.flatten(0, 1) for e in extras),
                      keyword=folded_keyword, options=options)
        assert len(ours) == len(looped) == len(one_call)
        names = [f"{fn.__name__} {i}" for i in range(len(ours))]
        assert_all_close(dict(zip(names, ours)), dict(zip(names, looped)))
        for label, t, whole in zip(names, ours, one_call):
            assert torch.equal(t, whole.reshape(t.shape)), f"{label}: not the folded call's bits"


def test_vmap_makes_the_bounds_once(counting_backend, monkeypatch):
    """The fold: one padding structure and one attention forward for the whole vmapped batch,
    not one per slice."""
    made = []
    padding_bounds = structured._padding_bounds
    monkeypatch.setattr(structured, "_padding_bounds", lambda rows, len_k: made.append(rows.shape)
                        or padding_bounds(rows, len_k))
    q, k, v, _, _ = inputs(LQ)
    torch.func.vmap(lambda q, k, v, mask: attention(q, k, v, key_padding=mask))(q, k, v, padding_with_holes())
    assert made == [(N * B, LK)]
    assert counting_backend.count("forward") == 1


@pytest.mark.parametrize("keyword, masks, message", [
    ("key_padding", torch.tensor([[LK, 9], [LK + 1, 5], [12, LK]]), "key_padding lengths must lie in"),
    ("document_ids", torch.tensor([[0] * 5 + [1] * 6 + [0] * 6, list(range(LK)), [2] * LK])[:, None],
     "document_ids: each document's tokens must be contiguous"),
    ("cu_seqlens", torch.tensor([[0, 5, LK], [0, 9, 4], [0, 1, LK]]), "cu_seqlens must rise from 0"),
])
def test_vmap_checks_every_slice(keyword, masks, message):
    """The masks' checks read every vmapped slice's values and name the argument."""
    q, k, v, _, _ = inputs(LK)
    with pytest.raises(ValueError, match=message):
        torch.func.vmap(lambda mask: attention(q[0], k[0], v[0], **{keyword: mask}))(masks)


@pytest.mark.parametrize("name", CASES)
def test_vmap_over_masks_on_the_meta_device(name):
    """On the meta device the masks give their shapes alone, under vmap as without it
    (boolean padding as the keep-mask), forward and gradient."""
    keyword, make_masks, options, len_q = CASES[name]
    masks = make_masks().to("meta")
    q, k, v = (t.to("meta") for t in inputs(len_q)[:3])

    def loss(q, k, v, mask):
        return attention(q, k, v, **{keyword: mask}, **options).sum()

    out = torch.func.vmap(lambda q, k, v, mask: attention(q, k, v, **{keyword: mask}, **options))(q, k, v, masks)
    grads = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(q, k, v, masks)
    assert out.device.type == "meta" and out.shape == (N, B, H, len_q, DV)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
