"""Write a benchmark's results into a markdown file between two marker comments (shared by tools/)."""
from __future__ import annotations

import os


def replace_block(path: str, name: str, lines: list[str]) -> None:
    """Replace the text between `<!-- {name}:begin -->` and `<!-- {name}:end -->` in `path` with
    `lines` (appended at the end, markers included, when the markers are not there yet)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = "\n".join([begin, *lines, end]) + "\n"
    text = open(path).read() if os.path.exists(path) else "# Performance\n\n"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end) + 1:]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    with open(path, "w") as f:
        f.write(text)
