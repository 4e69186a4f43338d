"""`tuning.Tuning`: a backend's tuning in force, changed inside a block and restored after."""

import dataclasses
import threading

import pytest

from attngrad.torch import tuning as tuning_module
from attngrad.torch.backends.cpu_tiles import native, tiling
from attngrad.torch.op import dispatch
from attngrad.torch.tuning import Tuning


@dataclasses.dataclass(frozen=True)
class _Sizes:
    rows: int = 128
    keys: int = 512


def test_an_override_holds_inside_its_block_nests_and_is_undone():
    tuning = Tuning("test_sizes", _Sizes())
    with tuning.override(rows=3) as inside:
        assert inside == tuning() == _Sizes(3, 512)
        with tuning.override(keys=8):
            assert tuning() == _Sizes(3, 8)
        assert tuning() == _Sizes(3, 512)
    assert tuning() == _Sizes()


def test_the_key_in_force_names_every_tunings_value_together():
    """`in_force()` differs for each combination of overrides in force, of any Tuning, and
    comes back with the combination: `dispatch.state()` keys plans by it alone."""
    sizes, other = Tuning("test_sizes_key", _Sizes()), Tuning("test_other_key", _Sizes())
    outside = tuning_module.in_force()
    seen = {outside}
    with sizes.override(rows=3):
        first = tuning_module.in_force()
        with other.override(keys=8):
            seen.add(tuning_module.in_force())
        assert tuning_module.in_force() == first
        seen.add(first)
        with other.override(keys=8):  # the same values as before, a new key: a plan is made again, never stale
            seen.add(tuning_module.in_force())
    assert tuning_module.in_force() == outside and len(seen) == 4
    thread_keys = []
    with sizes.override(rows=5):
        thread = threading.Thread(target=lambda: thread_keys.append(tuning_module.in_force()))
        thread.start()
        thread.join(timeout=10)
    assert thread_keys == [0]


def test_an_override_is_undone_when_its_block_raises_and_names_no_unknown_field():
    tuning = Tuning("test_sizes_raise", _Sizes())
    with pytest.raises(RuntimeError), tuning.override(rows=3):
        raise RuntimeError
    assert tuning() == _Sizes()
    with pytest.raises(TypeError, match="colums"), tuning.override(colums=3):
        pass


def test_an_override_holds_in_its_own_thread_alone():
    tuning = Tuning("test_sizes_thread", _Sizes())
    seen = []
    with tuning.override(rows=3):
        thread = threading.Thread(target=lambda: seen.append(tuning()))
        thread.start()
        thread.join(timeout=10)
    assert seen == [_Sizes()]


def test_the_tiles_read_their_tiling_at_each_call(tuned):
    """The compiled tiles' block rows follow an override (`tiling.query_block_rows`), and the
    dispatch state, which keys a prepared plan, changes with it."""
    before = dispatch.state()
    assert tiling.query_block_rows(4096, 4096, None, False) == native.TILING().block_rows == 128
    tuned(native.TILING, block_rows=16)
    assert tiling.query_block_rows(4096, 4096, None, False) == 16 and dispatch.state() != before
