"""What the benchmark programs under benchmarks/ share: interleaved medians, and a peak
memory read in a fresh interpreter that runs the program's own `--memory-of` mode."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional


def interleaved_medians(run: Callable[[str], object], names: Sequence[str], repeats: int) -> dict[str, float]:
    """Median seconds of run(name) for each name, the names taking turns in every round,
    after one warm-up call each."""
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        run(name)
    for _ in range(repeats):
        for name in names:
            start = time.perf_counter()
            run(name)
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def extra_mib_in_fresh_process(program: str, *args: str) -> float:
    """`python program --memory-of *args` in a fresh interpreter (its peak starts at its own
    baseline): the "extra_mib" of the JSON line it prints last."""
    done = subprocess.run([sys.executable, program, "--memory-of", *args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["extra_mib"]


def report(lines: list[str], page: Optional[Path], program: str, lengths: Sequence[int]) -> None:
    """Print a program's table, and with `page` write it as the program's section of that
    page, headed by the command that made it."""
    print("\n".join(lines))
    if page is None:
        return
    from ..docs_page import write_section

    command = f"python {program} --lengths " + " ".join(map(str, lengths))
    write_section(page, program, f"`{command}`\n\n" + "\n".join(lines), "Benchmarks")
    print(f"wrote {page}")
