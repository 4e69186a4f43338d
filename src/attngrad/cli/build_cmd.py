"""`attngrad build`: compile the CPU tiles ahead of time, into the cache or a folder given.

A container image, a cluster's shared environment or a CI step runs it once, so that no
job's first call waits for the compiler; later processes (with the same ATTNGRAD_CACHE,
CPU, compiler and PyTorch) load the library without a build step."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache", type=Path,
                        help="the cache folder to build into (default: $ATTNGRAD_CACHE, else $XDG_CACHE_HOME/attngrad "
                             "or ~/.cache/attngrad); jobs find the build there with ATTNGRAD_CACHE set to it")


def run(args: argparse.Namespace) -> int:
    if os.environ.get("ATTNGRAD_NATIVE", "1") == "0":
        print("attngrad build: ATTNGRAD_NATIVE=0 turns the tiles off; unset it to build them", file=sys.stderr)
        return 1
    try:
        from attngrad.torch.backends.cpu_tiles import build
    except ImportError as error:  # the core alone: no torch
        print(f"attngrad build: the tiles need PyTorch (pip install 'attngrad[torch]'): {error}", file=sys.stderr)
        return 1
    start = time.perf_counter()
    info = build.build(args.cache)
    if info.path is None:
        print(f"attngrad build: the tiles are unavailable: {info.reason}", file=sys.stderr)
        return 1
    took = time.perf_counter() - start
    what = f"built in {info.seconds:.0f} s" if info.compiled else f"already built (found in {took:.1f} s)"
    print(f"attngrad build: {what}: {info.path}")
    cache = args.cache or build._cache_dir()
    print(f"jobs load it with ATTNGRAD_CACHE={cache} (the same CPU, compiler and PyTorch)")
    return 0
