"""`tuning.Tuning`: a backend's tuning in force, changed inside a block and restored after."""

import dataclasses
import threading

import pytest

from attngrad.torch.backends.cpu_tiles import native, tiling
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
    tiles' settings, which key a prepared plan, change with it."""
    before = native.settings()
    assert tiling.query_block_rows(4096, 4096, None, False) == native.TILING().block_rows == 128
    tuned(native.TILING, block_rows=16)
    assert tiling.query_block_rows(4096, 4096, None, False) == 16 and native.settings() != before
