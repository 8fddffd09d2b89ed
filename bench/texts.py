"""The excerpt rule the quality benchmarks share (every quality table in bench/results/)."""

from __future__ import annotations

from pathlib import Path


def excerpt(path: Path, offset: int) -> str:
    """The text of `path` from character `offset`, starting after the first blank line there
    (CRs dropped), so a Gutenberg header and a half sentence are skipped; offset 0: the whole text."""
    text = Path(path).read_text(encoding="utf-8").replace("\r", "")
    if offset:
        text = text[offset:]
        text = text[text.index("\n\n") + 2:]
    return text
