"""Building and loading the compiled tiles (`csrc/`) as a PyTorch extension.

`torch.utils.cpp_extension.load` compiles the sources with the system's C++ compiler and
ninja (the files in parallel) into a cache folder, once per source, flags, compiler and CPU,
and loads the library into the process (is_python_module=False), whose TORCH_LIBRARY
registers the ops `torch.ops.attngrad_tiles.*`; the same file is also a Python module, the
eager fast path (`fast_entry`). A later process finds the built library in
its folder and loads it without a build step. The build says so on stderr, once, with the
cache folder and the seconds it usually takes, then how long it took (`announced`): a first
use waits for it.

ATTNGRAD_NATIVE=0 turns the tiles off; ATTNGRAD_CACHE names the cache folder (default
$XDG_CACHE_HOME/attngrad or ~/.cache/attngrad); CXX names the compiler (default c++).

A build never leaves a cache that blocks the next process: it runs under an OS lock beside
its folder, which the kernel releases when the holder dies however it dies, into a folder
of its own, moved into place whole once finished (`_build_into`). A process that finds a
live build waits for it, says so, and gives up after ATTNGRAD_BUILD_WAIT seconds (900). The
command `attngrad build` builds ahead of time.
ATTNGRAD_SANITIZE=1 builds them with AddressSanitizer and UndefinedBehaviorSanitizer
instead, into a folder of its own (for `scripts/sanitize_tiles.sh`, which preloads the
sanitizer runtimes that a Python process needs for such a library). ATTNGRAD_MARCH names
the CPU the build targets (-march; default native, the building machine's own): x86-64-v3
leaves out AVX-512, for older CPUs sharing a cache, and to test the code paths written for
them (`scripts/portable_tiles.sh`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TextIO

import torch

NAME = "attngrad_tiles"  # the extension's name and its ops' namespace
CSRC = Path(__file__).with_name("csrc")
SOURCES = ("ops.cpp", "fast_entry.cpp", "checked_call.cpp", "runtime.cpp", "bf16_products.cpp", "passes.cpp", "passes_higher.cpp", "passes_given_sums.cpp")
HEADERS = ("checked_call.h", "tiles.h", "tile_call.h", "score_masks.h", "pass.h", "accumulation.h", "tiles_math.h",
           "row_products.h", "whole_rows.h", "bf16_products.h")
# -fno-trapping-math lets the row loops' compares and selects vectorise; -ffp-contract=fast
# turns their a * b + c into FMAs. No -ffast-math: the code relies on -inf and exact order.
# -fopenmp where PyTorch's thread pool is OpenMP's: at::parallel_for is inline code in the
# tiles' own sources, a `#pragma omp parallel` that runs serially without it (measured: the
# same time on 1 and 2 threads). The libgomp it links is PyTorch's, already loaded under
# the same soname: one thread pool in the process.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast")
OPENMP_FLAGS = ("-fopenmp",)
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g")


@dataclass
class BuildInfo:
    """How the library was had: its path, whether it was compiled in this process, the
    seconds that took, or why it is unavailable."""

    path: Path | None = None
    compiled: bool = False
    seconds: float = 0.0
    reason: str | None = None

    def reset(self) -> None:
        self.path, self.compiled, self.seconds, self.reason = None, False, 0.0, None


build_info = BuildInfo()


def sanitized() -> bool:
    return os.environ.get("ATTNGRAD_SANITIZE") == "1"


def _openmp(openmp: bool = True) -> tuple[str, ...]:
    return OPENMP_FLAGS if openmp and torch.backends.openmp.is_available() else ()


def flags(openmp: bool = True) -> tuple[str, ...]:
    march = f"-march={os.environ.get('ATTNGRAD_MARCH') or 'native'}"
    base = tuple(march if flag == "-march=native" else flag for flag in FLAGS)
    return base + _openmp(openmp) + (SANITIZE_FLAGS if sanitized() else ())


def _cache_dir() -> Path:
    root = os.environ.get("ATTNGRAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "attngrad"
    )
    return Path(root)


def _machine_key(openmp: bool = True) -> str:
    """What the built library depends on: the sources, the flags, the compiler, the CPU
    (-march=native) and PyTorch (its headers and ABI), so a cache folder shared between
    machines or environments does not hand one the other's."""
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu += "".join(line for line in info if line.startswith(("model name", "flags")))
    except OSError:
        pass
    text = b"".join((CSRC / name).read_bytes() for name in SOURCES + HEADERS)
    text += " ".join(flags(openmp)).encode() + os.environ.get("CXX", "c++").encode() + cpu.encode()
    text += torch.__version__.encode()
    return hashlib.sha256(text).hexdigest()[:16]


