"""Shared helpers: random data, the error figure, and PyTorch as the oracle."""

from __future__ import annotations

import contextlib
import os

# The Triton backend's tests run its kernels in Triton's interpreter, on CPU tensors. The
# switch must come before anything imports triton (PyTorch may), so it is set here, first;
# on a GPU, TRITON_INTERPRET=0 makes the `gpu` tests compile them instead.
os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist's workers share the cores: each worker's OpenMP pool sized to every core
# oversubscribes them, and a pool's barrier then waits on a thread the other worker holds (on
# 2 cores under -n 2, a sinks test of 0.4 s alone took 58 s, test_sinks.py 200 s against 20).
# Each worker gets its share, before anything starts OpenMP; tests that count threads set them.
if "PYTEST_XDIST_WORKER" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // _workers))

import numpy as np  # noqa: E402
import pytest

from attngrad.check.compare import error_figure

# The full tier: the README's suite leaves out the tests marked `full` (each a costlier case
# of something the suite covers in kind), to keep it near 3 minutes on CI's 2 cores;
# ATTNGRAD_FULL=1 (scripts/full_suite.sh) runs them too, before a change to what they cover lands.
FULL = os.environ.get("ATTNGRAD_FULL") == "1"


def pytest_collection_modifyitems(config, items):
    if FULL:
        return
    kept, left = [], []
    for item in items:
        # on a GPU every case runs compiled, in seconds: the tier is for the CPU's interpreter
        (left if item.get_closest_marker("full") and not item.get_closest_marker("gpu") else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """Work stealing, whatever `-n` was given with: a worker that runs out takes pending tests
    from the other, so a long test near the end does not leave a core idle."""
    if config.getoption("dist") == "load":
        from xdist.scheduler import WorkStealingScheduling

        return WorkStealingScheduling(config, log)
    return None


def examples(suite: int, full: int) -> int:
    """A hypothesis test's draws: `suite` in the README's suite, `full` in the full tier."""
    return full if FULL else suite


@pytest.fixture(scope="session")
def once_per_session(tmp_path_factory):
    """once_per_session(name, make): make()'s result, made once in the whole test session, also
    across pytest-xdist's workers: the first worker to ask makes it under a file lock and
    pickles it in the session's shared folder; a worker that asks meanwhile waits for it
    rather than making it again beside (a spawn of ranks, a compile of kernels: the two would
    share the cores and each take longer)."""
    import pickle

    from filelock import FileLock

    made: dict = {}

    def get(name: str, make):
        if name in made:
            return made[name]
        if "PYTEST_XDIST_WORKER" not in os.environ:  # no xdist (or -p no:xdist): the process is the session
            made[name] = make()
            return made[name]
        path = tmp_path_factory.getbasetemp().parent / f"{name}.pickle"  # the session's, shared by its workers
        with FileLock(f"{path}.lock"):
            if not path.is_file():
                path.write_bytes(pickle.dumps(make()))
            made[name] = pickle.loads(path.read_bytes())
        return made[name]

    return get


@pytest.fixture
def tuned():
    """A backend's tuning changed for one test: `tuned(native.TILING, block_keys=8)` (each
    backend's or the masks' `tuning.Tuning`); every change is undone when the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda tuning, **changes: stack.enter_context(tuning.override(**changes))


def _nested_interpreted_calls_share_the_launchs_patch() -> None:
    """Triton's interpreter patches `triton.language` for each launch (and restores it after),
    and patches again at every call of a nested @triton.jit function: a scan of the language's
    members that took a third of the Triton tests' time, and repeats what the launch's patch or
    an earlier nested call's (never restored, by Triton's design) already did to the same
    module objects. Here a nested call within a launch patches only modules not yet patched
    during that launch. Only the tests install this; a Triton without these internals runs
    unchanged."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch is None or executor is None or not hasattr(interpreter, "_LangPatchScope") or \
            getattr(patch, "once_per_launch", False):
        return
    import triton.language as tl

    launches: list[set[int]] = []  # per launch in progress: the language modules patched during it
    run_grid = executor.__call__

    def run_grid_patching_once(self, *args, **kwargs):
        launches.append(set())
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            launches.pop()

    def patch_once(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if launches and langs and langs <= launches[-1]:
            return interpreter._LangPatchScope()  # nothing to restore
        if launches:
            launches[-1] |= langs
        return patch(fn)

    patch_once.once_per_launch = True
    interpreter._patch_lang = patch_once
    executor.__call__ = run_grid_patching_once


if os.environ["TRITON_INTERPRET"] == "1":
    _nested_interpreted_calls_share_the_launchs_patch()


# float64 bar against PyTorch autograd: max|ours - ref| / max|ref| (README, `attngrad check`).
EXACT = 1e-12


def rel_err(ours, ref) -> float:
    """max|ours - ref| / max|ref|, NaN-aware (NaN never compares below a bar)."""
    if hasattr(ref, "detach"):
        ref = ref.detach().numpy()
    if hasattr(ours, "detach"):
        ours = ours.detach().numpy()
    return error_figure(np.asarray(ours), np.asarray(ref)).rel


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261122)


def assert_all_close(ours: dict, theirs: dict, *, zeros=frozenset(), floor_fraction: float = 0.0, bar: float = EXACT) -> None:
    """Judge several gradients of one computation (numpy arrays or tensors) against a reference.

    scale = the largest reference magnitude over all of them. A name in `zeros` is 0 in exact
    arithmetic, so both sides hold rounding noise: it is measured against `scale`. Otherwise
    the error is relative to max(max|ref|, floor_fraction * scale); the property tests set
    floor_fraction = 1e-3 because the tiny shapes they draw can make a whole tensor the result
    of cancellation, which no two summation orders reproduce to 1e-12 of its own size.
    """
    ours = {k: v.detach().numpy() if hasattr(v, "detach") else np.asarray(v) for k, v in ours.items()}
    theirs = {k: v.detach().numpy() if hasattr(v, "detach") else np.asarray(v) for k, v in theirs.items()}
    assert ours.keys() == theirs.keys()
    scale = max((float(np.abs(v).max()) for v in theirs.values() if v.size), default=0.0)
    for name in ours:
        floor = scale if name in zeros else floor_fraction * scale
        figure = error_figure(ours[name], theirs[name], floor=floor)
        assert figure.rel <= bar, f"{name}: {figure}"
