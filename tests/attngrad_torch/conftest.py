"""Fixtures and helpers every attngrad.torch test shares: small tiles, the backends, the math
path as the oracle, and the ops called by keyword."""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from attngrad.torch import use_backend  # noqa: E402
from attngrad.torch.backends.cpu_tiles import native  # noqa: E402
from attngrad.torch.backends.torch_ops import first_order  # noqa: E402
from attngrad.torch.op import dispatch  # noqa: E402
from attngrad.torch.op.autograd import differentiable_attention  # noqa: E402
from attngrad.torch.op.call import AttentionCall, ScoreMasks  # noqa: E402

from ..counting_backend import registered_counting_backend  # noqa: E402


@pytest.fixture
def many_blocks(monkeypatch, tuned):
    """Small tiles in every backend, so that every test crosses many block boundaries, and
    short key slices in the forward's E V product (the last one shorter than the rest). The
    compiled tiles get 20-key blocks: a 16-wide vector and a scalar tail per row."""
    tuned(first_order.TILING, tile_elements=1 << 9, min_rows=3, value_slice=4, higher_min_rows=3)
    tuned(native.TILING, block_rows=3, block_keys=20, value_slice=4)


BACKENDS = ("tiles", "torch-ops")
# Triton's kernels in its interpreter take 0.1-1 s a call: the shared tests that run them too
# are those whose every case is a few calls (`every_backend`)
EVERY_BACKEND = (*BACKENDS, "triton")


def _alone(name: str):
    """Backend `name` alone, skipped where it does not run here; the test fails if any pass
    ran on another one."""
    status = {b.name: b for b in dispatch.list_backends()}[name]
    if not status.available:
        pytest.skip(f"backend {name} does not run here: {status.reason}")
    if name == "triton":
        from attngrad.torch.backends import triton as triton_backend

        if not triton_backend.interpreting():
            pytest.skip("Triton's kernels are compiled here (TRITON_INTERPRET=0): these tests are on CPU tensors")
    before = dict(dispatch.ran)
    with use_backend(name):
        yield name
    ran = {backend for (pass_name, backend), count in dispatch.ran.items() if count > before.get((pass_name, backend), 0)}
    assert ran <= {name}, f"passes ran on {ran}"


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Each CPU backend alone (`_alone`)."""
    yield from _alone(request.param)


@pytest.fixture(params=EVERY_BACKEND)
def every_backend(request):
    """Each backend alone, Triton's in its interpreter among them (`_alone`)."""
    yield from _alone(request.param)


@pytest.fixture
def fresh_plans():
    """No eager plan (nor published forward) before or after the test (`eager_plans`)."""
    from attngrad.torch import eager_plans

    eager_plans.clear()
    yield
    eager_plans.clear()


def full_path(query, key, value, **options):
    """The call through the full path: built and differentiated without a plan."""
    from attngrad.torch.arguments import build_call

    call, layout = build_call(query, key, value, **options)
    return layout.unfold(differentiable_attention(call))


def math_sdpa(*args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


def make_call(q, k, v, mask=None, bias=None, bounds=None, seed=None, causal=None, scale=None, softcap=0.0, dropout_p=0.0,
              sink=False, blocks=None, sinks=None) -> AttentionCall:
    """An `AttentionCall` on (B, H, L, E) tensors, by keyword: `sinks` the op's (1 or B, H)
    logits, `sink` the backends' zero-logit sink (a call for `ops.run_pass` alone)."""
    seed = torch.tensor(0) if seed is None else seed
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    masks = ScoreMasks(mask=mask, bias=bias, bounds=bounds, causal=causal, softcap=softcap, sink=sink, blocks=blocks,
                       sinks=sinks)
    return AttentionCall(q, k, v, masks, seed, float(scale), float(dropout_p))


def op_attention(q, k, v, **options):
    """The differentiable op on (B, H, L, E) tensors (`make_call`'s keywords)."""
    return differentiable_attention(make_call(q, k, v, **options))


@pytest.fixture
def counting_backend():
    """`CountingBackend`, registered first and the only one allowed while the test runs."""
    with registered_counting_backend() as counting:
        yield counting
