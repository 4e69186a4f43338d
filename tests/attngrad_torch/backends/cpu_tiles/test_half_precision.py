"""float16 and bfloat16 on the compiled tiles: the GEMMs behind them, each bfloat16 route
(oneDNN's brgemm on AMX or on AVX512-BF16, MKL's bfloat16 GEMM) and PyTorch's switch for it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from attngrad.torch import scaled_dot_product_attention  # noqa: E402
from attngrad.torch.backends.cpu_tiles import native  # noqa: E402

from ....conftest import EXACT, rel_err  # noqa: E402
from .cases import after_forward, brgemm_route_on, needs_tiles, random_inputs, tiles_call  # noqa: E402


@needs_tiles
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_aten_gemm_gives_the_blas_results(dtype):
    """Where PyTorch has no Fortran BLAS to link (macOS, another BLAS), the tiles' GEMMs are
    ATen's at::cpu::addmm_out: every pass gives the BLAS path's results, float64 to 1e-12
    (the same sums, perhaps in another order)."""
    ops = torch.ops.attngrad_tiles
    q, k, v, dout = random_inputs(2, 4, 2, 37, 45, 16, 8, dtype, 11)
    bias = torch.randn(4, 37, 45, dtype=dtype, generator=torch.Generator().manual_seed(1))
    cot = [torch.randn_like(t) for t in (q, k, v)]

    call, plain = tiles_call(q, k, v, 0, 0.25, 3, bias=bias, dropout_p=0.2), tiles_call(q, k, v, 0, 0.25)
    tangents, cotangents = (dict(zip(names, cot)) for names in (("tq", "tk", "tv"), ("gq", "gk", "gv")))

    def passes():
        stats = native.attention_forward(call)
        inputs = after_forward(dout, stats)
        grads = native.attention_backward(call, dict(inputs, bias_grad=True))
        second = native.attention_double_backward(call, dict(inputs, dout_grad=True, **cotangents))
        jvp = native.attention_jvp(plain, dict(row_max=stats[1], inv_sum=stats[2], **tangents))
        bjvp = native.attention_backward_jvp(plain, dict(inputs, tdout=dout, **tangents))
        return [t for t in (*stats, *grads, *second, jvp, *bjvp) if t is not None]

    with pytest.raises(RuntimeError, match="choose is 2, expected -1, 0 or 1"):
        ops.gemm_path(2)
    if ops.gemm_path(-1) == 1:
        pytest.skip("no BLAS in this process: the tiles run on ATen's GEMM throughout")
    blas = passes()
    try:
        assert ops.gemm_path(1) == 1
        aten = passes()
    finally:
        ops.gemm_path(0)
    for a, b in zip(aten, blas):
        assert rel_err(a, b) < (EXACT if dtype == torch.float64 else 1e-5)


@needs_tiles
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_half_precision_runs_on_the_tiles(dtype, is_causal):
    """float16 and bfloat16 inputs: every pass on the tiles, returned in the inputs' dtype
    (float16 computed in float32; bfloat16's GEMMs multiply bfloat16 operands, P and dS
    rounded to bfloat16 as PyTorch's kernels round them, with float32 sums); the torch-ops
    kernels (float32 throughout) give the same numbers up to about a rounding of the
    half-precision results."""
    from attngrad.torch import attention, ran, use_backend

    g = torch.Generator().manual_seed(4)
    q, k, v, dout, tq, tk, tv = (torch.randn(2, 4, 37, 16, generator=g).to(dtype) for _ in range(7))
    bias = torch.randn(4, 37, 37, generator=g).to(dtype)
    keep = torch.rand(2, 1, 37, 37, generator=g) > 0.2

    def everything():
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out = attention(*leaves[:3], attn_mask=keep, attn_bias=leaves[3], is_causal=is_causal)
        grads = torch.autograd.grad(out, leaves, dout, create_graph=True)
        second = torch.autograd.grad(sum((gr.float() ** 2).sum() for gr in grads[:3]), leaves[:3])
        fixed = bias.clone()
        out_t = torch.func.jvp(lambda q, k, v: attention(q, k, v, attn_mask=keep, attn_bias=fixed, is_causal=is_causal),
                               (q, k, v), (tq, tk, tv))[1]
        return [t.detach() for t in (out, *grads, *second, out_t)]

    ran.clear()
    ours = everything()
    assert {("forward", "tiles"), ("backward", "tiles"), ("forward_jvp", "tiles")} <= set(ran)
    with use_backend("torch-ops"):
        theirs = everything()
    eps = torch.finfo(dtype).eps
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.dtype == b.dtype == dtype, i
        # each side rounds its float32 result to the half dtype (eps / 2 at most); measured 0.54-0.64 eps
        assert rel_err(a.float(), b.float()) < eps, i


@needs_tiles
@pytest.mark.parametrize("is_causal", [False, True])
def test_bfloat16_products_on_either_route(is_causal):
    """bfloat16 products whose B is a pass input (K, V and their tangents) run on oneDNN's
    brgemm from VNNI copies where PyTorch packs bfloat16 (the matrix units), the others on
    MKL's bfloat16 GEMM: every pass (forward, backward with a learned bias, double backward,
    JVP), on lengths the route takes (>= 256; Lq odd, so one block's rows are odd; GQA; a
    mask), agrees with MKL's alone to far below bfloat16's rounding (their float32 sums round
    apart, which moves a few bfloat16 results by an ulp: 0 to 6.3e-4 measured, eps 7.8e-3), and
    is the same bit for bit on 1 and 2 threads."""
    from attngrad.torch import attention

    ops = torch.ops.attngrad_tiles
    before = brgemm_route_on()
    g = torch.Generator().manual_seed(7)
    q, dout, tq = (torch.randn(1, 4, 261, 32, generator=g).bfloat16() for _ in range(3))
    k, v, tk, tv = (torch.randn(1, 2, 320, 32, generator=g).bfloat16() for _ in range(4))
    bias = torch.randn(4, 261, 320, generator=g).bfloat16()
    keep = torch.rand(1, 1, 261, 320, generator=g) > 0.2

    def everything():
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out = attention(*leaves[:3], attn_mask=keep, attn_bias=leaves[3], is_causal=is_causal, enable_gqa=True)
        grads = torch.autograd.grad(out, leaves, dout, create_graph=True)
        second = torch.autograd.grad(sum((gr.float() ** 2).sum() for gr in grads[:3]), leaves[:3])
        out_t = torch.func.jvp(lambda q, k, v: attention(q, k, v, attn_mask=keep, is_causal=is_causal, enable_gqa=True),
                               (q, k, v), (tq, tk, tv))[1]
        return [t.detach().float() for t in (out, *grads, *second, out_t)]

    threads = torch.get_num_threads()
    try:
        results = {}
        for route, count in ((1, 1), (1, 2), (0, 2)):
            ops.brgemm_path(route)
            torch.set_num_threads(count)
            results[route, count] = everything()
    finally:
        torch.set_num_threads(threads)
        ops.brgemm_path(before)
    eps = torch.finfo(torch.bfloat16).eps
    for i, (one, two, mkl) in enumerate(zip(results[1, 1], results[1, 2], results[0, 2])):
        assert torch.equal(one, two), i
        assert rel_err(two, mkl) < eps / 8, i


@needs_tiles
def test_bfloat16_products_follow_torch_backends_mkldnn():
    """PyTorch's brgemm refuses while torch.backends.mkldnn is off: a bfloat16 call that the
    brgemm route took before runs on MKL's GEMM alone then (the backward raised, the forward
    threw and caught an error in every product), and the route comes back with it on."""
    ops = torch.ops.attngrad_tiles
    before = brgemm_route_on()
    g = torch.Generator().manual_seed(8)
    q, k, v, dout = (torch.randn(1, 2, 256, 32, generator=g).bfloat16() for _ in range(4))

    def step():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = scaled_dot_product_attention(*leaves, is_causal=True)
        return [t.float() for t in (out.detach(), *torch.autograd.grad(out, leaves, dout))]

    try:
        on = step()
        enabled = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = False  # its flags() context also sets oneDNN's TF32, with a warning
        try:
            assert ops.brgemm_path(-1) == 0
            off = step()
        finally:
            torch.backends.mkldnn.enabled = enabled
        assert ops.brgemm_path(-1) != 0
        ops.brgemm_path(0)
        mkl = step()
    finally:
        ops.brgemm_path(before)
    for a, b, c in zip(on, off, mkl):
        assert torch.equal(b, c)
        assert rel_err(a, c) < torch.finfo(torch.bfloat16).eps / 8


@needs_tiles
@pytest.mark.parametrize("is_causal", [None, 0])
def test_bfloat16_products_on_either_gemm_path(is_causal):
    """bfloat16 inputs multiply in bfloat16: the float32 results of MKL's bfloat16 GEMM and of
    the fallback (the same rounded operands through the float32 GEMM) differ from a
    float32-product computation by about bfloat16's rounding of P and dS (more than float32's,
    less than bfloat16's eps), and from each other by far less (their scores differ in the
    last float32 bit, which moves a few entries of P to the next bfloat16: 1.6e-4 measured)."""
    g = torch.Generator().manual_seed(6)
    q, k, v, dout = (torch.randn(2, 3, 150, 32, generator=g).bfloat16() for _ in range(4))

    def passes(q, k, v, dout):
        call = tiles_call(q, k, v, is_causal, 0.2)
        stats = native.attention_forward(call)
        return (stats[0], *native.attention_backward(call, after_forward(dout, stats))[:3])

    before = torch.ops.attngrad_tiles.gemm_path(-1)
    try:
        results = {}
        for path in (0, 1):  # 0: the BLAS (MKL's bfloat16 GEMM where it has one), 1: ATen's float32 GEMM
            try:
                torch.ops.attngrad_tiles.gemm_path(path)
            except RuntimeError:  # no BLAS in this process
                continue
            results[path] = passes(q, k, v, dout)
    finally:
        torch.ops.attngrad_tiles.gemm_path(before)
    float_products = passes(*(t.float() for t in (q, k, v, dout)))
    for i, ours in enumerate(results[1]):
        assert ours.dtype == torch.float32
        if 0 in results:
            assert rel_err(results[0][i], ours) < torch.finfo(torch.bfloat16).eps / 8, i
        assert 1e-5 < rel_err(ours, float_products[i]) < torch.finfo(torch.bfloat16).eps, i


def _cpu_has(flag: str) -> bool:
    return bool(torch._C._cpu._get_cpu_capability().get(flag))


@needs_tiles
@pytest.mark.skipif(not _cpu_has("avx512_bf16"), reason="the CPU has no AVX512-BF16")
def test_the_brgemm_route_without_the_matrix_units():
    """Where oneDNN may not use AMX (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 here, as on an AMD
    Zen 4 that has none), bfloat16's brgemm runs on AVX512-BF16's dot products from the same
    VNNI copies: the route test above passes there in a fresh process (every pass against MKL's
    GEMM alone, the same bits on 1 and 2 threads), and the route says what it is. Held lower
    still (AVX2), oneDNN refuses the route's probe, and MKL's GEMM takes every product."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    root = Path(__file__).resolve().parents[4]
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          f"{Path(__file__).relative_to(root)}::test_bfloat16_products_on_either_route"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    if ran.returncode == 0 and "2 skipped" in ran.stdout:  # no brgemm route there at all (no MKL, mkldnn off)
        pytest.skip(ran.stdout[-500:])
    assert ran.returncode == 0 and "2 passed" in ran.stdout, ran.stdout[-2000:] + ran.stderr[-2000:]
    script = """
import torch
from attngrad.torch import scaled_dot_product_attention
from attngrad.torch.backends.cpu_tiles import build, native
build.library()
print(native.bf16_products())
q, k, v = (torch.randn(1, 2, 512, 64, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(3))
scaled_dot_product_attention(q, k, v, is_causal=True)
print(native.bf16_products())
"""
    for isa, before, after in (("AVX512_CORE_BF16", "AVX512-BF16", "AVX512-BF16"), ("AVX2", "MKL", "MKL")):
        routes = subprocess.run([sys.executable, "-c", script], env={**os.environ, "ONEDNN_MAX_CPU_ISA": isa},
                                capture_output=True, text=True, timeout=300)
        assert routes.returncode == 0, routes.stderr[-2000:]
        first, then = routes.stdout.split("\n")[:2]
        assert before in first and after in then, (isa, routes.stdout)
