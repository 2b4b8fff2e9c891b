"""Copy the example sections into the how-to and tutorial pages again.

A how-to or tutorial page shows its code inline (so it reads the same on a code host as on
the site): each block follows a ``<!-- code: PATH[:SECTION] ... -->`` line, and
tests/unit/test_docs_code_blocks.py checks the block equals those sections. After changing an
example file, run ``make docs-code`` (``python -m docs.inline_code``) to copy them again.
"""

from __future__ import annotations

import re
import sys

from docs.site_files import ROOT, shown_code

_MARKER = re.compile(r"^[ \t]*<!-- code: (?P<paths>[^>]+?) -->[ \t]*$")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})")


def refreshed(text: str) -> str:
    """``text`` (a page) with every marked block's body copied from its sections again."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        marker = _MARKER.match(lines[i])
        opened = _FENCE.match(lines[i + 1]) if marker and i + 1 < len(lines) else None
        if marker is None or opened is None:
            out.append(lines[i])
            i += 1
            continue
        close = re.compile(rf"^[ \t]*{re.escape(opened['fence'])}\s*$")
        j = i + 2
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        code = shown_code(tuple(marker["paths"].split()))
        if code is None:
            raise SystemExit(f"{marker['paths']}: a file or section is missing")
        indent = opened["indent"]
        body = [indent + line if line else line for line in code.split("\n")]
        out += [lines[i], lines[i + 1], *body, *lines[j : j + 1]]
        i = j + 1
    return "\n".join(out)


def main() -> int:
    pages = sorted([*(ROOT / "docs/how-to").glob("*.md"), *(ROOT / "docs/tutorial").glob("*.md")])
    for page in pages:
        text = page.read_text(encoding="utf-8")
        new = refreshed(text)
        if new != text:
            page.write_text(new, encoding="utf-8")
            print(f"copied the code into {page.relative_to(ROOT)} again")
    return 0


if __name__ == "__main__":
    sys.exit(main())