def _library_file(folder: Path) -> Path:
    return folder / f"{NAME}.so"


def _build(folder: Path, openmp: bool) -> None:
    """Compile the sources into `folder` with cpp_extension and load the result."""
    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    extra = list(_openmp(openmp)) + (list(SANITIZE_FLAGS) if sanitized() else [])
    with warnings.catch_warnings():  # its own (a compiler it cannot version, ...): the one warning is library()'s
        warnings.simplefilter("ignore")
        cpp_extension.load(
            name=NAME, sources=[str(CSRC / name) for name in SOURCES], extra_cflags=list(flags(openmp)),
            extra_ldflags=extra, extra_include_paths=[str(CSRC)], build_directory=str(folder),
            is_python_module=False, with_cuda=False, verbose=False,
        )
    # cpp_extension names a second build in one process NAME_v1 (after a first that failed,
    # with OpenMP): the cache holds it under the name every process looks for
    for built in folder.glob(f"{NAME}_v*.so"):
        built.replace(_library_file(folder))


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no such method, or a closed stream
        return False


@contextlib.contextmanager
def announced(folder: Path, stream: TextIO | None = None, tick: float = 1.0) -> Iterator[None]:
    """Say on `stream` (stderr) that the tiles are compiling and where they will be cached,
    then "done in N s" (or "failed after N s"). On a terminal a second line counts the
    seconds meanwhile, rewritten in place every `tick` seconds; elsewhere (a log, a pipe)
    nothing comes between the two lines."""
    stream = sys.stderr if stream is None else stream
    start = time.perf_counter()
    stream.write(f"attngrad: compiling the CPU tiles (once, cached in {folder}; usually 10-60 s)...\n")
    stream.flush()
    stop, clock = threading.Event(), None
    if _is_terminal(stream):

        def count() -> None:
            while not stop.wait(tick):
                stream.write(f"\rattngrad: compiling, {time.perf_counter() - start:.0f} s")
                stream.flush()

        clock = threading.Thread(target=count, name="attngrad-build-clock", daemon=True)
        clock.start()
    outcome = "failed after"
    try:
        yield
        outcome = "done in"
    finally:
        if clock is not None:
            stop.set()
            clock.join()
        back = "\r" if clock is not None else ""  # over the count, which the line is longer than
        stream.write(f"{back}attngrad: compiling the CPU tiles {outcome} {time.perf_counter() - start:.0f} s\n")
        stream.flush()


_loaded: Path | None = None  # the library this process has loaded (one per process: its ops' namespace)
_module: ModuleType | None = None  # its Python module
DEFAULT_BUILD_WAIT = 900.0  # seconds a process waits for another's build (ATTNGRAD_BUILD_WAIT)


def _complete(folder: Path) -> bool:
    """Whether `folder` holds a finished build: the marker is written last, and a build is
    moved into place whole (`_build_into`), so a half-built folder never has it."""
    return (folder / "build_seconds").exists() and _library_file(folder).exists()


