"""What machine a figure came from, for the pages and reports that commands write."""

from __future__ import annotations

import platform


def cpu_name() -> str:
    """The processor's model name and widest vector extension (AVX2 or AVX-512 machines
    differ), from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            lines = info.read().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())
    flags = next((line for line in lines if line.startswith("flags")), "")
    return f"{name} ({'AVX-512' if 'avx512f' in flags else 'AVX2' if 'avx2' in flags else 'no AVX2'})"
