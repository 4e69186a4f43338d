"""Same inputs, same bits: for any thread count, tiling or batch folding. And the dropout
generator: the same keep-mask from the compiled tiles and from PyTorch operators, equal to
an independent reference on Python integers, and of the right density."""

import pytest

torch = pytest.importorskip("torch")

from attngrad.torch import attention  # noqa: E402
from attngrad.torch.backends.cpu_tiles import tiling  # noqa: E402
from attngrad.torch.op import dropout  # noqa: E402

from ...conftest import rel_err  # noqa: E402
from ..conftest import make_call  # noqa: E402

CASES = {
    "full": dict(),
    "causal": dict(is_causal=True),
    "bottom-right": dict(is_causal="bottom_right"),
    "masked": dict(mask=True),
    "bias": dict(bias=True),
    "bias-per-key": dict(bias="per-key"),  # its gradient sums over heads and rows: parts, added in order
    "dropout": dict(dropout_p=0.2, is_causal=True),
    # structured masks and the soft cap (its 16-lane float32 tanh, and the scalar tail)
    "structured-softcap": dict(bias=True, is_causal=True, structured=dict(
        window=(40, None), key_padding=torch.tensor([150]), softcap=2.0)),
    # sinks: the forward's scaled statistics, and the double backward's t D P_sink per row
    "sinks": dict(bias=True, is_causal=True, structured=dict(window=(40, None), sinks=torch.tensor([0.5, -0.3, 1.0]))),
    # a bias constant along the keys with sinks: its gradient in closed form, summed over rows
    # by halves (key_constant_bias.fixed_order_sum)
    "sinks-per-head-bias": dict(bias="per-head", structured=dict(sinks=torch.tensor([0.5, -0.3, 1.0]))),
}


def _everything(case: str, dtype=torch.float32, len_q=150, len_k=170):
    """out, its gradients (dq, dk, dv and dbias), the double backward of a gradient penalty,
    the output and its JVP from forward mode, and a forward-over-reverse HVP, for one
    configuration."""
    spec = CASES[case]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 3, len_q, 24, generator=g, dtype=dtype)
    k = torch.randn(1, 3, len_k, 24, generator=g, dtype=dtype)
    v = torch.randn(1, 3, len_k, 16, generator=g, dtype=dtype)
    dout = torch.randn(1, 3, len_q, 16, generator=g, dtype=dtype)
    bias_shape = {"per-key": (1, len_k), "per-head": (3, 1, 1)}.get(spec.get("bias"), (3, len_q, len_k))
    bias = torch.randn(bias_shape, generator=g, dtype=dtype) if spec.get("bias") else None
    mask = torch.rand(1, 1, len_q, len_k, generator=g) > 0.25 if spec.get("mask") else None
    tangents = [torch.randn(t.shape, generator=g, dtype=dtype) for t in (q, k, v)]
    options = dict(attn_mask=mask, is_causal=spec.get("is_causal", False), dropout_p=spec.get("dropout_p", 0.0),
                   **spec.get("structured", {}))
    primals = [q, k, v] + ([bias] if bias is not None else [])

    def run(q, k, v, bias=None):
        torch.manual_seed(7)  # the dropout seed
        return attention(q, k, v, attn_bias=bias, **options)

    leaves = [t.clone().requires_grad_() for t in primals]
    out = run(*leaves)
    grads = torch.autograd.grad(out, leaves, dout, create_graph=True)
    penalty = sum((gr * gr).sum() for gr in grads)
    second = torch.autograd.grad(penalty, leaves)

    def run_fixed_bias(q, k, v):
        return run(q, k, v, bias)

    out_fwd, jvp = torch.func.jvp(run_fixed_bias, tuple(primals[:3]), tuple(tangents))  # forward_jvp's pass

    def grad_q(q, k, v):
        return torch.func.grad(lambda q: (run_fixed_bias(q, k, v) * dout).sum())(q)

    _, hvp = torch.func.jvp(grad_q, tuple(primals[:3]), tuple(tangents))
    return [t.detach() for t in (out, *grads, *second, out_fwd, jvp, hvp)]


@pytest.mark.parametrize("case", list(CASES) + ["bfloat16"])
def test_bits_do_not_depend_on_the_thread_count(many_blocks, case):
    """1, 2, 3 and 4 threads: every result bit-equal, on the path each call takes (the
    compiled tiles, with their work split into chunks here; the torch-ops kernels for the
    double backward of dropout and of a bias gradient)."""
    threads = torch.get_num_threads()
    results = {}
    try:
        for count in (1, 2, 3, 4):
            torch.set_num_threads(count)
            # bfloat16: the GEMMs on bfloat16 operands (MKL's bfloat16 GEMM), causal with a bias
            results[count] = _everything("bias", torch.bfloat16) if case == "bfloat16" else _everything(case)
    finally:
        torch.set_num_threads(threads)
    for count in (2, 3, 4):
        for i, (a, b) in enumerate(zip(results[1], results[count])):
            assert torch.equal(a, b), f"{case}: result {i} differs between 1 and {count} threads"


