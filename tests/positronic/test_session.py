"""Sessions (positronic/session.py): what a saved run comes back as."""

import re

import pytest

import mirror
from positronic import session as sessions
from positronic.loop import Brain, BrainConfig


def test_a_session_saved_before_the_new_settings_resumes_with_the_values_it_ran_with(tiny, tmp_path):
    """A session from before ttl_decay/ttl_gain/unit/bridge_margin existed has no such keys; it
    resumes with the values it ran with (DESIGN's ttl constants, pairs), not today's defaults:
    it goes on exactly as the same session saved with every key."""
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 40)),
                        BrainConfig(budget=48, repairer="self", ttl_gain=10.0, unit=2, seed=3))
    for _ in range(20):
        brain.step()
    sessions.save(tmp_path / "now", brain, tiny.name)
    path = sessions.save(tmp_path / "before", brain, tiny.name)
    saved, meta = mirror.load(path)
    for key in sessions.BEFORE_NEW_SETTINGS:
        del meta["config"][key]
    mirror.save(path, saved, meta)
    now, before = sessions.resume(tiny, tmp_path / "now"), sessions.resume(tiny, tmp_path / "before")
    assert (before.config.ttl_gain, before.config.unit, before.config.ttl_decay) == (10.0, 2, 2.0)
    assert before.config.ttl_gain != BrainConfig().ttl_gain, "not today's default"
    for _ in range(20):
        a, b = now.step(), before.step()
        assert (a.token_id, a.actions) == (b.token_id, b.actions)
    assert now.counts["repairs"] > 0


def test_a_save_clears_what_a_killed_save_left(tiny, tmp_path):
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 20)), BrainConfig(budget=48))
    stale = tmp_path / "mirror.msgpack.k3j9x.tmp"  # the temporary file of a save that was killed
    stale.write_bytes(b"half a session")
    other = tmp_path / "notes.tmp"
    other.write_text("not ours")
    sessions.save(tmp_path, brain, tiny.name)
    assert not stale.exists() and other.exists()
    assert sessions.resume(tiny, tmp_path).tick == 0


def saved_session(tiny, tmp_path):
    brain = Brain.start(tiny, [tiny.bos_id] + list(range(10, 20)), BrainConfig(budget=48))
    path = sessions.save(tmp_path, brain, tiny.name)
    return path, *mirror.load(path)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("budget"), "settings missing: ['budget']"),
    (lambda c: c.update(budget="64"), "setting budget has the wrong type: '64'"),
    (lambda c: c.update(temperature=None), "setting temperature has the wrong type"),
    (lambda c: c.update(policy="lru"), "unknown policy 'lru'"),
    (lambda c: c.update(score_layers=[1.5]), "setting score_layers has the wrong type"),
    (lambda c: c.update(colour="blue"), "unknown settings: ['colour']"),
])
def test_a_session_with_bad_settings_is_refused_with_one_clear_error(tiny, tmp_path, edit, message):
    path, saved, meta = saved_session(tiny, tmp_path)
    edit(meta["config"])
    mirror.save(path, saved, meta)
    before = path.read_bytes()
    with pytest.raises(sessions.SessionError, match=re.escape(message)):
        sessions.resume(tiny, tmp_path)
    assert path.read_bytes() == before, "a failed resume changes nothing"


def test_a_negative_tick_is_refused(tiny, tmp_path):
    path, saved, meta = saved_session(tiny, tmp_path)
    meta["tick"] = -3
    mirror.save(path, saved, meta)
    with pytest.raises(sessions.SessionError, match="tick or model missing"):
        sessions.resume(tiny, tmp_path)
