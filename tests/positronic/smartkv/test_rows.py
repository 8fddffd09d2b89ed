"""RowBook (positronic/smartkv/rows.py): one layer's slots keep the sinks, the recent window and the
best-scored older tokens, whether tokens come one by one or a prompt at once."""

import random

import pytest

from positronic.smartkv.rows import RowBook


@pytest.mark.parametrize("sinks,budget,window", [(4, 10, 6), (2, 0, 8), (3, 7, 0), (0, 5, 1), (4, 1, 1)])
def test_row_book_keeps_sinks_window_and_the_best_scores(sinks, budget, window):
    rng = random.Random(sinks * 100 + budget * 10 + window)
    book = RowBook(sinks, budget, window)
    scores = [rng.random() for _ in range(60)]
    for n in range(60):
        placed = book.admit([n], [scores[n]])
        assert book.held == book.size == min(n + 1, book.capacity)
        held = sorted(p for p in book.positions() if p >= 0)
        rest = [p for p in range(n + 1) if p >= sinks]
        recent = rest[max(0, len(rest) - window):] if window else []
        older = [p for p in rest if p not in recent]
        best = sorted(older, key=lambda p: -scores[p])[:budget]
        assert held == sorted(set(range(min(sinks, n + 1))) | set(recent) | set(best))
        assert (n in held) == bool(placed) and all(i == 0 for _, i in placed)
    kinds = book.kinds()
    assert kinds.count("sink") == sinks and kinds.count("window") == window and kinds.count("memory") == budget


def test_row_book_admitting_a_prompt_at_once_is_the_bulk_prune():
    rng = random.Random(1)
    scores = [rng.random() for _ in range(200)]
    one_by_one, at_once = RowBook(4, 20, 8), RowBook(4, 20, 8)
    for n in range(200):
        one_by_one.admit([n], [scores[n]])
    placed = at_once.admit(list(range(200)), scores)
    assert sorted(one_by_one.positions()) == sorted(at_once.positions())
    assert sorted(slot for slot, _ in placed) == list(range(32))  # every slot holds a token of the batch


def test_row_book_refuses_an_empty_layout():
    with pytest.raises(ValueError):
        RowBook(0, 0, 0)
    with pytest.raises(ValueError):
        RowBook(-1, 4, 4)
