"""The examples run: a few steps of each, small, checked for what they promise."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_consistency_digits_trains_on_attngrad(tmp_path: Path) -> None:
    example = load_example("consistency_digits")
    result = example.main(["--steps", "3", "--batch", "4", "--width", "16", "--depth", "1", "--heads", "2",
                           "--compare-steps", "1", "--every", "2", "--out", str(tmp_path)])
    assert result["loss_png"].is_file() and result["samples_png"].is_file()
    assert len(result["losses"]) == 3
    assert all(math.isfinite(loss) for loss in result["losses"])
    assert math.isfinite(result["first_loss"]) and math.isfinite(result["last_loss"])
    # every attention call of training (forward, its JVP, backward) ran on attngrad, none on PyTorch
    assert result["calls"].attngrad == 3 and result["calls"].pytorch == {}
    assert {p for p, _ in result["ran"]} == {"forward_jvp", "backward"}  # the forward waits for its jvp
    assert set(result["comparison"]) == {"attngrad", "pytorch math"}


def test_consistency_digits_compiled_trains_to_the_same_loss_curve(tmp_path: Path) -> None:
    """--compile: the JVP inside a fullgraph graph gives the eager run's losses (float32, up to
    the compiled graph's order of summation). Before the traced operator, its du/dt was 0."""
    example = load_example("consistency_digits")
    settings = ["--steps", "3", "--batch", "4", "--width", "16", "--depth", "1", "--heads", "2", "--compare-steps", "0",
                "--every", "3", "--out", str(tmp_path)]
    eager = example.main(settings)
    compiled = example.main([*settings, "--compile"])
    assert compiled["calls"].pytorch == {}
    for a, b in zip(compiled["losses"], eager["losses"]):
        assert math.isclose(a, b, rel_tol=1e-4), (compiled["losses"], eager["losses"])
