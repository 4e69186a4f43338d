"""Building the compiled tiles: where there is a compiler, the fallback when a build fails, OpenMP or
not, what a build says, and the cache it keys."""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch")

from attngrad.torch import scaled_dot_product_attention  # noqa: E402
from attngrad.torch.backends.cpu_tiles import native  # noqa: E402
from attngrad.torch.op import dispatch  # noqa: E402

from ....conftest import EXACT, rel_err  # noqa: E402
from ...conftest import make_call  # noqa: E402
from ...test_functional import math_sdpa  # noqa: E402
from .cases import compiler, needs_tiles, random_inputs  # noqa: E402


@pytest.mark.skipif(compiler is None, reason="no C++ compiler")
def test_tiles_are_built_where_there_is_a_compiler():
    """A silent fallback would leave the compiled path untested and slow: with a compiler
    and PyTorch's BLAS at hand, the library must load."""
    assert native.library() is not None, native.build_info.reason


def test_a_failed_build_falls_back_with_a_warning(monkeypatch, tmp_path):
    from attngrad.torch.backends.cpu_tiles import build as tiles_build

    monkeypatch.setenv("ATTNGRAD_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    monkeypatch.setattr(tiles_build, "_loaded", None)  # as a fresh process, which loaded no build yet
    native.library.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert native.library() is None
        assert len(caught) == 1, [str(w.message) for w in caught]  # one warning, and it says why
        assert "compiled attention tiles are unavailable" in str(caught[0].message)
        assert "failed" in native.build_info.reason and "false" in native.build_info.reason  # names the compiler
        assert not native.available()
        q, k, v, _ = random_inputs(1, 2, 2, 5, 6, 4, 4, torch.float64, 0)
        assert dispatch.choose("forward", make_call(q, k, v)).name == "torch-ops"
        out = scaled_dot_product_attention(q, k, v)  # the torch-ops kernels run instead
        assert rel_err(out, math_sdpa(q, k, v)) < EXACT
        monkeypatch.setenv("ATTNGRAD_NATIVE", "0")
        native.library.cache_clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # turned off on purpose: no warning
            assert native.library() is None
        assert native.build_info.reason == "turned off by ATTNGRAD_NATIVE=0"
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
        native.library()


@needs_tiles
def test_a_second_build_in_one_process_is_refused_not_loaded(monkeypatch):
    """PyTorch takes one TORCH_LIBRARY per namespace and process: where the build's key
    changes under a process that has loaded the tiles (sources edited, another target CPU),
    the tiles fall back with a warning that says why, and nothing is built or loaded (a
    second library's registration would end the process)."""
    from attngrad.torch.backends.cpu_tiles import build as tiles_build

    loaded = native.library()
    monkeypatch.setenv("ATTNGRAD_MARCH", "x86-64-v2")  # another key, not built in this cache
    monkeypatch.setattr(tiles_build, "_build", lambda *args: pytest.fail("a second build was made"))
    native.library.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert native.library() is None
        assert len(caught) == 1 and "another build of the tiles is loaded" in native.build_info.reason
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert native.library() == loaded and native.available()


@needs_tiles
def test_a_failed_openmp_build_is_tried_again_without_it(monkeypatch):
    """Where the build with the OpenMP flag fails (Apple's clang refuses it), library()
    builds again without it and warns that the tiles run on one thread (the build itself:
    the next test, in scripts/portable_tiles.sh)."""
    from attngrad.torch.backends.cpu_tiles import build as tiles_build

    loaded = native.library()
    tried = []

    def load_or_build(openmp: bool):
        tried.append(openmp)
        if openmp:
            raise RuntimeError("c++: error: unrecognized command-line option '-fopenmp'")
        return loaded

    monkeypatch.setattr(tiles_build, "_load_or_build", load_or_build)
    native.library.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert native.library() == loaded and native.build_info.reason is None
        assert tried == [True, False] and len(caught) == 1 and "without OpenMP" in str(caught[0].message)
        assert "-fopenmp" in tiles_build.flags() and "-fopenmp" not in tiles_build.flags(openmp=False)
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert native.library() == loaded


@needs_tiles
@pytest.mark.skipif(os.environ.get("ATTNGRAD_BUILD_TESTS") != "1",
                    reason="builds the tiles again (10 s): scripts/portable_tiles.sh runs it, before csrc/ changes land")
def test_a_compiler_without_openmp_still_builds_the_tiles(tmp_path):
    """Where the compiler refuses the OpenMP flag (Apple's clang), the tiles are built
    without it and run, on one thread, with a warning that says so (a fresh process: one
    build of the tiles per process); the next process finds that build in the cache and
    compiles nothing."""
    script = textwrap.dedent("""
        import warnings, torch
        from attngrad.torch.backends.cpu_tiles import build as tiles_build, native
        tiles_build.OPENMP_FLAGS = ("-fopenmp", "-fattngrad-no-such-flag")
        tiles_build.FLAGS = ("-O0", *tiles_build.FLAGS[1:])  # the fallback is the point here, not speed
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert native.library() is not None, native.build_info.reason
        assert any("without OpenMP" in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert "-fattngrad-no-such-flag" not in tiles_build.flags(openmp=False)
        from attngrad.torch import attention, ran, use_backend
        q = torch.randn(1, 2, 9, 4, dtype=torch.float64)
        with use_backend("tiles"):
            out = attention(q, q, q, is_causal=True)
        ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert float((out - ref).abs().max()) < 1e-12 and ran[("forward", "tiles")] == 1
        print("ok", native.build_info.compiled)
    """)
    env = {**os.environ, "ATTNGRAD_CACHE": str(tmp_path)}
    for compiled in (True, False):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0 and done.stdout.strip().endswith(f"ok {compiled}"), done.stderr[-3000:]


def test_a_build_says_so_on_stderr_and_a_cached_load_is_quiet(monkeypatch, tmp_path, capsys):
    """A first use waits 10-60 s for the build: it says so once on stderr, with the cache
    folder, then how long it took. A process that finds the build loads it in silence.
    (No compiler runs here: _build and the load are stand-ins.)"""
    tiles_build, built = _stand_in_build(monkeypatch, tmp_path)
    target = tiles_build._load_or_build(openmp=True)
    lines = capsys.readouterr().err.splitlines()
    assert built == [target.parent.with_name(f"{target.parent.name}.building-{os.getpid()}")]  # moved into place
    assert lines[0] == (f"attngrad: compiling the CPU tiles (once, cached in {target.parent}; usually 10-60 s)...")
    assert len(lines) == 2 and lines[1].startswith("attngrad: compiling the CPU tiles done in ")  # no count: no TTY
    monkeypatch.setattr(tiles_build, "_loaded", None)  # the next process finds the build
    assert tiles_build._load_or_build(openmp=True) == target and len(built) == 1
    assert capsys.readouterr().err == ""


def test_a_build_counts_its_seconds_on_a_terminal_alone():
    """On a terminal a second line counts the seconds, rewritten in place, and ends as the
    line saying how it went; a failed build says it failed."""
    import io
    import time

    from attngrad.torch.backends.cpu_tiles import build as tiles_build

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    with tiles_build.announced("/cache/tiles", terminal, tick=0.01):
        time.sleep(0.1)
    first, second = terminal.getvalue().split("\n", 1)
    assert first == "attngrad: compiling the CPU tiles (once, cached in /cache/tiles; usually 10-60 s)..."
    assert second.startswith("\rattngrad: compiling, 0 s") and second.endswith("\rattngrad: compiling the CPU tiles "
                                                                               "done in 0 s\n")
    log = io.StringIO()
    with pytest.raises(RuntimeError), tiles_build.announced("/cache/tiles", log, tick=0.01):
        time.sleep(0.05)
        raise RuntimeError("the compiler failed")
    assert log.getvalue().splitlines()[1:] == ["attngrad: compiling the CPU tiles failed after 0 s"]  # no count


@needs_tiles
def test_the_tiles_are_cached_and_keyed(monkeypatch, tmp_path):
    """The library sits in the cache folder, in a folder of its own key (sources, flags,
    compiler, CPU): a sanitizer build, another target CPU or another compiler gets another
    folder, and a process that finds the build loads it without compiling."""
    from attngrad.torch.backends.cpu_tiles import build as tiles_build

    path = native.build_info.path
    assert path.parent.parent == tiles_build._cache_dir() and path.exists()
    assert (path.parent / "build_seconds").exists() and native.fresh_build_seconds() > 0
    assert native.library() is path and native.available()
    monkeypatch.setenv("ATTNGRAD_SANITIZE", "0")
    key = tiles_build._machine_key()
    monkeypatch.setenv("ATTNGRAD_SANITIZE", "1")
    assert tiles_build._machine_key() != key and "-fsanitize=address,undefined" in tiles_build.flags()
    monkeypatch.setenv("ATTNGRAD_SANITIZE", "0")
    march = os.environ.get("ATTNGRAD_MARCH")  # scripts/portable_tiles.sh runs this test on x86-64-v3
    monkeypatch.setenv("ATTNGRAD_MARCH", "x86-64-v2")
    assert "-march=x86-64-v2" in tiles_build.flags() and "-march=native" not in tiles_build.flags()
    assert tiles_build._machine_key() != key
    if march is None:
        monkeypatch.delenv("ATTNGRAD_MARCH")
    else:
        monkeypatch.setenv("ATTNGRAD_MARCH", march)
    assert tiles_build._machine_key() == key
    monkeypatch.setenv("CXX", "g++-other")
    assert tiles_build._machine_key() != key


def _stand_in_build(monkeypatch, tmp_path):
    """The build module as a fresh process has it, its cache in tmp_path, its compiler a
    stand-in that writes an empty library (nothing is loaded)."""
    from attngrad.torch.backends.cpu_tiles import build as tiles_build

    monkeypatch.setenv("ATTNGRAD_CACHE", str(tmp_path))
    monkeypatch.setattr(tiles_build, "_loaded", None)
    for field in ("compiled", "seconds"):
        monkeypatch.setattr(tiles_build.build_info, field, getattr(tiles_build.build_info, field))
    built = []

    def build(folder, openmp):
        folder.mkdir(parents=True)
        tiles_build._library_file(folder).write_bytes(b"")
        built.append(folder)

    monkeypatch.setattr(tiles_build, "_build", build)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: None)
    return tiles_build, built


