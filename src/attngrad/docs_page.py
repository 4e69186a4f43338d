"""Pages of docs/ that commands write themselves: `attngrad bench --docs` and `attngrad train
--docs` each replace their own section of a Markdown page, so that the figures there are the
ones the command measured, never copies by hand.

A section lies between two HTML comments that name it:

    <!-- written by: attngrad bench (train) -->
    ...
    <!-- end: attngrad bench (train) -->

A page that does not exist yet is started with `title` and `preamble`; a section not yet on
the page is added at its end.
"""

from __future__ import annotations

import re
from pathlib import Path


def _markers(key: str) -> tuple[str, str]:
    return f"<!-- written by: {key} -->", f"<!-- end: {key} -->"


def write_section(page: Path, key: str, body: str, title: str, preamble: str = "") -> Path:
    """Put `body` (Markdown) in section `key` of `page`, replacing what was there."""
    start, end = _markers(key)
    block = f"{start}\n{body.strip()}\n{end}"
    text = page.read_text(encoding="utf-8") if page.exists() else f"# {title}\n\n{preamble.strip()}\n".rstrip() + "\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), flags=re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    return page


def sections(page: Path) -> dict[str, str]:
    """The sections of `page`, by key."""
    text = page.read_text(encoding="utf-8")
    found = re.findall(r"<!-- written by: (.*?) -->\n(.*?)\n<!-- end: \1 -->", text, flags=re.S)
    return dict(found)
