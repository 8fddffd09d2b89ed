"""positronic.evaluate.stream: teacher forcing through Brain.step, a failed tick run again."""


import pytest
import torch

from positronic.evaluate import make_config, reference_config, run_stream, segment_bounds
from positronic.brain.loop import Brain


def test_the_stream_is_teacher_forced_through_brain_step(tiny, monkeypatch, eval_text):
    """run_stream drives a Brain: every tick is one `step(force=the text's token)`."""
    forced = []
    original = Brain.step
    monkeypatch.setattr(Brain, "step", lambda self, force=None: forced.append(force) or original(self, force))
    ids = [tiny.bos_id] + tiny.encode(eval_text)[:60]
    result = run_stream(tiny, ids, make_config("brightness", 48, repairer="self"))
    assert forced == ids[1:-1], "each token but the last is added by a forced tick, in order"
    assert len(result.nll) == 60 and result.repairs > 0 and result.max_live <= 49


def test_a_failed_tick_is_run_again_with_the_same_token(tiny, monkeypatch, eval_text):
    """A failed tick adds nothing; the stream must not lose its token, so the tick is repeated.
    With nothing evicted the rebuilt cache equals the incremental one: every NLL stays."""
    ids = [tiny.bos_id] + tiny.encode(eval_text)[:60]
    config = reference_config(len(ids))
    clean = run_stream(tiny, ids, config)
    brains = []
    start = Brain.start
    monkeypatch.setattr(Brain, "start", lambda lm, *args, **kwargs: brains.append(start(lm, *args, **kwargs))
                        or brains[-1])

    def fault_at(index, stage="forward"):
        def on_token(i):
            if i == index:
                brains[-1].state.inject_fault(stage)
        return on_token

    faulty = run_stream(tiny, ids, config, on_token=fault_at(20))
    assert faulty.rebuilds == 1 and clean.rebuilds == 0
    assert brains[-1].state.live_token_ids() == ids[:-1], "no token lost, none doubled"
    assert torch.allclose(torch.tensor(faulty.nll), torch.tensor(clean.nll), atol=1e-4, rtol=0)

    # a tick that fails again when repeated ends the evaluation
    monkeypatch.setattr(Brain, "step", _fail_after_first(Brain.step))
    with pytest.raises(RuntimeError, match="failed twice"):
        run_stream(tiny, ids, config, on_token=fault_at(5))


def _fail_after_first(step):
    """Brain.step, but once a fault was injected every later tick fails as well."""
    def wrapped(self, force=None):
        record = step(self, force)
        if record.rebuilt:
            self.state.inject_fault("forward")
        return record
    return wrapped


def test_segment_bounds_cover_every_token_once_in_near_equal_chunks():
    assert segment_bounds(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert segment_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]
