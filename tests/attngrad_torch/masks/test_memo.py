"""`attention(mask_mod=fn)` evaluates fn once while what it reads stays the same
(`mask_memo`): the evaluation is reused for fresh lambdas of the same code and values, and
redone when a tensor it reads changes in place or is swapped, a closure variable or a
global it names is rebound, the call's shape changes; FlexAttention's joined masks are
read through; a function reading an object's attributes is evaluated on every call. Each result equals the mask written out (float64).
"""

import sys
import types

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from attngrad.torch import attention  # noqa: E402
from attngrad.torch.masks import functions  # noqa: E402
from attngrad.torch.masks import memo as mask_memo  # noqa: E402

from ...conftest import assert_all_close  # noqa: E402

B, H, L, D = 2, 3, 24, 8
gen = torch.Generator().manual_seed(5)
Q, K, V = (torch.randn(B, H, L, D, generator=gen, dtype=torch.float64) for _ in range(3))
WIDTH = 4
DOCS = torch.arange(L) // 7


def global_window(b, h, q, kv):
    return (q >= kv) & (q - kv < WIDTH)


def documents(b, h, q, kv):
    return DOCS[q] == DOCS[kv]


@pytest.fixture
def evaluations(monkeypatch):
    """How many times a mask function was evaluated; the memo starts empty."""
    mask_memo.clear()
    count = [0]
    evaluate = functions.create_block_mask

    def counted(*args, **kwargs):
        count[0] += 1
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(functions, "create_block_mask", counted)
    return count


def check(mask_mod, keep):
    """attention(mask_mod=...) equals the math kernel on the dense mask `keep` (Lq, Lk)."""
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(Q, K, V, attn_mask=keep)
    assert_all_close(dict(out=attention(Q, K, V, mask_mod=mask_mod)), dict(out=expected))


def dense(fn):
    rows, keys = torch.arange(L)[:, None], torch.arange(L)[None, :]
    return fn(torch.tensor(0), torch.tensor(0), rows, keys)


def test_a_function_is_evaluated_once_and_fresh_lambdas_of_it_too(evaluations):
    for _ in range(3):
        check(documents, dense(documents))
    width = 5
    for _ in range(3):  # a new function object every call, the same code and values
        check(lambda b, h, q, kv: (q >= kv) & (q - kv < width), dense(lambda b, h, q, kv: (q >= kv) & (q - kv < 5)))
    assert evaluations[0] == 2


def test_what_the_function_reads_changing_evaluates_it_again(evaluations, monkeypatch):
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "DOCS", DOCS.clone())  # changed below, restored after
    check(documents, dense(documents))
    module.DOCS[10:] += 1  # in place: the version counter moves
    check(documents, dense(documents))
    module.DOCS.data = torch.arange(L) // 5  # swapped under the same tensor
    check(documents, dense(documents))
    monkeypatch.setattr(module, "DOCS", torch.arange(L) // 3)  # the global rebound
    check(documents, dense(documents))
    assert evaluations[0] == 4

    check(global_window, dense(global_window))
    monkeypatch.setattr(module, "WIDTH", 9)
    check(global_window, dense(global_window))
    assert evaluations[0] == 6

    width = 3

    def closure(b, h, q, kv):
        return (q >= kv) & (q - kv < width)

    check(closure, dense(closure))
    width = 6  # the closure's cell rebound
    check(closure, dense(closure))
    assert evaluations[0] == 8


def test_another_shape_is_another_evaluation(evaluations):
    check(documents, dense(documents))
    attention(Q[:1], K[:1], V[:1], mask_mod=documents)
    attention(Q, K, V, mask_mod=documents)
    assert evaluations[0] == 2


def test_what_has_no_fingerprint_is_evaluated_every_call(evaluations):
    settings = types.SimpleNamespace(width=3)

    def reads_an_attribute(b, h, q, kv):
        return (q >= kv) & (q - kv < settings.width)

    assert mask_memo.fingerprint(reads_an_attribute) is None
    check(reads_an_attribute, dense(reads_an_attribute))
    settings.width = 7
    check(reads_an_attribute, dense(reads_an_attribute))
    assert evaluations[0] == 2


def test_a_mask_with_holes_is_kept_per_block_and_so_kept(evaluations):
    """A mask no interval per row holds is evaluated into blocks (`mask_blocks`), compact
    enough to keep like the bounds."""
    def dilated(b, h, q, kv):
        return (q >= kv) & ((q - kv) % 3 == 0)

    for _ in range(2):
        check(dilated, dense(dilated))
    assert evaluations[0] == 1 and mask_memo._KEPT


def test_the_memo_keeps_a_bounded_number(evaluations):
    for width in range(mask_memo.KEPT + 3):
        attention(Q, K, V, mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv <= width))
    assert len(mask_memo._KEPT) == mask_memo.KEPT


def test_flex_attentions_joined_masks_are_read_through(evaluations):
    """FlexAttention's and_masks makes a closure in PyTorch's code: read by its contents,
    not taken by identity (a new one may take a freed one's id)."""
    from torch.nn.attention.flex_attention import and_masks

    for width in (3, 6, 3):
        joined = and_masks(lambda b, h, q, kv: q >= kv, lambda b, h, q, kv, w=width: q - kv < w)
        check(joined, dense(joined))
        del joined
    assert evaluations[0] == 2
