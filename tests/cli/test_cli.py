"""`attngrad check` as a user runs it."""

import json
import os
import subprocess
import sys

import pytest

from attngrad.cli.main import main

SMALL = ["--batch", "2", "--heads", "2", "--len-q", "3", "--len-k", "4", "--embed-dim", "4"]


def run_cli(*args, block=()):
    """Run `python -m attngrad` in a fresh process; `block` makes those modules unimportable."""
    code = "import sys\n"
    for name in block:
        code += f"sys.modules[{name!r}] = None\n"
    code += "from attngrad.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


def test_table_lists_every_tensor_and_exits_0():
    pytest.importorskip("torch")
    result = run_cli("check", *SMALL, "--flavor", "encoder", "--variant", "plain", "--variant", "gqa",
                     "--variant", "dropout")
    assert result.returncode == 0, result.stderr
    for fragment in ("flavor", "vs autograd", "vs finite diff", "verdict", "W^Q", "b^O", "gqa", "dropout", "all pass"):
        assert fragment in result.stdout
    # the oracle hands PyTorch's math kernel its keep-mask, which it warns is for testing: the
    # library silences that one warning where it calls the kernel
    assert "Dropout mask should only be used" not in result.stderr


def test_json_output(capsys):
    pytest.importorskip("torch")
    code = main(["check", *SMALL, "--flavor", "sdpa", "--variant", "dropout", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] is True
    assert report["config"]["batch"] == 2 and report["tolerances"]["autograd"] == 1e-12
    assert {r["tensor"] for r in report["rows"]} == {"out", "query", "key", "value"}
    assert all(r["autograd"]["rel"] < 1e-12 for r in report["rows"])
    assert len(report["backend"]) == 6 and all(r["passed"] for r in report["backend"])


def test_backend_torch_alone(capsys):
    pytest.importorskip("torch")
    assert main(["check", *SMALL, "--flavor", "sdpa", "--variant", "gqa", "--backend", "torch"]) == 0
    out = capsys.readouterr().out
    assert "attngrad.torch: 1 cases x 2 implementations x 3 derivatives: all pass" in out
    assert "vs autograd" not in out  # the reference's table is not there
    assert main(["check", "--backend", "torch", "--no-torch"]) == 2
    assert "--backend torch needs PyTorch" in capsys.readouterr().err


def test_runs_without_torch_and_says_so():
    result = run_cli("check", *SMALL, "--flavor", "cross", "--variant", "all", block=("torch",))
    assert result.returncode == 0, result.stderr
    assert "skipped" in result.stdout and "PyTorch is not installed" in result.stdout
    assert "attngrad.torch was not checked: PyTorch is not installed" in result.stdout


def test_a_failing_check_exits_1(monkeypatch, capsys):
    from attngrad import reference

    original = reference.sdpa_backward
    monkeypatch.setattr(
        "attngrad.check.cases.ref.sdpa_backward", lambda d, c: original(d, c)._replace(dk=original(d, c).dk * 1.001)
    )
    assert main(["check", *SMALL, "--flavor", "sdpa", "--variant", "plain", "--no-torch"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_bad_options_exit_2(capsys):
    assert main(["check", "--heads", "3", "--embed-dim", "8"]) == 2
    assert "embed_dim=8 is not divisible by heads=3" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "--flavor", "mlp"])
    assert exit_info.value.code == 2
    assert main(["check", "--flavor", "encoder", "--variant", "bias"]) == 2  # sdpa-only variant


def test_core_imports_with_numpy_alone():
    code = (
        "import sys\n"
        "for name in ('torch', 'rich', 'hypothesis', 'matplotlib'): sys.modules[name] = None\n"
        "import attngrad, attngrad.reference, attngrad.check\n"
        "from attngrad.derivation import chain_rule, defects, element_jacobians, formulas, head_selector\n"
        "from attngrad.check import run_check, CheckConfig\n"
        "assert run_check(CheckConfig(batch=1, heads=1, len_q=2, len_k=2, embed_dim=2), ('sdpa',), ('plain',)).passed\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ})
    assert result.returncode == 0, result.stderr


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "check" in capsys.readouterr().out


def test_nothing_to_check_is_an_error(capsys):
    assert main(["check", "--no-torch", "--no-finite-diff"]) == 2
    assert "leave nothing to check" in capsys.readouterr().err


def test_no_matching_case_lists_the_variants(capsys):
    assert main(["check", "--flavor", "encoder", "--variant", "causal"]) == 2
    err = capsys.readouterr().err
    assert "no case matches --flavor encoder --variant causal" in err
    assert "encoder: plain, no-bias, padding, attn-bias, gqa, dropout, masked-row, all" in err


def test_install_hint_is_printed_as_written():
    """Without PyTorch the hint says how to add it from a package index and in a clone, where
    only the second works; the console may wrap the line anywhere."""
    result = run_cli("check", *SMALL, "--flavor", "sdpa", "--variant", "plain", block=("torch",))
    out = " ".join(result.stdout.split())
    assert "pip install 'attngrad[torch]' (in a clone: pip install -e '.[torch]')" in out
    result = run_cli("bench", block=("torch",))
    assert result.returncode == 2
    assert "PyTorch is required: pip install 'attngrad[torch]' (in a clone: pip install -e '.[torch]')" in result.stderr


def test_a_closed_pipe_is_no_traceback():
    """`attngrad check --json | head -1`: the reader leaves early."""
    code = "from attngrad.cli.main import main\nimport sys\nsys.exit(main(sys.argv[1:]))\n"
    check = subprocess.Popen([sys.executable, "-c", code, "check", *SMALL, "--flavor", "sdpa", "--json", "--no-torch"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    check.stdout.readline()
    check.stdout.close()  # as head does after its line
    _, err = check.communicate(timeout=300)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err


@pytest.mark.parametrize("width", [80, 100])
def test_check_table_keeps_every_column(width):
    """Names and shapes wrap on a narrow terminal; no column is cut to an ellipsis."""
    from rich.console import Console

    from attngrad.check import CheckConfig, run_check
    from attngrad.cli.check_cmd import render_table

    report = run_check(CheckConfig(), ("decoder",), ("all",), use_torch=False)
    console = Console(width=width, record=True)
    render_table(report, console)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= width
    for header in ("flavor", "tensor", "shape", "vs autograd", "vs finite diff", "verdict", "W^Q", "pass"):
        assert header in text


def test_build_finds_the_tiles_built_and_says_where(capsys):
    """`attngrad build` where the tiles are built already (the suite's own cache): it loads
    them and prints the library and the ATTNGRAD_CACHE that jobs set (the compile itself:
    test_build.py's killed first use)."""
    pytest.importorskip("torch")
    from attngrad.torch.backends.cpu_tiles import native

    if native.library() is None:
        pytest.skip(f"no compiled tiles: {native.build_info.reason}")
    assert main(["build"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("attngrad build: ") and out[0].endswith(str(native.build_info.path))
    assert out[1].startswith("jobs load it with ATTNGRAD_CACHE=")


def test_build_refuses_when_the_tiles_are_turned_off(monkeypatch, capsys):
    monkeypatch.setenv("ATTNGRAD_NATIVE", "0")
    assert main(["build"]) == 1
    assert "ATTNGRAD_NATIVE=0" in capsys.readouterr().err
