"""Timing side by side: every implementation on identical inputs, alternating, median of runs.

Absolute times drift on a shared machine; ratios measured in one process, with the
implementations interleaved run by run, do not: each ratio is the median, over the rounds,
of the two implementations' times within one round. A float32 GEMM runs in every round too,
so the share of its speed each implementation reaches is comparable across machines and
across the minutes of a run.
"""

from __future__ import annotations

import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..machine import cpu_name
from .cases import IMPLEMENTATIONS, BenchCase, make_inputs, step
from .memory import measure

PLAIN = "attngrad-plain"  # attngrad on the case's reference, timed beside it
GEMM = "gemm"  # the float32 GEMM of gemm_peak_gflops, once in every round
GEMM_SIZE = 2048
# PyTorch's math backend times apart, after the interleaved rounds, where its score-sized
# tensors (B H L^2 of them, several per call) pass this many numbers: allocating and freeing
# gigabytes each call keeps the kernel reclaiming memory on the cores the others run on, and
# a double backward at L=4096 (math: 5.7 GiB) took 1259 ms of ours interleaved with it
# against 1064 ms without (our plain call: 464 against 427 ms; Intel Xeon, 2026-11-25).
MATH_APART = 1 << 26


def gemm_peak_gflops(size: int = GEMM_SIZE, repeats: int = 5) -> float:
    """float32 matmul throughput of this machine, best of `repeats` (2 n^3 flops each)."""
    run = _gemm(size)
    run()
    best = min(_timed(run) for _ in range(repeats))
    return 2.0 * size**3 / best / 1e9


def _gemm(size: int = GEMM_SIZE) -> Callable[[], Any]:
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    return lambda: torch.matmul(a, b)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass
class CaseResult:
    case: BenchCase
    seconds: dict[str, float] = field(default_factory=dict)  # median per implementation
    memory: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # implementation -> why
    ran: dict[str, str] = field(default_factory=dict)  # attngrad's pass -> implementation that ran it
    products: str | None = None  # what multiplied a bfloat16 case's tiles (cpu_tiles.native.bf16_products)
    apart: list[str] = field(default_factory=list)  # implementations timed after the interleaved rounds
    rounds: list[dict[str, float]] = field(default_factory=list)  # each round's times, interleaved
    gemm_size: int = GEMM_SIZE  # the n of the n^3 GEMM timed in each round

    def over_plain(self) -> float | None:
        """Our time over our plain call's (`BenchCase.reference`), timed interleaved with it."""
        return self.ratio(PLAIN)

    def ratio(self, other: str) -> float | None:
        """Our time over `other`'s: the median over the rounds of the two times within a round,
        where both ran in the rounds (a drift of the machine's speed between rounds then
        cancels); else the medians' ratio (an implementation timed apart)."""
        if "attngrad" not in self.seconds or other not in self.seconds:
            return None
        paired = [r["attngrad"] / r[other] for r in self.rounds if "attngrad" in r and other in r]
        return statistics.median(paired) if paired else self.seconds["attngrad"] / self.seconds[other]

    def gflops(self, implementation: str) -> float | None:
        seconds = self.seconds.get(implementation)
        return None if seconds is None else self.case.flops / seconds / 1e9

    def share_of_gemm(self, implementation: str = "attngrad") -> float | None:
        """Our GFLOP/s over the GEMM's in the same round, the median over the rounds (None
        where no round timed the GEMM)."""
        shares = [self.case.flops / r[implementation] / (2.0 * self.gemm_size**3 / r[GEMM])
                  for r in self.rounds if implementation in r and GEMM in r]
        return statistics.median(shares) if shares else None


@dataclass
class BenchReport:
    results: list[CaseResult]
    gemm_peak_gflops: float
    machine: dict[str, Any]
    gemm_size: int = GEMM_SIZE

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "gemm_peak_gflops": self.gemm_peak_gflops,
            "gemm_size": self.gemm_size,
            "results": [
                {
                    "case": r.case.as_dict(),
                    "flops": r.case.flops,
                    "seconds": r.seconds,
                    "rounds": r.rounds,
                    "gflops": {impl: r.gflops(impl) for impl in r.seconds if impl != GEMM},
                    "share_of_gemm": r.share_of_gemm(),
                    "ratio_to_torch_default": r.ratio("torch-default"),
                    "ratio_to_torch_math": r.ratio("torch-math"),
                    "ratio_to_plain": r.over_plain(),
                    "plain": None if r.case.reference is None else r.case.reference.as_dict(),
                    "memory": r.memory,
                    "skipped": r.skipped,
                    "attngrad_ran": r.ran,
                    "bf16_products": r.products,
                    "timed_apart": r.apart,
                }
                for r in self.results
            ],
        }


