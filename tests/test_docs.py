"""The README's and the docs' Python blocks run as written, so the docs cannot drift from the
code: each README block alone, as a reader pastes it; a page's blocks in order, in one
namespace. The README stays short enough to read in five minutes."""

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def run_blocks(path: Path) -> int:
    """Run the file's Python blocks in order, in one namespace; return how many ran."""
    namespace: dict = {}
    blocks = python_blocks(path)
    for number, block in enumerate(blocks, 1):
        try:
            exec(compile(block, f"{path.name}, block {number}", "exec"), namespace)  # noqa: S102
        except Exception as err:
            raise AssertionError(f"{path.name}: python block {number} failed:\n{block}") from err
    return len(blocks)


def test_readme_python_blocks_run_each_alone(tmp_path):
    """Each README block runs as a reader pastes it: as its own script, in a fresh
    interpreter, from a folder outside the clone, so it needs its own imports. None may
    fail, nor print PyTorch's testing-only dropout warning (the check example's oracle
    calls that kernel). The four run side by side, each on one thread: most of their time
    is imports."""
    # the drop-in and the check example's autograd column; a transformers model; a DiT block
    for needed in ("torch", "transformers", "diffusers"):
        if importlib.util.find_spec(needed) is None:  # the scripts import them, not this process
            pytest.skip(f"the README's examples need {needed}")
    import attngrad
    from attngrad.torch.backends.cpu_tiles import native

    native.library()  # built here if need be, so each script loads the tiles from the cache
    package_root = str(Path(attngrad.__file__).resolve().parents[1])  # this process's attngrad
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    blocks = python_blocks(ROOT / "README.md")
    assert len(blocks) == 4
    runs = []
    for number, block in enumerate(blocks, 1):
        script = tmp_path / f"readme_block_{number}.py"
        script.write_text(block, encoding="utf-8")
        runs.append(subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 180
    try:
        for number, (block, run) in enumerate(zip(blocks, runs), 1):
            _, stderr = run.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert run.returncode == 0, f"README.md, python block {number} failed alone:\n{block}\n{stderr[-3000:]}"
            assert "Dropout mask should only be used" not in stderr, f"README.md, python block {number}: {stderr}"
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 150


def test_api_tour_blocks_run():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    assert run_blocks(ROOT / "docs" / "api.md") >= 7


def test_every_code_block_is_one_the_tests_run():
    """Python blocks run above; the only shell blocks are the README's two set-up commands,
    which CI runs (test_readme_commands_match_ci). Blocks without a language are output."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        languages = re.findall(r"^\s*```(\w+)", path.read_text(encoding="utf-8"), flags=re.M)
        shell = [lang for lang in languages if lang != "python"]
        expected = ["bash", "bash"] if path.name == "README.md" else []
        assert shell == expected, f"{path.name}: code blocks in {shell} that no test runs"


def test_api_tour_lists_every_command():
    """docs/api.md's list of commands names each one `attngrad --help` lists, and no other."""
    from attngrad.cli.main import COMMANDS

    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    section = page.split("## The commands", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"`attngrad ([a-z-]+)", section)
    assert sorted(set(listed)) == sorted(name for name, *_ in COMMANDS)


def test_derivation_blocks_run():
    """Every formula of docs/derivation.md is followed by code asserting it equals attngrad's
    backward (or autograd, or finite differences): a changed result fails here."""
    pytest.importorskip("torch")  # section 8.3, 9 and 10 compare with PyTorch
    assert run_blocks(ROOT / "docs" / "derivation.md") >= 15


def test_readme_commands_match_ci():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    test_command = "python -m pytest -q -n 2"
    assert f'pip install -c constraints.txt -e ".[test]" && {test_command}' in readme
    assert ci.strip().splitlines()[-1] == test_command
    assert 'pip install -c constraints.txt ".[torch]" && attngrad check' in readme
