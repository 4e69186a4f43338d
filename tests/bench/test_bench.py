"""The bench program's parts: cases and FLOPs, one step of each implementation, the memory
probe, the report files, and the command's smoke run. Timings are never asserted."""

import importlib.util
import json

import pytest

torch = pytest.importorskip("torch")

from attngrad.bench.cases import (  # noqa: E402
    FAMILIES,
    IMPLEMENTATIONS,
    BenchCase,
    _attention,
    default_cases,
    make_inputs,
    select_cases,
    step,
)
from attngrad.bench.memory import measure, required_bytes  # noqa: E402
from attngrad.bench.report import COLUMNS, markdown, rows, write  # noqa: E402
from attngrad.bench.runner import PLAIN, BenchReport, CaseResult, machine_facts  # noqa: E402
from attngrad.cli.main import main  # noqa: E402
from attngrad.docs_page import sections  # noqa: E402


def test_flop_convention():
    case = BenchCase(1024)
    assert case.flops == 3.5 * 4 * 1 * 8 * 1024 * 1024 * 64
    assert BenchCase(1024, causal=True).flops == case.flops / 2
    assert [c.name for c in default_cases((64,))] == ["full", "causal", "full+bias-grad", "causal+bias-grad",
                                                      "full+padding", "full+float-mask", "full+dropout0.1",
                                                      "full+padding-lengths", "causal+window", "full+documents",
                                                      "causal+softcap50"]
    assert [c.name for c in default_cases((64,), ("jvp", "double-backward"))] == [
        "jvp+full", "jvp+causal", "double-backward+full", "double-backward+causal"]
    assert BenchCase(1024, mode="double-backward").flops == 8.5 * 4 * 8 * 1024 * 1024 * 64
    assert BenchCase(1024, mode="hvp", causal=True).flops == 9.5 * 4 * 8 * 1024 * 1024 * 64 / 2
    with pytest.raises(ValueError, match="unknown mode"):
        BenchCase(64, mode="hessian")
    with pytest.raises(ValueError, match="unknown mask"):
        BenchCase(64, mask="band")
    with pytest.raises(ValueError, match="causal sliding window"):
        BenchCase(64, mask="window")
    # a window or packed documents count the scores they admit
    assert BenchCase(1024, causal=True, mask="window").flops == 3.5 * 4 * 8 * (1024 * 256 - 256 * 255 / 2) * 64
    assert BenchCase(1024, mask="documents").flops == case.flops / 8
    assert BenchCase(1024, mask="padding").flops == case.flops * 3 / 4
    # decode: one query row against every key, forward only
    assert BenchCase(4096, batch=4, mode="decode").flops == 4 * 4 * 8 * 4096 * 64


def test_cases_name_their_dtype_and_batch_and_each_has_its_plain_call():
    names = {c.name for c in default_cases((64,), FAMILIES)}
    assert {"bf16+causal", "fp16+causal", "causal+b4", "full+b4", "decode+full+b4", "jvp+causal"} <= names
    with pytest.raises(ValueError, match="unknown dtype"):
        BenchCase(64, dtype="int8")
    assert BenchCase(64).reference is None and BenchCase(64, batch=4, mode="decode").reference is None
    assert BenchCase(64, causal=True, softcap=50.0).reference == BenchCase(64, causal=True)
    assert BenchCase(64, bias_grad=True).reference == BenchCase(64)
    assert BenchCase(64, mode="hvp", causal=True).reference == BenchCase(64, causal=True)
    assert BenchCase(64, causal=True, dtype="bfloat16", batch=4).reference is None
    inputs = make_inputs(BenchCase(64, batch=4, mode="decode", dtype="bfloat16"))
    assert inputs["q"].shape == (4, 8, 1, 64) and inputs["k"].shape == (4, 8, 64, 64)
    assert inputs["q"].dtype == inputs["k"].dtype == torch.bfloat16


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_every_implementation_steps_on_every_case(implementation):
    for case in default_cases((32,), FAMILIES):
        if implementation == "torch-default" and (case.mode not in ("train", "decode") or case.softcap):
            with pytest.raises((NotImplementedError, RuntimeError)):  # PyTorch's CPU kernel has neither
                step(implementation, case)(make_inputs(case))
            continue
        step(implementation, case)(make_inputs(case))
    with pytest.raises(ValueError, match="unknown implementation"):
        step("numpy", BenchCase(8))