@contextlib.contextmanager
def _build_lock(folder: Path, stream: TextIO | None = None) -> Iterator[None]:
    """Held while this process builds into `folder`'s place: an OS lock (flock) on a file
    beside it, released by the kernel when its holder ends however it ends (SIGKILL, an
    out-of-memory kill), so no dead process can hold it. A wait for a live holder says so
    once, naming the folder and the holder, and gives up after ATTNGRAD_BUILD_WAIT seconds
    (default 900) with a TimeoutError that says the same."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover (no flock: one builder at a time is not enforced)
        yield
        return
    stream = sys.stderr if stream is None else stream
    wait = float(os.environ.get("ATTNGRAD_BUILD_WAIT") or DEFAULT_BUILD_WAIT)
    path = folder.with_name(folder.name + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        start, said = time.monotonic(), False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "?"
                if time.monotonic() - start > wait:
                    raise TimeoutError(f"another process (pid {holder}) was still compiling the CPU tiles into {folder} "
                                       f"after {wait:.0f} s (ATTNGRAD_BUILD_WAIT); its lock is {path}") from None
                if not said:
                    stream.write(f"attngrad: waiting for another process (pid {holder}) compiling the CPU tiles into "
                                 f"{folder} (at most {wait:.0f} s)\n")
                    stream.flush()
                    said = True
                time.sleep(0.2)
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_into(folder: Path, openmp: bool) -> None:
    """Build in a folder of this process's own and move it into `folder`'s place whole, with
    the build lock held. What a killed build left (its own folder, or a half-built one at
    `folder` from before this scheme) is removed first: only the lock's holder builds."""
    import shutil

    for stale in folder.parent.glob(f"{folder.name}.building-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if folder.exists():
        shutil.rmtree(folder)
    building = folder.with_name(f"{folder.name}.building-{os.getpid()}")
    start = time.perf_counter()
    with announced(folder):
        _build(building, openmp)  # loads the library too, from `building` (the same file, moved below)
    build_info.compiled, build_info.seconds = True, time.perf_counter() - start
    (building / "build_seconds").write_text(f"{build_info.seconds:.3f}\n")
    os.replace(building, folder)


def _load_or_build(openmp: bool) -> Path:
    """Load the cached library, or build it first; its path."""
    global _loaded
    folder = _cache_dir() / f"{NAME}-{_machine_key(openmp)}"
    target = _library_file(folder)
    if _loaded != target:
        if _loaded is not None:
            # PyTorch takes one TORCH_LIBRARY per namespace and process: loading a second
            # build (its sources, flags or compiler changed under a running process) would
            # end the process in std::terminate
            raise RuntimeError(f"another build of the tiles is loaded in this process already ({_loaded}); a new "
                               "process loads this one")
        built_here = False
        if not _complete(folder):
            with _build_lock(folder):
                if not _complete(folder):  # else another process built it while this one waited
                    _build_into(folder, openmp)
                    built_here = True
        if not built_here:
            torch.ops.load_library(str(target))
        _loaded = target
    global _module
    if _module is None:
        _module = _python_module(target)
    return target


def _python_module(target: Path) -> ModuleType:
    """The loaded library's Python module (`csrc/fast_entry.cpp`): the same file, which the
    loader finds loaded already (a build loads it from the folder it was built in, moved
    since: the same file), so its ops are not registered twice."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(NAME, str(target))
    spec = importlib.util.spec_from_file_location(NAME, str(target), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def fast_entry() -> ModuleType:
    """The tiles' Python module, once `library()` has loaded them: the eager fast path of a
    repeated forward (`eager_plans.unmasked`)."""
    if _module is None:
        raise RuntimeError("attngrad's compiled tiles are not loaded: library() loads them")
    return _module


def build(cache: Path | None = None) -> BuildInfo:
    """Build the tiles ahead of time (a container image, a cluster's set-up): into `cache`
    (default: ATTNGRAD_CACHE's folder), or find them built there; `build_info`, with the
    library's path, or why it is unavailable."""
    if cache is not None:
        os.environ["ATTNGRAD_CACHE"] = str(cache)
    library.cache_clear()
    library()
    return build_info


@functools.cache
def library() -> Path | None:
    """The loaded tiles' library file (a truthy handle: `torch.ops.attngrad_tiles` holds
    its ops), or None, and `build_info.reason` says why."""
    build_info.reset()
    if os.environ.get("ATTNGRAD_NATIVE", "1") == "0":
        build_info.reason = "turned off by ATTNGRAD_NATIVE=0"
        return None
    try:
        try:
            target = _load_or_build(openmp=True)
        except Exception as error:
            if not _openmp():
                raise
            # a compiler without OpenMP (Apple's clang): the tiles still run, on one thread
            target = _load_or_build(openmp=False)
            build_info.reason = None
            warnings.warn(f"attngrad: the compiled tiles were built without OpenMP ({type(error).__name__}), so they "
                          "run on one thread", stacklevel=2)
    except Exception as error:  # no compiler, no ninja, a failed build or load: the fallback runs
        build_info.reason = f"building or loading the tiles failed: {type(error).__name__}: {str(error)[-2000:]}"
        warnings.warn(
            f"attngrad: the compiled attention tiles are unavailable ({build_info.reason}); "
            "the torch-ops kernels run instead, exact but slower",
            stacklevel=2,
        )
        return None
    build_info.path = target
    return target


def fresh_build_seconds() -> float:
    """Seconds the first use spent compiling the tiles on this machine (what a new machine
    pays once): this process's build, or the one recorded beside the cached library."""
    if library() is None:
        return 0.0
    if build_info.compiled:
        return build_info.seconds
    try:
        return float((build_info.path.parent / "build_seconds").read_text())
    except (OSError, ValueError):
        return float("nan")
