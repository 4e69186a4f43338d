"""The checker proves the reference, and fails when the reference is wrong."""

import numpy as np
import pytest

from attngrad import reference
from attngrad.check import FLAVORS, VARIANTS, CheckConfig, check_case, make_case, run_check
from attngrad.check.runner import _torch_oracle

SMALL = CheckConfig(batch=2, heads=2, len_q=3, len_k=4, embed_dim=4)


def test_every_case_passes_with_torch_and_finite_differences():
    pytest.importorskip("torch")
    report = run_check(SMALL)
    assert report.passed, [r for r in report.rows if not r.passed]
    assert report.torch_version is not None
    assert len({(r.flavor, r.variant) for r in report.rows}) == sum(len(VARIANTS[f]) for f in FLAVORS)
    worst = max(r.autograd.rel for r in report.rows)
    assert worst < 1e-13


def test_float32_is_judged_against_the_float64_truth():
    pytest.importorskip("torch")
    report = run_check(CheckConfig(dtype="float32", batch=2, heads=2, len_q=3, len_k=4, embed_dim=4), ("sdpa", "cross"))
    assert report.passed
    assert max(r.autograd.rel for r in report.rows) > 1e-9  # float32 rounding is visible: it really ran in float32


def test_without_torch_the_autograd_column_is_skipped():
    report = run_check(SMALL, ("sdpa",), ("plain",), use_torch=False)
    assert report.passed and report.torch_version is None
    assert all(r.autograd is None for r in report.rows)
    assert all(r.finite_diff is not None for r in report.rows if r.tensor != "out")
    assert report.to_json()["autograd_skipped"] is True


@pytest.mark.parametrize("use_torch", [True, False])
def test_a_wrong_gradient_is_caught(monkeypatch, use_torch):
    """Perturb dq slightly: one part in 1e9 against autograd (bar 1e-12), one part in 1e5
    against finite differences (bar 1e-7, which is all their resolution allows)."""
    if use_torch:
        pytest.importorskip("torch")
    original = reference.sdpa_backward
    factor = 1 + (1e-9 if use_torch else 1e-5)

    def wrong(dout, cache):
        g = original(dout, cache)
        return g._replace(dq=g.dq * factor)

    monkeypatch.setattr("attngrad.reference.mha.sdpa_backward", wrong)
    monkeypatch.setattr("attngrad.check.cases.ref.sdpa_backward", wrong)
    report = run_check(SMALL, ("sdpa", "encoder"), ("plain",), use_torch=use_torch, finite_differences=not use_torch)
    failed = {(r.flavor, r.tensor) for r in report.rows if not r.passed}
    assert ("sdpa", "query") in failed and ("encoder", "W^Q") in failed
    assert not report.passed


def test_nan_in_a_gradient_fails(monkeypatch):
    original = reference.sdpa_backward

    def nan_grad(dout, cache):
        g = original(dout, cache)
        dv = g.dv.copy()
        dv[0, 0, 0, 0] = np.nan
        return g._replace(dv=dv)

    monkeypatch.setattr("attngrad.check.cases.ref.sdpa_backward", nan_grad)
    rows = check_case(make_case("sdpa", "plain", SMALL), None)
    assert [r.tensor for r in rows if not r.passed] == ["value"]


def test_key_bias_is_zero_and_judged_on_the_case_scale():
    case = make_case("encoder", "plain", SMALL)
    assert case.exact_zeros == {"b^K"}
    rows = {r.tensor: r for r in check_case(case, _torch_oracle())}
    assert rows["b^K"].passed
    # the finite differences of b^K are pure rounding noise; the floor keeps the figure meaningful
    assert rows["b^K"].finite_diff.rel < 1e-7


@pytest.mark.parametrize(
    "sizes",
    [
        dict(batch=2, heads=2, len_q=3, len_k=1, embed_dim=4),  # one key: the query side is exactly 0
        dict(batch=1, heads=1, len_q=2, len_k=2, embed_dim=2),  # padding leaves a single key
        dict(batch=1, heads=1, len_q=1, len_k=1, embed_dim=1),
        dict(batch=3, heads=3, len_q=2, len_k=5, embed_dim=3),  # odd H: GQA with one key/value head
    ],
)
def test_degenerate_sizes_pass(sizes):
    pytest.importorskip("torch")
    report = run_check(CheckConfig(**sizes))
    assert report.passed, [r for r in report.rows if not r.passed]


def test_single_key_rows_make_the_query_side_exactly_zero():
    case = make_case("cross", "plain", CheckConfig(batch=2, heads=2, len_q=3, len_k=1, embed_dim=4))
    assert case.exact_zeros == {"b^K", "W^Q", "b^Q", "W^K", "x"}
    case = make_case("decoder", "plain", CheckConfig(batch=2, heads=2, len_q=3, len_k=1, embed_dim=4))
    assert case.exact_zeros == {"b^K"}  # causal rows 1.. still see several keys


def test_cases_are_deterministic_and_differ_by_seed():
    a = make_case("cross", "all", SMALL)
    b = make_case("cross", "all", SMALL)
    c = make_case("cross", "all", CheckConfig(**{**SMALL.__dict__, "seed": 1}))
    assert all(np.array_equal(a.inputs[n], b.inputs[n]) for n in a.inputs)
    assert not np.array_equal(a.inputs["x"], c.inputs["x"])


def test_config_and_case_errors():
    with pytest.raises(ValueError, match="embed_dim=6 is not divisible by heads=4"):
        CheckConfig(heads=4, embed_dim=6)
    with pytest.raises(ValueError, match="batch must be a positive integer"):
        CheckConfig(batch=0)
    with pytest.raises(ValueError, match="unknown flavor 'mlp'"):
        make_case("mlp", "plain", SMALL)
    with pytest.raises(ValueError, match="unknown variant 'bias' for encoder"):
        make_case("encoder", "bias", SMALL)


def test_attngrad_torch_is_proved_on_every_case():
    """--backend torch: every case through attngrad.torch, both implementations, three
    derivatives, against PyTorch's math path (and the gradient against the reference)."""
    pytest.importorskip("torch")
    report = run_check(SMALL, reference=False)
    assert not report.rows and report.backend_skipped is None
    cases = sum(len(VARIANTS[f]) for f in FLAVORS)
    assert len(report.backend_rows) == cases * 2 * 3
    assert report.passed, [r for r in report.backend_rows if not r.passed]
    assert max(max(r.vs_math, r.vs_reference) for r in report.backend_rows if r.derivative == "gradient") < 1e-13
    assert max(r.vs_math for r in report.backend_rows) < 1e-13
    assert max(r.vs_math for r in report.backend_rows) > 0  # two computations were compared, not one


def test_a_wrong_attngrad_torch_fails_every_derivative(monkeypatch):
    pytest.importorskip("torch")
    from attngrad.check import torch_backend

    original = torch_backend._attngrad_attention
    monkeypatch.setattr(torch_backend, "_attngrad_attention", lambda q, k, v, options: original(q * 1.0001, k, v, options))
    report = run_check(SMALL, ("sdpa", "encoder"), ("plain",), reference=False)
    assert not report.passed
    assert {(r.implementation, r.derivative) for r in report.backend_rows if not r.passed} == {
        (i, d) for i in ("tiles", "torch-ops") for d in torch_backend.DERIVATIVES}
