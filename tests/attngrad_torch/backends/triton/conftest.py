"""The Triton tests' fixtures: a test on the triton backend alone (`on_triton`), and the
interpreter's tile for one test (`tiles_of`)."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from attngrad.torch import use_backend  # noqa: E402
from attngrad.torch.backends.triton import config  # noqa: E402
from attngrad.torch.op import dispatch  # noqa: E402


@pytest.fixture
def on_triton():
    """Only the triton backend runs; the test fails if a pass ran elsewhere."""
    before = dict(dispatch.ran)
    with use_backend("triton"):
        yield
    ran = {name for key, count in dispatch.ran.items() if count > before.get(key, 0) for name in key[1:]}
    assert ran <= {"triton"}, f"passes ran on {ran}"


@pytest.fixture
def tiles_of(monkeypatch, tuned):
    """Set the interpreter's tile (rows = keys) and head-width slice."""
    def set_blocks(size, slice_=0):
        tuned(config.TUNING, interpreted=config.Blocks(size, size, 1, 1, slice_))
    return set_blocks
