"""`attngrad gpu-report`: the Triton kernels compiled for A100 and H100 without a GPU.

It runs in a fresh process without TRITON_INTERPRET (the interpreter tests set it, and it
would make the kernels interpreted, which cannot be compiled)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")


def gpu_report(*args, interpret=None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = interpret
    code = "import sys\nfrom attngrad.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run([sys.executable, "-c", code, "gpu-report", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_the_backward_jvp_compiles_for_sm80_without_spills():
    """IEEE float32 at d = 128 with every option (a boolean mask, a mask kept per block, a
    bias and its gradient, key bounds, causal, soft cap, dropout, GQA, every tangent and
    cotangent): the backward's JVP, whose kernels spilled most before their products over
    the head width were sliced (28 KB), their products on the CUDA cores, compiles for
    sm_80 without a spill. (`attngrad gpu-report` with no arguments covers every pass, dtype, width,
    feature set and both targets; docs/gpu.md holds its table.)"""
    result = gpu_report("--dtypes", "float32", "--widths", "128", "--features", "all", "--archs", "80",
                        "--passes", "backward_jvp", "--markdown")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| ") and "kernel" not in line]
    kernels = {(row[0].strip("| "), row[1]) for row in rows}
    assert kernels == {(kernel, "backward_jvp") for kernel in ("row_sums", "query_side", "key_side")}
    assert {row[5] for row in rows} == {"80"}
    assert all(row[8] == "0" for row in rows), result.stdout  # spill bytes
    assert "0 failed" in result.stdout


def test_light_calls_compile_for_sm90_with_hoppers_tiles_without_spills():
    """A light call (causal, key bounds, GQA) in bfloat16 at d = 128: its backward takes
    sm_90's own 128 x 64 tiles over the whole head width (launch._HOPPER_LIGHT), 4.4-4.9x
    as fast on an H100 as the general table's (docs/gpu-runs), and compiles for sm_90
    without a spill."""
    result = gpu_report("--dtypes", "bfloat16", "--widths", "128", "--features", "light", "--archs", "90",
                        "--passes", "backward", "--markdown")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| ") and "kernel" not in line]
    assert {row[0].strip("| ") for row in rows} == {"query_side", "key_side"}
    assert {row[6] for row in rows} == {"128x64 w8 s1"}, result.stdout  # the tile
    assert all(row[8] == "0" for row in rows), result.stdout  # spill bytes


def test_a_spill_where_the_bar_forbids_it_fails_the_report():
    """The JVP in IEEE float32 at d = 128 with its products over the whole head width at
    once (no slices) spills about 1 KB: the report says so and exits 1."""
    code = ("import sys\nfrom attngrad.torch.backends.triton import launch\n"
            "launch._TABLE[('jvp', 'float32', 128)] = launch.Blocks(16, 16, 8, 1)\n"
            "from attngrad.cli.main import main\nsys.exit(main(sys.argv[1:]))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code, "gpu-report", "--dtypes", "float32", "--widths", "128",
                             "--features", "all", "--passes", "jvp", "--archs", "80", "--markdown"],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 1 and "1 failed" in result.stdout, result.stdout + result.stderr
    spill = [line.split(" | ")[8] for line in result.stdout.splitlines() if line.startswith("| jvp ")]
    assert len(spill) == 1 and int(spill[0]) > 0, result.stdout


def test_the_command_offers_what_the_report_compiles():
    from attngrad.cli import gpu_report_cmd as cli
    from attngrad.torch.backends.triton import compile_report as report

    assert (cli.DTYPES, cli.WIDTHS, cli.ARCHS, cli.FEATURES, cli.PASSES) == (
        tuple(report.DTYPES), report.WIDTHS, report.ARCHS, report.FEATURES, report.PASSES)


def test_the_interpreter_is_refused_by_name():
    result = gpu_report("--dtypes", "bfloat16", "--widths", "64", "--features", "plain", interpret="1")
    assert result.returncode == 2 and "unset TRITON_INTERPRET" in result.stdout


def test_the_figures_are_those_of_tritons_own_ptxas_run():
    """The registers and spills come from the log of the ptxas run that builds the cubin,
    with Triton's flags; Triton skips ptxas for a kernel in its cache, so the report compiles
    past the cache: the same variant compiled twice in one process reports twice, alike."""
    code = (
        "from attngrad.torch.backends.triton import compile_report as r\n"
        "import torch\n"
        "launch = r.record_launches(torch.bfloat16, 64, 'plain', passes=('forward',), arch=80)[0]\n"
        "print(r.compile_launch(launch, 80), r.compile_launch(launch, 80))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    first, second = result.stdout.strip().split(") (")
    assert first + ")" == "(" + second, result.stdout
    registers = int(first.strip("(").split(",")[0])
    assert 16 <= registers <= 255, result.stdout


def test_a_log_without_ptxas_figures_is_an_error():
    from attngrad.torch.backends.triton import compile_report as report

    log = "ptxas info    : Used 128 registers, used 1 barriers\nptxas info    : 0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
    assert report._ptxas_report(log) == (128, 12)
    with pytest.raises(RuntimeError, match="no ptxas -v report"):
        report._ptxas_report("nothing here")
