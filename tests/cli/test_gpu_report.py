"""`attngrad gpu-report`: the Triton kernels compiled for A100 and H100 without a GPU.

It runs in a fresh process without TRITON_INTERPRET (the interpreter tests set it, and it
would make the kernels interpreted, which cannot be compiled)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")


def _without_interpreter(interpret=None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = interpret
    return env


def gpu_report(*args, interpret=None):
    code = "import sys\nfrom attngrad.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run([sys.executable, "-c", code, "gpu-report", *args], capture_output=True, text=True,
                          timeout=600, env=_without_interpreter(interpret))


# The compiling tests share one fresh process (each start imports torch and triton anew):
# it runs each report through `main` and prints {name: [exit code, stdout]} as JSON.
# The spill case patches the tiles' table, so it runs last.
_REPORTS = """
import contextlib, io, json, sys
import torch
from attngrad.cli.main import main
from attngrad.torch.backends.triton import compile_report, config

results = {}
def report(name, *args):
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = main(["gpu-report", *args, "--markdown"])
    results[name] = [code, text.getvalue()]

report("backward_jvp", "--dtypes", "float32", "--widths", "128", "--features", "all", "--archs", "80",
       "--passes", "backward_jvp")
report("half_double_backward", "--dtypes", "float16", "--widths", "64", "--features", "plain", "--archs", "80",
       "--passes", "double_backward")
report("light", "--dtypes", "bfloat16", "--widths", "128", "--features", "light", "--archs", "90",
       "--passes", "backward")
forward = compile_report.record_launches(torch.bfloat16, 64, "plain", passes=("forward",), arch=80)[0]
results["twice"] = [compile_report.compile_launch(forward, 80), compile_report.compile_launch(forward, 80)]
config._TABLE[("jvp", "float32", 128)] = config.Blocks(16, 16, 8, 1)  # the JVP's products unsliced
report("unsliced_jvp", "--dtypes", "float32", "--widths", "128", "--features", "all", "--passes", "jvp",
       "--archs", "80")
sys.__stdout__.write(json.dumps(results))
"""


def _reports() -> dict:
    done = subprocess.run([sys.executable, "-c", _REPORTS], capture_output=True, text=True, timeout=600,
                          env=_without_interpreter())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def _rows(stdout: str) -> list[list[str]]:
    return [line.split(" | ") for line in stdout.splitlines() if line.startswith("| ") and "kernel" not in line]


def _check_the_backward_jvp_compiles_for_sm80_without_spills(reports):
    """IEEE float32 at d = 128 with every option (a boolean mask, a mask kept per block, a
    bias and its gradient, key bounds, causal, soft cap, dropout, GQA, every tangent and
    cotangent): the backward's JVP, whose kernels spilled most before their products over
    the head width were sliced (28 KB), their products on the CUDA cores, compiles for
    sm_80 without a spill. (`attngrad gpu-report` with no arguments covers every pass, dtype, width,
    feature set and both targets; docs/gpu.md holds its table.)"""
    code, stdout = reports["backward_jvp"]
    assert code == 0, stdout
    rows = _rows(stdout)
    kernels = {(row[0].strip("| "), row[1]) for row in rows}
    assert kernels == {(kernel, "backward_jvp") for kernel in ("row_dot", "row_sums", "given_row_sums", "query_side",
                                                               "key_side")}
    assert {row[5] for row in rows} == {"80"}
    assert all(row[8] == "0" for row in rows), stdout  # spill bytes
    assert "0 failed" in stdout


def _check_the_uncentred_half_precision_walks_compile(reports):
    """The backward-type walks of float16 read their row sums without the centres
    (`tile_ops.load_row_sums`, CENTRE off): a compiled kernel's tuple may not hold None, which
    the interpreter allows, so only a compile shows it."""
    code, stdout = reports["half_double_backward"]
    assert code == 0 and "0 failed" in stdout, stdout
    assert {row[0].strip("| ") for row in _rows(stdout)} == {"row_dot", "row_sums", "query_side", "key_side"}


def _check_light_calls_compile_for_sm90_with_hoppers_tiles_without_spills(reports):
    """A light call (causal, key bounds, GQA) in bfloat16 at d = 128: its backward takes
    sm_90's own 128 x 64 tiles over the whole head width (config._HOPPER_LIGHT), 4.4-4.9x
    as fast on an H100 as the general table's (docs/gpu-runs), and compiles for sm_90
    without a spill."""
    code, stdout = reports["light"]
    assert code == 0, stdout
    rows = _rows(stdout)
    assert {row[0].strip("| ") for row in rows} == {"row_dot", "query_side", "key_side"}
    assert {row[6] for row in rows if row[0].strip("| ") != "row_dot"} == {"128x64 w8 s1"}, stdout  # the tile
    assert all(row[8] == "0" for row in rows), stdout  # spill bytes


def _check_a_spill_where_the_bar_forbids_it_fails_the_report(reports):
    """The JVP in IEEE float32 at d = 128 with its products over the whole head width at
    once (no slices) spills about 1 KB: the report says so and exits 1."""
    code, stdout = reports["unsliced_jvp"]
    assert code == 1 and "1 failed" in stdout, stdout
    spill = [line.split(" | ")[8] for line in stdout.splitlines() if line.startswith("| jvp ")]
    assert len(spill) == 1 and int(spill[0]) > 0, stdout


def test_the_command_offers_what_the_report_compiles():
    from attngrad.cli import gpu_report_cmd as cli
    from attngrad.torch.backends.triton import compile_report as report

    assert (cli.DTYPES, cli.WIDTHS, cli.ARCHS, cli.FEATURES, cli.PASSES) == (
        tuple(report.DTYPES), report.WIDTHS, report.ARCHS, report.FEATURES, report.PASSES)


def test_the_interpreter_is_refused_by_name():
    result = gpu_report("--dtypes", "bfloat16", "--widths", "64", "--features", "plain", interpret="1")
    assert result.returncode == 2 and "unset TRITON_INTERPRET" in result.stdout


def _check_the_figures_are_those_of_tritons_own_ptxas_run(reports):
    """The registers and spills come from the log of the ptxas run that builds the cubin,
    with Triton's flags; Triton skips ptxas for a kernel in its cache, so the report compiles
    past the cache: the same variant compiled twice in one process reports twice, alike."""
    first, second = reports["twice"]
    assert first == second, reports["twice"]
    assert 16 <= first[0] <= 255, reports["twice"]  # registers


def test_a_log_without_ptxas_figures_is_an_error():
    from attngrad.torch.backends.triton import compile_report as report

    log = "ptxas info    : Used 128 registers, used 1 barriers\nptxas info    : 0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
    assert report._ptxas_report(log) == (128, 12)
    with pytest.raises(RuntimeError, match="no ptxas -v report"):
        report._ptxas_report("nothing here")


def test_the_reports_compile_for_a100_and_h100():
    """Every report above from one compiling process, in one test: a fixture shared by
    several tests made the second xdist worker wait idle for the first's compiles."""
    reports = _reports()
    _check_the_backward_jvp_compiles_for_sm80_without_spills(reports)
    _check_the_uncentred_half_precision_walks_compile(reports)
    _check_light_calls_compile_for_sm90_with_hoppers_tiles_without_spills(reports)
    _check_a_spill_where_the_bar_forbids_it_fails_the_report(reports)
    _check_the_figures_are_those_of_tritons_own_ptxas_run(reports)
