"""What the evaluation tests share: a record of the streams evaluate() teacher-forces."""

import pytest

import positronic.evaluate.probe
import positronic.evaluate.sweep


@pytest.fixture
def fed_streams(monkeypatch) -> list[tuple[list[int], object]]:
    """Every (ids, config) that evaluate feeds through run_stream, in order: the text streams
    (sweep) and the probe streams (probe) alike."""
    fed = []
    for module in (positronic.evaluate.sweep, positronic.evaluate.probe):
        original = module.run_stream
        monkeypatch.setattr(module, "run_stream", lambda lm, ids, config, original=original, **kw:
                            fed.append((list(ids), config)) or original(lm, ids, config, **kw))
    return fed