def machine_facts() -> dict[str, Any]:
    import torch

    from ..torch.backends.cpu_tiles import native

    return {
        "attngrad_tiles": native.status(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "processor": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _math_apart(case: BenchCase, limit: int) -> bool:
    """Whether PyTorch's math backend times apart from the others in `case` (past `limit`
    scores: MATH_APART by default)."""
    return case.batch * case.heads * case.length**2 > limit


def run_bench(
    cases: list[BenchCase],
    *,
    repeats: int = 5,
    max_math_length: int = 4096,
    memory: bool = True,
    progress: Callable[[str], None] | None = None,
    gemm_size: int = GEMM_SIZE,
    math_apart: int = MATH_APART,
) -> BenchReport:
    """Time (and measure the memory of) every implementation on every case, beside a
    `gemm_size`^3 float32 GEMM in every round (a smoke run takes a small one); PyTorch's
    math backend apart past `math_apart` scores (`MATH_APART`)."""
    from ..torch.op.dispatch import ran  # counts what attngrad's passes ran on

    peak = gemm_peak_gflops(gemm_size)
    results = []
    for case in cases:
        result = CaseResult(case, gemm_size=gemm_size)
        implementations = list(IMPLEMENTATIONS)
        if case.length > max_math_length:
            implementations.remove("torch-math")
            result.skipped["torch-math"] = f"L > {max_math_length}: O(L^2) memory"
        if progress:
            progress(f"{case.name} L={case.length}: timing")
        inputs = make_inputs(case)
        runs = {impl: step(impl, case) for impl in implementations}
        reference = case.reference
        if reference is not None:  # our plain call of the same L, in the same interleaving
            plain_inputs = make_inputs(reference)
            plain_step = step("attngrad", reference)
            runs[PLAIN] = lambda _inputs: plain_step(plain_inputs)
        ran.clear()  # what attngrad's warm-up run takes, per pass
        for impl in list(implementations):  # warm-up: first-call costs are not the steady state
            try:
                runs[impl](inputs)
            except (NotImplementedError, RuntimeError) as error:  # PyTorch's default refuses jvp, double backward
                if impl == "attngrad":
                    raise  # ours must never be recorded as refused
                implementations.remove(impl)
                result.skipped[impl] = "refused: " + (str(error).strip().splitlines() or [type(error).__name__])[0]
        result.ran = {pass_name: choice for pass_name, choice in sorted(ran)}
        if case.dtype == "bfloat16" and "tiles" in result.ran.values():
            from ..torch.backends.cpu_tiles import native

            result.products = native.bf16_products()
        if reference is not None:
            runs[PLAIN](inputs)  # its warm-up
            implementations.append(PLAIN)
        gemm = _gemm(gemm_size)
        runs[GEMM] = lambda _inputs: gemm()
        implementations.append(GEMM)
        apart = [i for i in implementations if i == "torch-math" and _math_apart(case, math_apart)]
        together = [i for i in implementations if i not in apart]
        order = random.Random(0)
        for _ in range(repeats):
            # interleaved, so drift hits all alike, in an order shuffled each round: a run
            # pays for the caches its predecessor left (a decode step 1.3x after the math
            # path's), and a fixed order would charge that to one implementation
            result.rounds.append({impl: _timed(lambda: runs[impl](inputs))
                                  for impl in order.sample(together, len(together))})
        samples = {impl: [r[impl] for r in result.rounds] for impl in together}
        for impl in apart:
            samples[impl] = [_timed(lambda: runs[impl](inputs)) for _ in range(repeats)]
        result.apart = apart
        result.seconds = {impl: statistics.median(s) for impl, s in samples.items()}
        if memory:
            for impl in (i for i in implementations if i not in (PLAIN, GEMM)):
                if progress:
                    progress(f"{case.name} L={case.length}: memory of {impl}")
                result.memory[impl] = measure(impl, case)
        results.append(result)
    return BenchReport(results, peak, machine_facts(), gemm_size)