def test_memory_probe_in_a_fresh_process():
    result = measure("attngrad", BenchCase(128, causal=True))
    assert set(result) == {"peak_growth_bytes", "required_bytes", "extra_bytes", "process_peak_bytes"}
    assert result["process_peak_bytes"] > result["peak_growth_bytes"]
    assert result["required_bytes"] == required_bytes(BenchCase(128, causal=True)) == 4 * 8 * 128 * 64 * 4
    assert required_bytes(BenchCase(128, mode="double-backward")) == 4 * 8 * 128 * 64 * 7
    assert required_bytes(BenchCase(128, mode="hvp")) == 4 * 8 * 128 * 64 * 6


def test_report_files(tmp_path):
    pytest.importorskip("matplotlib")
    results = [
        CaseResult(BenchCase(256), {"attngrad": 0.01, "torch-default": 0.008, "torch-math": 0.02},
                   {"attngrad": {"extra_bytes": 2**20}}),
        CaseResult(BenchCase(512, causal=True), {"attngrad": 0.02, "torch-default": 0.01},
                   skipped={"torch-math": "L > 256"}),
        CaseResult(BenchCase(512, mode="jvp"), {"attngrad": 0.02, "torch-math": 0.06, PLAIN: 0.025},
                   skipped={"torch-default": "refused: Trying to use forward AD with ..."}),
    ]
    report = BenchReport(results, 300.0, machine_facts())
    table = rows(report)
    assert len(table[0]) == len(COLUMNS) and table[0][5] == "1.25x" and table[1][4] == "skipped"
    assert table[2][:8] == ["jvp+full", "512", "20.0", "refused", "60.0", "-", "0.33x", "0.80x"]
    assert table[0][7] == "-"  # the plain call has no plain call to be timed against
    assert "| full | 256 |" in markdown(report)
    written = write(report, tmp_path)
    assert [p.name for p in written] == ["results.json", "results.md", "results.png"]
    data = json.loads(written[0].read_text())
    assert data["results"][0]["ratio_to_torch_default"] == pytest.approx(1.25)
    assert data["results"][2]["ratio_to_plain"] == pytest.approx(0.8) and data["results"][0]["ratio_to_plain"] is None
    assert data["gemm_peak_gflops"] == 300.0


def test_ratios_pair_the_times_of_one_round():
    """A ratio is the median over the rounds of the two times within a round, so a round on a
    slower machine moves both; the medians' ratio stands in only for a backend timed apart."""
    rounds = [{"attngrad": 1.0, PLAIN: 1.0, "torch-default": 2.0}, {"attngrad": 4.0, PLAIN: 2.0, "torch-default": 8.0},
              {"attngrad": 3.0, PLAIN: 3.0, "torch-default": 6.0}]
    result = CaseResult(BenchCase(256), {"attngrad": 3.0, PLAIN: 2.0, "torch-default": 6.0, "torch-math": 4.0},
                        apart=["torch-math"], rounds=rounds)
    assert result.over_plain() == 1.0  # the rounds' ratios 1, 2, 1; the medians' would be 1.5
    assert result.ratio("torch-default") == 0.5
    assert result.ratio("torch-math") == 0.75  # timed apart: the medians'
    assert CaseResult(BenchCase(256), {"attngrad": 3.0}).ratio("torch-default") is None


def test_the_share_of_the_gemm_pairs_each_round_with_its_gemm():
    """% peak is our speed over the GEMM's of the same round, the median over the rounds: a
    round on a slower machine slows both."""
    from attngrad.bench.runner import GEMM, GEMM_SIZE

    case = BenchCase(256)
    gemm = 2.0 * GEMM_SIZE**3 / 100e9  # 100 GFLOP/s
    ours = case.flops / 50e9  # 50 GFLOP/s
    rounds = [{"attngrad": ours, GEMM: gemm}, {"attngrad": 2 * ours, GEMM: 2 * gemm}, {"attngrad": ours, GEMM: 4 * gemm}]
    result = CaseResult(case, {"attngrad": ours, GEMM: 2 * gemm}, rounds=rounds)
    assert result.share_of_gemm() == pytest.approx(0.5)  # the rounds' 0.5, 0.5, 2.0
    report = BenchReport([result], 400.0, machine_facts())
    assert rows(report)[0][9] == "50%"  # not 50 / 400
    assert rows(BenchReport([CaseResult(case, {"attngrad": ours})], 400.0, machine_facts()))[0][9] == "12%"


