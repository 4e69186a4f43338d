"""The README's Python blocks run as written, so the docs cannot drift from the code."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def test_readme_python_blocks_run():
    pytest.importorskip("torch")  # the check example reports autograd figures
    blocks = python_blocks(ROOT / "README.md")
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102


def test_readme_commands_match_ci():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    test_command = "python -m pytest -q"
    assert f'pip install -c constraints.txt -e ".[test]" && {test_command}' in readme
    assert ci.strip().splitlines()[-1] == test_command
    assert 'pip install -c constraints.txt ".[torch]" && attngrad check' in readme
