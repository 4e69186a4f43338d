"""Peak memory of one forward + backward, measured in a fresh process.

`python -m attngrad.bench.memory IMPLEMENTATION CASE_JSON` prints JSON with the process's
peak resident memory before and after one step. The inputs are made, and a small warm-up
step run (loading every library and kernel), before the baseline is read; the figure
reported is the growth of the peak minus what the step must allocate anyway: its output
and the gradients of q, k, v (and of the bias); in the jvp mode the output and its tangent;
in the double-backward mode also the first gradients; in the hvp mode the gradients and
their tangents. So it is the memory the algorithm
itself uses.
"""

from __future__ import annotations

import ctypes
import json
import resource
import subprocess
import sys
from dataclasses import replace
from typing import Any

from .cases import BenchCase, make_inputs, step


def _status_bytes(field: str) -> int | None:
    """A memory line of /proc/self/status (Linux), in bytes; None elsewhere."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def release_free_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc's malloc_trim), so that a step
    measured after others shows its peak in the resident memory instead of reusing pages the
    earlier ones left mapped (which read as no growth at all)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the growth may then read low
        pass


def reset_peak() -> int:
    """Restart the peak-RSS count at the current RSS and return that RSS, in bytes, after
    handing free pages back (`release_free_memory`).

    getrusage's ru_maxrss would not do: a child starts with its parent's peak (a bench
    parent that just ran PyTorch's math backend holds gigabytes), so the process's own
    high-water mark VmHWM is reset through /proc/self/clear_refs instead (Linux >= 4.0).
    """
    release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return _status_bytes("VmRSS") or 0


def peak_rss_bytes() -> int:
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_here(implementation: str, case: BenchCase) -> dict[str, Any]:
    """Run in this process (call it in a fresh one): peak growth of one step, in bytes."""
    warm = replace(case, length=min(case.length, 64))
    step(implementation, warm)(make_inputs(warm))
    inputs = make_inputs(case)
    baseline = reset_peak()
    step(implementation, case)(inputs)
    growth = peak_rss_bytes() - baseline
    required = required_bytes(case)
    return {"peak_growth_bytes": growth, "required_bytes": required, "extra_bytes": max(0, growth - required),
            "process_peak_bytes": baseline + growth}


def required_bytes(case: BenchCase) -> int:
    """What a step of `case` must hold beyond its inputs whatever the implementation: its
    outputs and gradients (and a bias gradient's L x L)."""
    element = {"float32": 4, "bfloat16": 2, "float16": 2}[case.dtype]
    required = element * case.batch * case.heads * case.length * case.dim * case.outputs
    if case.bias_grad:
        required += element * case.heads * case.length * case.length  # dbias
    return required


def measure(implementation: str, case: BenchCase, timeout: float = 600.0) -> dict[str, Any]:
    """measure_here in a fresh Python process, so that earlier cases leave no trace."""
    result = subprocess.run(
        [sys.executable, "-m", "attngrad.bench.memory", implementation, json.dumps(case.as_dict())],
        capture_output=True, text=True, timeout=timeout,
    )
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    fields = json.loads(sys.argv[2])
    fields.pop("name", None)
    print(json.dumps(measure_here(sys.argv[1], BenchCase(**fields))))