def test_the_math_backend_times_apart_where_its_tensors_are_large(monkeypatch):
    """Past MATH_APART numbers of scores, PyTorch's math backend runs after the interleaved
    rounds of the others (which stay shuffled together), and the report says so."""
    from attngrad.bench import runner

    calls = []
    small, large = BenchCase(64, mode="jvp"), BenchCase(128, mode="jvp")
    monkeypatch.setattr(runner, "step",
                        lambda impl, case: lambda inputs: calls.append(impl if case in (small, large) else PLAIN))
    monkeypatch.setattr(runner, "make_inputs", lambda case: {})
    monkeypatch.setattr(runner, "gemm_peak_gflops", lambda size: 100.0)
    monkeypatch.setattr(runner, "machine_facts", lambda: dict(processor="a CPU", torch="2.13", date="today", threads=2))
    report = runner.run_bench([small, large], repeats=4, memory=False,
                              math_apart=small.heads * 64**2)  # 64 keys interleave, 128 do not
    assert [r.apart for r in report.results] == [[], ["torch-math"]]
    timed = calls[len(calls) // 2:]  # the large case's: 4 warm-ups (one each), then 4 rounds
    assert timed[:4] == ["attngrad", "torch-default", "torch-math", PLAIN]
    assert timed[-4:] == ["torch-math"] * 4 and "torch-math" not in timed[4:-4]
    assert len(set(tuple(timed[4 + 3 * i:7 + 3 * i]) for i in range(4))) > 1  # still shuffled round to round
    assert "At L=128 the math backend ran after the interleaved rounds" in markdown(report)
    assert "ran after the interleaved rounds" not in markdown(runner.BenchReport(report.results[:1], 100.0,
                                                                                 report.machine))


def test_quick_command_writes_its_files(tmp_path, capsys):
    page = tmp_path / "docs" / "bench.md"
    assert main(["bench", "--quick", "--no-memory", "--modes", "train", "double-backward", "--out", str(tmp_path),
                 "--docs", str(page)]) == 0
    text = capsys.readouterr().out
    assert "default" in text and "results.md" in text and "double-backward+causal" in text
    assert "refused" in text and "a smoke run" in text
    assert max(len(line) for line in text.splitlines()) <= 100  # every column, within 100 columns
    assert (tmp_path / "results.json").exists() and "smoke run" in (tmp_path / "results.md").read_text()
    # its section of the docs: the command, the table, the plot and every case where it lost
    body = sections(page)["attngrad bench (train+double-backward)"]
    assert body.startswith("`attngrad bench --modes train double-backward --lengths 128 256 --repeats 3`")
    assert "| full | 128 |" in body and "](img/bench-train+double-backward.png)" in body
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    slower = [r for r in results if (r.get("ratio_to_torch_default") or 0) > 1.0]
    assert body.count(" the time of PyTorch's default backend") == len(slower)
    if importlib.util.find_spec("matplotlib"):
        assert (page.parent / "img" / "bench-train+double-backward.png").stat().st_size > 10_000


def test_masked_cases_mask_the_same_keys_everywhere():
    """The padding and float-mask cases exclude the last quarter of the keys, for every
    implementation: the outputs agree."""
    import torch

    outs = {}
    for mask in ("padding", "float-mask"):
        case = BenchCase(32, mask=mask)
        inputs = make_inputs(case)
        assert inputs["mask"].shape[-1] == 32
        for implementation in IMPLEMENTATIONS:
            outs[mask, implementation] = _attention(implementation, case)(inputs["q"], inputs["k"], inputs["v"],
                                                                          inputs["mask"])
    reference = outs["padding", "torch-math"]
    for out in outs.values():  # float32 (the bench's dtype): rounding is ~1e-7; a different mask would be O(1)
        assert torch.allclose(out, reference, atol=1e-5)


def test_softcap_case_caps_the_same_scores_everywhere():
    """attngrad's softcap and the spelled-out PyTorch formula agree, and differ from no cap."""
    import torch

    case = BenchCase(64, causal=True, softcap=0.5)
    inputs = make_inputs(case)
    ours = _attention("attngrad", case)(inputs["q"], inputs["k"], inputs["v"])
    theirs = _attention("torch-math", case)(inputs["q"], inputs["k"], inputs["v"])
    assert torch.allclose(ours, theirs, atol=1e-5)
    plain = _attention("attngrad", BenchCase(64, causal=True))(inputs["q"], inputs["k"], inputs["v"])
    assert not torch.allclose(plain, theirs, atol=1e-2)


@pytest.mark.parametrize("mask", ["padding-lengths", "window", "documents"])
def test_structured_cases_mask_what_pytorchs_dense_mask_does(mask):
    """attngrad gets the structure (lengths, a window, cu_seqlens), PyTorch the dense mask:
    the outputs agree, and differ from the unmasked call's."""
    import torch

    length = 300 if mask == "window" else 70  # a window of 256 shorter than the sequence; documents of 9 and 7 keys
    case = BenchCase(length, causal=mask == "window", mask=mask)
    inputs = make_inputs(case)
    outs = {implementation: _attention(implementation, case)(inputs["q"], inputs["k"], inputs["v"], inputs["mask"])
            for implementation in IMPLEMENTATIONS}
    for out in outs.values():
        assert torch.allclose(out, outs["torch-math"], atol=1e-5)
    plain = _attention("attngrad", BenchCase(length, causal=case.causal))(inputs["q"], inputs["k"], inputs["v"])
    assert not torch.allclose(plain, outs["torch-math"], atol=1e-2)


def test_the_distributed_report_is_a_table_of_every_method(tmp_path, monkeypatch):
    """`attngrad bench --distributed`'s report: one row per case and method, written out
    (the measuring itself spawns processes: the distributed tests cover that path)."""
    from attngrad.bench import runner
    from attngrad.bench.distributed import METHODS, DistributedCase, docs_section, write_distributed
    from attngrad.cli.bench_cmd import report_rows

    # the facts time a fresh build of the tiles (10 s): not what this test is about
    monkeypatch.setattr(runner, "machine_facts", lambda: dict(processor="a CPU", torch="2.13", date="today"))

    case = DistributedCase(2, 8192)
    report = [dict(case={}, name=case.name, method=m, seconds=1.0, one_process_seconds=1.7, efficiency=0.85, waiting=0.1,
                   memory_mib=12.5, one_process_memory_mib=20.0) for m in METHODS]
    header, lines = report_rows(report)
    assert [line[1] for line in lines] == list(METHODS)
    assert lines[0][:5] == ["P=2 L=8192", "ring-contiguous", "1.000", "1.700", "85%"]
    json_path, md_path = write_distributed(report, tmp_path, header, lines)
    assert "| P=2 L=8192 | ring-zigzag | 1.000 | 1.700 | 85% | 10% | 12.5 | 20.0 |" in md_path.read_text()
    assert json.loads(json_path.read_text())["cases"][2]["method"] == "all-to-all"
    assert md_path.read_text().startswith("a CPU, ")
    report[1].update(efficiency=0.6)  # ring-zigzag loses; the others keep 85% and wait 10%
    section = docs_section(report, "attngrad bench --distributed", header, lines)
    assert section.startswith("`attngrad bench --distributed`\n\na CPU, ")
    assert section.endswith("- P=2 L=8192 ring-zigzag: efficiency 60%, waiting 10% of the step.")


def test_cases_are_chosen_by_the_names_the_table_shows(capsys):
    cases = default_cases((1024, 4096), ("train", "double-backward"))
    chosen = select_cases(cases, ["causal+window", "double-backward+full"])
    assert [(c.name, c.length) for c in chosen] == [("causal+window", 1024), ("causal+window", 4096),
                                                     ("double-backward+full", 1024), ("double-backward+full", 4096)]
    assert all(c.reference is not None for c in chosen)  # each still timed beside its plain call
    with pytest.raises(ValueError, match="no case named window among .*causal\\+window"):
        select_cases(cases, ["window"])
    assert main(["bench", "--modes", "train", "--cases", "window"]) == 2
    assert "no case named window" in capsys.readouterr().err
    assert main(["bench", "--cases", "causal+window", "--docs"]) == 2
    assert "cannot take --cases" in capsys.readouterr().err
