"""Per-token text for a span, decoded as a span.

Decoding tokens one at a time loses information (sentencepiece drops a token's leading
space when it starts a decode; byte-level tokens may hold half a character). Each token's
text is instead what it adds to the decode of the few tokens before it.
"""

from __future__ import annotations

from typing import Callable

CONTEXT = 8  # left tokens decoded with each token; enough to settle spaces and split characters


def span_texts(decode: Callable[[list[int]], str], token_ids: list[int], previous: int | None = None) -> list[str]:
    """The text each of `token_ids` adds when decoded after `previous` (if any)."""
    sequence = ([] if previous is None else [previous]) + list(token_ids)
    texts = []
    for index in range(len(sequence) - len(token_ids), len(sequence)):
        low = max(0, index - CONTEXT)
        before = decode(sequence[low:index]) if index > low else ""
        after = decode(sequence[low : index + 1])
        stable = before.rstrip("\ufffd")  # an unfinished character may still change
        texts.append(after[len(stable):] if after.startswith(stable) else after)
    return texts


def rows_matching(texts: list[str], needle: str) -> list[int]:
    """Rows whose text overlaps an occurrence of `needle` in the concatenation of `texts`
    (one text per row); every occurrence, in row order."""
    if not needle:
        return []
    ends, total = [], 0
    for text in texts:
        total += len(text)
        ends.append(total)
    whole, rows, start = "".join(texts), set(), 0
    while (found := whole.find(needle, start)) >= 0:
        first = next(row for row, end in enumerate(ends) if end > found)
        last = next(row for row, end in enumerate(ends) if end >= found + len(needle))
        rows.update(range(first, last + 1))
        start = found + 1
    return sorted(rows)
