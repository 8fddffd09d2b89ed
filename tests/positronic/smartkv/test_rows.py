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


def test_a_token_taken_back_is_held_for_its_hold_then_competes_with_its_own_score():
    """Recall brings back a token the gates scored low (a fact's digits): it must not be the
    weakest again at the next offer, or it leaves before the question that called it back is
    answered; once its hold is over it competes like any other."""
    from positronic.smartkv.rows import Memories

    memory = Memories(layers=2, size=4, horizon=100)
    for token in range(4):
        memory.offer(token, position=token, scores=[1.0, 1.0], now=token + 1)
    [dropped] = memory.take_back(0, [99], scores=[-2.0], now=5, hold=10)  # the lowest score anyone has
    assert dropped in range(4) and 99 in memory.ids[0, :4]
    for token in range(10, 14):  # held until step 15: four stronger newcomers do not push it out
        memory.offer(token, position=token, scores=[1.0, 1.0], now=token + 1)
        assert 99 in memory.ids[0, :4]
    assert 99 not in memory.ids[1, :4]  # only layer 0 took it back
    memory.offer(20, position=20, scores=[1.0, 1.0], now=21)  # the hold is over: the weakest goes
    assert 99 not in memory.ids[0, :4]
    saved = Memories.from_entries(memory.entries(), 4, 100)
    assert saved.entries() == memory.entries()


def test_a_held_token_survives_a_session():
    from positronic.smartkv.rows import Memories

    memory = Memories(layers=1, size=3, horizon=50)
    for token in range(3):
        memory.offer(token, position=token, scores=[0.5], now=token + 1)
    memory.take_back(0, [42], scores=[-3.0], now=4, hold=20)
    entries = memory.entries()
    assert [e for e in entries[0] if e[2] == 42] == [[-3.0, 4, 42, 24]]
    resumed = Memories.from_entries(entries, 3, 50)
    for twin in (memory, resumed):
        twin.offer(7, position=7, scores=[2.0], now=8)
    assert resumed.entries() == memory.entries() and 42 in resumed.ids[0, :3]


def test_tokens_taken_back_together_each_replace_the_weakest_and_not_each_other():
    """A restore brings several tokens into a lane at once: each takes the place of the weakest
    token still there, never of one that came back with it (even with no hold)."""
    from positronic.smartkv.rows import Memories

    memory = Memories(layers=1, size=4, horizon=100)
    for token, score in enumerate([3.0, 0.5, 2.0, 1.0]):
        memory.offer(token, position=token, scores=[score], now=token + 1)
    dropped = memory.take_back(0, [50, 51, 52], scores=[-5.0, -5.0, -5.0], now=5, hold=0)
    assert dropped == [1, 3, 2]  # the weakest first: scores 0.5, 1.0, 2.0
    assert sorted(memory.ids[0, :4].tolist()) == [0, 50, 51, 52]
