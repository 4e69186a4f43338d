"""The defect demonstrations show their defects; the figure and the formulas render."""

import importlib.util
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from attngrad.cli.main import main
from attngrad.derivation import chain_rule, formulas

ROOT = Path(__file__).resolve().parents[2]


def test_defects_are_demonstrated():
    pytest.importorskip("torch")
    from attngrad.derivation import defects

    shared = defects.shared_heads(num_heads=3, d_model=6)
    assert (shared.layers_in_list, shared.distinct_layers, shared.heads_identical) == (3, 1, True)
    assert shared.registered_parameters == 0 < shared.fixed_registered_parameters
    leak = defects.multiplicative_mask(length=5)
    assert leak.future_weight > 0.05 and leak.fixed_future_weight == 0.0
    assert leak.output_change_from_future > 0.1 and leak.fixed_output_change_from_future == 0.0
    tied = defects.shared_attention_module()
    assert tied.same_object and tied.grad_is_sum_of_both_uses and tied.fixed_parameters == 2 * tied.parameters
    check = defects.int16_check(wrong_by=1.0)
    assert check.int16_printed_max == 0 and abs(check.relative_error - 1.0) < 1e-6


def test_graph_figure_is_drawn_from_graph(tmp_path):
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("draw_graph", ROOT / "docs" / "draw_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target = tmp_path / "graph.svg"
    drawn = module.draw(target)
    assert drawn == [(e.source, e.target) for e in chain_rule.GRAPH]
    ET.parse(target)  # well-formed SVG
    assert set(module.POSITIONS) == {e.source for e in chain_rule.GRAPH} | {e.target for e in chain_rule.GRAPH}


def test_committed_figure_exists_and_is_embedded():
    assert (ROOT / "docs" / "img" / "self_attention_graph.svg").stat().st_size > 1000
    assert "](img/self_attention_graph.svg)" in (ROOT / "docs" / "derivation.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("flavor", list(formulas.FLAVORS))
def test_formulas_command_prints_each_flavor(capsys, flavor):
    assert main(["formulas", "--flavor", flavor]) == 0
    text = capsys.readouterr().out
    assert formulas.FLAVORS[flavor][0] in text
    assert "dS = P ⊙ (dP − rowsum(dP ⊙ P))" in text
    if flavor != "sdpa":
        assert "dW^Q" in text and "db^K = Σ_b dK = 0" in text


def test_formulas_steps_and_errors():
    assert len(formulas.steps("sdpa")) == 4 and len(formulas.steps("cross")) == 8
    with pytest.raises(ValueError, match="unknown flavor 'mlp'"):
        formulas.steps("mlp")