def test_a_key_constant_bias_sums_its_rows_alike_on_any_thread_count():
    """The closed-form gradient of a bias constant along the keys sums a value per row over
    the rows a bias entry covers (`key_constant_bias.rows_to_bias`): for one scalar over
    2^17 rows, a reduction kernel splits the sum between threads (torch.sum's bits differed
    between 1 and 2 threads, Intel Xeon, torch 2.13); the sum by halves does not."""
    from attngrad.torch.op.key_constant_bias import rows_to_bias

    per_row = torch.randn(2, 4, 1 << 14, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    threads = torch.get_num_threads()
    sums = []
    try:
        for count in (1, 2, 3, 4):
            torch.set_num_threads(count)
            sums.append(rows_to_bias(per_row, torch.empty(1, 1, 1, 1), torch.float64))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(sums[0], s) for s in sums[1:])
    assert rel_err(sums[0].flatten(), per_row.sum().reshape(1)) < 1e-14


def test_a_ring_steps_bits_do_not_depend_on_the_thread_count(many_blocks):
    """A call on a part of each row's keys (a ring step: `dropout.Placement` with partial
    rows, row and key offsets), forward and backward with dropout, a bias gradient and a
    causal diagonal, and the higher kernels given the whole rows' sums: bit-equal for 1 to
    4 threads."""
    from attngrad.torch.backends.torch_ops import higher_order
    from attngrad.torch.op import ops
    from attngrad.torch.op.dropout import Placement

    g = torch.Generator().manual_seed(2)
    q, dout = torch.randn(1, 3, 150, 24, generator=g), torch.randn(1, 3, 150, 16, generator=g)
    k, v = torch.randn(1, 3, 170, 24, generator=g), torch.randn(1, 3, 170, 16, generator=g)
    bias, tq = torch.randn(3, 150, 170, generator=g), torch.randn(1, 3, 150, 24, generator=g)
    seed = Placement(11, 300, 250, 0, 1)

    def step():
        options = dict(q=q, k=k, v=v, mask=None, bias=bias, bounds=None, seed=seed.tensor(), causal=40, scale=0.2,
                       softcap=0.0, dropout_p=0.1)
        out, row_max, inv_sum = ops.attention_forward(**options)
        grads = ops.attention_backward(**options, dout=dout, out=out, row_max=row_max, inv_sum=inv_sum, bias_grad=True)
        sums = torch.zeros(1, 3, 150, 1)
        call = make_call(q, k, v, bias=bias, seed=seed.tensor(), causal=40, scale=0.2, dropout_p=0.1)
        share = higher_order.attention_jvp(call, row_max=row_max, inv_sum=inv_sum, tq=tq, tk=None, tv=None,
                                             tbias=None, row_sums=dict(centre=torch.zeros_like(sums), centre_sums=sums))
        return [out, row_max, inv_sum, *grads, share, sums]

    threads = torch.get_num_threads()
    try:
        results = {}
        for count in (1, 2, 3, 4):
            torch.set_num_threads(count)
            results[count] = step()
    finally:
        torch.set_num_threads(threads)
    for count in (2, 3, 4):
        for i, (a, b) in enumerate(zip(results[1], results[count])):
            assert torch.equal(a, b), f"result {i} differs between 1 and {count} threads"


def test_chunks_follow_the_shapes_alone(monkeypatch):
    """The backward's work split, the one thing that once followed the thread count."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = [tiling.chunk_count(heads, blocks) for heads in (1, 3, 8, 16, 40) for blocks in (1, 2, 9)]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    assert one == [tiling.chunk_count(heads, blocks) for heads in (1, 3, 8, 16, 40) for blocks in (1, 2, 9)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dropout_generator_is_one_function_of_the_coordinates(dtype):
    """The compiled generator and the PyTorch-operator one give the same bits; any tile of
    rows and keys gives those of the whole; a few entries match the Python-integer reference."""
    seed, p = 987654321987, 0.3
    whole = dropout.keep_scale_torch(torch.empty(2, 3, 40, 33, dtype=dtype), seed, 0, p)
    assert torch.equal(whole, dropout.keep_scale_into(torch.empty(2, 3, 40, 33, dtype=dtype), seed, 0, p))
    rows = dropout.keep_scale_into(torch.empty(2, 3, 7, 20, dtype=dtype), seed, 11, p)
    assert torch.equal(rows, whole[:, :, 11:18, :20])
    for tile in (dropout.keep_scale_into, dropout.keep_scale_torch):  # a tile of keys too
        assert torch.equal(tile(torch.empty(2, 3, 7, 13, dtype=dtype), seed, 11, p, 9), whole[:, :, 11:18, 9:22])
    for b, h, i, j in ((0, 0, 0, 0), (1, 2, 39, 32), (1, 0, 17, 5), (0, 1, 3, 31)):
        assert bool(whole[b, h, i, j] > 0) == dropout.keep_int(seed, b, h, i, j, p), (b, h, i, j)
    assert set(whole.unique().tolist()) <= {0.0, float(torch.tensor(1 / (1 - p), dtype=dtype))}


def test_dropout_keeps_one_minus_p():
    """Over a million draws the kept share is 1 - p within 5 standard deviations, for rows,
    for columns and for heads alike (a broken coordinate would show as a stripe)."""
    keep = dropout.keep_scale_into(torch.empty(2, 4, 512, 512), 42, 0, 0.25) > 0
    n = keep.numel()
    share = keep.double().mean().item()
    assert abs(share - 0.75) < 5 * (0.75 * 0.25 / n) ** 0.5
    for axis in (0, 1, 2, 3):
        per = keep.double().mean(dim=[d for d in range(4) if d != axis])
        assert float((per - 0.75).abs().max()) < 6 * (0.75 * 0.25 / (n / keep.shape[axis])) ** 0.5
