"""Fixtures shared by the mirror's test modules."""

import pytest

from positronic.mirror import Insertion, Mirror, plan_layout


def _splice(m, deleted, insertions, texts, tick, brightness=255.0):
    return m.splice(plan_layout(m.positions(), deleted, insertions, limit=10), texts, tick=tick, brightness=brightness)


def _built() -> Mirror:
    m = Mirror()
    _splice(m, [], [Insertion(0, (1, 10, 11, 12, 13), "prompt")], ["<s>", "A", " big", " red", " dog"], tick=0)
    _splice(m, [1], [], [], tick=3)
    _splice(m, [1, 2], [Insertion(1, (99, 98), "repair", replaces=(1, 2))], [" huge", "!"], tick=4)
    _splice(m, [], [Insertion(4, (7,), "generated")], [" ran"], tick=5, brightness=200.5)
    m.set_brightness([1.0, 2.0, 3.0, 4.5, 5.0])
    return m


@pytest.fixture
def built():
    """built() -> a fresh mirror with history: prompt, a cull, a replacement, a generated token
    (live ids [1, 99, 98, 13, 7] at positions [0, 1, 2, 4, 5], position limit 10)."""
    return _built
