"""Ring and all-to-all attention on 2 and 3 local processes (gloo on 127.0.0.1), each world
size one spawn that runs every case of `cases`: every derivative equals one-process attngrad
on the whole sequence to 1e-12 relative in float64. (A spawn of 4 on the 2 cores CI has took
8-11 s of the suite's 3 minutes for no path that 2 and 3 leave untried: the ring's steps are
the same at every size, and 3 is the odd one.)"""

from __future__ import annotations

import inspect

import pytest
import torch

from attngrad.torch import attention, distributed
from attngrad.torch.distributed.launch import spawn

from . import cases

WORLDS = (2, 3)
DERIVATIVES = ("forward", "backward", "jvp", "double_backward", "hvp", "reverse_over_forward")


@pytest.fixture
def results(once_per_session):
    """results(world): what every rank of a `world`-rank spawn returned, made once a session."""
    return lambda world: once_per_session(f"context_parallel_{world}", lambda: spawn(
        world, cases.all_cases, timeout=240, collective_timeout=60))


@pytest.mark.parametrize("world,name", [(world, config.name) for world in WORLDS for config in cases.configs(world)])
def test_every_derivative_equals_one_process(world: int, name: str, results) -> None:
    for rank, result in enumerate(results(world)):
        errors = result[name]
        assert set(errors) == set(DERIVATIVES)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-12, f"rank {rank} of {world}, {name}: {worst} off by {errors[worst]:.2e} ({errors})"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shard_and_gather_invert_each_other(world: int, layout: str, results) -> None:
    for result in results(world):
        assert result[f"shard-gather-{layout}"] == {"roundtrip": 0.0}


def test_float32_error_does_not_grow_with_the_world(results) -> None:
    for result in results(3):
        errors = result["float32"]
        assert 0 < errors["ring"] <= 1.5 * errors["single"], errors


def test_the_ring_runs_on_any_registered_backend(results) -> None:
    """A backend defined in the tests (`tests/counting_backend.py`), registered and alone
    allowed, runs every pass of the ring's steps, and ring and all-to-all attention on it
    equal one process."""
    for result in results(2):
        counts = result["counting-backend"]
        assert all(n > 0 for n in counts["ring_steps"].values()), counts["ring_steps"]
        for name, errors in counts["errors"].items():
            assert max(errors.values()) <= 1e-12, (name, errors)


def test_ranks_that_disagree_on_shapes_all_raise_naming_them(results) -> None:
    for rank, result in enumerate(results(2)):
        assert "rank 1 has query (1, 2, 9, 4)" in result["disagreeing-shapes"], (rank, result["disagreeing-shapes"])
        assert "rank 0 has query (1, 2, 8, 4)" in result["disagreeing-shapes"]


@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_a_failing_rank_makes_the_others_raise_within_the_timeout(how: str) -> None:
    results = spawn(2, cases.failing_rank, how, timeout=40, collective_timeout=3, deaths=True, wait_for=(0,))
    kind, seconds = results[0]
    assert kind != "no error" and seconds < 6, results[0]  # the group gives up after 3 s


def test_the_example_trains_as_in_one_process(results) -> None:
    for result in results(2):
        example = result["example"]
        assert example["last"] < example["first"]  # it learns
        assert example["difference"] < 1e-5, example  # float32 rounding, summed in another order
        assert example["pytorch_difference"] < 1e-5, example  # PyTorch's context_parallel() on attngrad


@pytest.mark.parametrize("entry", ["ring_attention", "all_to_all_attention"])
def test_the_sharded_entry_points_take_the_shared_options_with_their_own(entry: str) -> None:
    """ring_attention and all_to_all_attention show attention's options but the mask
    functions, plus group and layout, with their defaults; an unknown name raises before any
    process group is needed."""
    function = getattr(distributed, entry)
    ours = inspect.signature(function).parameters
    shared = {name: p.default for name, p in inspect.signature(attention).parameters.items()
              if name not in ("mask_mod", "block_mask")}
    assert {name: p.default for name, p in ours.items() if name in shared} == shared
    assert set(ours) == set(shared) | {"group", "layout"}
    assert ours["layout"].default == "contiguous" and ours["group"].default is None
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match=f"{entry}\\(\\) got an unexpected keyword argument 'mask_mod'"):
        function(q, q, q, mask_mod=None)
