"""RowBook (positronic/smartkv/rows.py): one layer's slots keep the sinks, the recent window and the
best-scored older tokens, whether tokens come one by one or a prompt at once."""

import math
import random

import numpy as np
import pytest

from positronic.smartkv.rows import RowBook


def reference_memory(scores: list[float], sinks: int, budget: int, window: int, horizon: int, upto: int) -> set[int]:
    """Long-term memory after positions 0 .. upto - 1, straight from the rule: a token leaving the
    window joins the memory, and while it holds more than `budget` the token with the lowest
    remaining rank (ties: the older) at step now = leaving position + window goes."""
    memory: set[int] = set()
    for leaving in range(sinks, upto - window):
        now = leaving + window
        memory.add(leaving)
        if len(memory) > budget:
            rank = {p: scores[p] + math.log(max(1e-3, 1 - (now - p) / horizon), 4) for p in memory}
            memory.remove(min(memory, key=lambda p: (rank[p], p)))
    return memory


@pytest.mark.parametrize("sinks,budget,window,horizon", [(4, 10, 6, 30), (2, 0, 8, 512), (3, 7, 1, 20), (0, 5, 1, 12),
                                                         (4, 1, 1, 512), (4, 10, 6, 10**9)])
def test_row_book_keeps_sinks_window_and_the_memory_the_rule_picks(sinks, budget, window, horizon):
    rng = random.Random(sinks * 100 + budget * 10 + window)
    layers = 3
    book = RowBook(layers, sinks, budget, window, horizon)
    scores = [[rng.random() for _ in range(80)] for _ in range(layers)]  # each layer its own
    for n in range(80):
        placed = book.admit([n], np.array([[scores[l][n]] for l in range(layers)]))
        assert book.held == book.size == min(n + 1, book.capacity)
        rest = [p for p in range(n + 1) if p >= sinks]
        recent = rest[max(0, len(rest) - window):]
        for l in range(layers):
            held = book.positions(l)
            assert len(held) == len(set(held)) == book.size
            memory = reference_memory(scores[l], sinks, budget, window, horizon, n + 1)
            assert sorted(held) == sorted(set(range(min(sinks, n + 1))) | set(recent) | memory)
            assert held[placed[l, 0]] == n  # the new token is in the slot admit named
            if horizon > 10**6:  # nothing ages: the memory is the best scores of all that left the window
                older = [p for p in rest if p not in recent]
                assert memory == set(sorted(older, key=lambda p: -scores[l][p])[:budget])
    for l in range(layers):
        kinds = book.kinds(l)
        assert kinds.count("sink") == sinks and kinds.count("window") == window and kinds.count("memory") == budget
    if budget:
        assert len({tuple(sorted(book.positions(l))) for l in range(layers)}) > 1, "layers keep their own memories"


def one(values):
    """Scores of one layer, [1, q]."""
    return np.array([values], dtype=np.float64)


def test_a_token_is_ranked_by_the_lifespan_still_ahead_of_it():
    book = RowBook(1, 0, 1, 1, horizon=4)
    book.admit([0, 1, 2], one([0.8, 0.7, 0.0]))
    # when 1 leaves the window (now = 2), 0 has half its horizon left: 4**0.8 * 0.5 < 4**0.7 * 0.75
    assert sorted(book.positions(0)) == [1, 2]
    ageless = RowBook(1, 0, 1, 1, horizon=10**9)
    ageless.admit([0, 1, 2], one([0.8, 0.7, 0.0]))
    assert sorted(ageless.positions(0)) == [0, 2]
    old = RowBook(1, 0, 1, 1, horizon=10)
    old.admit([0, 1], one([3.0, 0.0]))
    old.admit(list(range(2, 12)), one([-1.0] * 10))  # past its horizon, 0 keeps 4**3 / 1000 < 4**-1 * 0.9
    assert 0 not in old.positions(0)


def test_row_book_admitting_a_prompt_at_once_is_the_bulk_prune():
    rng = np.random.default_rng(1)
    scores = rng.random((2, 200))
    one_by_one, at_once = RowBook(2, 4, 20, 8), RowBook(2, 4, 20, 8)
    for n in range(200):
        one_by_one.admit([n], scores[:, n : n + 1])
    placed = at_once.admit(list(range(200)), scores)
    for l in range(2):
        assert sorted(one_by_one.positions(l)) == sorted(at_once.positions(l))
        assert sorted(placed[l][placed[l] >= 0].tolist()) == list(range(32))  # every slot holds a token of the batch


def test_a_token_leaving_the_window_unscored_is_an_error_until_scored():
    book = RowBook(2, 1, 4, 2)
    book.admit([0, 1, 2], None)
    assert book.unscored(arriving=0) == []  # 1 and 2 fill the window: nobody leaves yet
    waiting = book.unscored(arriving=1)  # 1 would leave: every unscored window token, in one batch
    assert [entry.position for entry in waiting] == [1, 2]
    with pytest.raises(RuntimeError, match="unscored"):
        RowBook(2, 1, 4, 2).admit([0, 1, 2, 3], None)
    book.set_scores(waiting, np.array([[0.1, 0.2], [0.3, 0.4]]))
    book.admit([3, 4], None)
    assert sorted(book.positions(1)) == [0, 1, 2, 3, 4]


def test_row_book_refuses_an_empty_layout():
    for bad in ((1, 0, 4, 0), (1, -1, 4, 4), (0, 1, 4, 4)):
        with pytest.raises(ValueError):
            RowBook(*bad)
