"""Sections of docs/ that commands write (`--docs`): a section is replaced in place, others
are kept, a new page gets its title, and `attngrad train` writes its own (the bench's is
checked with its quick run, tests/bench)."""

import pytest

from attngrad.cli.main import main
from attngrad.docs_page import sections, write_section


def test_a_section_is_replaced_and_the_rest_kept(tmp_path):
    page = tmp_path / "docs" / "page.md"
    write_section(page, "one", "first body", "Title", "Preamble.")
    write_section(page, "two", "second body", "Title")
    page.write_text(page.read_text().replace("Preamble.", "Preamble, edited by hand."))
    write_section(page, "one", "new body", "Title")
    text = page.read_text()
    assert text.startswith("# Title\n\nPreamble, edited by hand.\n")
    assert sections(page) == {"one": "new body", "two": "second body"}
    assert text.index("new body") < text.index("second body")  # in place, not moved to the end


def test_train_writes_its_section_and_curves(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    page = tmp_path / "train.md"
    assert main(["train", "--task", "copy", "--steps", "4", "--eval-every", "2", "--batch-size", "8",
                 "--out", str(tmp_path / "run"), "--docs", str(page)]) == 0
    body = sections(page)["attngrad train (copy)"]
    assert body.startswith("`attngrad train --task copy --steps 4 --batch-size 8 ")
    assert "Held-out exact match" in body and "after 4 steps" in body
    assert (tmp_path / "img" / "train-copy.png").exists()
