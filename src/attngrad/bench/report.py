"""The bench report as rows, Markdown, JSON and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

from .cases import IMPLEMENTATIONS
from .runner import BenchReport, CaseResult

# ours = attngrad; default / math = PyTorch's default and math SDPA backends
COLUMNS = ("case", "L", "ours ms", "default ms", "math ms", "vs default", "vs math", "over plain",
           "ours GFLOP/s", "% peak", "ours MiB", "default MiB", "math MiB", "ours ran")
RAN_SHORT = {"tiles": "tiles", "torch-ops": "ops"}


def _absent(result: CaseResult, impl: str) -> str:
    """Why a figure is missing: 'refused' (the implementation raised) or 'skipped'."""
    return "refused" if result.skipped.get(impl, "").startswith("refused") else "skipped"


def _mib(result: CaseResult, impl: str) -> str:
    m = result.memory.get(impl)
    if m is None:
        return "-" if impl not in result.skipped else _absent(result, impl)
    if "error" in m:
        return "error"
    return f"{m['extra_bytes'] / 2**20:.0f}"


def rows(report: BenchReport) -> list[list[str]]:
    out = []
    for r in report.results:
        ms = {impl: (f"{r.seconds[impl] * 1e3:.1f}" if impl in r.seconds else _absent(r, impl)) for impl in IMPLEMENTATIONS}
        vs_default, vs_math, over_plain = r.ratio("torch-default"), r.ratio("torch-math"), r.over_plain()
        gflops = r.gflops("attngrad")
        out.append([
            r.case.name, str(r.case.length), ms["attngrad"], ms["torch-default"], ms["torch-math"],
            "-" if vs_default is None else f"{vs_default:.2f}x", "-" if vs_math is None else f"{vs_math:.2f}x",
            "-" if over_plain is None else f"{over_plain:.2f}x",
            "-" if gflops is None else f"{gflops:.0f}", "-" if gflops is None else f"{100 * _share(r, report):.0f}%",
            _mib(r, "attngrad"), _mib(r, "torch-default"), _mib(r, "torch-math"),
            _ran(r),
        ])
    return out


def _ran(result: CaseResult) -> str:
    """The implementations of our passes, and for bfloat16 what multiplied on the tiles."""
    ran = "+".join(dict.fromkeys(RAN_SHORT[choice] for choice in result.ran.values())) or "-"
    return ran if result.products is None else f"{ran} ({result.products})"


def _share(result: CaseResult, report: BenchReport) -> float:
    """Our share of the GEMM's speed: against the GEMM of the same rounds, else the run's peak."""
    share = result.share_of_gemm()
    return share if share is not None else result.gflops("attngrad") / report.gemm_peak_gflops


def markdown(report: BenchReport) -> str:
    m = report.machine
    lines = [
        f"float32 unless named bf16 or fp16, B=1 unless named b4, H=8, d=64; {m['date']}; {m['processor']}, "
        f"{m['threads']} threads, torch {m['torch']}; "
        f"float32 GEMM peak {report.gemm_peak_gflops:.0f} GFLOP/s ({report.gemm_size}x{report.gemm_size}, same run). "
        "Times are medians of "
        "interleaved runs, in an order shuffled each round, and each ratio is the median over the rounds of the two times within a round; ours = attngrad, default / math = PyTorch's default and math SDPA backends; 'vs' is our "
        "time over theirs (below 1 is faster); 'over plain' is our time over our own fwd+bwd call without mask, "
        "bias, dropout or cap at the same L, causality, dtype and batch, timed in the same interleaving; "
        "% peak is our GFLOP/s (FlashAttention's convention) over the GEMM's, timed once in every round "
        "(the median over the rounds); MiB is peak memory beyond inputs, outputs and gradients, each case in a fresh process; 'ours ran' is the implementation of attngrad's passes (compiled tiles, torch-ops kernels), and for bfloat16 what multiplied on the tiles (oneDNN's brgemm on AMX or AVX512-BF16, or MKL's bfloat16 GEMM). Cases are "
        "fwd+bwd unless named jvp (forward and output tangent), double-backward (forward, backward with "
        "create_graph, backward again), hvp (forward over reverse: the JVP of the gradient) or decode (the "
        "forward of one query row against L keys, no gradient); 'refused' means "
        "the backend raised (PyTorch's default CPU kernel has neither forward mode nor a second derivative)."
        + _apart_note(report),
        "",
        f"attngrad: {m.get('attngrad_tiles', 'torch-ops kernels')}.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows(report)]
    if m.get("smoke_run"):
        lines = [f"**{m['smoke_run']}.**", ""] + lines
    return "\n".join(lines) + "\n"


def _apart_note(report: BenchReport) -> str:
    """The sentence on implementations timed after the interleaved rounds, where any were."""
    cases = sorted({f"L={r.case.length}" for r in report.results if "torch-math" in r.apart})
    if not cases:
        return ""
    return (f" At {', '.join(cases)} the math backend ran after the interleaved rounds, not among them: its "
            "gigabytes allocated and freed each call slow whatever runs beside it (bench/runner.py, MATH_APART).")


def write(report: BenchReport, directory: Path) -> list[Path]:
    """results.json, results.md and, with matplotlib, results.png in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / "results.json", directory / "results.md"]
    written[0].write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    written[1].write_text(markdown(report), encoding="utf-8")
    try:
        written.append(plot(report, directory / "results.png"))
    except ImportError:
        pass  # matplotlib is optional: the table and JSON carry every figure
    return written