def test_what_a_killed_build_left_is_cleared_by_the_next(monkeypatch, tmp_path, capsys):
    """A killed build's own folder, and a half-built folder in the final place with
    cpp_extension's lock file in it (as a build killed before this scheme left it, which
    made every later process wait forever), are removed by the next build."""
    tiles_build, built = _stand_in_build(monkeypatch, tmp_path)
    folder = tmp_path / f"{tiles_build.NAME}-{tiles_build._machine_key()}"
    stale = folder.with_name(f"{folder.name}.building-999999")
    (stale / "ops.o").parent.mkdir(parents=True)
    (stale / "ops.o").write_bytes(b"half")
    folder.mkdir()
    (folder / "lock").write_text("")  # cpp_extension's FileBaton, its holder dead
    target = tiles_build._load_or_build(openmp=True)
    assert target == tiles_build._library_file(folder) and tiles_build._complete(folder)
    assert not stale.exists() and not (folder / "lock").exists() and len(built) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name, f"{folder.name}.lock"]


def test_a_wait_for_a_live_build_says_so_and_ends(monkeypatch, tmp_path):
    """A build another live process holds: this one says once that it waits, naming the
    folder and the holder, and gives up after ATTNGRAD_BUILD_WAIT seconds with an error that
    says the same (library() then falls back to torch-ops with a warning)."""
    import fcntl
    import io

    from attngrad.torch.backends.cpu_tiles import build as tiles_build

    folder = tmp_path / "attngrad_tiles-key"
    lock = folder.with_name(folder.name + ".lock")
    monkeypatch.setenv("ATTNGRAD_BUILD_WAIT", "0.5")
    with open(lock, "w") as held:  # another process's lock: flock is per open file
        held.write("4242\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        said = io.StringIO()
        with pytest.raises(TimeoutError, match=r"pid 4242\) was still compiling the CPU tiles into .*attngrad_tiles-key"):
            with tiles_build._build_lock(folder, said):
                pytest.fail("the lock was taken while another holder had it")
    assert said.getvalue() == (f"attngrad: waiting for another process (pid 4242) compiling the CPU tiles into "
                               f"{folder} (at most 0 s)\n")
    with tiles_build._build_lock(folder, said):  # the holder gone (its file closed): taken at once
        assert lock.read_text() == f"{os.getpid()}\n"


# A stand-in for the tiles' sources: a Python module by their name whose compile takes a
# couple of seconds (a constant the compiler evaluates), so a kill lands while it runs.
STAND_IN = """
#include <Python.h>
constexpr unsigned long mix(unsigned long s, unsigned long n) {
    for (unsigned long i = 0; i < n; ++i) s = s * 6364136223846793005UL + i;
    return s;
}
constexpr unsigned long spin(int rounds) {
    unsigned long s = 1;
    for (int r = 0; r < rounds; ++r) s = mix(s, 100000);
    return s;
}
static_assert(spin(10) != 0, "a few seconds of the compiler's time");
PyMODINIT_FUNC PyInit_attngrad_tiles(void) {
    static PyModuleDef module = {PyModuleDef_HEAD_INIT, "attngrad_tiles", nullptr, -1, nullptr};
    return PyModule_Create(&module);
}
"""


@needs_tiles
@pytest.mark.parametrize("sources", [
    "stand-in",  # the build's own machinery (lock, folders, cpp_extension, ninja) on a small source
    pytest.param("tiles", marks=pytest.mark.full),  # the tiles themselves, at -O0: 30 s of CI's 2 cores
])
def test_a_first_use_killed_mid_compile_leaves_a_cache_the_next_one_builds_in(tmp_path, sources):
    """A first use, killed (SIGKILL) while its compiler runs, as a scheduler's time limit or
    an out-of-memory kill would: the next process builds and loads the library in the usual
    time. (Built at -O0 in a cache of the test's own: the kill is the point here.)"""
    import signal
    import time

    cache = tmp_path / "cache"
    if sources == "stand-in":
        (tmp_path / "stand_in.cpp").write_text(STAND_IN)
        use = f"tiles_build.CSRC, tiles_build.SOURCES, tiles_build.HEADERS = Path({str(tmp_path)!r}), ('stand_in.cpp',), ()"
    else:
        use = ""
    script = textwrap.dedent("""
        from pathlib import Path
        from attngrad.torch.backends.cpu_tiles import build as tiles_build
        tiles_build.FLAGS = ("-O0", *tiles_build.FLAGS[1:])
        {use}
        assert tiles_build.library() is not None, tiles_build.build_info.reason
        print("loaded", tiles_build.build_info.compiled)
    """).format(use=use)
    env = {**os.environ, "ATTNGRAD_CACHE": str(cache), "ATTNGRAD_BUILD_WAIT": "240"}
    first = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not any(cache.glob("*/build.ninja")):  # its compiler has started
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        time.sleep(1.0)
    finally:
        first.send_signal(signal.SIGKILL)  # the Python process alone: its compiler runs on, orphaned
        first.communicate()
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0 and done.stdout.strip() == "loaded True", done.stderr[-3000:]
    assert not list(cache.glob("*.building-*"))
