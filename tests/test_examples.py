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