PLOT_COLUMNS = 3  # panels per row: one per case, each readable at README width


def where_we_lose(report: BenchReport) -> list[str]:
    """A line for each case that is slower than PyTorch's default backend (or, where that
    refuses, its math path), or that takes more memory than it: computed from the run."""
    lines = []
    for r in report.results:
        other = "torch-default" if "torch-default" in r.seconds else "torch-math"
        ratio = r.ratio(other)
        name = "PyTorch's default backend" if other == "torch-default" else "PyTorch's math path"
        if ratio is not None and ratio > 1.0:
            lines.append(f"- {r.case.name} at L={r.case.length}: {r.seconds['attngrad'] * 1e3:.1f} ms, "
                         f"{ratio:.2f}x the time of {name} ({r.seconds[other] * 1e3:.1f} ms).")
        ours, theirs = r.memory.get("attngrad", {}), r.memory.get(other, {})
        if "extra_bytes" in ours and "extra_bytes" in theirs and ours["extra_bytes"] > theirs["extra_bytes"] + 2**20:
            lines.append(f"- {r.case.name} at L={r.case.length}: {ours['extra_bytes'] / 2**20:.0f} MiB, more than "
                         f"{name}'s {theirs['extra_bytes'] / 2**20:.0f} MiB.")
    return lines


def docs_section(report: BenchReport, command: str, image: str | None) -> str:
    """The Markdown of one run for docs/bench.md: the command, the table, the plot and the
    cases where attngrad loses."""
    parts = [f"`{command}`", "", markdown(report)]
    if image:
        parts += [f"![{command}]({image})", ""]
    losses = where_we_lose(report)
    parts.append("Where we lose in this run (slower than PyTorch, or more memory):" if losses
                 else "Where we lose in this run: no case is slower than PyTorch or takes more memory.")
    parts += ["", *losses]
    return "\n".join(parts)


def _plain_ticks(ax, lengths: list[int]) -> None:
    """Tick labels as plain numbers on log axes: the lengths measured, and times as 10, 200."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.set_xticks(lengths)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def plot(report: BenchReport, path: Path) -> Path:
    """A grid of panels, one per case: time per step against L for each implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.case.name for r in report.results))
    columns = min(len(names), PLOT_COLUMNS)
    rows_ = -(-len(names) // columns)
    fig, axes = plt.subplots(rows_, columns, figsize=(3.6 * columns, 2.9 * rows_), squeeze=False)
    styles = {"attngrad": ("#1f4e9c", "o"), "torch-default": ("#c0392b", "s"), "torch-math": ("#7f8c8d", "^")}
    labels = {"attngrad": "attngrad", "torch-default": "PyTorch default", "torch-math": "PyTorch math"}
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        results = [r for r in report.results if r.case.name == name]
        case = results[0].case
        for impl in IMPLEMENTATIONS:
            points = [(r.case.length, r.seconds[impl] * 1e3) for r in results if impl in r.seconds]
            if points:
                color, marker = styles[impl]
                ax.plot(*zip(*points), marker=marker, color=color, label=labels[impl])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        _plain_ticks(ax, sorted({r.case.length for r in results}))
        ax.set_title(f"{name}\nB={case.batch} H={case.heads} d={case.dim}", fontsize=10)
        ax.set_xlabel("L")
        ax.grid(True, which="major", alpha=0.3)
    for row in axes:
        row[0].set_ylabel("ms per step")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"CPU, {report.machine['processor']}, {report.machine['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
